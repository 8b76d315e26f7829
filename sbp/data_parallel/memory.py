"""What one rank holds for a model: `memory_report`, the bytes of its parameters,
gradients and optimizer state (their local tensors), and the sharded path's gathered
parameters, now and at the peak (docs/sharded_data_parallel.md, "Memory")."""

from __future__ import annotations

from typing import Any

import torch

from sbp.data_parallel.api import ATTR
from sbp.errors import InputTypeError
from sbp.tensor import GlobalTensor


def _bytes(t: Any) -> int:
    if not isinstance(t, torch.Tensor):
        return 0
    local = t._local if isinstance(t, GlobalTensor) else t
    return local.numel() * local.element_size()


def memory_report(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    reset_peak: bool = False,
) -> dict[str, int]:
    """This rank's bytes: "parameters", "gradients", "optimizer_state" (each tensor once,
    its local part), their sum "total", and for a module with sharded parameters the
    whole parameters gathered "gathered_now" and "gathered_peak" (the most alive at once
    since `module.to_global` or the last call with `reset_peak=True`; held by sbp or by
    autograd for backward); 0 for a module without."""
    if not isinstance(module, torch.nn.Module):
        raise InputTypeError(
            f"sbp.nn.memory_report: module must be a torch.nn.Module, got {module!r}"
        )
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise InputTypeError(
            f"sbp.nn.memory_report: optimizer must be a torch.optim.Optimizer, got {optimizer!r}"
        )
    params = {id(p): p for p in module.parameters()}
    report = {
        "parameters": sum(map(_bytes, params.values())),
        "gradients": sum(_bytes(p.grad) for p in params.values()),
        "optimizer_state": 0,
    }
    if optimizer is not None:
        seen: set[int] = set()
        for state in optimizer.state.values():
            for t in state.values():
                if isinstance(t, torch.Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    report["optimizer_state"] += _bytes(t)
    report["total"] = sum(report.values())
    fast = module.__dict__.get(ATTR)
    sharding = None if fast is None else fast._sharding
    report["gathered_now"] = 0 if sharding is None else sharding.gathered_now
    report["gathered_peak"] = 0 if sharding is None else sharding.gathered_peak
    if reset_peak and sharding is not None:
        sharding.gathered_peak = sharding.gathered_now
    return report
