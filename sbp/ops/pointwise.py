"""Elementwise ops with broadcasting: split any output dim, or keep partials where linear.

Splitting output dim d needs each input split on the dim aligned with d, or
broadcast where the input is size 1 (or absent) along d. Partial sums survive
ops that are linear: a sum of partials (add, sub), one partial times
broadcast values (mul, div by a broadcast denominator), and scaling.
"""

from __future__ import annotations

import torch

from sbp.ops.arguments import scalar_class
from sbp.ops.registry import Call, Strategy, register_strategy, register_when
from sbp.signature import broadcast, partial_sum, split

aten = torch.ops.aten


def _all_operands_global(call: Call) -> bool:
    """True when every operand (not counting alpha) is a global tensor, no constant."""
    return len(call.args) >= 2 and all(
        isinstance(a, torch.Tensor) and a.is_global for a in call.args[:2]
    )


def split_candidates(call: Call) -> list[Strategy]:
    """All-broadcast, then one candidate per output dim that every input can follow."""
    out_shape = call.out_meta[0][0]
    n_out = sum(m is not None for m in call.out_meta)
    cands = [Strategy((broadcast,) * len(call.specs), (broadcast,) * n_out)]
    for d in range(len(out_shape)):
        ins = []
        for s in call.specs:
            dd = d - (len(out_shape) - len(s.shape))
            ins.append(split(dd) if dd >= 0 and s.shape[dd] == out_shape[d] else broadcast)
        cands.append(Strategy(tuple(ins), (split(d),) * n_out))
    return cands


NONLINEAR = [
    aten.abs,
    aten.exp,
    aten.log,
    aten.log1p,
    aten.sqrt,
    aten.rsqrt,
    aten.reciprocal,
    aten.sigmoid,
    aten.tanh,
    aten.relu,
    aten.relu_,
    aten.gelu,
    aten.silu,
    aten.silu_,
    aten.hardtanh,
    aten.hardtanh_,
    aten.hardswish,
    aten.hardswish_,
    aten.hardsigmoid_,
    aten.hardsigmoid,
    aten.erf,
    aten.sin,
    aten.cos,
    aten.pow,
    aten.clamp,
    aten.clamp_,
    aten.clamp_min,
    aten.clamp_max,
    aten.sign,
    aten.threshold_backward,
    aten.hardtanh_backward,
    aten.gelu_backward,
    aten.sigmoid_backward,
    aten.tanh_backward,
    aten.silu_backward,
    aten.hardswish_backward,
    aten.log_sigmoid_backward,  # (its buffer: elementwise, or empty and whole on CUDA)
    aten.elu_backward,
    aten.softplus_backward,
    aten.hardsigmoid_backward,
    aten.softshrink_backward,
    aten.hardshrink_backward,
    aten._prelu_kernel,  # (the weight broadcast over the input)
    aten._prelu_kernel_backward,  # (both gradients of the input's shape; autograd sums)
    aten.where,
    aten.lerp,
    aten.lerp_,
    aten.addcmul,
    aten.addcmul_,
    aten.addcdiv,
    aten.addcdiv_,
    aten.maximum,
    aten.minimum,
    aten.eq,
    aten.ne,
    aten.lt,
    aten.gt,
    aten.le,
    aten.ge,
    aten.logical_and,
    aten.logical_or,
    aten.logical_not,
    aten.masked_fill,
    aten.masked_fill_,
    aten.fill_,
    aten.isnan,
    aten.isinf,
    aten.isfinite,
    aten.floor,
    aten.ceil,
    aten.round,
    aten.trunc,
    aten.frac,
    aten.bitwise_and,
    aten.bitwise_or,
    aten.square,
    aten.rsub,
    aten.remainder,
    aten.fmod,
    aten.exp_,
    aten.sqrt_,
    aten.pow_,
    aten.leaky_relu,
    aten.leaky_relu_backward,
    aten.elu,
    aten.softplus,
    aten.nan_to_num,
]
SCALING = [
    aten.neg,
    aten.neg_,
    aten.clone,
    aten.zero_,
    aten.positive,
    aten.mul.Scalar,
    aten.mul_.Scalar,
    aten.div.Scalar,
    aten.div_.Scalar,
    aten.copy_,
    aten.contiguous,
]
ADDITIVE = [aten.add.Tensor, aten.add_.Tensor, aten.sub.Tensor, aten.sub_.Tensor]
PRODUCTS = [aten.mul.Tensor, aten.mul_.Tensor]
QUOTIENTS = [aten.div.Tensor, aten.div_.Tensor, aten.div.Tensor_mode]


