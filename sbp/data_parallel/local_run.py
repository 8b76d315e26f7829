"""The local run: a module's forward on local tensors, with BatchNorm, dropout, attention
and losses given the op-by-op path's semantics (`_Run`, `_LocalOps`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.nn import _reduction
from torch.overrides import TorchFunctionMode

from sbp import comm
from sbp.data_parallel.by_name import (
    _ATTENTION,
    _DROPOUT,
    _LOSSES,
    BATCH_NORMS,
    _by_name_replaced,
    _unrouted,
    _within,
)
from sbp.data_parallel.layout import Layout
from sbp.errors import LabelRangeError
from sbp.nn import outputs, shard_batch_norm, torch_attention
from sbp.ops import batch_norm
from sbp.ops.nn import shard_seed

if TYPE_CHECKING:
    from sbp.data_parallel.call import DataParallel


class _LocalOps(TorchFunctionMode):
    """Inside the local forward: BatchNorm and dropout with the per-op path's semantics."""

    def __init__(self, run: _Run):
        super().__init__()
        self.run = run

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.batch_norm:
            return self.run.batch_norm(*args, **kwargs)
        original = _unrouted(func)
        if original is _DROPOUT:
            return self.run.dropout(*args, **kwargs)
        if original is torch_attention.ATTENTION:
            # (the mode is off inside its own call: its dropout is reached by name)
            with _by_name_replaced(self.run.by_name):
                return func(*args, **kwargs)
        if original is _ATTENTION:
            return self.run.attention(*args, **kwargs)
        if original in _LOSSES:
            return self.run.loss(func, *args, **kwargs)
        return func(*args, **kwargs)


class _Run:
    """One local forward: the layout it follows and what BatchNorm and dropout need."""

    def __init__(self, fast: DataParallel, layout: Layout, data_nd: tuple):
        self.fast, self.layout, self.data_nd = fast, layout, data_nd
        self.group = fast.group(data_nd)
        self.bn_calls = self.dropouts = self.losses = 0
        self.in_loss = False
        self.to_sync: list[torch.Tensor] = []

    def batch_norm(
        self,
        input,
        running_mean,
        running_var,
        weight=None,
        bias=None,
        training=False,
        momentum=0.1,
        eps=1e-5,
    ):
        if not training:
            return F.batch_norm(
                input, running_mean, running_var, weight, bias, False, momentum, eps
            )
        counts = self.layout.bn_counts
        if self.bn_calls >= len(counts):
            raise RuntimeError("sbp data-parallel fast path: more BatchNorm calls than checked")
        count = counts[self.bn_calls]
        self.bn_calls += 1
        group = self.group
        if self.fast.batch_norm == "local" or len(group) == 1:
            if len(group) > 1:
                self.to_sync += [t for t in (running_mean, running_var) if t is not None]
            return F.batch_norm(input, running_mean, running_var, weight, bias, True, momentum, eps)
        return batch_norm.LogicalBatchNorm.apply(
            input,
            weight,
            bias,
            running_mean,
            running_var,
            momentum if momentum is not None else 0.0,
            eps,
            count,
            batch_norm.GroupSum(group),
        )

    def dropout(self, input, p=0.5, training=True, inplace=False):
        if not training or p == 0:
            return _DROPOUT(input, p, training, inplace)
        if p == 1:
            return input.mul_(0) if inplace else torch.zeros_like(input)
        gen = torch.Generator(device=input.device)
        gen.manual_seed(shard_seed(self.fast.placement, self.data_nd))
        self.dropouts += 1
        if input.device.type == "cpu":  # what aten.dropout runs on CPU (bernoulli_ rule)
            noise = torch.empty_like(input).bernoulli_(1 - p, generator=gen).div_(1 - p)
            return input.mul_(noise) if inplace else input * noise
        mask = torch.empty_like(input).bernoulli_(1 - p, generator=gen).to(torch.bool)
        if inplace:  # the fused kernel elsewhere (native_dropout rule)
            return input.mul_(mask).mul_(1.0 / (1 - p))
        return input * mask * (1.0 / (1 - p))

    def attention(self, query, key, value, attn_mask=None, dropout_p=0.0, *args, **kwargs):
        """`F.scaled_dot_product_attention`. With dropout on the CPU, torch runs it as a
        composite drawing its mask by `bernoulli_` from the default generator, as the
        op-by-op path's `bernoulli_` rule draws it from a generator seeded by sbp's stream:
        the default generator is seeded alike for the call (and put back after)."""
        if not dropout_p or query.device.type != "cpu":  # (elsewhere the check refused it)
            return _ATTENTION(query, key, value, attn_mask, dropout_p, *args, **kwargs)
        self.dropouts += 1
        seed = shard_seed(self.fast.placement, self.data_nd)
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            return _ATTENTION(query, key, value, attn_mask, dropout_p, *args, **kwargs)

    def by_name(self, fn, *args, **kwargs):
        """A call of a function the local run replaces by name (`_by_name_replaced`)."""
        if fn is _ATTENTION:
            return self.attention(*args, **kwargs)
        if fn is _DROPOUT:
            return self.dropout(*args, **kwargs)
        return self.loss(fn, *args, **kwargs)

    def loss(
        self,
        fn,
        input,
        target,
        weight=None,
        size_average=None,
        ignore_index=-100,
        reduce=None,
        reduction="mean",
        **options,
    ):
        """F.cross_entropy or F.nll_loss (`fn`) of the local batch as the op-by-op rule
        computes it: a mean is this rank's sum over the logical batch's total weight, which
        the ranks sum in one collective (with, for labels on the CPU, the count of labels
        outside the classes: a bad label is an error on every rank, not a hang).

        Soft (probability) targets pass as they are: they make no `nll_loss` op, and the
        check refused their mean (a partial sum). So does a call made again from inside
        this one (a torch function mode hands `fn` back to its name)."""
        if self.in_loss or target.is_floating_point():
            return fn(
                input, target, weight, size_average, ignore_index, reduce, reduction, **options
            )
        self.losses += 1
        if size_average is not None or reduce is not None:  # (deprecated: what they mean)
            reduction = _reduction.legacy_get_string(size_average, reduce)
        self.in_loss = True
        try:
            return self._loss(fn, input, target, weight, ignore_index, reduction, options)
        finally:
            self.in_loss = False

    def _loss(self, fn, input, target, weight, ignore_index, reduction, options):
        if reduction != "mean":  # (this rank's sum is its part; none is per sample)
            return fn(
                input, target, weight, ignore_index=ignore_index, reduction=reduction, **options
            )
        classes = input.shape[1] if input.dim() > 1 else input.shape[0]
        with torch.no_grad():  # (as torch's: no gradient flows through the divisor)
            counted = target != ignore_index
            parts = []
            if target.device.type == "cpu":
                bad = counted & ((target < 0) | (target >= classes))
                counted = counted & ~bad
                parts.append(bad.sum(dtype=input.dtype))
            mine = outputs.local_total_weight(target, counted, weight, input.dtype)
            totals = torch.stack([mine, *parts])
            if len(self.group) > 1:
                totals = comm.all_reduce(totals, "sum", self.group)
        if parts and totals[1] > 0:
            raise LabelRangeError(
                f"target holds {int(totals[1])} label(s) outside [0, {classes}) for an input "
                f"of {classes} classes (ignore_index={ignore_index})"
            )
        local = fn(input, target, weight, ignore_index=ignore_index, reduction="sum", **options)
        return local / totals[0]


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
