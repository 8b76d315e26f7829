"""Torch implementations of the boxing kernels (CPU and any other device)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from sbp.comm.functional import tracing
from sbp.layout import elements_per_index


def pack_chunks(
    x: torch.Tensor, dim: int, sizes: Sequence[int], pad_to: int | None = None
) -> torch.Tensor:
    """Lay out consecutive chunks of `x` along `dim` (lengths `sizes`) one after another.

    The result is a flat buffer; chunk i holds `x.narrow(dim, sum(sizes[:i]), sizes[i])`
    in its own contiguous layout, padded to `pad_to` rows of `dim` when given (for
    collectives that need equal chunks). Costs one copy, none when the chunks are
    already laid out so (split along dim 0 of a contiguous tensor, no padding).
    """
    rest = elements_per_index(x.shape, dim)
    if pack_is_view(x, dim, sizes, pad_to):
        return x.reshape(-1)
    rows = [pad_to if pad_to is not None else s for s in sizes]
    out = staging(sum(rows) * rest, x, "send")
    offset = start = 0
    for size, row in zip(sizes, rows, strict=True):
        chunk = x.narrow(dim, start, size)
        out[offset : offset + chunk.numel()].view(chunk.shape).copy_(chunk)
        offset += row * rest
        start += size
    return out


def pack_is_view(
    x: torch.Tensor, dim: int, sizes: Sequence[int], pad_to: int | None = None
) -> bool:
    """Whether `x` is already laid out as its packed chunks (packing is then a view)."""
    whole = len(sizes) == 1 and pad_to in (None, sizes[0])
    leading = all(s == 1 for s in x.shape[:dim])
    return x.is_contiguous() and (whole or (leading and pad_to is None))


STAGING_LIMIT = 64 * 2**20  # bytes: larger buffers are not kept (a 256 MiB conversion kept 366 MiB)
_staging: dict = {}


def staging(numel: int, like: torch.Tensor, slot: str) -> torch.Tensor:
    """A scratch buffer of `like`'s dtype and device, kept between calls, valid until the
    next request for the same slot.

    Fresh CPU blocks of 32 MiB or more are mapped anew by glibc and fault on every first
    touch (about 25 ms per 32 MiB here, against 1.4 ms to refill a warm one); boxing
    stages through a few buffers per call, so reusing them is most of the cost at size.
    Buffers above `STAGING_LIMIT` are made per call and not kept, so memory does not stay
    at a peak; `sbp.boxing.empty_cache()` frees the kept ones. A traced graph owns its
    buffers, made like `like` (a fake tensor makes a fake one).
    """
    nbytes = numel * like.element_size()
    if nbytes > STAGING_LIMIT or tracing(like):
        return like.new_empty(numel)
    key = (slot, like.dtype, like.device)
    buf = _staging.get(key)
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):  # (kept: usable outside inference_mode too)
            buf = _staging[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buf[:numel]


def empty_cache() -> None:
    """Free the staging buffers boxing keeps between calls (`sbp.boxing.empty_cache()`).

    Boxing keeps one send and one receive buffer per dtype and device, each at most
    `STAGING_LIMIT` bytes (64 MiB), so after large conversions up to that much stays
    allocated per rank; call this to give it back (e.g. before evaluation or a checkpoint).
    """
    _staging.clear()


def unpack_chunks(
    buf: torch.Tensor,
    chunk_shapes: Sequence[Sequence[int]],
    dim: int,
    out: torch.Tensor,
    stride: int | None = None,
) -> torch.Tensor:
    """Inverse of `pack_chunks`: chunk i of the flat `buf` (starting at i*stride elements, or
    right after chunk i-1) is copied into `out` at its place along `dim`."""
    offset = start = 0
    for i, shape in enumerate(chunk_shapes):
        n = math.prod(shape)
        if stride is not None:
            offset = i * stride
        if n:
            out.narrow(dim, start, shape[dim]).copy_(buf[offset : offset + n].view(tuple(shape)))
        start += shape[dim]
        offset += n
    return out


def reduce_chunks(chunks: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    """Elementwise sum / max / min of equal-shaped chunks, in a new tensor."""
    out = chunks[0].clone()
    for c in chunks[1:]:
        if op == "sum":
            out.add_(c)
        elif op == "max":
            torch.maximum(out, c, out=out)
        else:
            torch.minimum(out, c, out=out)
    return out


def fill_value(dtype: torch.dtype, op: str) -> float | int | bool:
    """Identity element of the reduction `op` for `dtype` (what non-owners hold in a partial)."""
    if op == "sum":
        return False if dtype == torch.bool else 0
    if dtype == torch.bool:
        return op == "min"
    if dtype.is_floating_point or dtype.is_complex:
        return float("-inf") if op == "max" else float("inf")
    info = torch.iinfo(dtype)
    return info.min if op == "max" else info.max