def _tagged_pointwise(func) -> bool:
    """torch tags its elementwise ops (sgn, xlogy, expm1, the activations' backward...).
    Not random ones (sbp.random's rules decide their draws), nor those returning anything
    but tensors of the broadcast shape (`equal`'s bool), nor `out=` variants."""
    tags = getattr(func, "tags", ())
    schema = func._schema
    returns = [str(r.type) for r in schema.returns]
    return (
        torch.Tag.pointwise in tags
        and torch.Tag.nondeterministic_seeded not in tags
        and bool(returns)
        and all(r == "Tensor" for r in returns)
        and not any(a.is_out for a in schema.arguments)
    )


@register_strategy(*NONLINEAR)
@register_when(_tagged_pointwise, strategy=True)
def nonlinear(call: Call) -> list[Strategy]:
    return split_candidates(call)


@register_strategy(*SCALING)
def scaling(call: Call) -> list[Strategy]:
    """Linear in its one global input: a partial sum stays partial."""
    cands = split_candidates(call)
    if (len(call.specs) == 1 or call.func in (aten.copy_.default,)) and _scales_parts(call):
        n_out = sum(m is not None for m in call.out_meta)
        cands.append(Strategy((partial_sum,) * len(call.specs), (partial_sum,) * n_out))
    return cands


def _scales_parts(call: Call) -> bool:
    """Is a partial sum times (or over) the call's constant factor, a number or a 0-dim
    CPU tensor, its parts times it? Not for an infinite or NaN factor, nor dividing by
    zero: the parts' +inf and -inf (or 0/0) add up to NaN where the sum's result is an
    infinity. (A global factor's values are not read: docs/api.md.)"""
    packet = call.func.overloadpacket
    if packet not in (aten.mul, aten.mul_, aten.div, aten.div_):
        return True
    for factor in call.args[:2]:
        if type(factor) in (int, float, complex) or type(factor) is torch.Tensor:
            kind = scalar_class(factor)
            if kind == "not finite" or (kind == "zero" and packet in (aten.div, aten.div_)):
                return False
    return True


@register_strategy(*ADDITIVE)
def additive(call: Call) -> list[Strategy]:
    """A sum of partial sums is a partial sum, unless a constant would be added on every rank."""
    cands = split_candidates(call)
    if _all_operands_global(call):
        cands.append(Strategy((partial_sum,) * len(call.specs), (partial_sum,)))
    return cands


@register_strategy(*PRODUCTS, *QUOTIENTS)
def product(call: Call) -> list[Strategy]:
    """One partial factor times broadcast factors stays partial (for a quotient, the numerator;
    not one rounded by `rounding_mode`: the parts' floors do not sum to the sum's)."""
    cands = split_candidates(call)
    if call.func in QUOTIENTS and call.arg(2, "rounding_mode") is not None:
        return cands
    if not _scales_parts(call):
        return cands
    n = len(call.specs)
    positions = [0] if call.func.overloadpacket in (aten.div, aten.div_) else range(n)
    for i in positions:
        ins = tuple(partial_sum if j == i else broadcast for j in range(n))
        cands.append(Strategy(ins, (partial_sum,)))
    return cands
