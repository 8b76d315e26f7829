"""torch's multi-head attention (`nn.MultiheadAttention`, the Transformer layers, ViT) in
the data-parallel check and local run (an op family of `sbp.data_parallel.families`).

`F.multi_head_attention_forward` is row-wise in the batch: each sample's output depends on
its own query, key, value and masks alone. Op by op, though, it merges the sequence with
the split batch as the inner dim (`attn.transpose(0, 1).contiguous().view(L * N, E)`, for
the output projection), which no split describes, so the op is moved and the check would
fail although the local run, which merges its own rows, is exact. So the check takes the
call as a whole where its tensors are laid out as the batch, lets the moves inside it pass,
and lays its outputs out as the batch again.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.nn.functional as F

from sbp.data_parallel.batch_rows import moved_to
from sbp.layout import GlobalSpec
from sbp.signature import is_all_broadcast
from sbp.tensor import GlobalTensor

ATTENTION = F.multi_head_attention_forward
CALLS = (ATTENTION,)
LOCAL = CALLS  # (`sbp.data_parallel.families`: `run_local`)

# the tensors of a call: sequence-first (L, N, E), per sample (N, S), per sample and head
# (N * heads, ...); any other tensor (weights, biases, a 2-d mask) is taken whole
_SEQUENCE_FIRST = ("query", "key", "value")
_PER_SAMPLE = ("key_padding_mask",)
_PER_HEAD = ("attn_mask", "static_k", "static_v")


@functools.cache
def _signature() -> inspect.Signature:
    return inspect.signature(ATTENTION)


def _whole_samples(query: GlobalSpec, heads: int, rows: int, data_nd: tuple) -> bool:
    """Does a split of `rows` (batch x heads) rows laid out as the batch give every rank
    the rows of its own samples (query: (L, N, E), its batch on dim 1)?"""
    merged = GlobalSpec(query.placement, data_nd, (rows,), query.dtype)
    return all(
        merged.local_shape(r)[0] == query.local_shape(r)[1] * heads
        for r in query.placement.flat_ranks
    )


def why_not_row_wise(args: tuple, kwargs: dict, data_nd: tuple) -> str:
    """ "" where the call's local run on each rank's tensors gives that rank's rows of the
    logical result; else why not. Decided from the layouts alone, alike on every rank."""
    bound = _signature().bind(*args, **kwargs).arguments
    query = bound["query"]
    if not isinstance(query, GlobalTensor) or query.dim() != 3:
        return "an unbatched query"
    dropout = bound.get("dropout_p", 0.0) and bound.get("training", True)
    if dropout and not bound.get("need_weights", True) and query.device.type != "cpu":
        return "dropout inside torch's fused attention kernel"
    batch = moved_to(data_nd, 1)
    spec = query._spec
    heads = bound["num_heads"]
    if dropout and not _whole_samples(spec, heads, spec.shape[1] * heads, data_nd):
        # (the masks follow the rows of the merged (batch x heads) dim: only where its
        # split falls at whole samples are the op-by-op path's masks the local run's)
        return "dropout on (batch x heads) rows split within a sample"
    for name, value in bound.items():
        if not isinstance(value, torch.Tensor):
            continue
        if not isinstance(value, GlobalTensor):
            return f"{name} is a local tensor"
        if name in _SEQUENCE_FIRST:
            ok = tuple(value.sbp) == batch and value.shape[1] == query.shape[1]
        elif name in _PER_SAMPLE and value.dim() == 2:
            ok = tuple(value.sbp) == data_nd and value.shape[0] == query.shape[1]
        elif name in _PER_HEAD and value.dim() == 3:
            ok = tuple(value.sbp) == data_nd and _whole_samples(
                spec, heads, value.shape[0], data_nd
            )
        else:
            ok = is_all_broadcast(value.sbp)
        if not ok:
            return f"{name} is laid out as {tuple(value.sbp)}"
    return ""


def run_whole(func, args: tuple, kwargs: dict, data_nd: tuple) -> Any:
    """The call op by op (its dropout draws the op-by-op path's masks), its result,
    (output (L, N, E), weights (N, ...) or None), laid out as the batch, as the local run's
    are, where the moves inside left it otherwise (broadcast, or a partial sum: splitting
    is free where the boxing planner picks)."""
    output, weights = func(*args, **kwargs)
    output = output.to_global(sbp=moved_to(data_nd, 1))
    if weights is not None:
        weights = weights.to_global(sbp=data_nd)
    return output, weights


def run_local(run, func, args: tuple, kwargs: dict) -> Any:
    """The local run's call: torch's own, its dropout (called by name inside, where the
    local ops' mode is off) drawing the op-by-op path's masks (`run.by_name_replaced`)."""
    with run.by_name_replaced():
        return func(*args, **kwargs)
