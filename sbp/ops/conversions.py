"""`x.to(dtype=..., device=...)` on global tensors: a local conversion that keeps the layout.

`aten._to_copy` cannot find its output metadata on meta tensors when a device is
given ("Cannot copy out of meta tensor"), so it has its own rule: the local
tensor is converted, the spec takes the new dtype. A device of the placement's
type means this rank's device of the placement (cuda:LOCAL_RANK); another device
type is another placement, a `DeviceMismatchError`; but in backward the meta device
gives a plain meta tensor of the logical shape: metadata, which torch's kernels for a
zero gradient ask of the other operand (`x.sgn() * x`'s gradient adds one).
"""

from __future__ import annotations

import torch

from sbp import env
from sbp.boxing.executor import local_device
from sbp.errors import DeviceMismatchError
from sbp.ops.registry import register, without_partials
from sbp.signature import partial_sum
from sbp.tensor import GlobalTensor

aten = torch.ops.aten


def _keeps_partials(spec, dtype: torch.dtype) -> bool:
    """Casting to a floating dtype keeps a partial sum a partial sum, and a partial max or
    min one (monotone); to a complex one, a partial sum only (complex numbers have no order)."""
    if dtype.is_complex:
        return all(not s.is_partial or s == partial_sum for s in spec.nd_sbp)
    return dtype.is_floating_point


@register(aten._to_copy.default)
def to_copy(func, args, kwargs):
    g = args[0]
    P = g._spec.placement
    kwargs = dict(kwargs)
    dtype = kwargs.get("dtype") or g.dtype
    device = kwargs.get("device")
    if device is not None:
        device = torch.device(device)
        if device.type == "meta" and torch._C._current_graph_task_id() >= 0:
            # (in backward: torch's kernels for a zero gradient, after the result's metadata)
            return torch.empty(g.shape, dtype=dtype, device="meta")
        if device.type != P.type:
            raise DeviceMismatchError(
                f"{func}: device={device} but the global tensor's placement type is "
                f"{P.type!r}; move it with x.to_global(sbp.placement({device.type!r}, ...))"
            )
        kwargs["device"] = local_device(P.type)
    if any(s.is_partial for s in g._spec.nd_sbp) and not _keeps_partials(g._spec, dtype):
        g = without_partials(g)
    local = func(g._local, **kwargs) if env.get_rank() in P else g._local.to(dtype)
    return GlobalTensor(local, g._spec._replace(dtype=local.dtype))
