"""The local run: a module's forward on local tensors, with BatchNorm, dropout, attention
and losses given the op-by-op path's semantics (`_Run`, `_LocalOps`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.overrides import TorchFunctionMode

from sbp.data_parallel import families, shard_batch_norm
from sbp.data_parallel.by_name import (
    BATCH_NORMS,
    _by_name_replaced,
    _unrouted,
    _within,
)
from sbp.data_parallel.layout import Layout

if TYPE_CHECKING:
    from sbp.data_parallel.call import DataParallel


class _LocalOps(TorchFunctionMode):
    """Inside the local forward: the op families' functions (`families.LOCAL`: BatchNorm,
    dropout, attention, losses) with the per-op path's semantics."""

    def __init__(self, run: _Run):
        super().__init__()
        self.run = run

    def __torch_function__(self, func, types, args=(), kwargs=None):
        family = families.LOCAL.get(_unrouted(func))
        if family is None:
            return func(*args, **(kwargs or {}))
        return family.run_local(self.run, func, args, kwargs or {})


class _Run:
    """One local forward: the layout it follows, and what the op families' local functions
    need and count (`families`)."""

    def __init__(self, fast: DataParallel, layout: Layout, data_nd: tuple):
        self.fast, self.layout, self.data_nd = fast, layout, data_nd
        self.group = fast.group(data_nd)
        self.bn_calls = self.dropouts = self.losses = 0
        self.in_loss = False
        self.to_sync: list[torch.Tensor] = []

    def batch_norm(self, *args, **kwargs):
        """`F.batch_norm` in the local run (`families.batch_norm`)."""
        return families.batch_norm.local(self, *args, **kwargs)

    def dropout(self, *args, **kwargs):
        """`F.dropout` in the local run (`families.dropout`)."""
        return families.dropout.local(self, *args, **kwargs)

    def by_name(self, fn, *args, **kwargs):
        """A call of a function the local run replaces by name (`_by_name_replaced`)."""
        return families.LOCAL[fn].run_local(self, fn, args, kwargs)

    def by_name_replaced(self):
        """For the call, the functions replaced by name are this run's (`by_name`): inside a
        call the local ops' mode does not see (torch's multi-head attention's dropout)."""
        return _by_name_replaced(self.by_name)


def _local_forward(run: _Run, mode: _LocalOps):
    """The forward of a BatchNorm or dropout module in the local run: torch's own forward
    (torch 2.x `_BatchNorm.forward`, `Dropout.forward`) with the run's batch_norm or dropout
    called directly, or, for modules with their own forward, inside the local ops' mode."""

    def replacement(m: torch.nn.Module, forward):
        if isinstance(m, BATCH_NORMS) and shard_batch_norm.torch_forward(m):
            return lambda input: shard_batch_norm.batch_norm_forward(m, input, run.batch_norm)
        if type(m).forward is torch.nn.Dropout.forward:
            return lambda input: run.dropout(input, m.p, m.training, m.inplace)
        return _within(mode, forward)

    return replacement
