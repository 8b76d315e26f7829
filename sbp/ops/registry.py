"""The rule registry and the dispatcher, with the broadcast fallback."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from sbp import env
from sbp.comm import stats
from sbp.errors import PlacementError
from sbp.signature import broadcast

Rule = Callable[[Any, tuple, dict], Any]
_rules: dict[Any, Rule] = {}
_warned: set[str] = set()


def register(*ops: Any) -> Callable[[Rule], Rule]:
    """Decorator: `fn(func, args, kwargs)` handles the given aten ops (overloads or packets)."""

    def deco(fn: Rule) -> Rule:
        for op in ops:
            _rules[op] = fn
        return fn

    return deco


def _rule_for(func) -> Rule | None:
    return _rules.get(func) or _rules.get(func.overloadpacket)


def global_args(args: tuple, kwargs: dict) -> list:
    from sbp.tensor import GlobalTensor

    flat, _ = tree_flatten((args, kwargs))
    gts = [a for a in flat if isinstance(a, GlobalTensor)]
    locals_ = [a for a in flat if isinstance(a, torch.Tensor) and not isinstance(a, GlobalTensor)]
    return gts, locals_


def check_placements(func, gts: list, locals_: list) -> None:
    """Mixing global and local tensors, or placements, is an error naming the op."""
    name = getattr(func, "__name__", str(func))
    if locals_ and any(t.dim() > 0 or t.requires_grad for t in locals_):
        raise PlacementError(
            f"{name}: mixes global tensors with a local torch.Tensor; make it global first "
            "(x.to_global(placement, sbp))"
        )
    placements = {g.placement for g in gts}
    if len(placements) > 1:
        raise PlacementError(
            f"{name}: inputs are on different placements: {sorted(map(repr, placements))}"
        )


def dispatch(func, args: tuple, kwargs: dict) -> Any:
    gts, locals_ = global_args(args, kwargs)
    check_placements(func, gts, locals_)
    rule = _rule_for(func)
    if rule is not None:
        return rule(func, args, kwargs)
    return fallback(func, args, kwargs)


def fallback(func, args: tuple, kwargs: dict) -> Any:
    """Box every global input to broadcast, run the op locally, wrap outputs as broadcast."""
    from sbp.tensor import GlobalTensor, box

    name = str(func)
    if name not in _warned:
        _warned.add(name)
        warnings.warn(f"sbp: no SBP rule for {name}; running it on broadcast inputs", stacklevel=3)
        stats.record(f"fallback:{name}", 0)
    gts, _ = global_args(args, kwargs)
    P = gts[0].placement
    all_b = (broadcast,) * P.ndim
    if env.get_rank() not in P:
        return run_on_meta(func, args, kwargs, P, all_b)

    def unwrap(a):
        if isinstance(a, GlobalTensor):
            return box(a._local, a._spec, a._spec._replace(nd_sbp=all_b))
        return a

    out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
    return wrap_like(out, P, all_b)


def run_on_meta(func, args: tuple, kwargs: dict, placement, nd_sbp) -> Any:
    """Ranks outside the placement hold metadata only: find the output shapes on meta tensors."""
    from sbp.boxing.executor import empty_local
    from sbp.layout import GlobalSpec
    from sbp.tensor import GlobalTensor

    def to_meta(a):
        if isinstance(a, GlobalTensor):
            return torch.empty(a.shape, dtype=a.dtype, device="meta")
        return a

    out = func(*tree_map(to_meta, args), **tree_map(to_meta, kwargs))

    def wrap(t):
        if isinstance(t, torch.Tensor):
            spec = GlobalSpec(placement, nd_sbp, tuple(t.shape), t.dtype)
            return GlobalTensor(empty_local(spec), spec)
        return t

    return tree_map(wrap, out)


def wrap_like(out: Any, placement, nd_sbp) -> Any:
    """Wrap every tensor in `out` (this rank's locals) as a global tensor with `nd_sbp`."""
    from sbp.layout import GlobalSpec
    from sbp.tensor import GlobalTensor

    def wrap(t):
        if isinstance(t, torch.Tensor) and not isinstance(t, GlobalTensor):
            return GlobalTensor(t, GlobalSpec(placement, nd_sbp, tuple(t.shape), t.dtype))
        return t

    return tree_map(wrap, out)
