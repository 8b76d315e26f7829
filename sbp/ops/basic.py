"""Ops that keep the layout: clone and the *_like factories. (detach and alias keep it too;
`registry.dispatch` answers them before looking for a rule: autograd makes one per
gradient it stores.)"""

from __future__ import annotations

import torch

from sbp import env
from sbp.boxing.executor import empty_local
from sbp.layout import GlobalSpec
from sbp.ops.registry import register
from sbp.ops.writes import CopyOf, as_shown
from sbp.signature import broadcast, partials_to_broadcast
from sbp.tensor import GlobalTensor

aten = torch.ops.aten


@register(aten.clone.default)
def same_layout(func, args, kwargs):
    g = args[0]
    return GlobalTensor(func(g._local, *args[1:], **kwargs), g._spec)


@register(aten._conj.default, aten._neg_view.default)
def resolved_view(func, args, kwargs):
    """`z.conj()` (and the negative view autograd makes of complex gradients): torch marks
    a view conjugated (negated) and resolves it in the kernels of the ops that read it, a
    step that runs above sbp's dispatch, so a local tensor marked so would be read as it
    is stored. The local value is resolved at once instead; the result is a copied view
    (sbp.ops.writes) that refuses in-place writes rather than miss its base."""

    g = args[0]
    local = g._local.conj_physical() if func is aten._conj.default else g._local.neg()
    out = GlobalTensor(local, g._spec)
    out._copy_of = CopyOf(as_shown(g), None, func)
    return out


# allocations whose value is zero or undefined: a partial sum of them is one too
_PARTIAL_ALLOCS = frozenset(
    (
        aten.zeros_like.default,
        aten.empty_like.default,
        aten.new_empty_strided.default,
        aten.new_empty.default,
        aten.new_zeros.default,
    )
)


@register(
    aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default
)
def like(func, args, kwargs):
    """A new value of the same shape, in the input's layout. Ones and a fill value are set on
    every rank, so a partial input gives broadcast; zeros and an empty tensor stay partial, so
    that `torch.empty_like(p).copy_(p)` (which in-place ops make keep its layout) is free."""

    g = args[0]
    spec = g._spec
    nd = spec.nd_sbp if func in _PARTIAL_ALLOCS else partials_to_broadcast(spec.nd_sbp)
    out = func(g._local, *args[1:], **kwargs)
    return GlobalTensor(out, spec._replace(nd_sbp=nd, dtype=out.dtype))


@register(
    aten.new_empty_strided.default,
    aten.new_empty.default,
    aten.new_zeros.default,
    aten.new_ones.default,
    aten.new_full.default,
)
def new_alloc(func, args, kwargs):
    """`x.new_*(size)`: of x's shape, the new tensor keeps x's layout (partials made broadcast
    but for zeros and empty ones, as in `like`), so autograd's copy of a split or partial
    gradient into a new one (`new_empty_strided(...).copy_(grad)`) is free; of another shape,
    it is broadcast."""

    g, size = args[0], tuple(args[1])
    spec = g._spec
    keep = spec.nd_sbp if func in _PARTIAL_ALLOCS else partials_to_broadcast(spec.nd_sbp)
    nd = keep if size == tuple(spec.shape) else None
    nd = nd or (broadcast,) * spec.placement.ndim
    dtype = kwargs.get("dtype") or g.dtype
    out = GlobalSpec(spec.placement, nd, size, dtype)
    me = env.get_rank()
    if me not in spec.placement:
        return GlobalTensor(empty_local(out), out)
    local = list(out.local_shape(me))
    options = {k: v for k, v in kwargs.items() if k in ("dtype", "layout", "device", "pin_memory")}
    if func is aten.new_full.default:
        data = g._local.new_full(local, args[2], **options)
    elif func is aten.new_zeros.default:
        data = g._local.new_zeros(local, **options)
    elif func is aten.new_ones.default:
        data = g._local.new_ones(local, **options)
    else:
        data = g._local.new_empty(local, **options)
    return GlobalTensor(data, out)
