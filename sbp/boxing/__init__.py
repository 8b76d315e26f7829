"""Boxing: plan and run the collectives that turn one (placement, sbp) into another."""

from __future__ import annotations

from typing import Any

import torch

from sbp import trace
from sbp.boxing.executor import execute
from sbp.boxing.planner import Plan, Step, Transfer, plan_specs
from sbp.comm import stats
from sbp.errors import InputTypeError, PlacementError, SbpSignatureError
from sbp.kernels import empty_cache
from sbp.layout import GlobalSpec
from sbp.placement import placement as Placement
from sbp.signature import format_nd_sbp, normalize_nd_sbp

__all__ = [
    "empty_cache",
    "Plan",
    "Step",
    "Transfer",
    "box",
    "execute",
    "plan",
    "plan_specs",
    "target_spec",
]


def target_spec(src: GlobalSpec, placement: Any = None, sbp: Any = None) -> GlobalSpec:
    """`src` with a new placement and/or sbp (None keeps the current one)."""
    placement = src.placement if placement is None else placement
    if sbp is None:
        if placement.ndim != src.placement.ndim:
            raise SbpSignatureError(
                f"sbp is needed: the placement's hierarchy {placement.hierarchy} differs from "
                f"the current {src.placement.hierarchy}"
            )
        return GlobalSpec(placement, src.nd_sbp, tuple(src.shape), src.dtype)
    nd = normalize_nd_sbp(sbp, placement.ndim, len(src.shape))
    return GlobalSpec(placement, nd, tuple(src.shape), src.dtype)


def plan(tensor: Any, placement: Any = None, sbp: Any = None) -> Plan:
    """The plan that `tensor.to_global(placement, sbp)` would run (pure: nothing is sent).

    Its arguments are checked as a re-box's are: a plain tensor has no layout to plan from
    (`InputTypeError`), and a placement must be an `sbp.placement` (`PlacementError`)."""
    src = getattr(tensor, "_spec", None)  # (only global tensors have a GlobalSpec)
    if not isinstance(src, GlobalSpec):
        what = "a plain torch.Tensor" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise InputTypeError(
            f"sbp.boxing.plan: tensor must be a global tensor, got {what}; make it global "
            "first (x.to_global(placement, sbp)), then plan its re-box"
        )
    if placement is not None and not isinstance(placement, Placement):
        raise PlacementError(
            f"sbp.boxing.plan: placement must be an sbp.placement or None, got {placement!r}"
        )
    return plan_specs(src, target_spec(src, placement, sbp))


def box(local: torch.Tensor, src: GlobalSpec, dst: GlobalSpec) -> torch.Tensor:
    """Run the cached plan from `src` to `dst` on this rank's local tensor."""
    plan = plan_specs(src, dst)
    if not stats.watching():
        return execute(plan, local)
    source, target = format_nd_sbp(src.nd_sbp), format_nd_sbp(dst.nd_sbp)
    trace.check_conversion(source, target, plan.collectives)
    with stats.converting(f"{source} -> {target}"):
        return execute(plan, local)
