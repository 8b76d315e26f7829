"""Strided splits through views: flattening a split dim into a whole one before it.

`q @ k.transpose(-2, -1)` on `(batch, heads, seq, dim)` with the heads split: torch's
`matmul` flattens `(batch, heads)` for `bmm` and views the result back. No contiguous
split is that flattened dim, so a plain layout would move the data twice; a
`StridedSplit(dim, inner)` (each block of `inner` elements split alike, `sbp.signature`)
is exactly each rank's local view, and the product, its transposes and the view back
stay local. The few ops that keep it take it here; any other op converts it first
(`sbp.boxing`, on the unflattened tensor).

A strided split is offered only where the split dim divides evenly over all the
placement's ranks: each rank's part of the dim is then the same share of every block.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from sbp.layout import strided_of
from sbp.ops.registry import Call, Strategy
from sbp.signature import SBP, StridedSplit, split


def view_groups(in_shape: Sequence[int], out_shape: Sequence[int]) -> list[tuple[list, list]]:
    """(input dims, output dims) a reshape maps onto each other: the runs between places
    where the products of the dims before agree (dims of size one left out)."""
    if 0 in in_shape or 0 in out_shape:
        return []
    before_in = [math.prod(in_shape[:i]) for i in range(len(in_shape) + 1)]
    before_out = [math.prod(out_shape[:j]) for j in range(len(out_shape) + 1)]
    common = sorted(set(before_in) & set(before_out))
    groups = []
    for lo, hi in zip(common, common[1:], strict=False):
        ins = [i for i, s in enumerate(in_shape) if s > 1 and lo <= before_in[i] < hi]
        outs = [j for j, s in enumerate(out_shape) if s > 1 and lo <= before_out[j] < hi]
        groups.append((ins, outs))
    return groups


def strided_in(call: Call) -> StridedSplit | None:
    """The first input's strided split, if its signature holds one."""
    return strided_of(call.specs[0].nd_sbp)


def reshape_candidates(call: Call, in_shape, out_shape) -> list[Strategy]:
    """A split dim flattened behind whole ones gives a strided split; a strided split
    unflattened back at its block gives a split; one kept whole stays."""
    n = call.placement.size
    st = strided_in(call)
    cands = []
    for ins, outs in view_groups(in_shape, out_shape):
        if len(outs) == 1 and len(ins) > 1:  # flatten
            b = outs[0]
            for a in ins[1:]:
                if in_shape[a] % n == 0:
                    inner = math.prod(in_shape[a : ins[-1] + 1])
                    cands.append(_one(split(a), StridedSplit(b, inner)))
        if st is None or ins != [st.dim]:
            continue
        if len(outs) == 1 and out_shape[outs[0]] == in_shape[st.dim]:  # kept
            cands.append(_one(st, StridedSplit(outs[0], st.inner)))
        for j in outs[1:]:  # unflatten
            if math.prod(out_shape[j : outs[-1] + 1]) == st.inner and out_shape[j] % n == 0:
                cands.append(_one(st, split(j)))
    return cands


def moved_candidates(call: Call, pairs: Sequence[tuple[int, int]]) -> list[Strategy]:
    """A strided split on a dim an op moves whole (a transpose, an expand of other dims)."""
    st = strided_in(call)
    if st is None:
        return []
    return [_one(st, StridedSplit(b, st.inner)) for a, b in pairs if a == st.dim]


def batch_candidates(call: Call) -> list[Strategy]:
    """Batched products on batch dim 0 strided alike in every input stay local."""
    st = strided_in(call)
    if st is None or st.dim != 0 or any(st not in s.nd_sbp for s in call.specs):
        return []
    return [Strategy((st,) * len(call.specs), (st,))]


def _one(a: SBP, b: SBP) -> Strategy:
    return Strategy((a,), (b,))
