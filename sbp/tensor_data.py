"""`torch.tensor` / `torch.as_tensor` of a list holding global tensors.

Scripts written for one process build small tensors of their running values:
pytorch/examples' `AverageMeter.all_reduce` does `torch.tensor([self.sum, self.count])`,
where `self.sum` has become a global 0-dim tensor. torch reads each element's memory
in C++, and a global tensor has none of its own (it is a wrapper of this rank's part):
torch raised "The tensor has a non-zero number of elements, but its data is not
allocated yet", naming neither the tensor nor a fix.

Here each global element stands for its logical value, as in one process: `import sbp`
wraps the two functions so that, only once torch has refused such data, every global
tensor in it is replaced by `full_tensor()` (a collective over its placement: every rank
of it makes the same call, SPMD) and torch is asked again. Data without global tensors
never reaches that path: the wrapper costs one Python call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from sbp import env
from sbp.errors import PlacementError


def _holds_global(data: Any) -> bool:
    from sbp.tensor import GlobalTensor

    if isinstance(data, GlobalTensor):
        return True
    if isinstance(data, (list, tuple)):
        return any(_holds_global(item) for item in data)
    return False


def logical_data(data: Any, what: str) -> Any:
    """`data` with every global tensor in its lists and tuples replaced by its logical value
    (a plain, detached tensor). Ranks outside a tensor's placement hold no value: a named
    error says so, as `.item()` does."""
    from sbp.tensor import GlobalTensor

    if isinstance(data, GlobalTensor):
        value = data.full_tensor().detach()
        if env.get_rank() not in data.placement:
            raise PlacementError(
                f"{what}: data holds a global tensor on {data.placement}, and rank "
                f"{env.get_rank()} is outside it and holds no value; call it on the "
                "placement's ranks only"
            )
        return value
    if isinstance(data, (list, tuple)):
        return type(data)(logical_data(item, what) for item in data)
    return data


def wrap(fn: Callable, name: str) -> Callable:
    """`fn` (torch.tensor or torch.as_tensor), retried on the logical values of the global
    tensors in its data where torch refused them."""

    @functools.wraps(fn)
    def constructor(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        try:
            return fn(data, *args, **kwargs)
        except RuntimeError:
            if isinstance(data, torch.Tensor) or not _holds_global(data):
                raise
        return fn(logical_data(data, name), *args, **kwargs)

    constructor.__sbp_wrapped__ = fn
    return constructor


def install() -> None:
    """Wrap `torch.tensor` and `torch.as_tensor` once (see the module's docstring)."""
    for name in ("tensor", "as_tensor"):
        fn = getattr(torch, name)
        if not hasattr(fn, "__sbp_wrapped__"):
            setattr(torch, name, wrap(fn, f"torch.{name}"))
