"""Thin collective wrappers over torch.distributed.

Each takes the participating ranks in placement order, skips communication
for a single rank, counts the call and its bytes for `sbp.comm_stats()`, and
turns a backend timeout into `CommTimeoutError`. Tensors must be contiguous.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from sbp import env
from sbp.comm import cost, functional, stats
from sbp.comm.groups import get_group
from sbp.errors import CommTimeoutError, PlacementError

Ranks = tuple[int, ...]

REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_TIMEOUT = re.compile(r"time[d ]?\s*out|timeout", re.IGNORECASE)


@contextlib.contextmanager
def _timeouts(kind: str, ranks: Ranks) -> Iterator[None]:
    try:
        yield
    except RuntimeError as e:  # DistBackendError is a RuntimeError
        if _TIMEOUT.search(str(e)):
            raise CommTimeoutError(
                f"{kind} over ranks {list(ranks)} outlived the timeout of "
                f"{env.get_timeout()} (sbp.env.init(timeout=...)): {e}"
            ) from e
        raise


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_gather(output: torch.Tensor, input: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """Concatenate equal-sized `input`s of all ranks along dim 0 into `output`."""
    if len(ranks) == 1:
        output.copy_(input.reshape(output.shape))
        return output
    stats.record("all_gather", cost.all_gather_bytes(len(ranks), _nbytes(input)))
    if functional.tracing(input):
        return output.copy_(functional.all_gather(input, ranks).view(output.shape))
    with _timeouts("all_gather", ranks):
        _all_gather_single(output, input, group=get_group(ranks))
    return output


def all_reduce(tensor: torch.Tensor, op: str, ranks: Ranks) -> torch.Tensor:
    """Reduce `tensor` in place over `ranks` with `op` in {sum, max, min}."""
    if len(ranks) == 1:
        return tensor
    stats.record("all_reduce", cost.all_reduce_bytes(len(ranks), _nbytes(tensor)))
    if functional.tracing(tensor):
        return tensor.copy_(functional.all_reduce(tensor, op, ranks))
    with _timeouts("all_reduce", ranks):
        dist.all_reduce(tensor, op=REDUCE_OPS[op], group=get_group(ranks))
    return tensor


def reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, op: str, ranks: Ranks
) -> torch.Tensor:
    """Reduce `input` (n equal chunks along dim 0) and keep this rank's chunk in `output`."""
    if len(ranks) == 1:
        output.copy_(input.reshape(output.shape))
        return output
    stats.record("reduce_scatter", cost.reduce_scatter_bytes(len(ranks), _nbytes(input)))
    if functional.tracing(input):
        return output.copy_(functional.reduce_scatter(input, op, ranks).view(output.shape))
    with _timeouts("reduce_scatter", ranks):
        _reduce_scatter_single(output, input, op=REDUCE_OPS[op], group=get_group(ranks))
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
    row = _nbytes(input) // max(input.shape[0], 1) if input.dim() else 0
    stats.record("all_to_all", cost.all_to_all_bytes([s * row for s in input_splits], me))
    if functional.tracing(input):
        got = functional.all_to_all(input, output_splits, input_splits, ranks)
        return output.copy_(got.view(output.shape))
    with _timeouts("all_to_all", ranks):
        dist.all_to_all_single(
            output, input, list(output_splits), list(input_splits), group=get_group(ranks)
        )
    return output


def broadcast(tensor: torch.Tensor, src: int, ranks: Ranks) -> torch.Tensor:
    """Copy `tensor` of global rank `src` to every rank of `ranks`, in place."""
    if len(ranks) == 1:
        return tensor
    stats.record("broadcast", cost.broadcast_bytes(len(ranks), _nbytes(tensor)))
    if functional.tracing(tensor):
        return tensor.copy_(functional.broadcast(tensor, src, ranks))
    with _timeouts("broadcast", ranks):
        dist.broadcast(tensor, src=src, group=get_group(ranks))
    return tensor


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
    with _timeouts("send/recv", tuple(sorted(peers))):
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def barrier(ranks: Ranks) -> None:
    if len(ranks) > 1:
        with _timeouts("barrier", ranks):
            t = torch.zeros(1)
            dist.all_reduce(t, group=get_group(ranks))
