"""Thin collective wrappers over torch.distributed.

Each takes the participating ranks in placement order, skips communication
for a single rank, counts the call and its bytes for `sbp.comm_stats()`, and
turns a backend failure (timeout, a peer that closed its connection) into
`CommTimeoutError` naming the collective and the ranks that did not arrive.
Groups hold their ranks in ascending order (see `groups`); chunks are permuted
between that order and the placement's here. Max and min of floats keep NaN,
as torch does (gloo's MAX drops it). Tensors must be contiguous. While torch.compile
traces, each is recorded as an op of `functional` whose body, when the graph runs, is
this same wrapper (so it is counted then, not while traced).
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from sbp import env
from sbp.comm import cost, fingerprint, functional, inline, shm, stats
from sbp.comm.groups import get_group, group_order
from sbp.errors import CommTimeoutError, InputTypeError, PlacementError, SbpError

Ranks = tuple[int, ...]

REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_FAILED = re.compile(
    r"time[d ]?\s*out|timeout|closed|reset by peer|broken pipe|connection refused",
    re.IGNORECASE,
)
REPORT_WINDOW_S = 3.0  # how long a failed rank waits for the others to report the same failure
_failures: Counter = Counter()


@contextlib.contextmanager
def guarded(kind: str, ranks: Ranks) -> Iterator[None]:
    """Turn a backend timeout or lost peer inside the block into `CommTimeoutError`."""
    try:
        yield
    except RuntimeError as e:  # DistBackendError is a RuntimeError
        if isinstance(e, SbpError) or not _FAILED.search(str(e)):
            raise  # (named already: a nested guard, or sbp's own check)
        missing = _ranks_not_reporting(ranks)
        absent = (
            f"; ranks {missing} did not arrive (stuck elsewhere or exited)"
            if missing
            else ("" if missing is None else "; every rank arrived")
        )
        raise CommTimeoutError(
            f"{kind} over ranks {list(ranks)} failed within the timeout of "
            f"{env.get_timeout()} (sbp.env.init(timeout=...)){absent}: {e}"
        ) from e


def _ranks_not_reporting(ranks: Ranks) -> list[int] | None:
    """After a failed collective: which members did not report a failure of it in time.

    Each failed rank writes a key to the default store (shared by the world) and waits
    a few seconds for the others'; a rank that never came (or died) writes none. None
    when the store cannot be reached.
    """
    key = ",".join(map(str, sorted(ranks)))
    n = _failures[key]
    _failures[key] += 1
    prefix = f"sbp/failed/{key}/{n}/"
    me = env.get_rank()
    store = env.default_store()
    if store is None:
        return None
    try:
        store.set(prefix + str(me), "1")
        window = min(env.get_timeout().total_seconds() / 2, REPORT_WINDOW_S)
        deadline = time.monotonic() + window
        while True:
            missing = [r for r in ranks if r != me and not store.check([prefix + str(r)])]
            if not missing or time.monotonic() > deadline:
                return sorted(missing)
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - the store may be gone with the rank that hosted it
        return None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    return t.reshape(n, -1)


def all_gather(output: torch.Tensor, input: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """Concatenate equal-sized `input`s of all ranks along dim 0 into `output`."""
    if len(ranks) == 1:
        output.copy_(input.reshape(output.shape))
        return output
    if functional.tracing(input):
        return output.copy_(functional.all_gather(input, ranks).view(output.shape))
    stats.record("all_gather", cost.all_gather_bytes(len(ranks), _nbytes(input)))
    order = group_order(ranks)
    target = output if order is None else torch.empty_like(output)
    segment = _shared_segment(input, ranks, "all_gather")
    if segment is not None:
        segment.all_gather(target, input)
    elif _inline(input, ranks, "all_gather"):
        fp = fingerprint.of("all_gather", input.dtype, _nbytes(input))
        with guarded("all_gather", ranks):
            rows = inline.exchange(fp, ranks, get_group(ranks), input)
        _rows(target, len(ranks)).copy_(inline.parts(rows, input)[0])
    else:
        _agree("all_gather", input, ranks)
        with guarded("all_gather", ranks):
            _all_gather_single(_moved(target), _moved(input), group=get_group(ranks))
    if order is not None:
        _rows(output, len(ranks)).copy_(_rows(target, len(ranks))[order])
    return output


_ORDERED_INT = {torch.float64: torch.int64, torch.float32: torch.int32}


def _nan_keeping(tensor: torch.Tensor, op: str) -> tuple[torch.Tensor, torch.dtype] | None:
    """Floats as integers of the same order for max/min (NaN above +inf for max, below -inf
    for min), so the integer reduction keeps NaN as torch does; None if not needed."""
    if op == "sum" or not tensor.is_floating_point():
        return None
    work = tensor if tensor.dtype in _ORDERED_INT else tensor.float()
    itype = _ORDERED_INT[work.dtype]
    imax = torch.iinfo(itype).max
    nan_bits = torch.tensor(float("nan"), dtype=work.dtype).view(itype).item() & imax
    if op == "min":
        nan_bits = nan_bits - imax - 1  # the sign bit set: ordered below -inf
    i = torch.where(torch.isnan(work), nan_bits, work.view(itype))
    return torch.where(i < 0, i ^ imax, i), work.dtype


def _from_nan_keeping(i: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    imax = torch.iinfo(i.dtype).max
    return torch.where(i < 0, i ^ imax, i).view(dtype)


# dtypes gloo refuses ("Invalid scalar type"): moved as a dtype of their width, reduced wider
_GLOO_LACKS = {
    torch.int16,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
}
_MOVED_AS = {1: torch.uint8, 2: torch.float16, 4: torch.int32, 8: torch.int64}


def _moved(t: torch.Tensor) -> torch.Tensor:
    """`t` as gloo moves it: the same bytes, viewed as a dtype gloo has."""
    return t.view(_MOVED_AS[t.element_size()]) if t.dtype in _GLOO_LACKS else t


def _reducible(tensor: torch.Tensor, op: str) -> tuple[torch.Tensor, Callable | None]:
    """What gloo reduces for `tensor`, and how its result becomes `tensor`'s values (None:
    it reduced `tensor`'s own memory).

    Floats under max/min as ordered integers (NaN kept); int16/uint16/uint32 in int64 and
    float8 in float32 (cast back as torch casts: integers wrap); uint64 sums as int64
    (two's complement sums wrap alike)."""
    ordered = _nan_keeping(tensor, op)
    if ordered is not None:
        return ordered[0], lambda work: _from_nan_keeping(work, ordered[1])
    if tensor.dtype not in _GLOO_LACKS:
        return tensor, None
    if tensor.dtype == torch.uint64:
        if op != "sum":
            raise InputTypeError(
                f"a {op} over ranks of a torch.uint64 tensor: gloo has no unsigned 64-bit "
                "integers; convert it to torch.int64 first"
            )
        return tensor.view(torch.int64), None
    return tensor.to(torch.float32 if tensor.is_floating_point() else torch.int64), _same


def _same(work: torch.Tensor) -> torch.Tensor:
    return work


def _shared_segment(tensor: torch.Tensor, ranks: Ranks, kind: str) -> shm.Segment | None:
    """The shared-memory path of a small collective on one host (see `shm`), or None."""
    return _segment(ranks, kind) if shm.usable(tensor) else None


def _segment(ranks: Ranks, kind: str) -> shm.Segment | None:
    """The rank set's shared segment, None where it has none (another host, SBP_SHM=0)."""
    if not shm.enabled():
        return None
    group = get_group(ranks)
    if shm.ready(ranks, group):
        return shm.segment(ranks, group)
    with guarded(kind, ranks):  # (a collective sets the segment up at the first call)
        return shm.segment(ranks, group)


def _big_segment(tensor: torch.Tensor, ranks: Ranks, kind: str) -> shm.Segment | None:
    """The rank set's large shared segment for a collective of `tensor` (a rank's part), or
    None where it goes through gloo (another host, too large, SBP_SHM=0)."""
    if not shm.usable_big(tensor):
        return None
    with guarded(kind, ranks):  # (made at the first call: a collective)
        return shm.big_segment(ranks, get_group(ranks))


def _met_big(
    kind: str, tensor: torch.Tensor, ranks: Ranks, op: str | None = None
) -> tuple[shm.Segment | None, shm.Segment | None]:
    """(the large segment for this collective or None: gloo, the small segment its call
    meets through, or None where it met already). Once the large segment is settled, a
    call meets the others once, in the small segment, with its fingerprint, while its
    data waits in the large one (before: a meeting in the small segment, then one in the
    large: two waits). The first call meets first, as any gloo call, before the
    collective that makes the large segment."""
    group = get_group(ranks)
    if shm.usable_big(tensor) and shm.big_ready(ranks, group):
        big = shm.big_segment(ranks, group)
        small = _segment(ranks, kind)
        if big is not None and small is not None:
            return big, small
    _agree(kind, tensor, ranks, op)
    return _big_segment(tensor, ranks, kind), None


def _agree(
    kind: str, tensor: torch.Tensor, ranks: Ranks, op: str | None = None, nbytes: int = -1
) -> None:
    """Before a gloo or NCCL collective: the ranks compare its fingerprint (see
    `fingerprint`) on the host, in the rank set's shared segment where there is one, else
    in a gloo all-gather of a fixed-size frame (`inline`: small calls carry their data in
    it instead of coming here). A device tensor's collective (NCCL)
    is checked in the shared segment only (ranks of one host, ~20 us, without waiting
    for the device): across hosts a gloo round trip per NCCL collective would cost more
    than the collective, so it is not checked there; nor where the group has no CPU
    backend (`backend="nccl"` alone)."""
    if not fingerprint.ENABLED:
        return
    on_host = tensor.device.type == "cpu"
    if not on_host and not _host_backend(ranks):
        return
    fp = fingerprint.of(kind, tensor.dtype, _nbytes(tensor) if nbytes < 0 else nbytes, op)
    segment = _segment(ranks, kind)
    if segment is not None:
        segment.agree(fp)
        return
    if not on_host:
        return
    with guarded(kind, ranks):  # (the frame alone: its data follows in its own call)
        inline.exchange(fp, ranks, get_group(ranks))


def _inline(tensor: torch.Tensor, ranks: Ranks, kind: str) -> bool:
    """Does this all-reduce or all-gather travel inside its fingerprint's frame (a small
    CPU tensor of a rank set with no shared segment: `inline`)?"""
    return (
        fingerprint.ENABLED
        and tensor.device.type == "cpu"
        and inline.fits(tensor)
        and tensor.dtype not in _GLOO_LACKS
        and _segment(ranks, kind) is None
    )


def _all_reduce_inline(tensor: torch.Tensor, op: str, ranks: Ranks) -> torch.Tensor:
    fp = fingerprint.of("all_reduce", tensor.dtype, _nbytes(tensor), op)
    with guarded("all_reduce", ranks):
        rows = inline.exchange(fp, ranks, get_group(ranks), tensor)
    typed, parts = inline.parts(rows, tensor)
    shm.reduce_in_rank_order(typed, parts, op, tensor.view(-1))
    return tensor


_host_backends: dict[Ranks, bool] = {}


def _host_backend(ranks: Ranks) -> bool:
    """Can the rank set's group run a collective of CPU tensors (gloo beside NCCL, as
    `sbp.env.init` makes it by default)?"""
    known = _host_backends.get(ranks)
    if known is None:
        try:
            get_group(ranks)._get_backend(torch.device("cpu"))
            known = True
        except (RuntimeError, AttributeError, ValueError):
            known = False
        _host_backends[ranks] = known
    return known


def all_reduce(tensor: torch.Tensor, op: str, ranks: Ranks) -> torch.Tensor:
    """Reduce `tensor` in place over `ranks` with `op` in {sum, max, min}."""
    if len(ranks) == 1:
        return tensor
    if functional.tracing(tensor):
        return tensor.copy_(functional.all_reduce(tensor, op, ranks))
    stats.record("all_reduce", cost.all_reduce_bytes(len(ranks), _nbytes(tensor)))
    segment = _shared_segment(tensor, ranks, "all_reduce")
    if segment is not None:  # one host: ~20 us instead of gloo's ~0.4-4 ms
        return segment.all_reduce(tensor, op)
    if _inline(tensor, ranks, "all_reduce"):  # across hosts: one round trip, checked
        return _all_reduce_inline(tensor, op, ranks)
    if tensor.dtype == torch.bool:  # (never in a segment: gloo, after the meeting)
        _agree("all_reduce", tensor, ranks, op)
        segment = via = None
    else:
        segment, via = _met_big("all_reduce", tensor, ranks, op)
    if segment is not None:  # up to 8 MiB on one host (a tensor-parallel block's output)
        return segment.all_reduce(tensor, op, via)
    work, back = _reducible(tensor, op)
    with guarded("all_reduce", ranks):
        dist.all_reduce(work, op=REDUCE_OPS[op], group=get_group(ranks))
    if back is not None:
        tensor.copy_(back(work))
    return tensor


class Pending:
    """A collective in flight (`all_reduce_async`); `wait()` returns its tensor, passed
    through `then` first where given (the local half of a collective made of two)."""

    def __init__(self, work, tensor: torch.Tensor, kind: str, ranks: Ranks, then=None):
        self.work, self.tensor, self.kind, self.ranks = work, tensor, kind, ranks
        self.then = then

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            with guarded(self.kind, self.ranks):
                self.work.wait()
            self.work = None
        if self.then is not None:
            self.tensor, self.then = self.then(self.tensor), None
        return self.tensor


def all_reduce_async(tensor: torch.Tensor, op: str, ranks: Ranks) -> Pending:
    """Start summing `tensor` in place over `ranks`; the caller waits on the result."""
    if op != "sum":
        raise ValueError("all_reduce_async sums (max/min keep NaN through all_reduce)")
    if (
        len(ranks) == 1
        or tensor.dtype in _GLOO_LACKS  # (reduced wider, at once)
        or _inline(tensor, ranks, "all_reduce")  # (one round trip, at once)
    ):
        return Pending(None, all_reduce(tensor, op, ranks), "all_reduce", ranks)
    stats.record("all_reduce", cost.all_reduce_bytes(len(ranks), _nbytes(tensor)))
    _agree("all_reduce", tensor, ranks, op)
    with guarded("all_reduce", ranks):
        work = dist.all_reduce(tensor, op=REDUCE_OPS[op], group=get_group(ranks), async_op=True)
    return Pending(work, tensor, "all_reduce", ranks)


def all_gather_async(output: torch.Tensor, input: torch.Tensor, ranks: Ranks) -> Pending:
    """Start `all_gather(output, input, ranks)`; the caller waits on the result. (A group
    whose ascending order is not the ranks' runs it at once, permuting the chunks.)"""
    if len(ranks) == 1 or group_order(ranks) is not None or functional.tracing(input):
        return Pending(None, all_gather(output, input, ranks), "all_gather", ranks)
    stats.record("all_gather", cost.all_gather_bytes(len(ranks), _nbytes(input)))
    # (the fingerprint first in the small segment, where every rank meets whichever path
    # its next collective takes: a rank taking gloo there is named, not waited for)
    segment, via = _met_big("all_gather", input, ranks)
    if segment is not None:  # (one host: at once, at memcpy speed)
        return Pending(None, segment.all_gather(output, input, via), "all_gather", ranks)
    with guarded("all_gather", ranks):
        work = _all_gather_single(
            _moved(output).view(-1), _moved(input), group=get_group(ranks), async_op=True
        )
    return Pending(work, output, "all_gather", ranks)


def reduce_scatter_async(output: torch.Tensor, input: torch.Tensor, ranks: Ranks) -> Pending:
    """Start summing `input` (n equal chunks along dim 0) into this rank's chunk `output`;
    the caller waits on the result. (As `all_gather_async`, a group in another order, and
    a dtype gloo cannot sum, run at once.) On CPU, gloo's reduce-scatter is 2-3x slower
    than an all-to-all of the same bytes and a local sum (2 ranks, 2-8 MiB): it runs so."""
    if (
        len(ranks) == 1
        or group_order(ranks) is not None
        or functional.tracing(input)
        or input.dtype in _GLOO_LACKS
    ):
        return Pending(None, reduce_scatter(output, input, "sum", ranks), "reduce_scatter", ranks)
    # (as in all_gather_async: the fingerprint meets first, once per call, on every rank
    # alike: the same sizes, the same segment)
    agreed = shm.usable_big(input)
    segment, via = _met_big("reduce_scatter", input, ranks, "sum") if agreed else (None, None)
    if segment is not None:  # (one host: at once, at memcpy speed)
        stats.record("reduce_scatter", cost.reduce_scatter_bytes(len(ranks), _nbytes(input)))
        return Pending(None, segment.reduce_scatter(output, input, via), "reduce_scatter", ranks)
    if input.device.type == "cpu":
        n = len(ranks)
        chunks = torch.empty_like(input).view(n, -1)
        stats.record("all_to_all", cost.reduce_scatter_bytes(n, _nbytes(input)))
        if not agreed:
            _agree("all_to_all", input, ranks, nbytes=_nbytes(input) // n)
        with guarded("all_to_all", ranks):
            work = dist.all_to_all_single(
                chunks, input.reshape(n, -1), group=get_group(ranks), async_op=True
            )
        # (rank j's chunk for this rank, summed in rank order: the same sums on every rank)
        return Pending(
            work, chunks, "all_to_all", ranks, lambda c: torch.sum(c, 0, out=output.view(-1))
        )
    stats.record("reduce_scatter", cost.reduce_scatter_bytes(len(ranks), _nbytes(input)))
    if not agreed:
        _agree("reduce_scatter", input, ranks, "sum")
    with guarded("reduce_scatter", ranks):
        work = _reduce_scatter_single(
            output.reshape(-1),
            input.reshape(-1),
            op=REDUCE_OPS["sum"],
            group=get_group(ranks),
            async_op=True,
        )
    return Pending(work, output, "reduce_scatter", ranks)


def reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, op: str, ranks: Ranks
) -> torch.Tensor:
    """Reduce `input` (n equal chunks along dim 0) and keep this rank's chunk in `output`."""
    if len(ranks) == 1:
        output.copy_(input.reshape(output.shape))
        return output
    if functional.tracing(input):
        return output.copy_(functional.reduce_scatter(input, op, ranks).view(output.shape))
    n = len(ranks)
    stats.record("reduce_scatter", cost.reduce_scatter_bytes(n, _nbytes(input)))
    order = group_order(ranks)
    if order is not None:  # chunk j of the group goes to its j-th (ascending) rank
        inverse = [ranks.index(r) for r in sorted(ranks)]
        input = _rows(input, n)[inverse]
    _agree("reduce_scatter", input, ranks, op)
    src, back = _reducible(input, op)
    dst = output.view(src.dtype) if back is None else src.new_empty(output.shape)
    with guarded("reduce_scatter", ranks):
        _reduce_scatter_single(
            dst.reshape(-1), src.reshape(-1), op=REDUCE_OPS[op], group=get_group(ranks)
        )
    if back is not None:
        output.copy_(back(dst))
    return output


def all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    output_splits: Sequence[int],
    input_splits: Sequence[int],
    ranks: Ranks,
) -> torch.Tensor:
    """Send chunk i of `input` (dim 0, sizes `input_splits`) to ranks[i]; receive into `output`."""
    me = ranks.index(env.get_rank())
    if len(ranks) == 1:
        output.copy_(input.reshape(output.shape))
        return output
    if functional.tracing(input):
        got = functional.all_to_all(input, output_splits, input_splits, ranks)
        return output.copy_(got.view(output.shape))
    row = math.prod(input.shape[1:]) * input.element_size() if input.dim() else 0
    stats.record("all_to_all", cost.all_to_all_bytes([s * row for s in input_splits], me))
    _agree("all_to_all", input, ranks, nbytes=row)
    order = group_order(ranks)
    target = output
    if order is not None:  # chunks in group order (ascending ranks) on the wire
        inverse = [ranks.index(r) for r in sorted(ranks)]
        input = torch.cat([input.split(list(input_splits))[i] for i in inverse])
        input_splits = [input_splits[i] for i in inverse]
        output_splits = [output_splits[i] for i in inverse]
        target = torch.empty_like(output)
    with guarded("all_to_all", ranks):
        dist.all_to_all_single(
            _moved(target),
            _moved(input),
            list(output_splits),
            list(input_splits),
            group=get_group(ranks),
        )
    if order is not None:
        chunks = target.split(list(output_splits))
        torch.cat([chunks[j] for j in order], out=output)
    return output


