"""Pack, unpack and reduce through the raw kernels of boxing.cu, on any launcher.

This module turns the torch-level arguments of the kernels' API into the kernels' plain
integer arguments (word width, chunk table, grid) and allocates the outputs. The launcher
runs the named kernel: `sbp.kernels.cupy_launcher` on a GPU, `sbp.kernels.host_launcher`
(g++ build of the same source) in the CPU tests. Each function returns None where the
kernels do not apply (a strided input, chunks of different shapes, ...); the caller then
uses the torch implementation, which handles every case.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Protocol

import torch

from sbp.kernels import reference

SOURCE_PATH = Path(__file__).with_name("boxing.cu")

# Pack and unpack move bytes: one kernel per word width serves every dtype.
WORDS = {
    1: ("w1", "unsigned char"),
    2: ("w2", "unsigned short"),
    4: ("w4", "unsigned int"),
    8: ("w8", "unsigned long long"),
    16: ("w16", "uint4"),
}
# Reduce computes: one set of kernels per dtype.
DTYPES = {
    torch.float32: ("f32", "float"),
    torch.float16: ("f16", "__half"),
    torch.bfloat16: ("bf16", "__nv_bfloat16"),
    torch.float64: ("f64", "double"),
    torch.int32: ("i32", "int"),
    torch.int64: ("i64", "long long"),
    torch.bool: ("b8", "bool"),
}
OPS = ("sum", "max", "min")
MAX_CHUNKS = 65535  # gridDim.y picks the chunk


@cache
def include_dirs() -> tuple[str, ...]:
    """The directory holding cuda_fp16.h / cuda_bf16.h, for NVRTC (empty if none)."""
    found = []
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        found.append(find_nvidia_header_directory("cudart"))
    except Exception:  # noqa: BLE001 - any failure just means: look elsewhere
        pass
    for var in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(var):
            found.append(os.path.join(os.environ[var], "include"))
    found.append("/usr/local/cuda/include")
    usable = [d for d in found if d and Path(d, "cuda_bf16.h").exists()]
    return tuple(usable[:1])  # one toolkit's headers, never a mix of versions


@cache
def base_source() -> str:
    return SOURCE_PATH.read_text()


def move_instance(width: int) -> str:
    """The line that instantiates the pack and unpack kernels of a word width."""
    name, ctype = WORDS[width]
    return f"SBP_MOVE_KERNELS({name}, {ctype})"


def reduce_instance(dtype: torch.dtype) -> str:
    """The line that instantiates the reduce kernels of a dtype."""
    name, ctype = DTYPES[dtype]
    return f"SBP_REDUCE_KERNELS({name}, {ctype})"


def all_instances() -> list[str]:
    return [move_instance(w) for w in WORDS] + [reduce_instance(d) for d in DTYPES]


def source(instances: Sequence[str]) -> str:
    """boxing.cu with the given instantiation lines appended."""
    return base_source() + "\n" + "\n".join(instances) + "\n"


def kernel_names() -> list[str]:
    """Every entry point that `source(all_instances())` defines."""
    names = []
    for name, _ in WORDS.values():
        names += [f"sbp_{k}{s}_{name}" for s in ("", "_rows", "_flat") for k in ("pack", "unpack")]
    for name, _ in DTYPES.values():
        names += [f"sbp_reduce_{op}_{name}{v}" for v in ("", "_v") for op in OPS]
    return names


class Launcher(Protocol):
    """Runs one kernel of boxing.cu over a grid (tensors are passed by their data)."""

    threads: int

    def max_blocks(self, device: torch.device) -> int:
        """Blocks worth launching at most along x (more only queue up)."""
        ...

    def table(self, values: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """`values` as an int64 tensor on `device`, ready for the next launch."""
        ...

    def launch(self, kernel: str, instance: str, grid: tuple[int, int], args: Sequence) -> None: ...


@dataclass(frozen=True)
class Move:
    """A pack or unpack in the kernel's terms, all counts in words of `width` bytes."""

    width: int
    cols: tuple[int, ...]  # n_chunks + 1 column starts within a row of the unpacked tensor
    bases: tuple[int, ...]  # n_chunks starts in the packed buffer
    outer: int
    row: int


