"""Per-shard BatchNorm as ops: each rank normalises its part of the batch with its own
statistics, which is what torch DDP computes without SyncBatchNorm.

`sbp.nn.data_parallel(model, batch_norm="local")` asks for it. The fast path runs
it on local tensors itself; a module that runs op by op, or one that
`torch.compile` traces, needs it as an op on global tensors instead, so the
BatchNorm modules of such a model call `sbp::shard_batch_norm` (`sbp.data_parallel.shard_batch_norm`).
As a custom op it is one node in a Dynamo graph, and its rule below runs torch's
native kernels on the local tensors (under AOT autograd too), with no collective:
- forward: the output is laid out as the input; the batch statistics, which differ
  per rank, are honest global tensors: the ranks' statistics side by side, split
  where the batch is split; the op is functional (custom ops with an autograd
  formula must be), so it returns the running statistics updated with this rank's
  own, and the module writes them and then copies the first rank's to every rank
  (`first_rank_values`), as torch DDP keeps rank 0's buffers;
- backward (`sbp::shard_batch_norm_backward`, registered as its autograd formula):
  the input gradient laid out as the input, and the weight and bias gradients as
  partial sums, which the gradient reduction makes whole with every other parameter.
An empty shard (an uneven batch) contributes nothing: its output is empty, its
statistics zeros and its running statistics unchanged.
"""

from __future__ import annotations

import torch

from sbp import comm, env
from sbp.boxing.executor import empty_local
from sbp.layout import GlobalSpec
from sbp.ops.batch_norm import _acc, _bn_layout, _locals, _parts
from sbp.ops.registry import rebox, register, schema_args
from sbp.signature import broadcast, split, splits_to_partials
from sbp.tensor import GlobalTensor

Tensor = torch.Tensor
aten = torch.ops.aten


