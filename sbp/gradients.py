"""Leaf gradients end in the leaf's sbp; partial sums are reduced in buckets during backward.

A broadcast parameter trained on a split batch receives a partial-sum
gradient. Reducing each one as it arrives costs one collective per parameter;
instead each leaf whose gradient is partial where the leaf is broadcast joins
a bucket: a full bucket (`BUCKET_BYTES`) starts its flat all-reduce at once, while
backward goes on (as torch DDP's do), and when the backward pass ends the rest are
started and all are waited for. Every rank sees the same leaves in the same order
(SPMD), so buckets match across ranks. Other mismatches are boxed at once.

The data-parallel fast path sums its gradients apart (`sbp.data_parallel.reducer`), and
they wait plain on their parameters (`sbp.data_parallel.waiting`); it uses the helpers
at the top of this module for its loops over every parameter.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections import deque
from collections.abc import Iterator

import torch

from sbp import comm, env
from sbp.boxing import box
from sbp.comm import shm, stats

BUCKET_BYTES = 25 * 2**20
BUCKETS = "gradient buckets"  # the cause traced collectives of the reduction name
TORCH_GRAD = torch._C.TensorBase.grad  # torch's own `.grad`, under GlobalTensor's
# torch's C getters (`.grad`, `.requires_grad`) look up a subclass's __torch_function__ at
# every read, ~0.17 us on a GlobalTensor (whose is disabled); inside this they do not. For
# the loops over every parameter that run each step.
PLAIN_GETTERS = torch._C.DisableTorchFunctionSubclass


def has_user_hooks(p: torch.Tensor) -> bool:
    """Does global `p` hold gradient hooks besides sbp's own (`_sbp_accumulates`,
    `_sbp_grad_hook`)?"""
    own_pre = 1 if getattr(p, "_sbp_accumulates", False) else 0
    own_post = 1 if getattr(p, "_sbp_grad_hook", False) else 0
    return (
        len(p._backward_hooks or ()) > own_pre
        or len(p._post_accumulate_grad_hooks or ()) > own_post
    )


def post_accumulate_hook(leaf: torch.Tensor) -> None:
    """Runs after autograd accumulated `leaf.grad` (see `GlobalTensor.requires_grad_`);
    once per parameter and backward, so no spec is rebuilt needlessly."""
    grad = TORCH_GRAD.__get__(leaf)  # (a waiting gradient is whole already: not this one)
    spec = getattr(grad, "_spec", None)  # (only global tensors have one)
    if spec is None:
        if grad is not None and (grad._is_zerotensor() or not grad.any()):
            # torch's formulas make a zero gradient from sizes alone (`sgn`, `copysign`'s
            # sign operand), a plain tensor: the leaf's zeros, in its layout
            _zero_grad(leaf, grad)
        return
    if not grad._local.is_contiguous():
        # An expanded gradient (`p.sum()`'s, one element seen everywhere): torch's
        # AccumulateGrad makes a `.grad` of its own only where the wrapper's strides are
        # off, and a global tensor's claim contiguous. In-place updates need its own. (A
        # Linear's weight gradient comes contiguous: its transpose's wrapper has torch's
        # strides, so `mm`'s backward computes it in the weight's layout, no copy here.)
        grad._local = grad._local.contiguous()
    target = leaf._spec
    if grad.dtype != target.dtype:
        target = target._replace(dtype=grad.dtype)
    if spec == target:
        return
    if target.placement.size == 1 and spec.placement == target.placement:
        # one rank holds the whole tensor whatever the sbp says: only the label changes
        grad._spec = target  # (a gradient has its leaf's shape)
        return
    if _bucketable(spec, target):
        if not getattr(leaf, "_sbp_accumulates", False):
            leaf._sbp_accumulates = True
            leaf.register_hook(functools.partial(_accumulate_partially, weakref.ref(leaf)))
        if not _BUCKETS.done:
            torch.autograd.Variable._execution_engine.queue_callback(flush)
        _BUCKETS.add(grad, target.nd_sbp)
        return
    grad._local, grad._spec = box(grad._local, grad._spec, target), target


def _zero_grad(leaf: torch.Tensor, grad: torch.Tensor) -> None:
    spec = leaf._spec._replace(dtype=grad.dtype)
    local = torch.zeros(spec.local_shape(env.get_rank()), dtype=grad.dtype, device=grad.device)
    leaf.grad = type(leaf)(local, spec)  # (the leaf is a GlobalTensor: its gradient is one)


def _accumulate_partially(leaf_ref: weakref.ref, new_grad: torch.Tensor) -> None:
    """Before autograd adds a partial gradient into the whole `.grad` of an earlier backward
    (gradient accumulation), the old one is relabelled partial (kept on one rank, zeros on
    the others: no communication), so the in-place sum stays partial, which keeps the layout
    it is written in, and joins the bucket again: one flat all-reduce per backward, not one
    per gradient. (`.grad` is sbp's own tensor here: nothing views it.)"""
    leaf = leaf_ref()
    grad = None if leaf is None else TORCH_GRAD.__get__(leaf)
    new_spec = getattr(new_grad, "_spec", None)
    spec = getattr(grad, "_spec", None)
    if new_spec is None or spec is None or spec == new_spec:
        return
    if spec._replace(nd_sbp=new_spec.nd_sbp) == new_spec and _bucketable(new_spec, spec):
        grad._local, grad._spec = box(grad._local, spec, new_spec), new_spec


def _bucketable(spec, target) -> bool:
    return spec.placement == target.placement and all(
        a == b or (a.is_partial and a.op == "sum" and b.is_broadcast)
        for a, b in zip(spec.nd_sbp, target.nd_sbp, strict=True)
    )


class _Buckets:
    """This backward's partial gradients, in buckets of `BUCKET_BYTES` per hierarchy dim
    they are summed along, filled in arrival order (the same on every rank). A gradient
    of other layouts along the dims kept (a tensor-parallel split) shares the
    data-parallel all-reduce, which sums each element with its replicas alone; one partial
    along two dims (a LayerNorm's weights under DP x TP) joins the buckets of each, not
    buckets of its own. A bucket of gradients partial along its dim alone starts as soon
    as it is full, while backward goes on; the rest wait for `flush`, which reduces the
    buckets holding a gradient of several dims one dim after the other (sums over
    distinct dims compose, each on what the dims before it made)."""

    def __init__(self) -> None:
        self.open: dict = {}  # (placement, dim, dtype, device) -> [bytes, [weak ref], several]
        self.started: list = []  # (gradients, flat, pending all-reduce or None)
        self.later: list = []  # (key, gradients): buckets holding a gradient of several dims
        self.done: dict = {}  # id -> (weak reference, target nd_sbp): this backward's

    def add(self, grad: torch.Tensor, done: tuple) -> None:
        known = self.done.get(id(grad))
        if known is not None and known[0]() is grad:
            return  # (a gradient met twice in one backward is reduced once; an id freed
            # by a dead gradient may be reused, by a new one, which joins)
        self.done[id(grad)] = (weakref.ref(grad), done)
        spec = grad._spec
        dims = [h for h, (s, t) in enumerate(zip(spec.nd_sbp, done, strict=True)) if s != t]
        nbytes = grad._local.numel() * grad._local.element_size()
        for h in dims:
            key = (spec.placement, h, grad.dtype, grad._local.device)
            entry = self.open.setdefault(key, [0, [], False])
            if entry[1] and entry[0] + nbytes > BUCKET_BYTES:
                self._close(key, entry, overlap=True)
                entry[:] = [0, [], False]
            entry[0] += nbytes
            entry[1].append(weakref.ref(grad))
            entry[2] = entry[2] or len(dims) > 1

    def _close(self, key: tuple, entry: list, overlap: bool) -> None:
        grads = [g for g in (r() for r in entry[1]) if g is not None]
        if not grads:  # (gradients dropped since they came: alike on every rank)
            return
        if entry[2]:
            self.later.append((key, grads))
        else:
            self.started.append((grads, *self._start(key, grads, overlap)))

    @staticmethod
    def _start(key: tuple, grads: list, overlap: bool) -> tuple:
        """(flat, pending) of one bucket's all-reduce over the ranks of its dim: started
        asynchronously while backward goes on (`overlap`), else at once (through shared
        memory on one host); (None, None) on a rank outside the placement."""
        placement, h = key[0], key[1]
        me = env.get_rank()
        if me not in placement:
            return None, None
        flat = torch.cat([g._local.reshape(-1) for g in grads])
        ranks = placement.group_ranks(me, h)
        with stats.noted(BUCKETS, implicit=False, phase="backward"):
            if overlap:
                return flat, comm.all_reduce_async(flat, "sum", ranks)
            comm.all_reduce(flat, "sum", ranks)
        return flat, None

    def flush(self) -> None:
        for key, entry in self.open.items():
            if entry[1]:
                self._close(key, entry, overlap=False)
        started, later, done = self.started, self.later, self.done
        self.drop()
        for grads, flat, pending in started:
            if pending is not None:
                pending.wait()
            _write_back(grads, flat)
        for key, grads in sorted(later, key=lambda kg: kg[0][1]):  # (stable: arrival order)
            _write_back(grads, self._start(key, grads, overlap=False)[0])
        for ref, target in done.values():
            g = ref()
            if g is not None:
                g._spec = g._spec._replace(nd_sbp=target)

    def drop(self) -> None:
        self.open, self.started, self.later, self.done = {}, [], [], {}

    def abandon(self) -> None:
        """The state of a backward that raised (its `flush` never ran): its gradients stay
        partial sums (their logical values, reduced when read); the all-reduces it started
        are waited for, as every rank that raised alike started them."""
        started = self.started
        self.drop()
        for _, _, pending in started:
            if pending is not None:
                with contextlib.suppress(Exception):  # (a rank that did not raise: out of step)
                    pending.wait()


def _write_back(grads: list, flat: torch.Tensor | None) -> None:
    """Each gradient's local tensor becomes its part of the reduced `flat` (a view)."""
    if flat is None:
        return
    offset = 0
    for g in grads:
        n = g._local.numel()
        g._local = flat[offset : offset + n].view(g._local.shape)
        offset += n


_BUCKETS = _Buckets()


def _drop_pending(ranks: tuple[int, ...]) -> None:
    """Ranks found out of step abort their backward: what it left pending is not flushed
    by the next one (one rank would reduce a bucket more than the others)."""
    _BUCKETS.drop()


shm.on_out_of_step(_drop_pending)


def abandon() -> None:
    """After a backward that raised (autograd runs no final callback then, so `flush`
    did not): forget its buckets, or no later backward would queue its own `flush`."""
    _BUCKETS.abandon()


def flush() -> None:
    """Make every partial gradient of this backward whole: start the buckets not started
    yet, then wait for each, in order. Only the dims where the leaf is broadcast are
    reduced: a partial leaf keeps a partial grad."""
    _BUCKETS.flush()


def run_all(calls: Iterator) -> None:
    """Run a lazy map of calls in C (a loop over hundreds of parameters each step)."""
    deque(calls, maxlen=0)
