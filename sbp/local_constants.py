"""Local constants inside models: the tensors model code makes for itself.

Model code written for one process makes its own tensors in `forward`: position
ids from `torch.arange`, causal masks, `torch.tensor([])` in a cache. On global
tensors those are local, and mixing them with global ones is a `PlacementError`.
Two opt-in ways make them safe, after OneFlow and DTensor:

- `global_mode(placement, sbp)`: torch's factories (`torch.arange`, `zeros`,
  `ones`, `full`, `empty`, `tensor`, ...) called inside return global tensors on
  that placement and sbp, the value being what one process would make.
- `implicit_replication()`: a local tensor mixed with global ones in an op is
  taken as the `broadcast` value of the op's placement. Autograd saves the
  local tensor itself, so a backward that uses it (the other factor of a
  product, say) must run inside the mode too, as with DTensor's.

A `global_mode` also replicates the local tensors that still meet global ones.
Both trust every rank to make the same value, as SPMD code does. `check=True`
verifies it: each such value's hash is all-gathered over the placement and a
value that differs between ranks raises `MetaMismatchError` on every rank.
Factories called by sbp's own machinery (boxing, collectives) stay local.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from sbp import env
from sbp.boxing.executor import local_device
from sbp.errors import InputTypeError, PlacementError
from sbp.factories import from_logical
from sbp.ops.arguments import SUSPENDED, check_same_on_ranks, replicated
from sbp.placement import placement as Placement
from sbp.signature import broadcast, normalize_nd_sbp

# Factories a global_mode makes global. Random ones are left out on purpose: use
# sbp.randn and friends, whose value does not depend on the layout.
FACTORIES = frozenset(
    {
        torch.arange,
        torch.zeros,
        torch.ones,
        torch.full,
        torch.empty,
        getattr(torch.tensor, "__sbp_wrapped__", torch.tensor),  # (torch's own: what a
        getattr(torch.as_tensor, "__sbp_wrapped__", torch.as_tensor),  # mode is passed)
        torch.linspace,
        torch.eye,
        torch.scalar_tensor,
    }
)


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Inside, factories make local tensors and nothing is replicated: a module running on
    local shards (the data-parallel fast path) makes its constants as one process would.

    `global_mode`'s modes, which do nothing inside, leave torch's mode stack for the
    duration where they are on its top: each would cost a Python call per torch call."""
    SUSPENDED.append(True)
    lifted = []
    while (
        torch._C._len_torch_function_stack()
        and type(torch._C._get_function_stack_at(torch._C._len_torch_function_stack() - 1))
        is _GlobalFactories
    ):
        lifted.append(torch._C._pop_torch_function_stack())
    try:
        yield
    finally:
        for mode in reversed(lifted):
            torch._C._push_on_torch_function_stack(mode)
        SUSPENDED.pop()


# ---------------------------------------------------------------- implicit replication


@contextlib.contextmanager
def implicit_replication(check: bool = False) -> Iterator[None]:
    """Inside, a local tensor mixed with global tensors in an op is the broadcast value of the
    op's placement (DTensor's `implicit_replication`). With `check=True`, every such value is
    compared across the placement's ranks first (one small all-gather per use)."""
    _check_flag("implicit_replication", check)
    with replicated(check):
        yield


def _check_flag(name: str, check: Any) -> None:
    """`check` is a bool: `check="no"` would be true, and cost an all-gather per value."""
    if not isinstance(check, bool):
        raise InputTypeError(f"sbp.{name}: check must be True or False, got {check!r}")


# ---------------------------------------------------------------- global mode


def _in_torch(module: str) -> bool:
    """torch's own modules (not torchvision's or torchaudio's: model code)."""
    return module == "torch" or module.startswith("torch.")


def _called_by_sbp() -> bool:
    """Was the factory called by sbp's own machinery (not a user's script, model or test
    helper)? The first caller outside torch's own Python code, torch function modes
    (which pass calls on: the fast path's checking pass has one) and sbp's wrapper of
    `torch.tensor` (`sbp.tensor_data`) decides: a model's forward
    run by sbp (the data-parallel fast path) still makes global constants."""
    frame = sys._getframe(2)
    while frame is not None and (
        _in_torch(frame.f_globals.get("__name__", ""))
        or frame.f_code.co_name == "__torch_function__"
        or frame.f_globals.get("__name__") == "sbp.tensor_data"  # (torch.tensor's wrapper)
    ):
        frame = frame.f_back
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    return name.startswith("sbp.") and not name.startswith(("sbp.testing", __name__))


def _stays_local(kwargs: dict) -> bool:
    """Meta tensors (shape-only model set-up) and writes into a given `out=` stay as asked."""
    device = kwargs.get("device")
    return "out" in kwargs or (device is not None and torch.device(device).type == "meta")


class _GlobalFactories(TorchFunctionMode):
    def __init__(self, placement: Placement, sbp: Any, check: bool):
        super().__init__()
        self.placement, self.sbp, self.check = placement, sbp, check

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in FACTORIES or SUSPENDED or _stays_local(kwargs) or _called_by_sbp():
            return func(*args, **kwargs)
        P = self.placement
        requires_grad = kwargs.pop("requires_grad", False)
        kwargs["device"] = local_device(P.type)
        value = func(*args, **kwargs)
        if func is torch.empty:  # (zeros: the replicas agree before it is filled, as by
            value.zero_()  # stochastic depth's `torch.empty(...).bernoulli_(p)`)
        if self.check:
            check_same_on_ranks(value, P, f"the value of {func.__name__} in global_mode")
        nd = normalize_nd_sbp(self.sbp, P.ndim, value.dim())
        return from_logical(value, P, nd, requires_grad=requires_grad)


@contextlib.contextmanager
def global_mode(placement: Placement, sbp: Any = None, *, check: bool = False) -> Iterator[None]:
    """Inside, torch's factories (`FACTORIES`) make global tensors on `placement` with `sbp`
    (default: broadcast), OneFlow's `global_mode`: the logical value is what one process
    makes. Local tensors that still meet global ones (made before the mode, or by torch's
    C++ code, such as the 0-dim fill values of a boolean attention mask) are replicated as
    under `implicit_replication`. With `check=True`, each value is compared across the
    placement's ranks first."""
    if not isinstance(placement, Placement):
        raise PlacementError(f"global_mode: placement must be an sbp.placement, got {placement!r}")
    _check_flag("global_mode", check)
    if sbp is None:
        sbp = (broadcast,) * placement.ndim
    placement.check_in_world(env.get_world_size())
    normalize_nd_sbp(sbp, placement.ndim)  # a bad sbp fails here, not at the first factory
    # (replicated: constants torch makes in C++, with no factory call, too)
    with replicated(bool(check)), _GlobalFactories(placement, sbp, check):
        yield
