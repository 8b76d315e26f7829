"""Rules for the BatchNorm ops that torch.compile traces and eager mode does not use.

Eager BatchNorm reaches `aten.native_batch_norm`; Dynamo and AOT autograd trace
`aten._native_batch_norm_legit` and its variants instead. Without rules here
they would fall back to broadcast inputs (an all-gather of every activation).
Each rule delegates to the eager rule `sbp.ops.nn.native_batch_norm`, so a
traced BatchNorm computes the same logical statistics.

Under AOT autograd, a rule must not read a buffer that the same op mutates in
place after its update: the running statistics are graph inputs, their update is
copied back into them after the forward graph, and the backward graph may read
the input again (saved or recomputed) and then sees the updated value. So in
training the eager rule gets copies of the running statistics and updates the
copies, and its statistics come from the batch and its all-reduce's result alone
(`sbp.ops.batch_norm.forward`); the copies are then written into the buffers (or
returned, by the functional variant). One all-reduce per layer in
forward, as in eager mode, with the same numbers.
Where no rank's batch is split (a world of one), there is nothing to sum, and torch's
own op runs on the local tensors, as it does in plain torch's graph.
"""

from __future__ import annotations

import torch

from sbp import env
from sbp.layout import GlobalSpec
from sbp.ops.batch_norm import (
    _acc,
    _bn_layout,
    _locals,
    _parts,
    native_batch_norm,
    wrap_native,
)
from sbp.ops.registry import rebox, register, schema_args
from sbp.signature import broadcast

aten = torch.ops.aten
_NATIVE = aten.native_batch_norm.default


def _train(x, weight, bias, running_mean, running_var, momentum: float, eps: float):
    """(out, batch mean, batch 1/std, new running mean, new running variance): the eager rule
    on copies of the running statistics, which it updates; the buffers themselves are not
    written here."""
    new_mean, new_var = running_mean.clone(), running_var.clone()
    out, mean, invstd = native_batch_norm(
        _NATIVE, (x, weight, bias, new_mean, new_var, True, momentum, eps), {}
    )
    return out, mean, invstd, new_mean, new_var


def _native_on_locals(func, args: list):
    """Train mode where every rank holds its whole batch (a world of one, or a batch not
    split): torch's own op on the local tensors, as plain torch traces it, one fused
    BatchNorm instead of ~20 ops rebuilding the running statistics. None otherwise.

    `args` are the op's (x, weight, bias, running_mean, running_var, ...); its outputs are
    (out, mean, invstd) and, for the functional variant, the new running statistics."""
    x, weight, bias, running_mean, running_var = args[:5]
    nd = _bn_layout(x)
    placement = x._spec.placement
    allb = (broadcast,) * len(nd)
    if (
        _parts(placement, nd) != 1
        or env.get_rank() not in placement
        or any(t._spec.nd_sbp != allb for t in (running_mean, running_var))
    ):
        return None
    x = rebox(x, nd)
    outs = func(x._local, *_locals((weight, bias, running_mean, running_var), len(nd)), *args[5:])
    stat_spec = GlobalSpec(placement, allb, (x.shape[1],), _acc(x.dtype))
    return wrap_native(outs, x, stat_spec, (running_mean, running_var)[: len(outs) - 3])


@register(aten._native_batch_norm_legit.default)
def batch_norm_legit(func, args, kwargs):
    """Train or eval with running statistics; updates them in place when training."""
    every = schema_args(func, args, kwargs)
    x, weight, bias, running_mean, running_var, training, momentum, eps = every
    if not training:
        return native_batch_norm(
            _NATIVE, (x, weight, bias, running_mean, running_var, False, momentum, eps), {}
        )
    whole = _native_on_locals(func, every)
    if whole is not None:
        return whole
    out, mean, invstd, new_mean, new_var = _train(
        x, weight, bias, running_mean, running_var, momentum, eps
    )
    with torch.no_grad():
        running_mean.copy_(new_mean)
        running_var.copy_(new_var)
    return out, mean, invstd


@register(aten._native_batch_norm_legit.no_stats)
def batch_norm_legit_no_stats(func, args, kwargs):
    x, weight, bias, training, momentum, eps = schema_args(func, args, kwargs)
    return native_batch_norm(_NATIVE, (x, weight, bias, None, None, training, momentum, eps), {})


@register(aten._native_batch_norm_legit_functional.default)
def batch_norm_legit_functional(func, args, kwargs):
    """Like `_native_batch_norm_legit`, returning the new running statistics instead."""
    every = schema_args(func, args, kwargs)
    x, weight, bias, running_mean, running_var, training, momentum, eps = every
    if not training:
        out, mean, invstd = native_batch_norm(
            _NATIVE, (x, weight, bias, running_mean, running_var, False, momentum, eps), {}
        )
        return out, mean, invstd, running_mean.clone(), running_var.clone()
    whole = _native_on_locals(func, every)
    if whole is not None:
        return whole
    return _train(x, weight, bias, running_mean, running_var, momentum, eps)


@register(aten._native_batch_norm_legit_no_training.default)
def batch_norm_legit_no_training(func, args, kwargs):
    x, weight, bias, running_mean, running_var, momentum, eps = schema_args(func, args, kwargs)
    return native_batch_norm(
        _NATIVE, (x, weight, bias, running_mean, running_var, False, momentum, eps), {}
    )
