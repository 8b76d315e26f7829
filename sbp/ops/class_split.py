"""Softmax, the negative log-likelihood and embedding over a split vocabulary dim.

A language model's head with its weight `split(0)` makes logits split along the class
(vocabulary) dim. Gathering them for the loss moves the whole (tokens, vocabulary) tensor;
Megatron's vocabulary-parallel cross-entropy moves three numbers per token instead. Here
the same, op by op, as torch's `cross_entropy` decomposes:

* `log_softmax` / `softmax` over the split dim: each rank's log-sum-exp of its slice,
  combined over the ranks holding the other slices (an all-reduce of the maximum, then
  of the sum of exponentials: one number per row each); the result stays split.
* `nll_loss` of split log-probabilities: each rank picks the targets that fall in its
  slice, so the loss is a partial sum over those ranks (no collective).
* Their backward passes are local too, but for log_softmax's sum of the incoming
  gradient along the class dim (one all-reduce of one number per row).
* `embedding` with the weight's rows (the vocabulary) split, Megatron's
  VocabParallelEmbedding: each rank looks up the ids in its rows, zeros for the others,
  so the result is a partial sum, reduced where it is needed whole.

The functions here are rules' local computations (`StrategyRule.local`): they run on the
local tensors after boxing, with the specs the rule decided.
"""

from __future__ import annotations

import math

import torch

from sbp import env
from sbp.comm import functional as collective
from sbp.layout import GlobalSpec

aten = torch.ops.aten


def class_group(spec: GlobalSpec, dim: int) -> tuple[int, ...]:
    """The ranks holding the other slices of this rank's rows: those that differ from it
    only on hierarchy dims that split tensor dim `dim` (this rank alone if none does)."""
    splitting = {h for h, s in enumerate(spec.nd_sbp) if s.is_split and s.dim == dim}
    me = env.get_rank()
    if not splitting or me not in spec.placement:
        return (me,)
    return spec.placement.ranks_varying(me, splitting)


def class_offset(spec: GlobalSpec, dim: int) -> int:
    """Where this rank's slice of tensor dim `dim` starts in the logical tensor."""
    return spec.ranges(env.get_rank())[dim][0]


def _dim(x: torch.Tensor, dim: int) -> int:
    return dim + x.dim() if dim < 0 else dim


def _reduce_over(t: torch.Tensor, op: str, ranks: tuple[int, ...]) -> torch.Tensor:
    return collective.all_reduce(t.contiguous(), op, list(ranks))


def _log_normaliser(x: torch.Tensor, dim: int, ranks: tuple[int, ...]) -> torch.Tensor:
    """log(sum(exp(x))) along `dim` over the ranks' slices, kept as a size-1 dim."""
    if x.shape[dim] == 0:  # (an uneven split: nothing here adds nothing)
        local = x.new_full((*x.shape[:dim], 1, *x.shape[dim + 1 :]), -math.inf)
    else:
        local = torch.logsumexp(x, dim, keepdim=True)
    top = _reduce_over(local, "max", ranks)
    finite = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    total = _reduce_over(torch.exp(local - finite), "sum", ranks)
    return finite + torch.log(total)


def softmax(func, args: tuple, kwargs: dict, in_specs: list[GlobalSpec]) -> torch.Tensor:
    """`_log_softmax` / `_softmax` / `_safe_softmax` (x, dim, half_to_float or dtype)."""
    x, dim = args[0], _dim(args[0], args[1])
    ranks = class_group(in_specs[0], dim)
    if len(ranks) == 1:
        return func(*args, **kwargs)
    out_dtype = x.dtype
    if func.overloadpacket is aten._safe_softmax:
        out_dtype = args[2] if len(args) > 2 and args[2] is not None else x.dtype
    elif len(args) > 2 and args[2]:  # half_to_float
        out_dtype = torch.float32
    x = x.to(out_dtype)
    lse = _log_normaliser(x, dim, ranks)
    if func.overloadpacket is aten._log_softmax:
        return x - lse
    out = torch.exp(x - lse)
    if func.overloadpacket is aten._safe_softmax:  # a row of -inf only: zeros, not NaN
        out = torch.where(torch.isneginf(lse), torch.zeros_like(out), out)
    return out


