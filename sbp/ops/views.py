"""View and shape ops: a split follows the dim it lives on; size arguments become local sizes.

A split survives a view only on a dim kept whole (same size, same product of
the dims before it), so every rank's local view is exactly its shard of the
logical result, uneven shards included. Partial sums pass through every view.
"""

from __future__ import annotations

import math

import torch

from sbp import env
from sbp.boxing.executor import empty_local
from sbp.errors import IndexRangeError, PlacementError
from sbp.ops import arguments, strided
from sbp.ops.arguments import LOCAL_INDEX_OPS, formula_buffer, trusted_constant
from sbp.ops.local_views import local_view
from sbp.ops.meta import outside_ranks_learn
from sbp.ops.registry import (
    Call,
    Strategy,
    indices_within,
    rebox,
    register,
    register_strategy,
)
from sbp.ops.writes import assign, mark_view
from sbp.signature import broadcast, partial_sum, split
from sbp.tensor import GlobalTensor

aten = torch.ops.aten


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def mapped(pairs: list[tuple[int, int]], n_in: int, n_out: int = 1) -> list[Strategy]:
    """B, P, and S(a) -> S(b) for each (input dim a, output dim b) that a view keeps whole."""
    cands = [
        Strategy((broadcast,) * n_in, (broadcast,) * n_out),
        Strategy((partial_sum,) * n_in, (partial_sum,) * n_out),
    ]
    for a, b in pairs:
        cands.append(Strategy((split(a),) * n_in, (split(b),) * n_out))
    return cands


def kept_dims(in_shape, out_shape) -> list[tuple[int, int]]:
    """(a, b) where input dim a reappears whole as output dim b of a reshape."""
    pairs = []
    for a, size in enumerate(in_shape):
        before = math.prod(in_shape[:a])
        for b, osize in enumerate(out_shape):
            if osize == size and math.prod(out_shape[:b]) == before:
                pairs.append((a, b))
                break
    return pairs


def local_out_size(func, args, kwargs, rank, in_specs, out_specs):
    """Replace the size argument (position 1) by this rank's local output shape."""
    return (args[0], list(out_specs[0].local_shape(rank)), *args[2:]), kwargs


local_out_size.size_from_output = True  # the dispatcher may precompute it per decision
local_out_size.from_local_input = True  # (see `sbp.ops.registry.StrategyRule`)


def _storage_of_its_own(func, args, kwargs, rank, in_specs, out_specs):
    """as_strided reads strides over a storage: an expanded local tensor (a gradient of a
    sum, say) holds one element where the logical tensor holds all: made whole first."""
    x = args[0]
    if 0 in x.stride() and x.numel() > 1:
        x = x.contiguous()
    return (x, *args[1:]), kwargs


@register_strategy(aten.as_strided, local_args=_storage_of_its_own)
def as_strided(call: Call) -> list[Strategy]:
    """Any element of the storage may land anywhere: on the whole value (a partial sum stays
    partial: the op only picks elements)."""
    return [Strategy((broadcast,), (broadcast,)), Strategy((partial_sum,), (partial_sum,))]


@register_strategy(
    aten.view, aten._unsafe_view, aten.reshape, aten.expand, local_args=local_out_size
)
def reshape(call: Call) -> list[Strategy]:
    in_shape, out_shape = call.specs[0].shape, call.out_meta[0][0]
    if call.func.overloadpacket is aten.expand:
        off = len(out_shape) - len(in_shape)
        pairs = [(a, a + off) for a, s in enumerate(in_shape) if s == out_shape[a + off]]
        return mapped(pairs, 1) + strided.moved_candidates(call, pairs)
    pairs = kept_dims(in_shape, out_shape) + evenly_merged_dims(call, in_shape, out_shape)
    return mapped(pairs, 1) + strided.reshape_candidates(call, in_shape, out_shape)


def evenly_merged_dims(call: Call, in_shape, out_shape) -> list[tuple[int, int]]:
    """(a, b) where output dim b starts where input dim a does (a flatten or unflatten of the
    batch dim, say) and both divide evenly over all the placement's ranks: each rank's
    contiguous part of dim a, split along any of the hierarchy dims (nested, the first
    outermost), is then exactly its part of dim b, so a split follows with no
    communication."""
    n = call.placement.size
    if in_shape == out_shape:
        return []
    pairs = []
    for a, size in enumerate(in_shape):
        before = math.prod(in_shape[:a])
        for b, osize in enumerate(out_shape):
            if osize == 1 or math.prod(out_shape[:b]) != before:
                continue
            if osize != size and size % n == 0 and osize % n == 0:
                pairs.append((a, b))
            break
    return pairs


