"""`g[index] = value` on a global tensor: each rank writes the part of the logical slice it holds.

torch runs `x[:3] = y` as a view (`slice`) and a `copy_` into it. When that view needs its
input re-boxed (a slice along a split dim), the view is a copy and the write would be lost.
So basic indexing (ints and slices, with Ellipsis) writes in logical coordinates instead, as
OneFlow's logical slice assign does: each rank writes what falls in its shard, with no
communication for split and broadcast tensors (a partial tensor is made broadcast first).
Other indexes, and writes autograd must record, take torch's own path; a Python number
written there (`x[x < 0] = 0`) goes as a broadcast global 0-dim tensor, since torch would
make it a local one.
"""

from __future__ import annotations

from typing import Any

import torch

from sbp import env


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


def _local_part(item: Any, size: int, lo: int, hi: int) -> tuple[Any, Any] | None:
    """(local index, index into the value) of the logical `item` on a shard [lo, hi), or None."""
    if isinstance(item, int):
        i = item + size if item < 0 else item
        return (i - lo, None) if lo <= i < hi else None
    start, stop, step = item.indices(size)
    first = max(lo, start)
    k0 = -(-(first - start) // step)
    i0 = start + k0 * step
    end = min(hi, stop)
    if i0 >= end:
        return None
    count = len(range(i0, end, step))
    return slice(i0 - lo, i0 - lo + (count - 1) * step + 1, step), slice(k0, k0 + count)


def setitem(g, index: Any, value: Any) -> bool:
    """Write `value` into the logical slice `index` of `g`; False when torch's path must do it."""
    from sbp.errors import PlacementError
    from sbp.ops.registry import without_partials
    from sbp.tensor import GlobalTensor

    items = _expand(index, g.dim())
    grads = torch.is_grad_enabled() and (
        g.requires_grad or (isinstance(value, torch.Tensor) and value.requires_grad)
    )
    if items is None or grads:
        return False
    if isinstance(value, GlobalTensor):
        if value.placement != g.placement:
            raise PlacementError(
                f"__setitem__: value is on {value.placement!r}, the tensor on {g.placement!r}"
            )
        value = value.full_tensor()
    elif isinstance(value, torch.Tensor) and value.dim() > 0:
        raise PlacementError(
            f"__setitem__: value is a local torch.Tensor of shape {tuple(value.shape)}; "
            "make it global first (value.to_global(placement, sbp))"
        )
    flat = without_partials(g)
    g._local, g._spec = flat._local, flat._spec
    if env.get_rank() in g.placement:
        _write_local_part(g, items, value)
    torch.autograd.graph.increment_version(g)  # autograd sees the write, as for x[i] = v
    return True


def _write_local_part(g, items: list, value: Any) -> None:
    sizes = [
        len(range(*i.indices(n)))
        for i, n in zip(items, g.shape, strict=True)
        if isinstance(i, slice)
    ]
    value = torch.as_tensor(value, dtype=g.dtype, device=g._local.device).expand(sizes)
    local_index, value_index = [], []
    for item, size, (lo, hi) in zip(items, g.shape, g._spec.ranges(env.get_rank()), strict=True):
        part = _local_part(item, size, lo, hi)
        if part is None:
            return  # nothing of the slice lives on this rank
        local_index.append(part[0])
        if part[1] is not None:
            value_index.append(part[1])
    g._local[tuple(local_index)] = value[tuple(value_index)]


def number_as_global(g, value: Any) -> Any:
    """A Python number to write into `g` by torch's path, as the broadcast global 0-dim
    tensor of `g`'s dtype torch would otherwise make local; any other value as it is."""
    from sbp.local_constants import as_broadcast

    if not isinstance(value, (bool, int, float, complex)):
        return value
    return as_broadcast(torch.tensor(value, dtype=g.dtype), g.placement)
