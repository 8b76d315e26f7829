"""BatchNorm over a batch split across ranks: the statistics of the whole logical batch.

One place for the math, used by the per-op rules below and by the data-parallel
fast path (`sbp.nn.data_parallel`), which runs whole modules on local tensors:
- forward: each rank's count, mean and sum of squared deviations from that mean
  (two local passes: no cancellation, however far the data sit from zero), one
  all-reduce that gathers them, merged as Chan et al. do; then torch's native
  eval-mode kernel normalises in one pass;
- backward: torch's native kernel gives the local batch's input gradient and the
  local sums of dy and dy*xhat in one call, one all-reduce makes the sums whole,
  and a per-channel affine function of x added in place corrects the input gradient.
`all_reduce` sums a tensor over the ranks that hold parts of the batch; the
count is the logical number of elements per channel. Nothing here reads a
buffer after writing it: the statistics come from the batch and the all-reduce's
result alone (a traced graph may recompute them in backward, after the buffers
were updated).
"""

from __future__ import annotations

import functools
import math

import torch

from sbp import comm, env
from sbp.boxing.executor import empty_local
from sbp.layout import GlobalSpec
from sbp.ops.registry import rebox, register
from sbp.signature import broadcast, splits_to_partials
from sbp.tensor import GlobalTensor

aten = torch.ops.aten