@register_strategy(aten.t, aten.transpose, aten.permute)
def transpose(call: Call) -> list[Strategy]:
    ndim = len(call.specs[0].shape)
    if call.func.overloadpacket is aten.permute:
        order = [_norm(d, ndim) for d in call.arg(1, "dims")]
    else:
        order = list(range(ndim))
        if ndim >= 2:
            d0 = _norm(call.arg(1, "dim0", 0), ndim)
            d1 = _norm(call.arg(2, "dim1", 1), ndim)
            order[d0], order[d1] = order[d1], order[d0]
    pairs = [(a, order.index(a)) for a in range(ndim)]
    return mapped(pairs, 1) + strided.moved_candidates(call, pairs)


def _shard_shaped(func, args, kwargs, outs, in_specs, out_specs):
    """A shard of one row along a dim the logical tensor keeps is a local dim of size one,
    which the local squeeze removes too: view each rank's result as its shard."""
    want = out_specs[0].local_shape(env.get_rank())
    return [outs[0] if tuple(outs[0].shape) == tuple(want) else outs[0].view(want)]


@register_strategy(aten.squeeze, post=_shard_shaped)
@register_strategy(aten.unsqueeze)
def squeeze(call: Call) -> list[Strategy]:
    """Adding or dropping dims of size one keeps every other dim's split."""
    in_shape, out_shape = call.specs[0].shape, call.out_meta[0][0]
    return mapped(kept_dims(in_shape, out_shape), 1)


@register_strategy(aten.slice, aten.select, aten.narrow)
def slicing(call: Call) -> list[Strategy]:
    """Slicing dim `dim` keeps every other dim's split."""
    ndim = len(call.specs[0].shape)
    dim = _norm(call.arg(1, "dim", 0), ndim)
    drop = call.func.overloadpacket is aten.select
    pairs = [(a, a - (drop and a > dim)) for a in range(ndim) if a != dim]
    return mapped(pairs, 1)


def _dim_size(args: list) -> int:
    """`self`'s size along `dim` (args: self, dim, ...), 1 for a 0-dim self."""
    shape = args[0].shape
    return shape[_norm(args[1], len(shape))] if len(shape) else 1


@register_strategy(aten.gather, check=indices_within((2, "index"), _dim_size))
def gather(call: Call) -> list[Strategy]:
    """out = self's elements picked along `dim` by index: a split of another dim stays where
    self and index split it alike (the same size there); index split along `dim` picks from
    the whole self; a partial self stays partial (picking elements is linear)."""
    if len(call.specs) != 2:  # (a local index: only where every rank holds everything)
        return [Strategy((broadcast,) * len(call.specs), (broadcast,))]
    self_shape, index_shape = call.specs[0].shape, call.specs[1].shape
    ndim = len(self_shape)
    dim = _norm(call.arg(1, "dim"), ndim)
    cands = [
        Strategy((broadcast, broadcast), (broadcast,)),
        Strategy((partial_sum, broadcast), (partial_sum,)),
        Strategy((broadcast, split(dim)), (split(dim),)),
    ]
    cands += [
        Strategy((split(d), split(d)), (split(d),))
        for d in range(ndim)
        if d != dim and self_shape[d] == index_shape[d]
    ]
    return cands


@register_strategy(
    aten.scatter_add, aten.scatter_add_, check=indices_within((2, "index"), _dim_size)
)
def scatter_add(call: Call) -> list[Strategy]:
    """self plus src's elements added at index along `dim` (gather's backward): a split of
    another dim stays where all three split it alike; src and index split along `dim` add
    into partial sums; linear in self and src, so partial ones stay partial."""
    if len(call.specs) != 3:
        return [Strategy((broadcast,) * len(call.specs), (broadcast,))]
    shapes = [s.shape for s in call.specs]
    ndim = len(shapes[0])
    B, P = broadcast, partial_sum
    cands = [Strategy((B, B, B), (B,)), Strategy((P, B, P), (P,))]
    if ndim == 0 or min(len(s) for s in shapes) == 0:  # (0-dim: dim 0 is no dim to split)
        return cands
    dim = _norm(call.arg(1, "dim"), ndim)
    if shapes[1][dim] == shapes[2][dim]:  # (src may be longer: its rows must pair with index's)
        cands.append(Strategy((P, split(dim), split(dim)), (P,)))
    cands += [
        Strategy((split(d),) * 3, (split(d),))
        for d in range(ndim)
        if d != dim and shapes[0][d] == shapes[1][d] == shapes[2][d]
    ]
    return cands


