"""`g[index] = value` on a global tensor: each rank writes the part of the logical slice it holds.

torch runs `x[:3] = y` as a view (`slice`) and a `copy_` into it. When that view needs its
input re-boxed (a slice along a split dim), the view is a copy, which passes the write on
to its base (sbp.ops.writes) at the price of the copy. So basic indexing (ints and slices,
with Ellipsis) writes in logical coordinates instead, as OneFlow's logical slice assign
does: each rank writes what falls in its shard, with no communication for split and
broadcast tensors (nor for partial ones: along a partial sum, the first rank writes the
value and the others zeros).
Other indexes, and writes autograd must record, take torch's own path; a Python number
written there (`x[x < 0] = 0`) goes as a broadcast global 0-dim tensor, since torch would
make it a local one."""

from __future__ import annotations

from typing import Any

import torch

from sbp.errors import PlacementError
from sbp.layout import strided_of
from sbp.ops import registry
from sbp.ops.arguments import as_broadcast
from sbp.ops.writes import write_part, written
from sbp.tensor import GlobalTensor


def _expand(index: Any, ndim: int) -> list | None:
    """The index as one int or slice per dim, or None for what this module does not handle."""
    items = list(index) if isinstance(index, tuple) else [index]
    if any(not isinstance(i, (int, slice)) and i is not Ellipsis for i in items):
        return None
    if any(isinstance(i, bool) for i in items) or sum(i is Ellipsis for i in items) > 1:
        return None
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items[at : at + 1] = [slice(None)] * (ndim - len(items) + 1)
    if len(items) > ndim:
        return None
    items += [slice(None)] * (ndim - len(items))
    if any(isinstance(i, slice) and i.step is not None and i.step <= 0 for i in items):
        return None
    return items


def setitem(g, index: Any, value: Any) -> bool:
    """Write `value` into the logical slice `index` of `g`; False when torch's path must do it."""

    items = _expand(index, g.dim())
    grads = torch.is_grad_enabled() and (
        g.requires_grad or (isinstance(value, torch.Tensor) and value.requires_grad)
    )
    if items is None or grads or strided_of(g._spec.nd_sbp) is not None:
        return False  # (a strided split holds no range: torch's path converts it)
    if isinstance(value, GlobalTensor):
        if value.placement != g.placement:
            raise PlacementError(
                f"__setitem__: value is on {value.placement!r}, the tensor on {g.placement!r}"
            )
    elif isinstance(value, torch.Tensor) and value.dim() > 0:
        raise PlacementError(
            f"__setitem__: value is a local torch.Tensor of shape {tuple(value.shape)}; "
            "make it global first (value.to_global(placement, sbp))"
        )
    if registry.observers:  # (the data-parallel check: these writes are not aten ops)
        registry.observers[-1].write(g, items, value)
    write_part(g, items, value)
    written(g)  # a view sbp had to copy passes the write on to its base
    torch.autograd.graph.increment_version(g)  # autograd sees the write, as for x[i] = v
    return True


def number_as_global(g, value: Any) -> Any:
    """A Python number to write into `g` by torch's path, as the broadcast global 0-dim
    tensor of `g`'s dtype torch would otherwise make local; any other value as it is."""

    if not isinstance(value, (bool, int, float, complex)):
        return value
    return as_broadcast(torch.tensor(value, dtype=g.dtype), g.placement)
