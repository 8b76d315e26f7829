"""boxing.cu built for the CPU with g++ and host_shim.h, run through ctypes (tests only).

The shim runs every (block, thread) of the grid in a loop, so the kernels' index logic can
be checked against the torch implementation on machines without a GPU. The shared library
is built once per source text and compiler and cached on disk.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import torch

from sbp.kernels import raw

SHIM_PATH = Path(__file__).with_name("host_shim.h")
CXX_FLAGS = ["-std=c++17", "-O1", "-shared", "-fPIC", "-x", "c++"]


def compiler() -> str | None:
    """The C++ compiler to build with ($CXX, else g++), or None when there is none."""
    return shutil.which(os.environ.get("CXX", "g++"))


def host_source() -> str:
    return SHIM_PATH.read_text() + "\n" + raw.source(raw.all_instances())


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "sbp" / "kernels"


@cache
def library(wide_index: bool = False) -> ctypes.CDLL:
    """The compiled shim (built on first use, then loaded from the disk cache); `wide_index`
    builds the pack and unpack kernels to take their 64-bit index path at every size."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++ or $CXX) to build the kernels for the CPU")
    text = host_source()
    flags = [*CXX_FLAGS, *(["-DSBP_NARROW_INDEX_LIMIT=0"] if wide_index else [])]
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256((text + version + " ".join(flags)).encode()).hexdigest()[:16]
    stem = "boxing-host-wide" if wide_index else "boxing-host"
    path = _cache_dir() / f"{stem}-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        try:
            subprocess.run(
                [cxx, *flags, "-", "-o", tmp],
                input=text,
                text=True,
                check=True,
                capture_output=True,
            )
            os.replace(tmp, path)  # atomic: parallel builders never load a partial file
            for old in path.parent.glob(f"{stem}-{'[0-9a-f]' * 16}.so"):  # older sources
                if old != path:
                    old.unlink(missing_ok=True)
        except subprocess.CalledProcessError as e:
            raise RuntimeError(f"building the host kernels failed:\n{e.stderr}") from e
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.CDLL(str(path))


class HostLauncher:
    """Runs the kernels on CPU tensors with the given block size and grid cap."""

    def __init__(self, threads: int = 32, blocks: int = 4, wide_index: bool = False) -> None:
        self.threads = threads
        self.blocks = blocks
        self.wide_index = wide_index

    def max_blocks(self, device: torch.device) -> int:
        return self.blocks

    def table(self, values: tuple[int, ...], device: torch.device) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64)

    def launch(self, kernel: str, instance: str, grid: tuple[int, int], args: Sequence) -> None:
        lib = library(self.wide_index)
        address = ctypes.cast(getattr(lib, kernel), ctypes.c_void_p)
        c_args = [
            ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor) else ctypes.c_longlong(a)
            for a in args
        ]
        entry = lib.launch_reduce if kernel.startswith("sbp_reduce_") else lib.launch_move
        entry(
            address,
            ctypes.c_uint(grid[0]),
            ctypes.c_uint(grid[1]),
            ctypes.c_uint(self.threads),
            *c_args,
        )