@register_strategy(aten.scatter, aten.scatter_, check=indices_within((2, "index"), _dim_size))
def scatter(call: Call) -> list[Strategy]:
    """self with src's elements (or a value) written at index along `dim` (the backward of
    topk, sort, kthvalue: zeros with the gradient scattered back): a split of another dim
    stays where every tensor splits it alike (the same size there); else broadcast."""
    shapes = [s.shape for s in call.specs]
    n = len(shapes)
    cands = [Strategy((broadcast,) * n, (broadcast,))]
    ndim = len(shapes[0])
    if ndim == 0 or min(len(s) for s in shapes) != ndim:
        return cands
    dim = _norm(call.arg(1, "dim"), ndim)
    cands += [
        Strategy((split(d),) * n, (split(d),))
        for d in range(ndim)
        if d != dim and len({s[d] for s in shapes}) == 1
    ]
    return cands


@register_strategy(aten.slice_backward, aten.select_backward, local_args=local_out_size)
def slicing_backward(call: Call) -> list[Strategy]:
    """A slice's (select's) gradient: the incoming gradient inside zeros of the input's
    shape. Splits of every dim but the sliced one stay, so does a partial sum."""
    ndim = len(call.arg(1, "input_sizes"))
    dim = _norm(call.arg(2, "dim"), ndim)
    drop = call.func.overloadpacket is aten.select_backward
    return mapped([(a - (drop and a > dim), a) for a in range(ndim) if a != dim], 1)


@register_strategy(aten.roll, aten.flip)
def along_dims(call: Call) -> list[Strategy]:
    """Rolling or flipping along `dims` moves elements within them only: a split (or a
    partial sum) of any other dim stays. (A roll with no dims rolls the flattened tensor.)"""
    ndim = len(call.specs[0].shape)
    dims = call.arg(2, "dims", ()) if call.func.overloadpacket is aten.roll else call.arg(1, "dims")
    moved = {_norm(d, ndim) for d in dims} if dims else set(range(ndim))
    return mapped([(a, a) for a in range(ndim) if a not in moved], 1)


def _sequence_specs(call: Call) -> int:
    return len(call.specs)


@register_strategy(aten.cat, aten.stack)
def concat(call: Call) -> list[Strategy]:
    n = _sequence_specs(call)
    ndim = len(call.specs[0].shape)
    dim = call.arg(1, "dim", 0)
    if call.func.overloadpacket is aten.stack:
        dim = _norm(dim, ndim + 1)
        pairs = [(a, a + (a >= dim)) for a in range(ndim)]
        return mapped(pairs, n)
    # torch's cat skips empty 1-D tensors whatever the others' shape (transformers' KV cache
    # starts as `torch.tensor([])`): they add nothing and are taken as they are, broadcast
    skipped = [s.shape == (0,) for s in call.specs]
    kept = [s for s, skip in zip(call.specs, skipped, strict=True) if not skip]
    if kept and any(skipped):
        ndim = len(kept[0].shape)
    dim = _norm(dim, ndim)
    cands = mapped([(a, a) for a in range(ndim) if a != dim], n)
    if not kept or not any(skipped):
        return cands
    return [
        Strategy(
            tuple(broadcast if skip else s for s, skip in zip(c.inputs, skipped, strict=True)),
            c.outputs,
        )
        for c in cands
    ]


