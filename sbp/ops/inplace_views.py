"""In-place view ops: `x.t_()`, `x.unsqueeze_(0)`, `x.set_(y)`, `x.resize_(n)` change which
elements `x` shows and its shape, not the values.

`x` becomes the global view the out-of-place op gives (`x.t()`): its local tensor, spec,
and the wrapper's shape. It stays a view of what it showed before, so an older view of `x`
sees writes into it, as in torch; where the view had to be a copy (`as_strided` of a split
tensor), writes pass on or fail loudly as for any copied view (`sbp.ops.writes`).
"""

from __future__ import annotations

from typing import Any

import torch

from sbp import env
from sbp.boxing.executor import empty_local
from sbp.errors import PlacementError, SbpSignatureError
from sbp.ops.registry import register
from sbp.ops.writes import as_shown
from sbp.signature import Split, broadcast
from sbp.tensor import GlobalTensor

aten = torch.ops.aten

_VIEW_OF = {
    aten.t_.default: aten.t.default,
    aten.transpose_.default: aten.transpose.int,
    aten.unsqueeze_.default: aten.unsqueeze.default,
    aten.squeeze_.default: aten.squeeze.default,
    aten.squeeze_.dim: aten.squeeze.dim,
    aten.squeeze_.dims: aten.squeeze.dims,
    aten.as_strided_.default: aten.as_strided.default,
}


def become(x, view) -> Any:
    """`x` takes global tensor `view`'s local tensor, spec and shape, and what it is a copied
    view of; returns `x`."""
    torch._C.TensorBase.data.__set__(x, view)  # the wrapper's sizes (no dispatch)
    x._local, x._spec = view._local, view._spec  # (counted: caches over x look again)
    x._copy_of = view._copy_of
    return x


@register(*_VIEW_OF)
def view_in_place(func, args: tuple, kwargs: dict) -> Any:
    """`x.t_()` is `x` becoming `x.t()`."""
    x = args[0]
    return become(x, _VIEW_OF[func](as_shown(x), *args[1:], **kwargs))


@register(aten.set_.source_Tensor, aten.set_.default)
def set_to(func, args: tuple, kwargs: dict) -> Any:
    """`x.set_(source)`: `x` shows `source`'s data, in `source`'s layout; `x.set_()` makes
    it empty."""
    x = args[0]
    if func is aten.set_.default:
        spec = x._spec._replace(nd_sbp=(broadcast,) * x.placement.ndim, shape=(0,))
        local = x._local.new_empty(0) if env.get_rank() in x.placement else empty_local(spec)
        return become(x, GlobalTensor(local, spec))
    source = args[1] if len(args) > 1 else kwargs["source"]
    if not isinstance(source, GlobalTensor):
        raise PlacementError(
            f"{func}: source is a local {type(source).__name__}; a global tensor can only "
            "show another global tensor's data: make it global first "
            "(source.to_global(placement, sbp))"
        )
    if source is x:
        return x
    view = GlobalTensor(aten.alias.default(source._local), source._spec)
    view._copy_of = source._copy_of  # (x shows what source shows, wherever source goes)
    return become(x, view)


@register(
    aten.set_.source_Storage,
    aten.set_.source_Storage_storage_offset,
    aten.set_.source_Tensor_storage_offset,
)
def set_to_storage(func, args: tuple, kwargs: dict) -> Any:
    raise PlacementError(
        f"{func}: a storage is one rank's memory, not a global tensor's logical value; set "
        "the tensor to another global tensor instead (x.set_(y)), or set its local tensor"
    )


@register(aten.resize_.default, aten.resize_as_.default)
def resize(func, args: tuple, kwargs: dict) -> Any:
    """Resizing keeps the elements in their flat order: every rank keeps its own, which is
    the logical result only where no dim is split."""
    x = args[0]
    size = args[1] if len(args) > 1 else kwargs.get("size", kwargs.get("the_template"))
    if func is aten.resize_as_.default:
        size = size.shape
    size = tuple(size)
    if size == tuple(x.shape):
        return x
    if any(isinstance(s, Split) for s in x.sbp):
        raise SbpSignatureError(
            f"{func}: a tensor of sbp {x.sbp} cannot be resized from {tuple(x.shape)} to "
            f"{size}: its elements would move between ranks. Convert it to broadcast first "
            "(x.to_global(sbp=...)), or make a new tensor"
        )
    if x._copy_of is not None:
        raise SbpSignatureError(
            f"{func}: the tensor is a view sbp had to copy from its base; resized to {size} "
            "it would no longer show a part of the base. Resize a clone, or the base"
        )
    spec = x._spec._replace(shape=size)
    if env.get_rank() in x.placement:
        local = aten.alias.default(x._local)
        local.resize_(size)
    else:
        local = empty_local(spec)
    return become(x, GlobalTensor(local, spec))
