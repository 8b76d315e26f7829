"""Leaf gradients end in the leaf's sbp; partial sums are reduced in buckets after backward.

A broadcast parameter trained on a split batch receives a partial-sum
gradient. Reducing each one as it arrives costs one collective per parameter;
instead each leaf whose gradient is partial where the leaf is broadcast joins
a bucket, and when the backward pass ends one flat all-reduce per bucket makes
every such gradient whole. Every rank sees the same leaves in the same order
(SPMD), so buckets match across ranks. Other mismatches are boxed at once.

The data-parallel fast path computes gradients on plain local leaves and sums them
with a `sbp.data_parallel.reducer.Reducer`; the sums wait, plain, until `.grad` is read
(`take_waiting`, kept here: `GlobalTensor.grad` calls it). On one
rank nothing is summed: each gradient waits in its leaf's `.grad`, where autograd put it.
A `.grad` a parameter already holds gets the sum at once, as torch accumulates into it.
"""

from __future__ import annotations

import functools
import weakref
from collections import deque
from collections.abc import Iterable, Iterator
from itertools import repeat
from operator import attrgetter, is_
from typing import Any

import torch

from sbp import comm, env
from sbp.comm import shm, stats

BUCKET_BYTES = 25 * 2**20
BUCKETS = "gradient buckets"  # the cause traced collectives of the reduction name
WAITING_GRAD = attrgetter("_waiting_grad")  # a parameter's plain summed gradient, or None
# a parameter's (one-rank Reducer, local leaf) whose `.grad` is its gradient, or None
WAITING_IN = attrgetter("_waiting_in")
_pending: dict = {}  # id(grad) -> (weak reference, target nd_sbp), in arrival order
TORCH_GRAD = torch._C.TensorBase.grad  # torch's own `.grad`, under GlobalTensor's
# torch's C getters (`.grad`, `.requires_grad`) look up a subclass's __torch_function__ at
# every read, ~0.17 us on a GlobalTensor (whose is disabled); inside this they do not. For
# the loops over every parameter that run each step.
PLAIN_GETTERS = torch._C.DisableTorchFunctionSubclass


# The data-parallel fast paths alive (`sbp.data_parallel.call.DataParallel`): each computes its
# parameters' gradients in local leaves, and knows which (`local_leaves`).
LEAF_OWNERS: weakref.WeakSet = weakref.WeakSet()


def local_leaves(inputs: torch.Tensor | Iterable[torch.Tensor]) -> list:
    """`inputs` of a `backward(inputs=...)` with each fast-path parameter replaced by the
    local leaf its local graph accumulates into: the parameter itself is in no graph."""
    tensors = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
    for owner in list(LEAF_OWNERS):
        tensors = owner.local_leaves(tensors)
    return tensors


def leaf_grad_spec(p: torch.Tensor) -> Any:
    """The layout of a gradient taken at fast-path parameter `p`'s local leaf (by
    `torch.autograd.grad`): this rank's share of the logical gradient, a partial sum over
    the ranks splitting the batch; None where `p` has no local leaf."""
    for owner in list(LEAF_OWNERS):
        spec = owner.leaf_grad_spec(p)
        if spec is not None:
            return spec
    return None


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
    # One bucket sequence per (placement, dims reduced, dtype, device): gradients of other
    # layouts along the dims kept (a tensor-parallel split) share the data-parallel
    # all-reduce, which sums each element with its replicas alone.
    groups: dict = {}
    target: dict = {}
    for g, done in grads:
        dims = tuple(h for h, (s, t) in enumerate(zip(g._spec.nd_sbp, done, strict=True)) if s != t)
        key = (g._spec.placement, dims, g.dtype, g._local.device)
        groups.setdefault(key, []).append(g)
        target[id(g)] = done
    me = env.get_rank()
    for (placement, dims, _, _), members in groups.items():
        for bucket in _buckets(members):
            if me in placement:
                _all_reduce_bucket(bucket, [placement.group_ranks(me, h) for h in dims])
            for g in bucket:
                g._spec = g._spec._replace(nd_sbp=target[id(g)])


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


