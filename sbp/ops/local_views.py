"""How a view op's local call and its wrapper are made: a view of a permuted local tensor
runs on a contiguous copy where torch cannot view it, and a transpose's wrapper reports
torch's strides so autograd computes gradients in the layout their tensors have."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

_T, _TRANSPOSE, _PERMUTE = (
    torch.ops.aten.t.default,
    torch.ops.aten.transpose.int,
    torch.ops.aten.permute.default,
)


def permuted_strides(func, local: list, g) -> tuple[int, ...] | None:
    """The wrapper strides of a transpose or permute of global `g` whose local result is
    not contiguous: `g`'s own strides in the new dim order, as torch gives a transpose.
    Autograd reads them (`mm`'s backward computes a transposed operand's gradient in the
    layout its transpose makes contiguous: a Linear's weight gradient then needs no copy).
    Other views keep contiguous strides (None). The strides depend on the logical shape
    and the op's arguments alone: alike on every rank, whatever each one's local holds."""
    if func is _T:
        order = [1, 0] if g.dim() == 2 else None
    elif func is _TRANSPOSE:
        ndim = g.dim()
        if ndim < 2:
            return None
        d0, d1 = local[1] % ndim, local[2] % ndim
        order = list(range(ndim))
        order[d0], order[d1] = d1, d0
    elif func is _PERMUTE:
        ndim = g.dim()
        order = [d % ndim for d in local[1]] if ndim else None
    else:
        return None
    if order is None or order == sorted(order):
        return None
    stride = g.stride()
    return tuple(stride[d] for d in order)


def view_wrappers(base) -> Any:
    """Where a view's wrappers are made: a view of a normal tensor under inference_mode is
    a normal tensor in torch, also where sbp copied its local tensor (an inference tensor
    then, which torch would refuse to give its base's version counter)."""
    if torch.is_inference_mode_enabled() and not base.is_inference():
        return torch.inference_mode(False)
    return contextlib.nullcontext()


def local_view(func, largs: tuple, lkwargs: dict) -> Any:
    """A view op's local call. A global tensor claims a contiguous layout, so a view of a
    permuted one (`x.permute(...).reshape(...)`, which torch turns into a view of a
    contiguous tensor) is valid logically while its local tensor cannot be viewed: then
    the view runs on a contiguous copy, as reshape would copy it. Returns (the local view,
    whether it is a copy)."""
    try:
        return func._op(*largs, **lkwargs), False
    except (RuntimeError, ValueError):  # (eager tensors raise the one, fake tensors the other)
        if largs[0].is_contiguous():
            raise
        return func._op(largs[0].contiguous(), *largs[1:], **lkwargs), True
