"""In-place random fills (`torch.nn.init.*`): keep the layout, draw only this rank's part.

`normal_` and `uniform_` on a global tensor fill each rank's local tensor with
counter-based draws indexed by the logical position (`sbp.random.uniform_at`), so
the logical value depends on the seed alone, not on the placement or sbp, and no
rank draws or moves what it does not hold. The seed comes from the `generator=`
argument when given (one draw from it), else from sbp's random stream
(`sbp.manual_seed`), which every rank advances alike. A partial tensor becomes
broadcast: every element is set. The rest of `trunc_normal_` (erfinv_, mul_, add_,
clamp_) is elementwise and keeps the layout by the pointwise rules.
"""

from __future__ import annotations

import torch

from sbp import env
from sbp import random as sbp_random
from sbp.layout import GlobalSpec, strided_of, unflattened
from sbp.ops.pointwise import nonlinear
from sbp.ops.registry import register, register_strategy
from sbp.ops.writes import assign
from sbp.signature import partials_to_broadcast

aten = torch.ops.aten

register_strategy(aten.erfinv, aten.erfinv_)(nonlinear)


def _seed(op: str, generator: torch.Generator | None) -> int:
    if generator is not None:
        return int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
    return sbp_random.draw_seed("init", op)


def logical_indices(spec: GlobalSpec, rank: int) -> torch.Tensor:
    """Row-major logical index of every element of `rank`'s local tensor (int64). (A
    strided split's: those of its unflattened tensor, in the same row-major order.)"""
    if strided_of(spec.nd_sbp) is not None:
        return logical_indices(unflattened(spec), rank).reshape(spec.local_shape(rank))
    idx = torch.zeros((), dtype=torch.int64)
    stride = 1
    strides = []
    for size in reversed(spec.shape):
        strides.append(stride)
        stride *= size
    for d, ((a, b), st) in enumerate(zip(spec.ranges(rank), reversed(strides), strict=True)):
        shape = [1] * len(spec.shape)
        shape[d] = b - a
        idx = idx + (torch.arange(a, b, dtype=torch.int64) * st).reshape(shape)
    return idx


@register(aten.normal_.default, aten.uniform_.default)
def random_fill_(func, args, kwargs):
    g = args[0]
    seed = _seed(str(func), kwargs.get("generator"))  # every rank draws: streams stay in step
    spec = g._spec._replace(nd_sbp=partials_to_broadcast(g._spec.nd_sbp))
    me = env.get_rank()
    local = g._local if spec == g._spec else torch.empty_like(g._local)
    if me in spec.placement and g._local.numel():
        idx = logical_indices(spec, me)
        if func is aten.normal_.default:
            mean = args[1] if len(args) > 1 else kwargs.get("mean", 0.0)
            std = args[2] if len(args) > 2 else kwargs.get("std", 1.0)
            values = sbp_random.normal_at(seed, idx) * std + mean
        else:
            low = args[1] if len(args) > 1 else kwargs.get("from", 0.0)
            high = args[2] if len(args) > 2 else kwargs.get("to", 1.0)
            values = sbp_random.uniform_at(seed, idx) * (high - low) + low
        with torch.no_grad():
            local.copy_(values.to(device=local.device).expand_as(local))
    assign(g, local, spec)  # (a partial tensor's draws, made partial again)
    return g
