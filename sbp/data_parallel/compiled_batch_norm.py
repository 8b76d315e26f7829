"""Logical BatchNorm (`batch_norm="global"`) inside a compiled local forward.

The eager local run intercepts each BatchNorm call (`sbp.data_parallel.families.batch_norm`)
and computes the logical batch's statistics with an autograd function of its own. A
forward compiled by torch.compile cannot be intercepted per call (a module's forward
replaced for every call would fail Dynamo's guards, and recompile), so the BatchNorm
modules of such a model keep a forward of their own (`install`): on the local tensors of
a compiled run (`Groups.ranks` set) it is `sbp.ops.batch_norm.differentiable_forward`,
which Dynamo traces, with the statistics table all-reduced over the ranks that hold
parts of the batch; everywhere else it is torch's `F.batch_norm`, as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sbp.data_parallel import shard_batch_norm
from sbp.ops import batch_norm
from sbp.tensor import GlobalTensor

_BatchNorm = torch.nn.modules.batchnorm._BatchNorm


class Groups:
    """The ranks that hold parts of the batch, and this rank's place among them, while a
    compiled local run is on (None outside: the modules then run as torch's). Dynamo
    guards the compiled forward on them."""

    def __init__(self) -> None:
        self.ranks: tuple[int, ...] | None = None
        self.index = 0


def _forward(m: _BatchNorm, input: torch.Tensor) -> torch.Tensor:
    groups = m.__dict__["_sbp_groups"]

    def logical(x, running_mean, running_var, weight, bias, training, momentum, eps):
        ranks = groups.ranks
        if not training or ranks is None or isinstance(x, GlobalTensor):
            return F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)
        return batch_norm.differentiable_forward(
            x, weight, bias, running_mean, running_var, momentum, eps, ranks, groups.index
        )

    # (in a compiled run the momentum may be a tensor: `differentiable_forward` takes it)
    return shard_batch_norm.batch_norm_forward(m, input, logical, groups.ranks is not None)


def install(module: torch.nn.Module, groups: Groups) -> list[_BatchNorm]:
    """Give the BatchNorm submodules the forward above; returns them."""
    found = shard_batch_norm.install(module, _forward)
    for m in found:
        m.__dict__["_sbp_groups"] = groups
    return found


def remove(found: list[_BatchNorm]) -> None:
    shard_batch_norm.remove(found, _forward)
    for m in found:
        m.__dict__.pop("_sbp_groups", None)