def _all_reduce_bucket(bucket: list, groups: list[tuple[int, ...]]) -> None:
    flat = torch.cat([g._local.reshape(-1) for g in bucket])
    with stats.noted(BUCKETS, implicit=False, phase="backward"):
        for ranks in groups:
            comm.all_reduce(flat, "sum", ranks)
    offset = 0
    for g in bucket:
        n = g._local.numel()
        g._local = flat[offset : offset + n].view(g._local.shape)
        offset += n


# ---------------------------------------------------------------- gradients not yet wrapped


def take_waiting(p: torch.Tensor) -> None:
    """Wrap the gradient waiting on global parameter `p` into its `.grad` (or add it to the
    one there): `GlobalTensor.grad` calls this when read.

    The fast path's reducer leaves each summed gradient, this rank's local part of it, in
    `p._waiting_grad` rather than in a new global tensor per parameter and backward. An
    optimizer step on locals takes it as it is (`local_grad`) and `zero_grad` drops it
    (`sbp.optim_step`), so a training step wraps no gradient at all: for mobilenet_v2,
    ~160 wrappers made, assigned and freed, ~8 us each on this project's CPU.

    On one rank the gradient may also wait in the `.grad` of the parameter's local leaf
    (`p._waiting_in`, see `sbp.data_parallel.reducer.Reducer.backward_started`): it is taken from there too."""
    grad = p._waiting_grad
    if p._waiting_in is not None:
        held = p._waiting_in[0].take(p._waiting_in[1])
        if held is not None:
            grad = held if grad is None else grad.add_(held)
    if grad is None:
        return
    object.__setattr__(p, "_waiting_grad", None)  # (bookkeeping: not a rebinding)
    current = TORCH_GRAD.__get__(p)
    if current is None:
        spec = p._spec if grad.dtype == p._spec.dtype else p._spec._replace(dtype=grad.dtype)
        TORCH_GRAD.__set__(p, type(p)(grad, spec))  # (a GlobalTensor: params are)
    else:
        current._local.add_(grad)


def local_grad(p: torch.Tensor) -> torch.Tensor | None:
    """The local tensor of global `p.grad`, without wrapping a gradient waiting plain on
    `p` (one waiting in a leaf is wrapped: the leaf is the optimizer's local then)."""
    if TORCH_GRAD.__get__(p) is None and p._waiting_in is None:
        return p._waiting_grad
    take_waiting(p)
    grad = TORCH_GRAD.__get__(p)
    return None if grad is None else grad._local


def run_all(calls: Iterator) -> None:
    """Run a lazy map of calls in C (a loop over hundreds of parameters each step)."""
    deque(calls, maxlen=0)


def drop_waiting(params: list) -> bool:
    """`zero_grad` of the waiting gradients of `params` (plain tensors have none); then, has
    none of `params` a `.grad` left? A `zero_grad(set_to_none=True)` then has nothing more
    to do: torch's would read every `.grad` in Python."""
    waiting = list(map(getattr, params, repeat("_waiting_grad"), repeat(None)))
    if not all(map(is_, waiting, repeat(None))):
        for p, grad in zip(params, waiting, strict=True):
            if grad is not None:
                object.__setattr__(p, "_waiting_grad", None)
    claims = list(map(getattr, params, repeat("_waiting_in"), repeat(None)))
    first = claims[0][0] if claims and claims[0] is not None else None
    if first is not None and first.holds_all(claims):
        first.drop(claims)  # (the usual: one reducer's claims, all of them)
    elif not all(map(is_, claims, repeat(None))):
        held: dict = {}  # {one-rank Reducer: its claims among params}
        for claim in filter(None, claims):
            held.setdefault(claim[0], []).append(claim)
        for reducer, own in held.items():
            reducer.drop(own)
    with PLAIN_GETTERS():
        return all(map(is_, map(TORCH_GRAD.__get__, params), repeat(None)))
