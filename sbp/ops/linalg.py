"""Matrix products: split rows, columns or batch; a split contraction dim gives partial sums."""

from __future__ import annotations

import torch

from sbp.ops.registry import Call, Strategy, register_strategy
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
    ]


@register_strategy(aten._linalg_check_errors)
def linalg_check_errors(call: Call) -> list[Strategy]:
    """The error codes of a factorization (`linalg.inv`, `cholesky`, `solve`), read whole on
    every rank: a singular matrix raises on every rank, not only where its code lies."""
    return [Strategy((B,), ())]
