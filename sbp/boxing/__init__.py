"""Boxing: plan and run the collectives that turn one (placement, sbp) into another."""

from __future__ import annotations

from typing import Any

from sbp.boxing.executor import execute
from sbp.boxing.planner import Plan, Step, Transfer, plan_specs
from sbp.kernels import empty_cache
from sbp.layout import GlobalSpec
from sbp.signature import normalize_nd_sbp

__all__ = [
    "empty_cache",
    "Plan",
    "Step",
    "Transfer",
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
            from sbp.errors import SbpSignatureError

            raise SbpSignatureError(
                f"sbp is needed: the placement's hierarchy {placement.hierarchy} differs from "
                f"the current {src.placement.hierarchy}"
            )
        sbp = src.nd_sbp
    nd = normalize_nd_sbp(sbp, placement.ndim, len(src.shape))
    return GlobalSpec(placement, nd, tuple(src.shape), src.dtype)


def plan(tensor: Any, placement: Any = None, sbp: Any = None) -> Plan:
    """The plan that `tensor.to_global(placement, sbp)` would run (pure: nothing is sent)."""
    src = tensor._spec
    return plan_specs(src, target_spec(src, placement, sbp))