@register_strategy(
    aten.split,
    aten.split_with_sizes,
    aten.unbind,
    aten.chunk,
    # (not views to autograd: the gates of torch's LSTM and GRU cells)
    aten.unsafe_split,
    aten.unsafe_split_with_sizes,
    aten.unsafe_chunk,
)
def splitting(call: Call) -> list[Strategy]:
    ndim = len(call.specs[0].shape)
    unbind = call.func.overloadpacket is aten.unbind
    dim = _norm(call.arg(1 if unbind else 2, "dim", 0), ndim)
    n_out = sum(m is not None for m in call.out_meta)
    pairs = [(a, a - (unbind and a > dim)) for a in range(ndim) if a != dim]
    return mapped(pairs, 1, n_out)


def _unindexed_dims(ndim: int, indices: list) -> dict[int, int]:
    """Where advanced indexing puts each dim of x it does not index (input dim: output dim),
    for integer indices on adjacent dims (`x[:, idx]`, `x[..., i, j]`): the indexed block
    becomes the indices' broadcast shape in place. Else (indices apart) none."""
    at = [k for k, i in enumerate(indices) if i is not None]
    if not at or at != list(range(at[0], at[-1] + 1)):
        return {}
    block = len(torch.broadcast_shapes(*(tuple(indices[k].shape) for k in at)))
    first, last = at[0], at[-1]
    return {
        d: d if d < first else d - (last - first + 1) + block
        for d in range(ndim)
        if d < first or d > last
    }


def _check_mask_shapes(shape: tuple, indices: list) -> None:
    """A mask must have the shape of the dims it indexes, as torch checks: its nonzero
    positions would index other dims' elements silently otherwise (and a longer one
    raise on some ranks only). Logical shapes: every rank raises alike."""
    d = 0
    for k, i in enumerate(indices):
        if i is None or i.dtype not in (torch.bool, torch.uint8):
            d += 1
            continue
        want = tuple(shape[d : d + i.dim()])
        if tuple(i.shape) != want:
            raise IndexRangeError(
                f"index: the shape of the mask {list(i.shape)} at index {k} does not match "
                f"the shape of the indexed tensor {list(shape)} at dim {d}"
            )
        d += i.dim()


def _masks_as_integers(given: list, local_idx: list, placement) -> list:
    """A k-dim mask indexes k dims by its nonzero positions, as torch reads it: as k integer
    indices, found from the mask's values (`local_idx`: each index whole on this rank).

    A rank outside the placement holds no values of a global mask (`given`): it learns how
    many positions each has from the placement's first rank (every rank calls, SPMD), and
    takes that many zeros, which is all the output's shape needs there."""

    inside = env.get_rank() in placement
    out: list = []
    learnt = []  # (where in `out`, the logical dims) of each global mask
    for g, i in zip(given, local_idx, strict=True):
        if i is None or i.dtype not in (torch.bool, torch.uint8):
            out.append(i)
            continue
        is_global = isinstance(g, GlobalTensor)
        if is_global:
            learnt.append((len(out), g.dim()))
        if inside or not is_global:
            out.extend(i.bool().nonzero(as_tuple=True))
        else:  # (filled below)
            out.extend([None] * g.dim())
    if not learnt:
        return out
    metas = [(tuple(out[at].shape), out[at].dtype) for at, _ in learnt] if inside else []
    metas = outside_ranks_learn(placement, metas, inside)
    if not inside:
        for (at, dims), (shape, dtype) in zip(learnt, metas, strict=True):
            out[at : at + dims] = [torch.zeros(shape, dtype=dtype)] * dims
    return out


def _meta_index(index, local: torch.Tensor) -> torch.Tensor:
    """An integer index for finding the output's shape, by its logical shape (a rank outside
    the placement holds none)."""
    return torch.empty(tuple(index.shape), dtype=local.dtype, device="meta")


_COMPLEX_DTYPES = {
    torch.float64: torch.complex128,
    torch.float32: torch.complex64,
    torch.float16: torch.complex32,
}