def plan_move(
    cols: Sequence[int], bases: Sequence[int], outer: int, row: int, pointers: Sequence[int]
) -> Move:
    """Byte offsets -> word offsets, with the widest word (up to 16 bytes) that divides
    every offset and aligns every pointer."""
    g = 16
    for v in (*cols, *bases, row, *pointers):
        g = math.gcd(g, v)
    width = g & -g
    return Move(
        width,
        tuple(c // width for c in cols),
        tuple(b // width for b in bases),
        outer,
        row // width,
    )


# Words each pack/unpack thread moves at least in the linear scheme: its start costs four
# integer divisions, which a single 4-byte word does not repay (measured on an H100:
# inner-axis uneven packs of 16 MiB went from 0.33 to 0.71 of a device copy). The reduce
# kernels start cheaply and keep one word per thread up to the block cap.
MOVE_WORDS_PER_THREAD = 4
# Words each thread of the rows and flat schemes moves per round (kMoveUnroll in boxing.cu).
MOVE_UNROLL = 8
# The rows scheme is for words narrower than 16 bytes (16-byte words already run at copy
# speed in the linear scheme), rows of chunks that fill a team, and enough of them (rows x
# chunks) for a grid at least ROWS_MIN_GRID times the linear scheme's largest: below that
# the linear scheme was faster (H100, float32 (r, 1027) over 8 ranks: at 16 MiB the rows grid
# is 1.9 times it, and packs ran at 0.73 of a copy against the linear scheme's 0.78).
ROWS_MAX_WIDTH = 8
ROWS_MIN_WORDS = 32
ROWS_MIN_GRID = 4.0


def _grid_x(words: int, launcher: Launcher, device: torch.device, per_thread: int = 1) -> int:
    threads = launcher.threads * per_thread
    return max(1, min(-(-words // threads), launcher.max_blocks(device)))


def _team(words: int, width: int, threads: int) -> int:
    """Lanes per row of a chunk in the rows scheme: the power of two, up to a warp, that
    moves a row of `words` words in one round."""
    if threads % 32:  # blocks of 1 or 3 threads in the CPU tests: the block is the team
        return threads
    if width >= 4:  # 16-byte slots: one more than the row spans at most
        slots, per_lane = -(-words * width // 16) + 1, MOVE_UNROLL * width // 16
    else:
        slots, per_lane = words, MOVE_UNROLL
    team = 1
    while team < 32 and team * per_lane < slots:
        team *= 2
    return team


def move_plan(m: Move, launcher: Launcher, device: torch.device):
    """The kernel scheme for `m` ("" linear, "_rows" or "_flat"), its table, its grid and
    the (outer, row) it takes."""
    n = len(m.bases)
    lens = [b - a for a, b in zip(m.cols, m.cols[1:], strict=False)]
    cols, outer, row = m.cols, m.outer, m.row
    if n == 1 and lens[0] == row:  # whole rows: one contiguous range
        cols, outer, row, lens = (0, outer * row), 1, outer * row, [outer * row]
    if outer == 1:
        grid = (_grid_x(max(lens), launcher, device, MOVE_UNROLL), n)
        return "_flat", (*cols, *m.bases), grid, outer, row
    if m.width <= ROWS_MAX_WIDTH and sum(lens) >= ROWS_MIN_WORDS * n:
        team = _team(sum(lens) // n, m.width, launcher.threads)
        blocks = -(-outer * n * team // launcher.threads)  # a team for every piece
        if ROWS_MIN_GRID * launcher.max_blocks(device) <= blocks < 2**31:
            return "_rows", (*cols, *m.bases, team), (blocks, 1), outer, row
    grid = (_grid_x(max(lens) * outer, launcher, device, MOVE_WORDS_PER_THREAD), n)
    return "", (*cols, *m.bases), grid, outer, row


def _run_move(
    launcher: Launcher, kind: str, src: torch.Tensor, dst: torch.Tensor, m: Move, device
) -> None:
    if m.outer == 0 or m.cols[-1] == m.cols[0]:
        return
    scheme, values, grid, outer, row = move_plan(m, launcher, device)
    table = launcher.table(values, device)
    name = f"sbp_{kind}{scheme}_{WORDS[m.width][0]}"
    args = [src, dst, table, len(m.bases), outer, row]
    launcher.launch(name, move_instance(m.width), grid, args)


def _split(shape: Sequence[int], dim: int) -> tuple[int, int, int]:
    return math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1 :])


def pack_chunks(
    launcher: Launcher,
    x: torch.Tensor,
    dim: int,
    sizes: Sequence[int],
    pad_to: int | None = None,
) -> torch.Tensor | None:
    """`reference.pack_chunks` in one kernel launch (None: not a case for the kernels)."""
    if reference.pack_is_view(x, dim, sizes, pad_to):
        return x.reshape(-1)
    if not x.is_contiguous() or len(sizes) > MAX_CHUNKS or sum(sizes) > x.shape[dim]:
        return None
    outer, _, inner = _split(x.shape, dim)
    rows = [pad_to if pad_to is not None else s for s in sizes]
    out = reference.staging(sum(rows) * outer * inner, x, "send")
    if x.numel() == 0 or out.numel() == 0:
        return out
    row_bytes = inner * x.element_size()
    cols = [0, *(c * row_bytes for c in _prefix(sizes))]
    bases = [b * outer * row_bytes for b in _prefix([0, *rows[:-1]])]
    pointers = (x.data_ptr(), out.data_ptr())
    m = plan_move(cols, bases, outer, x.shape[dim] * row_bytes, pointers)
    _run_move(launcher, "pack", x, out, m, x.device)
    return out


def unpack_chunks(
    launcher: Launcher,
    buf: torch.Tensor,
    chunk_shapes: Sequence[Sequence[int]],
    dim: int,
    out: torch.Tensor,
    stride: int | None = None,
) -> torch.Tensor | None:
    """`reference.unpack_chunks` in one kernel launch (None: not a case for the kernels)."""
    shapes = [tuple(s) for s in chunk_shapes]
    rest = [s[:dim] + s[dim + 1 :] for s in shapes]
    sizes = [s[dim] for s in shapes]
    if (
        not (out.is_contiguous() and buf.is_contiguous())
        or buf.dtype != out.dtype
        or len(shapes) > MAX_CHUNKS
        or any(r != tuple(out.shape[:dim]) + tuple(out.shape[dim + 1 :]) for r in rest)
        or sum(sizes) > out.shape[dim]
    ):
        return None
    if out.numel() == 0 or sum(sizes) == 0:
        return out
    outer, _, inner = _split(out.shape, dim)
    esize = out.element_size()
    row_bytes = inner * esize
    cols = [0, *(c * row_bytes for c in _prefix(sizes))]
    if stride is not None:
        bases = [i * stride * esize for i in range(len(shapes))]
    else:
        bases = [b * outer * row_bytes for b in _prefix([0, *sizes[:-1]])]
    pointers = (buf.data_ptr(), out.data_ptr())
    m = plan_move(cols, bases, outer, out.shape[dim] * row_bytes, pointers)
    _run_move(launcher, "unpack", buf, out, m, out.device)
    return out


def reduce_chunks(
    launcher: Launcher, chunks: Sequence[torch.Tensor], op: str
) -> torch.Tensor | None:
    """`reference.reduce_chunks` in one kernel launch, for chunks laid out at equal
    distances in one buffer, as the executor's are (None: not a case for the kernels)."""
    first = chunks[0]
    if (
        len(chunks) < 2
        or op not in OPS
        or first.dtype not in DTYPES
        or not all(
            c.is_contiguous() and c.shape == first.shape and c.dtype == first.dtype for c in chunks
        )
    ):
        return None
    out = torch.empty(first.shape, dtype=first.dtype, device=first.device)
    n, esize = first.numel(), first.element_size()
    if n == 0:
        return out
    start = first.data_ptr()
    gap = chunks[1].data_ptr() - start
    if (
        gap <= 0
        or gap % esize
        or any(c.data_ptr() != start + i * gap for i, c in enumerate(chunks))
    ):
        return None
    storage = first.untyped_storage()
    if any(c.untyped_storage().data_ptr() != storage.data_ptr() for c in chunks):
        return None
    k, chunk = len(chunks), gap // esize
    whole = first.as_strided((k, n), (chunk, 1))  # every chunk, one view
    vec = 16 // esize
    if n % vec or math.gcd(16, start, gap, out.data_ptr()) != 16:
        vec = 1
    name = f"sbp_reduce_{op}_{DTYPES[first.dtype][0]}{'_v' if vec > 1 else ''}"
    grid = (_grid_x(n // vec, launcher, first.device), 1)
    launcher.launch(
        name, reduce_instance(first.dtype), grid, [whole, out, k, chunk // vec, n // vec]
    )
    return out


def _prefix(values: Sequence[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out
