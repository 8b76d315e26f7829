"""`x.to(dtype=..., device=...)` on global tensors: a local conversion that keeps the layout.

`aten._to_copy` cannot find its output metadata on meta tensors when a device is
given ("Cannot copy out of meta tensor"), so it has its own rule: the local
tensor is converted, the spec takes the new dtype. A device of the placement's
type means this rank's device of the placement (cuda:LOCAL_RANK); another device
type is another placement, a `DeviceMismatchError`.
"""

from __future__ import annotations

import torch

from sbp import env
from sbp.boxing.executor import local_device
from sbp.errors import DeviceMismatchError
from sbp.ops.registry import register, without_partials

aten = torch.ops.aten


def _is_linear_cast(dtype: torch.dtype) -> bool:
    """Casting to a floating (or complex) dtype keeps a partial sum a partial sum."""
    return dtype.is_floating_point or dtype.is_complex


@register(aten._to_copy.default)
def to_copy(func, args, kwargs):
    from sbp.tensor import GlobalTensor

    g = args[0]
    P = g._spec.placement
    kwargs = dict(kwargs)
    device = kwargs.get("device")
    if device is not None:
        device = torch.device(device)
        if device.type != P.type:
            raise DeviceMismatchError(
                f"{func}: device={device} but the global tensor's placement type is "
                f"{P.type!r}; move it with x.to_global(sbp.placement({device.type!r}, ...))"
            )
        kwargs["device"] = local_device(P.type)
    dtype = kwargs.get("dtype") or g.dtype
    if any(s.is_partial for s in g._spec.nd_sbp) and not _is_linear_cast(dtype):
        g = without_partials(g)
    local = func(g._local, **kwargs) if env.get_rank() in P else g._local.to(dtype)
    return GlobalTensor(local, g._spec._replace(dtype=local.dtype))
