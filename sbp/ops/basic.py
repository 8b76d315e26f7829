"""Ops that keep the layout: detach, alias, clone, and the *_like factories."""

from __future__ import annotations

import torch

from sbp.ops.registry import register
from sbp.signature import partials_to_broadcast

aten = torch.ops.aten


@register(aten.detach.default, aten.alias.default, aten.clone.default)
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
