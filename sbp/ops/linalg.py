"""Matrix products: split rows, columns or batch; a split contraction dim gives partial sums."""

from __future__ import annotations

import torch

from sbp.ops.registry import Call, Strategy, register_strategy, split_leading_dims
from sbp.ops.strided import batch_candidates
from sbp.signature import SBP, broadcast, partial_sum, split

aten = torch.ops.aten
B, P = broadcast, partial_sum


def _bias_sbp(bias_shape, out_shape, out_dim: int) -> SBP:
    """How a bias broadcast against `out_shape` follows a split of output dim `out_dim`."""
    d = out_dim - (len(out_shape) - len(bias_shape))
    return split(d) if d >= 0 and bias_shape[d] == out_shape[out_dim] else B


@register_strategy(aten.mm)
def mm(call: Call) -> list[Strategy]:
    S0, S1 = split(0), split(1)
    return [
        Strategy((B, B), (B,)),
        Strategy((S0, B), (S0,)),
        Strategy((B, S1), (S1,)),
        Strategy((S1, S0), (P,)),
        Strategy((P, B), (P,)),
        Strategy((B, P), (P,)),
    ]


@register_strategy(aten.addmm)
def addmm(call: Call) -> list[Strategy]:
    S0, S1 = split(0), split(1)
    out = call.out_meta[0][0]
    bias = call.specs[0].shape
    return [
        Strategy((B, B, B), (B,)),
        Strategy((_bias_sbp(bias, out, 0), S0, B), (S0,)),
        Strategy((_bias_sbp(bias, out, 1), B, S1), (S1,)),
        Strategy((P, S1, S0), (P,)),
        Strategy((P, P, B), (P,)),
        Strategy((P, B, P), (P,)),
    ]


@register_strategy(aten.bmm)
def bmm(call: Call) -> list[Strategy]:
    S0, S1, S2 = split(0), split(1), split(2)
    return [
        Strategy((B, B), (B,)),
        Strategy((S0, S0), (S0,)),
        Strategy((S1, B), (S1,)),
        Strategy((B, S2), (S2,)),
        Strategy((S2, S1), (P,)),
        Strategy((P, B), (P,)),
        Strategy((B, P), (P,)),
        *batch_candidates(call),
    ]


@register_strategy(aten._linalg_check_errors)
def linalg_check_errors(call: Call) -> list[Strategy]:
    """The error codes of a factorization (`linalg.inv`, `cholesky`, `solve`), read whole on
    every rank: a singular matrix raises on every rank, not only where its code lies."""
    return [Strategy((B,), ())]


@register_strategy(aten.mv)
def mv(call: Call) -> list[Strategy]:
    S0, S1 = split(0), split(1)
    return [
        Strategy((B, B), (B,)),
        Strategy((S0, B), (S0,)),
        Strategy((S1, S0), (P,)),
        Strategy((P, B), (P,)),
        Strategy((B, P), (P,)),
    ]


@register_strategy(aten.dot, aten.vdot)
def dot(call: Call) -> list[Strategy]:
    """(vdot conjugates its first vector: the conjugate of a sum is the sum of conjugates.)"""
    S0 = split(0)
    return [
        Strategy((B, B), (B,)),
        Strategy((S0, S0), (P,)),
        Strategy((P, B), (P,)),
        Strategy((B, P), (P,)),
    ]


@register_strategy(aten.tril, aten.triu, aten.tril_, aten.triu_)
def triangle(call: Call) -> list[Strategy]:
    """A triangle keeps or zeroes each entry by its place alone: linear, so a partial sum's
    parts give the parts of the result."""
    return [*split_leading_dims(call, 1, 1), Strategy((P,), (P,))]


@register_strategy(aten.linalg_matrix_exp)
def matrix_exp(call: Call) -> list[Strategy]:
    return split_leading_dims(call, 1, 1)


_WEIGHT_NORM = (aten._weight_norm_interface.default,)


@register_strategy(aten._weight_norm_interface, aten._weight_norm_interface_backward)
def weight_norm(call: Call) -> list[Strategy]:
    """`v * g / norm(v)` with the norm over every dim but `dim`: every tensor (`v`, `g`, the
    norms, and in backward the output's gradient) split alike along `dim`, or broadcast."""
    n = len(call.specs)
    n_out = sum(m is not None for m in call.out_meta)
    ndim = len(call.specs[0].shape)
    dim = call.arg(2 if call.func in _WEIGHT_NORM else 4, "dim", 0)
    cands = [Strategy((B,) * n, (B,) * n_out)]
    if 0 <= dim < ndim and all(len(s.shape) == ndim for s in call.specs):
        cands.append(Strategy((split(dim),) * n, (split(dim),) * n_out))
    return cands
