"""Leaf gradients end in the leaf's sbp; partial sums are reduced in buckets after backward.

A broadcast parameter trained on a split batch receives a partial-sum
gradient. Reducing each one as it arrives costs one collective per parameter;
instead each leaf whose gradient is partial where the leaf is broadcast joins
a bucket, and when the backward pass ends one flat all-reduce per bucket makes
every such gradient whole. Every rank sees the same leaves in the same order
(SPMD), so buckets match across ranks. Other mismatches are boxed at once.

The data-parallel fast path sums its gradients apart (`sbp.data_parallel.reducer`), and
they wait plain on their parameters (`sbp.data_parallel.waiting`); it uses the helpers
at the top of this module for its loops over every parameter.
"""

from __future__ import annotations

import functools
import weakref
from collections import deque
from collections.abc import Iterator

import torch

from sbp import comm, env
from sbp.comm import shm, stats

BUCKET_BYTES = 25 * 2**20
BUCKETS = "gradient buckets"  # the cause traced collectives of the reduction name
_pending: dict = {}  # id(grad) -> (weak reference, target nd_sbp), in arrival order
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
        if not _pending:
            torch.autograd.Variable._execution_engine.queue_callback(flush)
        known = _pending.get(id(grad))
        if known is None or known[0]() is not grad:
            # (an id freed by a dead gradient may be reused: the new one goes last, as it
            # would on a rank where the id differs, so buckets keep the same order everywhere)
            _pending.pop(id(grad), None)
            _pending[id(grad)] = (weakref.ref(grad), target.nd_sbp)
        return
    from sbp.tensor import box

    grad._local, grad._spec = box(grad._local, grad._spec, target), target


def _zero_grad(leaf: torch.Tensor, grad: torch.Tensor) -> None:
    from sbp.tensor import GlobalTensor

    spec = leaf._spec._replace(dtype=grad.dtype)
    local = torch.zeros(spec.local_shape(env.get_rank()), dtype=grad.dtype, device=grad.device)
    leaf.grad = GlobalTensor(local, spec)


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
        from sbp.tensor import box

        grad._local, grad._spec = box(grad._local, spec, new_spec), new_spec


def _bucketable(spec, target) -> bool:
    return spec.placement == target.placement and all(
        a == b or (a.is_partial and a.op == "sum" and b.is_broadcast)
        for a, b in zip(spec.nd_sbp, target.nd_sbp, strict=True)
    )


def _drop_pending(ranks: tuple[int, ...]) -> None:
    """Ranks found out of step abort their backward: what it left pending is not flushed
    by the next one (one rank would reduce a bucket more than the others)."""
    _pending.clear()


shm.on_out_of_step(_drop_pending)


def flush() -> None:
    """Reduce every pending partial gradient, one flat all-reduce per bucket and hierarchy dim.

    Only the dims where the leaf is broadcast are reduced: a partial leaf keeps a partial grad.
    """
    grads = [
        (g, done) for g, done in ((r(), done) for r, done in _pending.values()) if g is not None
    ]
    _pending.clear()
    # One bucket sequence per (placement, hierarchy dim reduced, dtype, device): gradients
    # of other layouts along the dims kept (a tensor-parallel split) share the
    # data-parallel all-reduce, which sums each element with its replicas alone; and a
    # gradient partial along two dims (a LayerNorm's weights' under DP x TP) joins the
    # buckets of each, not buckets of its own (sums over distinct dims compose in any order).
    groups: dict = {}
    for g, done in grads:
        for h, (s, t) in enumerate(zip(g._spec.nd_sbp, done, strict=True)):
            if s != t:
                groups.setdefault((g._spec.placement, h, g.dtype, g._local.device), []).append(g)
    me = env.get_rank()
    for (placement, h, _, _), members in sorted(groups.items(), key=lambda kv: kv[0][1]):
        if me in placement:
            for bucket in _buckets(members):
                _all_reduce_bucket(bucket, placement.group_ranks(me, h))
    for g, done in grads:
        g._spec = g._spec._replace(nd_sbp=done)


def _buckets(members: list) -> list[list]:
    out, current, size = [], [], 0
    for g in members:
        nbytes = g._local.numel() * g._local.element_size()
        if current and size + nbytes > BUCKET_BYTES:
            out.append(current)
            current, size = [], 0
        current.append(g)
        size += nbytes
    if current:
        out.append(current)
    return out


def _all_reduce_bucket(bucket: list, ranks: tuple[int, ...]) -> None:
    flat = torch.cat([g._local.reshape(-1) for g in bucket])
    with stats.noted(BUCKETS, implicit=False, phase="backward"):
        comm.all_reduce(flat, "sum", ranks)
    offset = 0
    for g in bucket:
        n = g._local.numel()
        g._local = flat[offset : offset + n].view(g._local.shape)
        offset += n


def run_all(calls: Iterator) -> None:
    """Run a lazy map of calls in C (a loop over hundreds of parameters each step)."""
    deque(calls, maxlen=0)
