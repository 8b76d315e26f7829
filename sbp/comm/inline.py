"""gloo collectives with their fingerprint in the same buffer (ranks with no shared segment).

gloo aborts the process when two ranks pair calls whose byte counts differ ("Received
data size doesn't match"), so a fingerprint (`sbp.comm.fingerprint`) cannot ride inside
a collective of the caller's size: it has to travel in a call whose size every rank
knows beforehand. Every gloo collective of CPU tensors therefore starts with one
all-gather of a fixed `FRAME_BYTES` per rank, a frame: the fingerprint, and for an
all-reduce or all-gather of at most `INLINE_BYTES` (a loss, a norm, a small gradient,
the optimizer's agreement) the data itself. Such a call is then done in that one round
trip: every rank holds every part and reduces them in rank order (the same bits on every
rank, as in shared memory). A larger call runs its own gloo collective after the frame,
which is its meeting (one small round trip before it, as before). Every rank sees every
rank's fingerprint, so a mismatch raises `MetaMismatchError` on every rank naming what
each rank ran, before any data is read. The frame is waited for in slices
(`failure`): a rank that raised on bad input, and will not come, is named there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from sbp.comm import failure, fingerprint
from sbp.errors import MetaMismatchError

FRAME_BYTES = 16 * 1024  # per rank: over gloo as fast as 16 bytes (~0.4 ms on loopback)
HEADER_BYTES = 8  # the fingerprint, an int64
INLINE_BYTES = FRAME_BYTES - HEADER_BYTES
_frames: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def fits(tensor: torch.Tensor) -> bool:
    """Can this tensor's all-reduce or all-gather travel inside the frame?"""
    return (
        tensor.numel() * tensor.element_size() <= INLINE_BYTES
        and tensor.is_contiguous()
        and tensor.dtype != torch.bool
    )


def exchange(
    fp: int, ranks: tuple[int, ...], group, data: torch.Tensor | None = None
) -> torch.Tensor:
    """One all-gather of every rank's frame (`fp`, then `data`'s bytes): raise on a
    mismatch, else every rank's data bytes as rows in the group's (ascending) rank order."""
    n, key = len(ranks), tuple(sorted(ranks))
    calls = failure.frames(key)
    failure.begin(key, calls, lambda: _fill(n, group), fp=fp)
    frame, gathered = _buffers(n)
    frame[:HEADER_BYTES].view(torch.int64)[0] = fp
    nbytes = 0
    if data is not None:
        nbytes = data.numel() * data.element_size()
        frame[HEADER_BYTES : HEADER_BYTES + nbytes].copy_(data.reshape(-1).view(torch.uint8))
    calls.calls += 1
    work = _all_gather_single(gathered, frame, group=group, async_op=True)
    failure.wait(work, key, calls, calls.calls, fp, leave=lambda: _frames.pop(n, None))
    rows = gathered.view(n, FRAME_BYTES)
    fps = rows[:, :HEADER_BYTES].contiguous().view(torch.int64).view(-1).tolist()
    if any(f != fp for f in fps):
        sides = [(f"rank {r}", f) for r, f in zip(sorted(ranks), fps, strict=True)]
        raise MetaMismatchError(fingerprint.mismatch(sides, ranks, "gloo"))
    return rows[:, HEADER_BYTES : HEADER_BYTES + nbytes]


def parts(rows: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The rows of `exchange` as `like`'s dtype: all parts as rows, and one by one."""
    typed = rows.contiguous().view(like.dtype)
    return typed, list(typed.unbind(0))


def _fill(n: int, group) -> None:
    """A filler frame: joins a frame that peers left behind (`failure.settle`). It is not
    waited for: the other ranks that did not make that frame join it at their own next
    call of the set, which may come after calls this rank's peers wait in elsewhere."""
    gathered, frame = (
        torch.empty(n * FRAME_BYTES, dtype=torch.uint8),
        torch.zeros(FRAME_BYTES, dtype=torch.uint8),
    )
    failure.keep(_all_gather_single(gathered, frame, group=group, async_op=True), gathered, frame)


def _buffers(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's frame and the gathered frames, made once per rank-set size (a call's
    results are read before the next call writes them: collectives are blocking)."""
    bufs = _frames.get(n)
    if bufs is None:
        with torch.inference_mode(False):  # (kept: usable outside inference_mode too)
            bufs = _frames[n] = (
                torch.zeros(FRAME_BYTES, dtype=torch.uint8, device="cpu"),
                torch.empty(n * FRAME_BYTES, dtype=torch.uint8, device="cpu"),
            )
    return bufs