def broadcast(tensor: torch.Tensor, src: int, ranks: Ranks) -> torch.Tensor:
    """Copy `tensor` of global rank `src` to every rank of `ranks`, in place."""
    if len(ranks) == 1:
        return tensor
    if functional.tracing(tensor):
        return tensor.copy_(functional.broadcast(tensor, src, ranks))
    stats.record("broadcast", cost.broadcast_bytes(len(ranks), _nbytes(tensor)))
    _agree("broadcast", tensor, ranks)
    with guarded("broadcast", ranks):
        dist.broadcast(_moved(tensor), src=src, group=get_group(ranks))
    return tensor


def broadcast_async(tensor: torch.Tensor, src: int, ranks: Ranks) -> Pending:
    """Start copying `tensor` of global rank `src` to every rank of `ranks`, in place."""
    if len(ranks) == 1:
        return Pending(None, tensor, "broadcast", ranks)
    stats.record("broadcast", cost.broadcast_bytes(len(ranks), _nbytes(tensor)))
    _agree("broadcast", tensor, ranks)
    with guarded("broadcast", ranks):
        work = dist.broadcast(_moved(tensor), src=src, group=get_group(ranks), async_op=True)
    return Pending(work, tensor, "broadcast", ranks)


def exchange_p2p(
    sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]]
) -> None:
    """Post all sends and receives (tensor, peer global rank) at once and wait for them.

    Every pair is its own transfer, so moves between rank sets spread over all pairs.
    """
    if not sends and not recvs:
        return
    if functional.tracing((sends or recvs)[0][0]):
        raise PlacementError(
            "moving a global tensor between placements (send/recv) cannot be traced by "
            "torch.compile; do the move outside the compiled function"
        )
    for t, _ in sends:
        stats.record("send", cost.broadcast_bytes(2, _nbytes(t)))
    peers = {env.get_rank(), *[p for _, p in sends], *[p for _, p in recvs]}
    ops = [dist.P2POp(dist.isend, t, p) for t, p in sends]
    ops += [dist.P2POp(dist.irecv, t, p) for t, p in recvs]
    with guarded("send/recv", tuple(sorted(peers))):
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def barrier(ranks: Ranks) -> None:
    if len(ranks) > 1:
        t = torch.zeros(1)
        _agree("barrier", t, ranks, nbytes=0)
        with guarded("barrier", ranks):
            dist.all_reduce(t, group=get_group(ranks))


# the eager bodies of `sbp.comm.functional`'s ops (what a compiled graph runs)
functional.bind(
    all_reduce=all_reduce,
    all_gather=all_gather,
    reduce_scatter=reduce_scatter,
    all_to_all=all_to_all,
    broadcast=broadcast,
)
