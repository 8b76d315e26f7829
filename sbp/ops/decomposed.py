"""Ops with no rule of their own, run as torch's decomposition on the global tensors.

`mse_loss` and its kind are a few elementwise ops and a reduction, each with a rule, but
their aten ops have none: the broadcast fallback would gather prediction and target on
every rank and compute the whole loss on each. torch's own decomposition (`torch._decomp`,
the one Inductor uses) runs instead, op by op through the rules: the batch stays split,
the reduction is a partial sum, and a mean divides by the logical number of elements.

Composite ops (`aten.to.dtype`, `log_sigmoid`: torch defines them by other ops) reach
sbp where a decomposition calls them; they run as their definition, as DTensor runs them.
"""

from __future__ import annotations

import torch
from torch._decomp import decomposition_table

from sbp.comm import stats
from sbp.ops.registry import register, register_when, without_partials

aten = torch.ops.aten

DECOMPOSED = [
    aten.mse_loss.default,
    aten.mse_loss_backward.default,
    aten.smooth_l1_loss.default,
    aten.smooth_l1_loss_backward.default,
    aten.huber_loss.default,
    aten.huber_loss_backward.default,
    aten.binary_cross_entropy.default,
    aten.binary_cross_entropy_backward.default,
    aten.binary_cross_entropy_with_logits.default,
    aten.soft_margin_loss.default,
    aten.soft_margin_loss_backward.default,
]


def _decomposed(func, args, kwargs):
    """torch's decomposition, on the inputs made whole first where they are partial sums:
    these losses need them whole anyway, and a conversion made here is kept with the
    input (`sbp.ops.converted`), so the backward's decomposition, which recomputes from
    the same saved input (mse's `input - target`), takes the reduced value instead of
    reducing its own gradient again."""
    if any(_partial(a) for a in args):
        with stats.noted(str(func), implicit=True):
            args = tuple(without_partials(a, keep=True) if _partial(a) else a for a in args)
    return decomposition_table[func](*args, **kwargs)


def _partial(a) -> bool:
    spec = getattr(a, "_spec", None)
    return spec is not None and any(s.is_partial for s in spec.nd_sbp)


register(*(op for op in DECOMPOSED if op in decomposition_table))(_decomposed)


def _composite(func) -> bool:
    return func.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd)


@register_when(_composite)
def composite_definition(func, args, kwargs):
    return func.decompose(*args, **kwargs)
