"""The ranks agree on an optimizer's settings before each of its steps.

A learning rate, momentum or weight decay set on one rank only changes no collective:
the replicas of a broadcast parameter then drift apart silently, and `full_tensor()`
returns another "logical" value on each rank. So before every step of an optimizer over
global parameters, the ranks compare a description of it: each param group's
hyper-parameters, which of its parameters hold state and which require a gradient. One
small all-gather (in shared memory on one host, ~20 us); where the descriptions differ,
`MetaMismatchError` on every rank names the setting and each rank's value.
"""

from __future__ import annotations

from typing import Any

import torch

from sbp import env
from sbp.comm import stats
from sbp.comm.meta import exchange
from sbp.tensor import GlobalTensor


def check(optimizer: torch.optim.Optimizer) -> None:
    """Raise `MetaMismatchError` on every rank where the ranks' settings differ. The ranks
    compared are those the parameters' placements hold (the ones stepping them)."""
    if not env.is_distributed() or torch.compiler.is_compiling():
        return
    ranks = _ranks(optimizer)
    if len(ranks) > 1 and env.get_rank() in ranks:
        what = f"the settings of {type(optimizer).__name__}"
        with stats.paused():  # (a check, not a collective of the step)
            exchange(settings(optimizer), ranks, what=what)


def _ranks(optimizer: torch.optim.Optimizer) -> tuple[int, ...]:
    placements = {
        p.placement
        for group in optimizer.param_groups
        for p in group["params"]
        if isinstance(p, GlobalTensor)
    }
    return tuple(sorted({r for P in placements for r in P.flat_ranks}))


def settings(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What must be equal on every rank: per group, its hyper-parameters, its parameter
    count, which parameters have state and which require a gradient."""
    out: dict[str, Any] = {}
    state = optimizer.state
    for i, group in enumerate(optimizer.param_groups):
        params = group["params"]
        for key, value in group.items():
            if key != "params":
                out[f"param_groups[{i}][{key!r}]"] = _plain(value)
        out[f"param_groups[{i}] parameters"] = len(params)
        out[f"param_groups[{i}] parameters with state"] = _bits(bool(state.get(p)) for p in params)
        out[f"param_groups[{i}] parameters requiring grad"] = _bits(p.requires_grad for p in params)
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else f"tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    return value


def _bits(flags) -> str:
    return "".join("1" if f else "0" for f in flags)
