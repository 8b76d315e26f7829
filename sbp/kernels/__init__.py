"""Pack, unpack and reduce of boxing buffers.

The executor calls only these functions. `launcher_for` is the one place that chooses how
they run: CUDA tensors go through the raw kernels of boxing.cu (one pass over memory each,
launched with CuPy), everything else through the torch implementation in `reference`.
`SBP_KERNELS=torch` forces torch everywhere (for comparison); without CuPy, CUDA tensors
use torch too, after a one-time notice. Cases the kernels do not cover (a strided input,
chunks scattered in memory) also fall back to torch, so the result never depends on the
choice beyond the rounding of half-precision sums (the kernels add in float).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence

import torch

from sbp.errors import SbpError
from sbp.kernels import raw, reference
from sbp.kernels.reference import empty_cache, fill_value, staging

__all__ = [
    "KernelChoiceError",
    "empty_cache",
    "fill_value",
    "launcher_for",
    "pack_chunks",
    "reduce_chunks",
    "staging",
    "unpack_chunks",
]

CHOICES = ("auto", "torch")


class KernelChoiceError(SbpError, ValueError):
    """SBP_KERNELS names no known implementation."""


_cuda: list = []  # [CupyLauncher or None], filled on first use


def cuda_launcher() -> raw.Launcher | None:
    """The CuPy launcher, or None (with a one-time notice) when CuPy cannot be imported."""
    if not _cuda:
        try:
            from sbp.kernels.cupy_launcher import CupyLauncher

            _cuda.append(CupyLauncher())
        except Exception as e:  # noqa: BLE001 - ImportError, or a CuPy that cannot load CUDA
            _cuda.append(None)
            warnings.warn(
                f"sbp: CuPy is unavailable ({type(e).__name__}: {e}); CUDA tensors are "
                "packed and reduced with torch ops. Install the `cuda` extra for the raw "
                "kernels.",
                stacklevel=3,
            )
    return _cuda[0]


def launcher_for(device: torch.device) -> raw.Launcher | None:
    """The raw-kernel launcher for tensors on `device`; None means the torch implementation."""
    choice = os.environ.get("SBP_KERNELS", "auto")
    if choice not in CHOICES:
        raise KernelChoiceError(f"SBP_KERNELS must be one of {CHOICES}, got {choice!r}")
    if device.type != "cuda" or choice == "torch":
        return None
    return cuda_launcher()


def pack_chunks(
    x: torch.Tensor, dim: int, sizes: Sequence[int], pad_to: int | None = None
) -> torch.Tensor:
    """See `reference.pack_chunks`."""
    launcher = launcher_for(x.device)
    if launcher is not None:
        out = raw.pack_chunks(launcher, x, dim, sizes, pad_to)
        if out is not None:
            return out
    return reference.pack_chunks(x, dim, sizes, pad_to)


def unpack_chunks(
    buf: torch.Tensor,
    chunk_shapes: Sequence[Sequence[int]],
    dim: int,
    out: torch.Tensor,
    stride: int | None = None,
) -> torch.Tensor:
    """See `reference.unpack_chunks`."""
    launcher = launcher_for(out.device)
    if launcher is not None:
        done = raw.unpack_chunks(launcher, buf, chunk_shapes, dim, out, stride)
        if done is not None:
            return done
    return reference.unpack_chunks(buf, chunk_shapes, dim, out, stride)


def reduce_chunks(chunks: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    """See `reference.reduce_chunks`."""
    launcher = launcher_for(chunks[0].device)
    if launcher is not None:
        out = raw.reduce_chunks(launcher, chunks, op)
        if out is not None:
            return out
    return reference.reduce_chunks(chunks, op)
