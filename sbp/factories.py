"""Factories of global tensors: the logical value does not depend on placement or sbp.

Every rank draws the whole logical tensor from torch's own generator, then keeps
its part, so after `sbp.manual_seed(s)` the value is what one process would draw
after `torch.manual_seed(s)`; ranks outside the placement draw too, to keep the
generators of all ranks in step. That is trusted, not checked: ranks seeded
differently get different "broadcast" values. `sbp.tensor(data)` does check (a hash of
`data`, one small all-gather), since its data comes from the caller.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from sbp import comm, env
from sbp import random as sbp_random
from sbp.boxing import box
from sbp.boxing.executor import local_device
from sbp.comm import agreement, stats
from sbp.errors import InputTypeError, PlacementError, SbpError, SbpSignatureError
from sbp.layout import GlobalSpec
from sbp.local_to_global import unsupported_kind
from sbp.placement import placement as Placement
from sbp.ranges import learn_range
from sbp.signature import broadcast, normalize_nd_sbp
from sbp.tensor import GlobalTensor


def manual_seed(seed: int) -> None:
    """Seed torch's generators and sbp's random ops alike on this rank (use one seed on all).
    An int: a float or a string would be truncated or fail inside torch."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        try:
            seed = operator.index(seed)  # (numpy integers)
        except TypeError:
            raise InputTypeError(
                f"sbp.manual_seed: seed must be an int, got {seed!r}; pass int(seed)"
            ) from None
    torch.manual_seed(seed)
    sbp_random.manual_seed(seed)


def _device_of(placement: Any) -> torch.device:
    """The local device of `placement`, after checking it is an sbp.placement of this world."""
    if not isinstance(placement, Placement):
        raise PlacementError(f"placement must be an sbp.placement, got {placement!r}")
    placement.check_in_world(env.get_world_size())
    return local_device(placement.type)


def from_logical(
    value: torch.Tensor,
    placement: Placement,
    sbp: Any,
    requires_grad: bool = False,
    checked: bool = False,
) -> GlobalTensor:
    """A global tensor whose logical value is `value` (the same on every rank). Ranks that
    ask for different layouts (a rank-dependent `sbp=`) raise `MetaMismatchError` on every
    rank, as a re-box does (`agreement.check_rebox`; `checked`: the caller did)."""
    with agreement.announcing(placement):
        _device_of(placement)
        nd = normalize_nd_sbp(sbp, placement.ndim, value.dim())
    all_b = GlobalSpec(placement, (broadcast,) * placement.ndim, tuple(value.shape), value.dtype)
    target = all_b._replace(nd_sbp=nd)
    if not checked:
        agreement.check_rebox(all_b, target, requires_grad, what="a factory's layout")
    local = value if env.get_rank() in placement else value.new_empty(0)
    local = box(local, all_b, target).detach()
    if local.untyped_storage().nbytes() > local.numel() * local.element_size():
        # a shard sliced out of the logical value: its own, contiguous (the storage of
        # the whole would stay alive, and a column shard's strides would not be dense)
        local = local.clone(memory_format=torch.contiguous_format)
    out = GlobalTensor(local, target)
    if requires_grad:
        out.requires_grad_()
    return out


def tensor(data: Any, placement: Placement, sbp: Any, *, dtype=None, requires_grad: bool = False):
    """`sbp.tensor(data, placement, sbp)`: data is the full logical value on every rank.

    Ranks check (one small all-gather, and a hash of the data) that they passed equal
    data, shape, dtype, placement and sbp: else `MetaMismatchError` on every rank.
    """
    error, description = None, {}
    try:
        device = _device_of(placement)
        try:
            value = torch.as_tensor(data, dtype=dtype, device=device)
        except (TypeError, ValueError, RuntimeError) as e:
            raise InputTypeError(f"sbp.tensor: cannot make a tensor of data: {e}") from e
        kind = unsupported_kind(value)
        if kind is not None:
            raise InputTypeError(f"sbp.tensor: data is {kind}")
        check_requires_grad("sbp.tensor", requires_grad, value.dtype)
        description = {
            "placement": repr(placement),
            "sbp": repr(normalize_nd_sbp(sbp, placement.ndim, value.dim())),
            "dtype": str(value.dtype),
            "shape": tuple(value.shape),
            "requires_grad": requires_grad,
            "data hash": agreement.data_hash(value),
        }
    except SbpError as e:
        error = e
    with stats.paused():  # a check of the arguments, not a collective of the tensor's
        comm.exchange(description, agreement.world(), what="sbp.tensor data", error=error)
    out = from_logical(value.clone(), placement, sbp, requires_grad, checked=True)
    learn_range(out, value)
    return out


def check_requires_grad(name: str, requires_grad: Any, dtype: torch.dtype) -> None:
    """`requires_grad` is a bool, and True only for a dtype autograd differentiates: checked
    before the value is placed (torch's own check came after, and a string was taken as
    true)."""
    if not isinstance(requires_grad, bool):
        raise InputTypeError(f"{name}: requires_grad must be True or False, got {requires_grad!r}")
    if requires_grad and not (dtype.is_floating_point or dtype.is_complex):
        raise InputTypeError(
            f"{name}: requires_grad=True needs a floating point or complex dtype, got {dtype}; "
            "pass dtype=torch.float32 (or another float dtype), or requires_grad=False"
        )


def _value(fn, args: tuple, placement: Any, sbp: Any, **kw) -> torch.Tensor:
    """torch's `fn(*args, **kw)` on the placement's device; a bad argument (a dtype given as
    a string, a negative size, no `sbp=`) raises a named error, alike on every rank."""
    device = _device_of(placement)
    if sbp is None:
        raise SbpSignatureError(f"sbp.{fn.__name__}: sbp= is required (split, broadcast, ...)")
    try:
        return fn(*args, device=device, **kw)
    except (TypeError, ValueError, RuntimeError, NotImplementedError) as e:
        raise InputTypeError(f"sbp.{fn.__name__}: cannot make the value: {e}") from e


def _factory(fn):
    def make(*size, placement: Placement, sbp: Any = None, dtype=None, requires_grad=False, **kw):
        if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
            size = tuple(size[0])
        with agreement.announcing(placement):
            value = _value(fn, size, placement, sbp, dtype=dtype, **kw)
            check_requires_grad(f"sbp.{fn.__name__}", requires_grad, value.dtype)
        return from_logical(value, placement, sbp, requires_grad)

    make.__name__ = fn.__name__
    make.__doc__ = f"`sbp.{fn.__name__}(*size, placement=, sbp=, ...)`: like torch.{fn.__name__}."
    return make


randn = _factory(torch.randn)
rand = _factory(torch.rand)
zeros = _factory(torch.zeros)
ones = _factory(torch.ones)
empty = _factory(torch.empty)


def full(
    size, fill_value, *, placement: Placement, sbp: Any = None, dtype=None, requires_grad=False
):
    with agreement.announcing(placement):
        value = _value(torch.full, (size, fill_value), placement, sbp, dtype=dtype)
        check_requires_grad("sbp.full", requires_grad, value.dtype)
    return from_logical(value, placement, sbp, requires_grad)


def arange(*args, placement: Placement, sbp: Any = None, dtype=None, requires_grad=False):
    with agreement.announcing(placement):
        value = _value(torch.arange, args, placement, sbp, dtype=dtype)
        check_requires_grad("sbp.arange", requires_grad, value.dtype)
    return from_logical(value, placement, sbp, requires_grad)