def softmax_backward(func, args: tuple, kwargs: dict, in_specs: list[GlobalSpec]):
    """`_log_softmax_backward_data` / `_softmax_backward_data` (grad, output, dim, dtype)."""
    grad, out, dim, input_dtype = args[0], args[1], _dim(args[1], args[2]), args[3]
    ranks = class_group(in_specs[1], dim)
    if len(ranks) == 1:
        return func(*args, **kwargs)
    if func.overloadpacket is aten._log_softmax_backward_data:
        total = _reduce_over(grad.sum(dim, keepdim=True), "sum", ranks)
        result = grad - torch.exp(out) * total
    else:
        total = _reduce_over((grad * out).sum(dim, keepdim=True), "sum", ranks)
        result = out * (grad - total)
    return result.to(input_dtype)


def _in_slice(ids: torch.Tensor, lo: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which ids fall in this rank's slice [lo, lo + width) of a split dim, and each id's
    position in the slice (clamped into it where it falls outside: masked by the caller)."""
    here = (ids >= lo) & (ids < lo + width)
    return here, (ids - lo).clamp(0, max(width - 1, 0))


def picked(
    x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int, lo: int
) -> torch.Tensor:
    """-weight[t] * x[n, t] for the targets t in this rank's classes [lo, lo + width), 0
    elsewhere: this rank's part of the unreduced loss (N, d1, ...)."""
    width = x.shape[1]
    if width == 0:
        return torch.zeros(target.shape, dtype=x.dtype, device=x.device)
    here, at = _in_slice(target, lo, width)
    out = -x.gather(1, at.unsqueeze(1)).squeeze(1) * target_weights(
        target, weight, ignore_index, x.dtype
    )
    # (the mask, not the zero weight, drops ignored targets: their score may be -inf)
    return torch.where(here & (target != ignore_index), out, torch.zeros_like(out))


def target_weights(target, weight, ignore_index: int, dtype) -> torch.Tensor:
    """The weight of each target, 0 where ignored (whatever the class split)."""
    kept = target != ignore_index
    if weight is None:
        return kept.to(dtype)
    return torch.where(kept, weight[target.clamp(0, weight.numel() - 1)], 0).to(dtype)


def nll_backward(func, args: tuple, kwargs: dict, in_specs: list[GlobalSpec]) -> torch.Tensor:
    """`nll_loss_backward` / `nll_loss2d_backward` (grad, self, target, weight, reduction,
    ignore_index, total_weight): where self is split along the class dim, each rank writes
    the gradient of the targets that fall in its slice."""
    grad, x, target, weight, reduction, ignore_index, total = args
    ranks = class_group(in_specs[1], 1) if x.dim() > 1 else ()
    if len(ranks) <= 1:
        return func(*args, **kwargs)
    lo, width = class_offset(in_specs[1], 1), x.shape[1]
    scale = target_weights(target, weight, ignore_index, x.dtype)
    scale = -(scale * grad if reduction == 0 else scale * grad.reshape(()))
    if reduction == 1:
        scale = scale / total
    out = torch.zeros_like(x)
    if width:  # (ignored targets have scale 0)
        here, at = _in_slice(target, lo, width)
        where = torch.where(here, scale, torch.zeros_like(scale))
        out.scatter_(1, at.unsqueeze(1), where.unsqueeze(1))
    return out


def embedding(func, args: tuple, kwargs: dict, in_specs: list[GlobalSpec]) -> torch.Tensor:
    """`embedding(weight, indices, ...)` where the weight's rows (the vocabulary) are split:
    this rank's rows for the ids in its slice, zeros for the others (a partial sum)."""
    weight, indices = args[0], args[1]
    if len(class_group(in_specs[0], 0)) == 1:
        return func(*args, **kwargs)
    lo, rows = class_offset(in_specs[0], 0), weight.shape[0]
    if rows == 0:
        return weight.new_zeros((*indices.shape, weight.shape[1]))
    here, at = _in_slice(indices, lo, rows)
    out = func(weight, at, *args[2:], **kwargs)
    return torch.where(here.unsqueeze(-1), out, torch.zeros((), dtype=out.dtype))
