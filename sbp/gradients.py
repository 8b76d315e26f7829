"""Leaf gradients end in the leaf's sbp; partial sums are reduced in buckets after backward.

A broadcast parameter trained on a split batch receives a partial-sum
gradient. Reducing each one as it arrives costs one collective per parameter;
instead each leaf whose gradient is partial where the leaf is broadcast joins
a bucket, and when the backward pass ends one flat all-reduce per bucket makes
every such gradient whole. Every rank sees the same leaves in the same order
(SPMD), so buckets match across ranks. Other mismatches are boxed at once.
"""

from __future__ import annotations

import weakref

import torch

from sbp import comm, env

BUCKET_BYTES = 25 * 2**20
_pending: list = []


def post_accumulate_hook(leaf: torch.Tensor) -> None:
    """Runs after autograd accumulated `leaf.grad` (see `GlobalTensor.requires_grad_`)."""
    from sbp.tensor import GlobalTensor, box

    grad = leaf.grad
    if not isinstance(grad, GlobalTensor):
        return
    target = leaf._spec._replace(dtype=grad.dtype)
    if grad._spec == target:
        return
    if _bucketable(grad._spec, target):
        if not _pending:
            torch.autograd.Variable._execution_engine.queue_callback(flush)
        if all(ref() is not grad for ref, _ in _pending):
            _pending.append((weakref.ref(grad), target.nd_sbp))
        return
    grad._local, grad._spec = box(grad._local, grad._spec, target), target


def _bucketable(spec, target) -> bool:
    return spec.placement == target.placement and all(
        a == b or (a.is_partial and a.op == "sum" and b.is_broadcast)
        for a, b in zip(spec.nd_sbp, target.nd_sbp, strict=True)
    )


def flush() -> None:
    """Reduce every pending partial gradient, one flat all-reduce per bucket and hierarchy dim.

    Only the dims where the leaf is broadcast are reduced: a partial leaf keeps a partial grad.
    """
    grads = [(g, done) for g, done in ((ref(), done) for ref, done in _pending) if g is not None]
    _pending.clear()
    groups: dict = {}
    for g, done in grads:
        key = (g._spec.placement, g._spec.nd_sbp, done, g.dtype, g._local.device)
        groups.setdefault(key, []).append(g)
    me = env.get_rank()
    for (placement, nd, done, _, _), members in groups.items():
        dims = [h for h, (s, t) in enumerate(zip(nd, done, strict=True)) if s != t]
        for bucket in _buckets(members):
            if me in placement:
                _all_reduce_bucket(bucket, [placement.group_ranks(me, h) for h in dims])
            for g in bucket:
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


def _all_reduce_bucket(bucket: list, groups: list[tuple[int, ...]]) -> None:
    flat = torch.cat([g._local.reshape(-1) for g in bucket])
    for ranks in groups:
        comm.all_reduce(flat, "sum", ranks)
    offset = 0
    for g in bucket:
        n = g._local.numel()
        g._local = flat[offset : offset + n].view(g._local.shape)
        offset += n
