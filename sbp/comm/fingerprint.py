"""What each rank believes a collective is, checked as part of the collective.

Ranks that run collectives in different orders (a conversion skipped on one rank, a
layer frozen on one rank, another bucket size) pair the wrong calls: gloo aborts the
process when the byte counts differ ("Received data size doesn't match"), and where they
agree, or on the shared-memory path, the ranks silently mix data. So every collective
sbp runs through `sbp.comm.collectives` carries a fingerprint: one int64 packing its
kind, reduction, dtype and byte count (for an all-to-all, whose parts differ per rank,
the bytes of one row). The ranks compare them before any data is read:

- on the shared-memory path (small CPU collectives of one host) each rank publishes
  its fingerprint beside its sequence number, in the same write: no extra step;
- a gloo collective of a rank set that has a shared segment first meets the others in
  the segment with its fingerprint alone (~10-20 us, against the ~0.1-10 ms of the
  collective), so a small call paired with a large one is caught too;
- across hosts (no shared segment) every gloo collective starts with a fixed-size
  frame holding the fingerprint, and the data itself where it fits (`inline`): a small
  all-reduce or all-gather is then that one call; a larger one follows its frame.

A mismatch raises `MetaMismatchError` on every rank, naming each side, before any data
moves. Not checked: point-to-point moves between placements (`exchange_p2p`), CUDA
tensors across hosts (NCCL: checked in the segment on one host; across hosts a gloo
round trip per collective would cost more than the collective), object
gathers (`all_gather_object` of checkpoints and metadata fallbacks) and collectives
torch itself runs (DCP, torch DDP). `SBP_CHECK_COLLECTIVES=0` turns the check off.
"""

from __future__ import annotations

import os

import torch

ENABLED = os.environ.get("SBP_CHECK_COLLECTIVES", "1") != "0"

KINDS = ("none", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "barrier")
OPS = (None, "sum", "max", "min")
DTYPES = (
    None,
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)
_DTYPE_CODE = {d: i for i, d in enumerate(DTYPES)}
_BYTES_BITS, _DTYPE_BITS, _OP_BITS, _KIND_BITS = 40, 6, 2, 4
_BYTES_MASK = (1 << _BYTES_BITS) - 1


def of(kind: str, dtype: torch.dtype | None, nbytes: int, op: str | None = None) -> int:
    """The fingerprint of a collective: equal on every rank exactly when they agree on
    kind, reduction, dtype and bytes (bytes past 1 TiB compare modulo 1 TiB)."""
    code = KINDS.index(kind)
    code = (code << _OP_BITS) | OPS.index(op)
    code = (code << _DTYPE_BITS) | _DTYPE_CODE.get(dtype, len(DTYPES))
    return (code << _BYTES_BITS) | (nbytes & _BYTES_MASK)


def describe(fingerprint: int) -> str:
    """`all_reduce(sum) of 24 bytes of torch.float32`, from a fingerprint."""
    nbytes = fingerprint & _BYTES_MASK
    code = fingerprint >> _BYTES_BITS
    dtype = code & ((1 << _DTYPE_BITS) - 1)
    code >>= _DTYPE_BITS
    op = OPS[code & ((1 << _OP_BITS) - 1)]
    kind = KINDS[(code >> _OP_BITS) & ((1 << _KIND_BITS) - 1)]
    dtype_name = str(DTYPES[dtype]) if 0 < dtype < len(DTYPES) else "another dtype"
    if kind == "barrier":
        return "barrier"
    per = " per row" if kind == "all_to_all" else ""
    return f"{kind}{f'({op})' if op else ''} of {nbytes} bytes{per} of {dtype_name}"


def mismatch(sides: list[tuple[str, int]], ranks: tuple[int, ...], where: str) -> str:
    """The message of a mismatch: what each rank (or each side: `who`) runs."""
    by_fp: dict[int, list[str]] = {}
    for who, fp in sides:
        by_fp.setdefault(fp, []).append(who)
    text = "; ".join(f"{', '.join(who)} ran {describe(fp)}" for fp, who in by_fp.items())
    return (
        f"collectives out of step over ranks {list(ranks)} ({where}): {text}. The ranks ran "
        "different sequences of collectives: an op, a conversion or a training step taken "
        "on some ranks only, or per-rank settings that differ (requires_grad, train/eval, "
        "data_parallel's arguments)"
    )
