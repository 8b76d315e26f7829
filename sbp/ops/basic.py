"""Ops that keep the layout: clone and the *_like factories. (detach and alias keep it too;
`registry.dispatch` answers them before looking for a rule: autograd makes one per
gradient it stores.)"""

from __future__ import annotations

import torch

from sbp.ops.registry import register
from sbp.signature import partials_to_broadcast

aten = torch.ops.aten


@register(aten.clone.default)
def same_layout(func, args, kwargs):
    from sbp.tensor import GlobalTensor

    g = args[0]
    return GlobalTensor(func(g._local, *args[1:], **kwargs), g._spec)


@register(
    aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default
)
def like(func, args, kwargs):
    """A new value of the same shape: every element is set, so a partial input gives broadcast."""
    from sbp.tensor import GlobalTensor

    g = args[0]
    spec = g._spec
    nd = partials_to_broadcast(spec.nd_sbp)
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
    """`x.new_*(size)`: of x's shape, the new tensor keeps x's layout (partials made broadcast),
    so autograd's copy of a split gradient stays split; of another shape, it is broadcast."""
    from sbp import env
    from sbp.boxing.executor import empty_local
    from sbp.layout import GlobalSpec
    from sbp.signature import broadcast
    from sbp.tensor import GlobalTensor

    g, size = args[0], tuple(args[1])
    spec = g._spec
    nd = partials_to_broadcast(spec.nd_sbp) if size == tuple(spec.shape) else None
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