@register(aten.view_as_complex.default, aten.view_as_real.default)
def complex_view(func, args, kwargs):
    """`view_as_complex` folds the last dim (its pairs) into complex numbers, `view_as_real`
    unfolds them: every other dim keeps its split, and partial sums stay (both are linear).
    Only a split of the folded pairs' dim, and a partial max or min (complex numbers have
    no order), are gathered first. The local view of a local
    tensor whose pairs are not adjacent in memory (an expanded gradient) is taken of a
    contiguous copy (`local_view`), as for a reshape."""

    g = args[0]
    spec = g._spec
    to_complex = func is aten.view_as_complex.default
    folded = len(spec.shape) - 1 if to_complex else None
    x = rebox(
        g,
        [
            broadcast
            if (s.is_split and s.dim == folded) or (s.is_partial and s != partial_sum)
            else s
            for s in spec.nd_sbp
        ],
    )
    if to_complex:
        shape, dtype = spec.shape[:-1], _COMPLEX_DTYPES.get(spec.dtype, spec.dtype)
    else:
        shape, dtype = (*spec.shape, 2), spec.dtype.to_real()
    out_spec = x._spec._replace(shape=tuple(shape), dtype=dtype)
    if env.get_rank() not in spec.placement:
        return GlobalTensor(empty_local(out_spec), out_spec)
    local, copied = local_view(func, (x._local,), {})
    out = GlobalTensor(local, out_spec)
    mark_view(func, args, kwargs, [out], x is not g, copied)
    return out


@register(aten.index.Tensor)
def index(func, args, kwargs):
    """Advanced indexing with global or local (constant) integer indices: on the indices'
    whole values, with x split where a dim it does not index is (`input_ids[:, [-1, 0]]`
    of a split batch), else broadcast (or a partial sum: indexing is linear)."""

    x, indices = args[0], args[1]
    allb = (broadcast,) * len(x.sbp)
    local_idx = [
        None if i is None else rebox(i, allb)._local if isinstance(i, GlobalTensor) else i
        for i in indices
    ]
    if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in local_idx):
        _check_mask_shapes(x.shape, indices)
        indices = local_idx = _masks_as_integers(indices, local_idx, x._spec.placement)
    kept = _unindexed_dims(len(x.shape), indices)  # (logical shapes: alike on every rank)
    nd = tuple(s if s.is_partial or (s.is_split and s.dim in kept) else broadcast for s in x.sbp)
    x = rebox(x, nd)
    spec = x._spec
    meta = func(
        torch.empty(spec.shape, dtype=spec.dtype, device="meta"),
        [
            None if i is None else _meta_index(i, li)
            for i, li in zip(indices, local_idx, strict=True)
        ],
    )
    out_nd = tuple(split(kept[s.dim]) if s.is_split else s for s in nd)
    out_spec = spec._replace(shape=tuple(meta.shape), nd_sbp=out_nd)
    if env.get_rank() not in spec.placement:
        return GlobalTensor(empty_local(out_spec), out_spec)
    return GlobalTensor(
        func(x._local, [None if i is None else i.to(x._local.device) for i in local_idx]), out_spec
    )


@register(aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default)
def index_put(func, args, kwargs):
    """Writing `values` at indices: linear in self and values, so both become partial where
    either is, else broadcast. (The backward of `y[idx] = v` writes zeros made of the
    logical shape there: a broadcast value, see FORMULA_BUFFER_OPS.)"""

    x, indices, values = args[0], args[1], args[2]
    if not isinstance(values, GlobalTensor):  # (integer values pass scan as indices do)
        if not formula_buffer(func, values) and (values.dim() != 0 or not trusted_constant(func)):
            raise PlacementError(
                f"{func}: values is a local tensor of shape {tuple(values.shape)}; make it "
                "global first (values.to_global(placement, sbp)), or pass a Python number"
            )
        values = arguments.as_broadcast(values, x._spec.placement)
    nd = tuple(
        partial_sum if a.is_partial or b.is_partial else broadcast
        for a, b in zip(x.sbp, values.sbp, strict=True)
    )
    xb, vb = rebox(x, nd), rebox(values, nd)
    allb = (broadcast,) * len(nd)
    local_idx = [
        None if i is None else rebox(i, allb)._local if isinstance(i, GlobalTensor) else i
        for i in indices
    ]
    inside = env.get_rank() in xb._spec.placement
    if func is aten.index_put.default:
        out = func(xb._local, local_idx, vb._local, *args[3:], **kwargs) if inside else xb._local
        return GlobalTensor(out, xb._spec)
    if inside:
        func(xb._local, local_idx, vb._local, *args[3:], **kwargs)
    assign(x, xb._local, xb._spec)  # (in x's own layout: in-place ops keep it)
    return x


LOCAL_INDEX_OPS.update(
    {
        aten.index.Tensor,
        aten.index_put.default,
        aten.index_put_.default,
        aten._index_put_impl_.default,
    }
)