def _without_autocast(f):
    """`f` with torch's autocast off: its sums by product (`ones @ t`) and `torch.mv` would
    run in half precision under the fast path's local run, where autocast sees them (the
    per-op rules run below autocast, which never sees their kernels): statistics less
    exact, and the first local run differing from the checking pass's."""

    @functools.wraps(f)
    def without(t: torch.Tensor, *args, **kwargs):
        if not torch.is_autocast_enabled(t.device.type):
            return f(t, *args, **kwargs)
        with torch.autocast(t.device.type, enabled=False):
            return f(t, *args, **kwargs)

    return without


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _channel_sums(t: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    plane = math.prod(t.shape[2:])  # (not -1: a rank's part of the batch may be empty)
    return t.reshape(t.shape[0], t.shape[1], plane).sum(2, dtype=acc).sum(0)


# Plane sizes (elements per sample and channel) where sums over the batch are faster as a
# matrix product with a vector of ones (one BLAS call) than with torch's CPU kernels, measured
# on x86-64: plain sums over the late layers of a CNN (4x4 down to 1x1 planes) are slow, and
# the native BatchNorm backward is 5-10x slower on planes shorter than a vector register.
SUM_BY_PRODUCT = range(2, 17)
BACKWARD_BY_PRODUCT = range(2, 8)


def _by_product(planes: range, *ts: torch.Tensor) -> bool:
    """Sum these over every dim but 1 with `_product_sums`? Only where that keeps the
    accumulation type: float32/64, contiguous, on CPU."""
    x = ts[0]
    return (
        x.numel() > 0
        and x.numel() // (x.shape[0] * x.shape[1]) in planes
        and x.device.type == "cpu"
        and all(t.dtype == _acc(t.dtype) and t.is_contiguous() for t in ts)
    )


def _product_sums(t: torch.Tensor, ones: torch.Tensor) -> torch.Tensor:
    """Per channel sum of `t` over every dim but 1 (see `SUM_BY_PRODUCT`)."""
    return (ones @ t.view(t.shape[0], -1)).view(t.shape[1], -1).sum(1)


def _sums(t: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """Per channel sum of `t` over every dim but 1, in `acc`."""
    if _by_product(SUM_BY_PRODUCT, t):
        return _product_sums(t, t.new_ones(t.shape[0]))
    return _channel_sums(t, acc)


def _statistics(x: torch.Tensor, acc: torch.dtype, count: int, all_reduce: GroupSum) -> tuple:
    """The logical batch's per-channel mean and (biased) variance, in `acc`; `count`: the
    logical number of elements per channel.

    Each rank takes its part's count n, mean m and sum of squared deviations M from m
    (two passes: no cancellation; torch's `var_mean` is slower on the CPU); one
    all-reduce of a table makes them known to all, each rank writing its own row [m, n]
    and adding its M to the last row (the others' rows are zeros: the sum is the table,
    exactly). Then, with N = sum n = count,
        mean = sum(n m) / N,   var = (sum M + sum n (m - mean)^2) / N
    (Chan et al.), free of the cancellation of E[x^2] - E[x]^2 on data far from zero.
    The table is in `acc` where that holds the counts exactly, else in float64."""
    C, k, me = x.shape[1], len(all_reduce.ranks), all_reduce.index
    n = x.numel() // C if C else 0
    exact = acc if count <= 2**24 else torch.float64  # (float32 holds integers to 2^24)
    table = torch.zeros(k + 1, C + 1, dtype=exact, device=x.device)
    if n:
        local_mean = _sums(x, acc).div_(n)
        # (a half input's deviations in float32: their squares may not fit in half)
        d = x.to(acc) - local_mean.view((1, C) + (1,) * (x.dim() - 2))
        table[me, :C] = local_mean
        table[me, C] = n
        table[k, :C] = _sums(d.square_(), acc)
    table = all_reduce(table)
    means, counts = table[:k, :C], table[:k, C]
    mean = torch.mv(means.t(), counts).div_(count)
    spread = (means - mean).square_()
    var = torch.mv(spread.t(), counts).add_(table[k, :C]).div_(count)
    return mean.to(acc), var.to(acc)


@_without_autocast
def forward(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    momentum: float,
    eps: float,
    count: int,
    all_reduce: GroupSum,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Train-mode BatchNorm of the local part `x` with the logical batch's statistics.

    Returns (output, mean, invstd) and updates the running statistics in place.
    """
    acc = _acc(x.dtype)
    mean, var = _statistics(x, acc, count, all_reduce)
    invstd = torch.rsqrt(var + eps)
    if x.numel() == 0:
        out = torch.empty_like(x)
    else:
        if x.dtype != acc:  # (half input: torch takes float32 statistics with float32 affine)
            weight = None if weight is None else weight.to(acc)
            bias = None if bias is None else bias.to(acc)
        out = torch.batch_norm(x, weight, bias, mean, var, False, 0.0, eps, False)
    with torch.no_grad():
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            unbiased = var * (count / max(count - 1, 1))
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
    return out, mean, invstd


@_without_autocast
def differentiable_forward(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    momentum: float | torch.Tensor,
    eps: float,
    ranks: tuple[int, ...],
    index: int,
) -> torch.Tensor:
    """`forward` in differentiable torch ops, for a compiled local forward: Dynamo traces
    it, Inductor fuses the normalisation with its neighbours, and autograd makes the
    backward, whose one all-reduce is the table's gradient's (`_TableSum`).
    The statistics are `_statistics`'s (the same table, `index` this rank's row among
    `ranks`), the logical count read from the table: a graph must not bake in a count
    that the next batch changes. The table is float64, which holds any count exactly."""
    C, k = x.shape[1], len(ranks)
    acc = _acc(x.dtype)
    dims = [0, *range(2, x.dim())]
    view = (1, C) + (1,) * (x.dim() - 2)
    xa = x.to(acc)
    n = x.numel() // C if C else 0
    # (no branch for an empty part: its table row stays in the graph, so that the backward
    # all-reduces the table's gradient on every rank)
    local_mean = xa.sum(dims) / max(n, 1)
    spread = (xa - local_mean.view(view)).square().sum(dims)
    counted = local_mean.new_full((1,), n, dtype=torch.float64)
    own = torch.cat([local_mean.double(), counted])
    last = torch.cat([spread.double(), torch.zeros_like(counted)])
    zeros = torch.zeros_like(own)
    table = torch.stack([own if r == index else zeros for r in range(k)] + [last])
    table = _TableSum.apply(table, list(ranks))
    means, counts = table[:k, :C], table[:k, C]
    count = counts.sum()
    mean = (means * counts[:, None]).sum(0) / count
    var = (((means - mean).square() * counts[:, None]).sum(0) + table[k, :C]) / count
    out = (xa - mean.to(acc).view(view)) * torch.rsqrt(var.to(acc) + eps).view(view)
    if weight is not None:
        out = out * weight.to(acc).view(view)
    if bias is not None:
        out = out + bias.to(acc).view(view)
    with torch.no_grad():  # (a tensor times `momentum`, not alpha=: a cumulative average's
        # momentum changes every step, and Dynamo would make a graph for each value)
        if running_mean is not None:
            running_mean.sub_((running_mean - mean.to(running_mean.dtype)) * momentum)
        if running_var is not None:
            unbiased = (var * (count / (count - 1).clamp_min(1))).to(running_var.dtype)
            running_var.sub_((running_var - unbiased) * momentum)
    return out.to(x.dtype)


class _TableSum(torch.autograd.Function):
    """`sbp::all_reduce`'s sum over `ranks`, differentiable (Dynamo traces it): each
    rank's loss is its part of the logical one, so an input's gradient is the sum of
    every rank's output gradient. (`_SumOverRanks` goes through `sbp.comm`'s Python,
    which Dynamo would have to trace.)"""

    @staticmethod
    def forward(ctx, t: torch.Tensor, ranks: list[int]) -> torch.Tensor:
        ctx.ranks = ranks
        return comm.functional.all_reduce(t, "sum", ranks)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        return comm.functional.all_reduce(grad.contiguous(), "sum", ctx.ranks), None


@_without_autocast
def backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    invstd: torch.Tensor,
    count: int,
    all_reduce: GroupSum,
    input_grad: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Train-mode BatchNorm backward of the local part: (dx, local sums, logical sums).

    The sums are [sum(dy * xhat), sum(dy)] per channel (the weight and bias gradients).
    With N logical elements per channel and a = weight * invstd, the logical input gradient
        dx = a * (dy - sum(dy)/N - xhat * sum(dy*xhat)/N)
    is a * dy plus a per-channel affine function of x. On large planes torch's native kernel
    gives the sums and the input gradient of the *local* batch in one call, corrected in
    place after the all-reduce (no temporary: with results kept alive, as in training, each
    new buffer costs page faults). On small planes, where that kernel is slow, the sums are
    matrix products (`BACKWARD_BY_PRODUCT`) and dx is computed at once.
    """
    C = x.shape[1]
    if x.numel() == 0:
        local = torch.zeros(2, C, dtype=mean.dtype, device=x.device)
        return (torch.empty_like(x) if input_grad else None), local, all_reduce(local.clone())
    view = (1, C) + (1,) * (x.dim() - 2)
    a = invstd if weight is None else invstd * weight.to(invstd.dtype)
    if _by_product(BACKWARD_BY_PRODUCT, x, dy) and mean.dtype == x.dtype:
        ones = x.new_ones(x.shape[0])
        centred = (x - mean.view(view)).mul_(dy)
        local = torch.stack([_product_sums(centred, ones).mul_(invstd), _product_sums(dy, ones)])
        whole = all_reduce(local.clone())
        if not input_grad:
            return None, local, whole
        means = whole / count
        scale = (a * invstd).mul_(means[0]).neg_()
        shift = torch.addcmul((a * means[1]).neg_(), scale, mean, value=-1)
        dx = torch.addcmul(shift.view(view), x, scale.view(view)).addcmul_(dy, a.view(view))
        return dx, local, whole
    if weight is not None and x.dtype != mean.dtype:  # (half input: float32 statistics)
        weight = weight.to(mean.dtype)
    dx, gw, gb = aten.native_batch_norm_backward(
        dy, x, weight, None, None, mean, invstd, True, 0.0, [input_grad, True, True]
    )
    local = torch.stack([gw, gb]).to(mean.dtype)
    whole = all_reduce(local.clone())
    if not input_grad:
        return None, local, whole
    n = x.numel() // C
    # [sum(dy*xhat), sum(dy)]: local means minus logical means, per channel
    excess = torch.sub(local, whole, alpha=n / count).div_(n)
    scale = a * invstd * excess[0]
    shift = torch.addcmul(a * excess[1], scale, mean, value=-1)
    dx.addcmul_(x, scale.to(x.dtype).view(view)).add_(shift.to(x.dtype).view(view))
    return dx, local, whole


class LogicalBatchNorm(torch.autograd.Function):
    """Train-mode BatchNorm on local tensors with logical statistics (the fast path's form).

    The weight and bias gradients it returns are this rank's partial sums; the
    gradient reducer makes them whole with every other parameter's.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps, count, all_reduce):
        out, mean, invstd = forward(
            x, weight, bias, running_mean, running_var, momentum, eps, count, all_reduce
        )
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.count, ctx.all_reduce, ctx.eps = count, all_reduce, eps
        return out

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, invstd = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: a gradient penalty differentiates these
            return _differentiable_backward(ctx, dy, x, weight)
        dy = dy.contiguous()
        dx, local, _ = backward(
            dy, x, weight, mean, invstd, ctx.count, ctx.all_reduce, ctx.needs_input_grad[0]
        )
        gw = local[0].to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        gb = local[1].to(weight.dtype) if ctx.needs_input_grad[2] else None
        return dx, gw, gb, None, None, None, None, None, None


def _differentiable_backward(ctx, dy, x, weight) -> tuple:
    """The gradients of `LogicalBatchNorm` as a graph autograd can differentiate again
    (`create_graph=True`): the normalisation is computed anew from `x` with sums over the
    ranks that are differentiable (`_SumOverRanks`), and differentiated by autograd. As in
    the first-order form, the weight and bias gradients are this rank's partial sums."""
    needs = ctx.needs_input_grad
    dims = [0, *range(2, x.dim())]
    view = (1, -1) + (1,) * (x.dim() - 2)
    mean = _SumOverRanks.apply(x.sum(dims), ctx.all_reduce) / ctx.count
    centred = x - mean.view(view)
    var = _SumOverRanks.apply(centred.square().sum(dims), ctx.all_reduce) / ctx.count
    xhat = centred * torch.rsqrt(var + ctx.eps).view(view)
    out = xhat if weight is None else xhat * weight.view(view)
    wanted = [t for t, need in ((x, needs[0]), (weight, needs[1])) if need and t is not None]
    grads = iter(torch.autograd.grad(out, wanted, dy, create_graph=True))
    dx = next(grads) if needs[0] else None
    gw = next(grads) if needs[1] and weight is not None else None
    gb = dy.sum(dims) if needs[2] else None
    return dx, gw, gb, None, None, None, None, None, None


class _SumOverRanks(torch.autograd.Function):
    """A sum over the ranks of a group (`GroupSum`), differentiable: its gradient is the
    sum over the ranks of theirs (every rank's output depends on every rank's input)."""

    @staticmethod
    def forward(ctx, t, all_reduce):
        ctx.all_reduce = all_reduce
        return all_reduce(t.detach().clone())

    @staticmethod
    def backward(ctx, grad):
        return _SumOverRanks.apply(grad.contiguous(), ctx.all_reduce), None


class GroupSum:
    """Sums a tensor over `ranks` (the ranks holding parts of one batch); `index`: this
    rank's place among them."""

    def __init__(self, ranks: tuple[int, ...]):
        self.ranks = ranks
        self.index = ranks.index(env.get_rank())  # (this rank's row in `_statistics`)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return comm.all_reduce(t, "sum", self.ranks)


def split_group(placement, nd, rank: int) -> tuple[int, ...]:
    """Ranks whose local tensors are parts of the same batch as `rank`'s: those that differ
    from it only on hierarchy dims where `nd` splits (in placement order)."""
    return placement.ranks_varying(rank, {h for h, s in enumerate(nd) if s.is_split})


# ---------------------------------------------------------------- per-op rules


def _bn_layout(x) -> tuple:
    """Keep splits of dims other than the channel dim (1); everything else broadcast."""
    return tuple(s if s.is_split and s.dim != 1 else broadcast for s in x._spec.nd_sbp)


def _parts(placement, nd) -> int:
    """Into how many parts `nd` splits the batch (1: every rank holds all of it)."""
    return math.prod(n for n, s in zip(placement.hierarchy, nd, strict=True) if s.is_split)


def _count(x) -> int:
    return math.prod(x.shape[d] for d in range(x.dim()) if d != 1)


def _locals(tensors, nd_len: int) -> list:
    allb = (broadcast,) * nd_len
    return [rebox(t, allb)._local if t is not None else None for t in tensors]


def _written_back(running: tuple, updated: tuple, training: bool) -> None:
    """Running statistics laid out otherwise than broadcast (split with a sharded model's
    parameters, say) were updated as whole copies (`_locals`): write each rank's part of
    the new value back into them (no communication: the whole is on every rank)."""
    if not training:
        return
    for t, new in zip(running, updated, strict=True):
        if t is None or all(s.is_broadcast for s in t._spec.nd_sbp):
            continue
        whole = GlobalTensor(new, t._spec._replace(nd_sbp=(broadcast,) * len(t._spec.nd_sbp)))
        t._local.copy_(rebox(whole, t._spec.nd_sbp)._local)


def wrap_native(outs, x, stat_spec: GlobalSpec, running: tuple = ()) -> tuple:
    """torch's BatchNorm outputs on the local tensors as global ones: (out, mean, invstd) laid
    out as `x` and `stat_spec` (the shape and dtype torch gave them), and, from the functional
    variant, the new running statistics laid out as the old ones (`running`)."""

    wrapped = [GlobalTensor(outs[0], x._spec)]
    for stat in outs[1:3]:
        wrapped.append(
            GlobalTensor(stat, stat_spec._replace(shape=tuple(stat.shape), dtype=stat.dtype))
        )
    for new, old in zip(outs[3:], running, strict=True):
        wrapped.append(GlobalTensor(new, old._spec._replace(dtype=new.dtype)))
    return tuple(wrapped)


@register(aten.native_batch_norm.default)
def native_batch_norm(func, args, kwargs):
    """Train mode over a split batch: the logical batch's statistics; otherwise local."""

    x, weight, bias, running_mean, running_var, training, momentum, eps = args
    nd = _bn_layout(x)
    x = rebox(x, nd)
    placement = x._spec.placement
    allb = (broadcast,) * len(nd)
    stat_spec = GlobalSpec(placement, allb, (x.shape[1],), _acc(x.dtype))
    me = env.get_rank()
    if me not in placement:
        empty = empty_local(stat_spec)
        return (
            GlobalTensor(empty_local(x._spec), x._spec),
            GlobalTensor(empty, stat_spec),
            GlobalTensor(empty, stat_spec),
        )
    w, b, rm, rv = _locals((weight, bias, running_mean, running_var), len(nd))
    if not training or _parts(placement, nd) == 1:
        outs = wrap_native(func(x._local, w, b, rm, rv, training, momentum, eps), x, stat_spec)
        _written_back((running_mean, running_var), (rm, rv), training)
        return outs
    reduce = GroupSum(split_group(placement, nd, me))
    out, mean, invstd = forward(x._local, w, b, rm, rv, momentum, eps, _count(x), reduce)
    _written_back((running_mean, running_var), (rm, rv), training)
    return (
        GlobalTensor(out, x._spec),
        GlobalTensor(mean, stat_spec),
        GlobalTensor(invstd, stat_spec),
    )


@register(aten.native_batch_norm_backward.default)
def native_batch_norm_backward(func, args, kwargs):
    """Train mode over a split batch: one all-reduce of the two gradient sums, so parameter
    gradients come out whole (broadcast)."""

    grad_out, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps, mask = args
    nd = _bn_layout(x)
    x, grad_out = rebox(x, nd), rebox(grad_out, nd)
    placement = x._spec.placement
    allb = (broadcast,) * len(nd)
    split_batch = _parts(placement, nd) > 1
    param_nd = allb if train and split_batch else splits_to_partials(nd)
    pspec = GlobalSpec(placement, param_nd, (x.shape[1],), x.dtype)
    me = env.get_rank()
    if me not in placement:
        outs = [empty_local(x._spec), empty_local(pspec), empty_local(pspec)]
    else:
        w, rm, rv, mean, invstd = _locals(
            (weight, running_mean, running_var, save_mean, save_invstd), len(nd)
        )
        if not train or not split_batch:
            outs = list(func(grad_out._local, x._local, w, rm, rv, mean, invstd, train, eps, mask))
        else:
            dy = grad_out._local.contiguous()
            reduce = GroupSum(split_group(placement, nd, me))
            dx, _, sums = backward(dy, x._local, w, mean, invstd, _count(x), reduce, mask[0])
            outs = [
                dx,
                sums[0].to(x.dtype) if mask[1] else None,
                sums[1].to(x.dtype) if mask[2] else None,
            ]
    specs = [x._spec, pspec, pspec]
    return tuple(
        GlobalTensor(o, s) if o is not None else None for o, s in zip(outs, specs, strict=True)
    )


@register(aten.cudnn_batch_norm.default, aten.miopen_batch_norm.default)
def vendor_batch_norm(func, args, kwargs):
    """cuDNN's (and MIOpen's) BatchNorm, which torch picks for a tensor on the GPU: the
    native rule's result (torch's native kernels run on the locals), plus cuDNN's reserve
    buffer, left empty since the backward below does not read it."""

    out, mean, invstd = native_batch_norm(aten.native_batch_norm.default, args, kwargs)
    if func is aten.miopen_batch_norm.default:
        return out, mean, invstd
    reserve = torch.empty(0, dtype=torch.uint8, device=out._local.device)
    placement = out._spec.placement
    spec = GlobalSpec(placement, (broadcast,) * placement.ndim, (0,), torch.uint8)
    return out, mean, invstd, GlobalTensor(reserve, spec)


@register(aten.cudnn_batch_norm_backward.default, aten.miopen_batch_norm_backward.default)
def vendor_batch_norm_backward(func, args, kwargs):
    """The train-mode backward of `vendor_batch_norm` (autograd calls these only in train
    mode): the native rule's, with the saved mean and inverse std it gave."""
    x, grad_out, weight, running_mean, running_var, save_mean, save_invstd, eps = args[:8]
    native_args = (grad_out, x, weight, running_mean, running_var, save_mean, save_invstd)
    return native_batch_norm_backward(
        aten.native_batch_norm_backward.default, (*native_args, True, eps, [True] * 3), {}
    )