@torch.library.custom_op("sbp::shard_batch_norm", mutates_args=())
def shard_batch_norm(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    momentum: float,
    eps: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Train-mode BatchNorm of `x` with its own statistics: (output, mean, 1/std, new running
    mean, new running variance), the last two as torch updates them (empty where not given).
    Functional, so that it can have an autograd formula: the caller writes the new running
    statistics into its buffers."""
    return _forward_local(x, weight, bias, running_mean, running_var, momentum, eps)


def _forward_local(
    x, weight, bias, running_mean, running_var, momentum: float, eps: float
) -> tuple:
    """The op on plain tensors; the rule below calls it on the local tensors, so that a traced
    graph holds torch's own BatchNorm op, which Inductor compiles, rather than this one."""
    if x.numel() > 0 and running_mean is not None and running_var is not None:
        return aten._native_batch_norm_legit_functional(
            x, weight, bias, running_mean, running_var, True, momentum, eps
        )
    new_mean, new_var = (
        t.clone() if t is not None else x.new_empty(0) for t in (running_mean, running_var)
    )
    if x.numel() == 0:
        zeros = x.new_zeros(x.shape[1], dtype=_acc(x.dtype))
        return torch.empty_like(x), zeros, zeros.clone(), new_mean, new_var
    out, mean, invstd = torch.native_batch_norm(
        x,
        weight,
        bias,
        new_mean if running_mean is not None else None,
        new_var if running_var is not None else None,
        True,
        momentum,
        eps,
    )
    return out, mean, invstd, new_mean, new_var


@shard_batch_norm.register_fake
def _(x, weight, bias, running_mean, running_var, momentum, eps):
    stat = x.new_empty(x.shape[1], dtype=_acc(x.dtype))
    new_mean, new_var = (
        torch.empty_like(t) if t is not None else x.new_empty(0)
        for t in (running_mean, running_var)
    )
    return torch.empty_like(x), stat, torch.empty_like(stat), new_mean, new_var


@torch.library.custom_op("sbp::shard_batch_norm_backward", mutates_args=())
def shard_batch_norm_backward(
    dy: Tensor, x: Tensor, weight: Tensor | None, mean: Tensor, invstd: Tensor, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(input gradient, weight gradient, bias gradient) of `shard_batch_norm`."""
    return _backward_local(dy, x, weight, mean, invstd, eps)


def _backward_local(dy, x, weight, mean, invstd, eps: float) -> tuple:
    if x.numel() == 0:
        zeros = x.new_zeros(x.shape[1])
        return torch.empty_like(x), zeros, zeros.clone()
    dx, gw, gb = aten.native_batch_norm_backward(
        dy, x, weight, None, None, mean, invstd, True, eps, [True, True, True]
    )
    return dx, gw, gb


@shard_batch_norm_backward.register_fake
def _(dy, x, weight, mean, invstd, eps):
    grad = x.new_empty(x.shape[1])
    return torch.empty_like(x), grad, torch.empty_like(grad)


def _save(ctx, inputs, output) -> None:
    x, weight, bias, _, _, _, eps = inputs
    _, mean, invstd, _, _ = output
    ctx.save_for_backward(x, weight, mean, invstd)
    ctx.eps, ctx.has_bias = eps, bias is not None


def _backward(ctx, dout, *_):
    x, weight, mean, invstd = ctx.saved_tensors
    dx, gw, gb = shard_batch_norm_backward(dout.contiguous(), x, weight, mean, invstd, ctx.eps)
    return (
        dx,
        gw if weight is not None else None,
        gb if ctx.has_bias else None,
        None,
        None,
        None,
        None,
    )


shard_batch_norm.register_autograd(_backward, setup_context=_save)


# ---------------------------------------------------------------- rules on global tensors


def _stat_spec(x, stat: Tensor) -> GlobalSpec:
    """Every rank's statistics side by side: split where the batch is split."""
    placement, nd = x._spec.placement, x._spec.nd_sbp
    stat_nd = tuple(split(0) if s.is_split else broadcast for s in nd)
    return GlobalSpec(placement, stat_nd, (_parts(placement, nd) * stat.shape[0],), stat.dtype)


def _outside(specs) -> tuple:
    """A rank outside the placement: empty local tensors."""

    return tuple(GlobalTensor(empty_local(s), s) for s in specs)


@register(torch.ops.sbp.shard_batch_norm.default)
def shard_batch_norm_rule(func, args, kwargs):
    x, weight, bias, running_mean, running_var, momentum, eps = schema_args(func, args, kwargs)
    nd = _bn_layout(x)
    x = rebox(x, nd)
    C, acc = x.shape[1], _acc(x.dtype)
    allb = (broadcast,) * len(nd)
    running = [
        t._spec._replace(nd_sbp=allb)
        if t is not None
        else GlobalSpec(x._spec.placement, allb, (0,), x.dtype)
        for t in (running_mean, running_var)
    ]
    if env.get_rank() not in x._spec.placement:
        spec = _stat_spec(x, torch.empty(C, dtype=acc, device="meta"))
        return _outside((x._spec, spec, spec, *running))
    w, b, rm, rv = _locals((weight, bias, running_mean, running_var), len(nd))
    outs = _forward_local(x._local, w, b, rm, rv, momentum, eps)
    out, mean, invstd, new_mean, new_var = outs
    return (
        GlobalTensor(out, x._spec),
        GlobalTensor(mean, _stat_spec(x, mean)),
        GlobalTensor(invstd, _stat_spec(x, invstd)),
        GlobalTensor(new_mean, running[0]),
        GlobalTensor(new_var, running[1]),
    )


@register(torch.ops.sbp.shard_batch_norm_backward.default)
def shard_batch_norm_backward_rule(func, args, kwargs):
    dy, x, weight, mean, invstd, eps = schema_args(func, args, kwargs)
    nd = _bn_layout(x)
    x, dy = rebox(x, nd), rebox(dy, nd)
    placement = x._spec.placement
    pspec = GlobalSpec(placement, splits_to_partials(nd), (x.shape[1],), x.dtype)
    if env.get_rank() not in placement:
        return _outside((x._spec, pspec, pspec))
    (w,) = _locals((weight,), len(nd))
    dx, gw, gb = _backward_local(dy._local, x._local, w, mean._local, invstd._local, eps)
    return GlobalTensor(dx, x._spec), GlobalTensor(gw, pspec), GlobalTensor(gb, pspec)


@torch.library.custom_op("sbp::first_rank_values", mutates_args=())
def first_rank_values(tensors: list[Tensor]) -> list[Tensor]:
    """The values the first rank holds, on every rank (plain tensors: copies)."""
    return [t.clone() for t in tensors]


@first_rank_values.register_fake
def _(tensors):
    return [torch.empty_like(t) for t in tensors]


@register(torch.ops.sbp.first_rank_values.default)
def first_rank_values_rule(func, args, kwargs):
    """One broadcast from the placement's first rank of every tensor's local values (one
    collective for all of a model's running statistics), keeping each tensor's spec."""

    (tensors,) = schema_args(func, args, kwargs)
    placement = tensors[0]._spec.placement
    ranks = placement.flat_ranks
    if env.get_rank() not in placement:
        return [GlobalTensor(t._local.clone(), t._spec) for t in tensors]
    flat = torch.cat([t._local.reshape(-1) for t in tensors])
    flat = comm.broadcast(flat, ranks[0], ranks)
    out, offset = [], 0
    for t in tensors:
        n = t._local.numel()
        out.append(GlobalTensor(flat[offset : offset + n].view_as(t._local), t._spec))
        offset += n
    return out
