"""`module.to_global`: every parameter and buffer of a module made global, in place."""

from __future__ import annotations

from typing import Any

import torch

from sbp.comm import agreement, failure
from sbp.counters import COUNTS
from sbp.errors import InputTypeError
from sbp.local_to_global import LOCAL_OPTIONS, bad_input, local_to_global
from sbp.placement import placement as Placement
from sbp.signature import broadcast, normalize_nd_sbp
from sbp.tensor import GlobalTensor


def _converted_parameter(p: torch.Tensor, value: GlobalTensor) -> torch.nn.Parameter:
    """The parameter holding `value`: `p` itself where it was global already (`p.data =`,
    as OneFlow re-boxes: an optimizer holding it steps the new layout, as after torch's
    `module.to`), else a new one, which `p` names (`_sbp_replaced_by`): a plain tensor
    cannot become a global one in place, and an optimizer made before is pointed at it at
    its next step (`sbp.optim_step.repoint`)."""
    if isinstance(p, GlobalTensor):
        p.data = value
        return p
    new = torch.nn.Parameter(value, requires_grad=p.requires_grad)
    p._sbp_replaced_by = new
    COUNTS.replaced += 1
    return new


@failure.user_call
def module_to_global(module: torch.nn.Module, placement: Placement, sbp: Any, **kwargs: Any):
    """`module.to_global`: every parameter and buffer becomes global, in place; returns `module`.

    Values are synced from the placement's first rank (`sync_data=True`), so ranks
    that initialised differently start equal. Shared parameters stay shared. On an
    already-global module, parameters and buffers are re-boxed to `placement`/`sbp`.
    """
    unknown = sorted(set(kwargs) - LOCAL_OPTIONS)
    if unknown:
        raise InputTypeError(
            f"module.to_global: unknown keyword argument(s) {', '.join(unknown)}; it takes "
            "placement, sbp, shape=, sync_data=, check_meta= and grad_sbp="
        )
    bad = None
    buffer_sbp = _buffer_sbp(placement, sbp)
    for t in module.parameters():
        if bad is None and not isinstance(t, GlobalTensor):
            bad = bad_input(t, placement, buffer_sbp if t.dim() == 0 else sbp, kwargs.get("shape"))
    for t in module.buffers():
        if bad is None and not isinstance(t, GlobalTensor):
            bad = bad_input(t, placement, buffer_sbp, kwargs.get("shape"))
    if bad is not None:  # nothing converted yet: the module stays as it was
        if kwargs.get("check_meta", True):
            agreement.raise_everywhere(bad, "module.to_global")
        agreement.announce(bad)  # (unchecked: the others go on, over the world: see to_global)
        raise bad
    done: dict[int, Any] = {}
    nd = normalize_nd_sbp(sbp, placement.ndim)
    whole = (broadcast,) * placement.ndim

    buffer_nd = normalize_nd_sbp(buffer_sbp, placement.ndim)

    def convert(t: torch.Tensor, nd: tuple = nd) -> GlobalTensor:
        if isinstance(t, GlobalTensor):  # already global: re-box, as OneFlow does
            return t.detach().to_global(placement, nd)
        # Each rank holds the user's whole model: it is the logical one, synced as a
        # broadcast, and then each rank keeps its part (split) or share (partial). Taken
        # as each rank's shard, as a tensor's `to_global` would, `split(0)` would make
        # every weight rank-count times as long (docs/api.md "Global modules").
        value = local_to_global(t.detach(), placement, whole, **kwargs)
        return value if nd == whole else value.to_global(placement, nd)

    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is None:
                continue
            if id(p) not in done:
                # (a 0-dim parameter, a learnt scale, has no dim to split: whole everywhere)
                value = convert(p, buffer_nd if p.dim() == 0 else nd)
                done[id(p)] = _converted_parameter(p, value)
            sub._parameters[name] = done[id(p)]
        for name, b in list(sub._buffers.items()):
            if b is None:
                continue
            if id(b) not in done:
                done[id(b)] = convert(b, buffer_nd)
            sub._buffers[name] = done[id(b)]
    return module


def _buffer_sbp(placement: Placement, sbp: Any) -> Any:
    """A split shards the parameters; buffers (running statistics, masks, counters) and
    0-dim parameters stay broadcast, as FSDP2 and ZeRO shard parameters only (docs/api.md
    "Global modules")."""
    try:
        nd = normalize_nd_sbp(sbp, placement.ndim)
    except Exception:  # noqa: BLE001 - a bad sbp: reported by bad_input for the parameters
        return sbp
    return (broadcast,) * placement.ndim if any(s.is_split for s in nd) else sbp
