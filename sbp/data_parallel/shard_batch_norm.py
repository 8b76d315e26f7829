"""`batch_norm="local"` where the fast path does not run: op by op, and under torch.compile.

The fast path computes per-shard BatchNorm on local tensors itself. When the module
runs op by op instead (the fast path declined or is off), or Dynamo traces it, its
BatchNorm modules get a forward of their own (`install`) that calls the per-shard op
`sbp::shard_batch_norm` (`sbp.ops.shard_batch_norm`) instead of `F.batch_norm`, and
after the model's forward the first rank's running statistics are copied to every
rank in one collective (`sync_statistics`), as torch DDP broadcasts rank 0's buffers.
So the three paths compute the same thing, and it equals torch DDP.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
import torch.nn.functional as F

from sbp.ops import shard_batch_norm  # noqa: F401 - the ops
from sbp.placement import placement as Placement
from sbp.tensor import GlobalTensor

_BatchNorm = torch.nn.modules.batchnorm._BatchNorm


def batch_norm_forward(
    m: _BatchNorm, input: torch.Tensor, batch_norm: Callable, tensor_factor: bool = False
) -> torch.Tensor:
    """torch's `_BatchNorm.forward` (torch 2.x) with `batch_norm(input, running_mean,
    running_var, weight, bias, training, momentum, eps)` called in place of `F.batch_norm`.
    `tensor_factor`: a cumulative average's momentum is passed as a 0-d tensor, not a
    number (which Dynamo makes a graph for at each step in torch 2.11)."""
    m._check_input_dim(input)
    factor = 0.0 if m.momentum is None else m.momentum
    if m.training and m.track_running_stats and m.num_batches_tracked is not None:
        m.num_batches_tracked.add_(1)
        if m.momentum is None:  # a cumulative moving average
            count = m.num_batches_tracked
            factor = 1.0 / (count.double() if tensor_factor else float(count))
    batch_stats = m.training or (m.running_mean is None and m.running_var is None)
    keep = not m.training or m.track_running_stats
    return batch_norm(
        input,
        m.running_mean if keep else None,
        m.running_var if keep else None,
        m.weight,
        m.bias,
        batch_stats,
        factor,
        m.eps,
    )


def per_shard(input, running_mean, running_var, weight, bias, training, momentum, eps):
    """`F.batch_norm` with each rank's own statistics in train mode on a global input."""
    if not training or not isinstance(input, GlobalTensor):
        return F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)
    out, _, _, new_mean, new_var = torch.ops.sbp.shard_batch_norm(
        input, weight, bias, running_mean, running_var, momentum, eps
    )
    with torch.no_grad():
        for buffer, new in ((running_mean, new_mean), (running_var, new_var)):
            if buffer is not None:
                buffer.copy_(new)
    return out


def _forward(m: _BatchNorm, input: torch.Tensor) -> torch.Tensor:
    return batch_norm_forward(m, input, per_shard)


# the forwards `install` gives: a module with one of them still runs torch's forward
_GIVEN: set[Callable] = {_forward}


def torch_forward(m: torch.nn.Module) -> bool:
    """Does BatchNorm module `m` run torch's own forward (BatchNorm1d/2d/3d, not
    SyncBatchNorm or a subclass with its own, and no forward set on the instance, as
    hooks such as accelerate's do), or one `install` gave it in its place?"""
    own = m.__dict__.get("forward")
    return type(m).forward is _BatchNorm.forward and (
        own is None or getattr(own, "__func__", None) in _GIVEN
    )


def modules(module: torch.nn.Module) -> list[_BatchNorm]:
    """BatchNorm submodules with torch's own forward (`torch_forward`)."""
    return [m for m in module.modules() if isinstance(m, _BatchNorm) and torch_forward(m)]


def install(module: torch.nn.Module, forward: Callable = _forward) -> list[_BatchNorm]:
    """Give the BatchNorm submodules `forward(m, input)` (the per-shard one by default);
    returns them."""
    _GIVEN.add(forward)
    found = modules(module)
    for m in found:
        m.__dict__["forward"] = types.MethodType(forward, m)
    return found


def remove(found: list[_BatchNorm], forward: Callable = _forward) -> None:
    """Take `forward` from the modules `install` gave it."""
    for m in found:
        own = m.__dict__.get("forward")
        if isinstance(own, types.MethodType) and own.__func__ is forward:
            del m.__dict__["forward"]


def running_statistics(modules: list[torch.nn.Module]) -> list[GlobalTensor]:
    """The running statistics that the BatchNorm modules among `modules` update in train
    mode (a module's own mode: it may differ from its model's)."""
    return [
        t
        for m in modules
        if isinstance(m, _BatchNorm) and m.training and m.track_running_stats
        for t in (m.running_mean, m.running_var)
        if isinstance(t, GlobalTensor)
    ]


def sync_statistics(modules: list[_BatchNorm], placement: Placement) -> None:
    """After a forward: every rank takes the first rank's running statistics (of the modules
    in train mode), in one collective. Traceable by Dynamo: plain attribute reads only."""
    if placement.size == 1:
        return
    stats = running_statistics(modules)
    if stats:
        with torch.no_grad():
            for t, new in zip(stats, torch.ops.sbp.first_rank_values(stats), strict=True):
                t.copy_(new)
