"""Runs a boxing `Plan` on this rank's local tensor.

Every rank of the source and target placements calls `execute` with the same
plan (SPMD); ranks outside a step's placement skip it. Each rank derives what
it sends and receives from the pure plan, so ranks never negotiate sizes. Packing,
unpacking and reducing go through `sbp.kernels`, which picks raw CUDA kernels for CUDA
tensors and torch ops otherwise (`sbp.kernels.launcher_for`). The input is never modified.
"""

from __future__ import annotations

import math

import torch

from sbp import comm, env, kernels
from sbp.boxing.planner import Plan, Step
from sbp.layout import GlobalSpec, balanced_range, balanced_sizes, elements_per_index


def local_device(placement_type: str) -> torch.device:
    """The device of this rank's local tensors on a placement of `placement_type`."""
    if placement_type == "cuda":
        if not torch.cuda.is_available():
            from sbp.errors import DeviceMismatchError

            raise DeviceMismatchError(
                "the placement type is 'cuda' but this process sees no GPU "
                "(torch.cuda.is_available() is False); use sbp.placement('cpu', ...)"
            )
        return torch.device("cuda", env.get_local_rank())
    if placement_type != "cpu":
        from sbp.errors import InputValueError

        raise InputValueError(
            f"device type must be 'cpu' or 'cuda', got {placement_type!r} (as sbp.placement's)"
        )
    return torch.device("cpu")


def empty_local(spec: GlobalSpec) -> torch.Tensor:
    """What a rank outside `spec`'s placement holds: nothing, on the right device and dtype."""
    return torch.empty(0, dtype=spec.dtype, device=local_device(spec.placement.type))


def execute(plan: Plan, local: torch.Tensor) -> torch.Tensor:
    """Run `plan` on this rank's `local` tensor of `plan.src`; return the local tensor of `plan.dst`."""
    rank = env.get_rank()
    x, owned = local, False
    for step in plan.steps:
        if step.view:
            if rank in step.after.placement:
                x = x.reshape(step.after.local_shape(rank))
        elif step.hdim is None:
            x, owned = _transfer(step, x, rank), True
        elif rank in step.before.placement:
            x, owned = _group_step(step, x, rank, owned)
    if rank not in plan.dst.placement:
        return empty_local(plan.dst)
    if not plan.steps and rank in plan.src.placement:
        return local
    return x


def _group_step(step: Step, x: torch.Tensor, rank: int, owned: bool) -> tuple[torch.Tensor, bool]:
    h = step.hdim
    before, after = step.before, step.after
    a, b = before.nd_sbp[h], after.nd_sbp[h]
    group = before.placement.group_ranks(rank, h)
    n, me = len(group), group.index(rank)
    if n == 1:  # one rank on this dim: every sbp is the same local tensor
        return x, owned
    if a.is_split and b.is_broadcast:
        return _all_gather(
            x, a.dim, [before.local_shape(r) for r in group], after, rank, group
        ), True
    if a.is_split and b.is_split:
        shapes = [before.local_shape(r) for r in group]
        return _split_to_split(x, a.dim, b.dim, shapes, after, rank, group, me), True
    if a.is_partial and b.is_broadcast:
        y = x.contiguous() if owned else x.clone(memory_format=torch.contiguous_format)
        return (comm.all_reduce(y, a.op, group) if y.numel() else y), True
    if a.is_partial and b.is_split:
        return _partial_to_split(x, a.op, b.dim, group, me), True
    if a.is_broadcast and b.is_split:
        start, stop = balanced_range(x.shape[b.dim], n, me)
        return x.narrow(b.dim, start, stop - start).contiguous(), owned
    if a.is_broadcast and b.is_partial:
        if b.op != "sum" or me == 0:
            return x, owned
        return torch.zeros_like(x), True
    if a.is_split and b.is_partial:
        out = x.new_full(after.local_shape(rank), kernels.fill_value(x.dtype, b.op))
        start, _ = balanced_range(out.shape[a.dim], n, me)
        out.narrow(a.dim, start, x.shape[a.dim]).copy_(x)
        return out, True
    raise AssertionError(f"no group step {a} -> {b}")  # the planner never emits one


def _all_gather(x, dim, shapes, after, rank, group) -> torch.Tensor:
    out = x.new_empty(after.local_shape(rank))
    sizes = [s[dim] for s in shapes]
    pad = max(sizes)
    if pad * elements_per_index(out.shape, dim) == 0:
        return out
    leading = all(s == 1 for s in x.shape[:dim])
    if len(set(sizes)) == 1 and leading:
        comm.all_gather(out.view(-1), x.contiguous().view(-1), group)
        return out
    packed = kernels.pack_chunks(x, dim, [x.shape[dim]], pad_to=pad)
    buf = kernels.staging(len(group) * packed.numel(), x, "recv")
    comm.all_gather(buf, packed, group)
    return kernels.unpack_chunks(buf, shapes, dim, out, stride=packed.numel())


def _split_to_split(x, src_dim, dst_dim, shapes, after, rank, group, me) -> torch.Tensor:
    n = len(group)
    parts = balanced_sizes(x.shape[dst_dim], n)
    send = kernels.pack_chunks(x, dst_dim, parts)
    send_splits = [p * elements_per_index(x.shape, dst_dim) for p in parts]
    recv_shapes = [_with(s, dst_dim, parts[me]) for s in shapes]
    recv_splits = [math.prod(s) for s in recv_shapes]
    out = x.new_empty(after.local_shape(rank))
    if sum(math.prod(s) for s in shapes) == 0:
        return out
    if all(s == 1 for s in out.shape[:src_dim]):  # chunks arrive already in out's layout
        comm.all_to_all(out.view(-1), send, recv_splits, send_splits, group)
        return out
    recv = kernels.staging(sum(recv_splits), x, "recv")
    comm.all_to_all(recv, send, recv_splits, send_splits, group)
    return kernels.unpack_chunks(recv, recv_shapes, src_dim, out)


def _partial_to_split(x, op, dim, group, me) -> torch.Tensor:
    """Reduce-scatter as an all-to-all of chunks plus a local reduce: even or uneven, and on
    gloo faster than its reduce-scatter (see NOTES.md)."""
    n = len(group)
    parts = balanced_sizes(x.shape[dim], n)
    mine = _with(x.shape, dim, parts[me])
    if x.numel() == 0:
        return x.new_empty(mine)
    send = kernels.pack_chunks(x, dim, parts)
    send_splits = [p * elements_per_index(x.shape, dim) for p in parts]
    chunk = math.prod(mine)
    recv = kernels.staging(n * chunk, x, "recv")
    comm.all_to_all(recv, send, [chunk] * n, send_splits, group)
    return kernels.reduce_chunks(
        [recv[i * chunk : (i + 1) * chunk].view(mine) for i in range(n)], op
    )


def _transfer(step: Step, x: torch.Tensor, rank: int) -> torch.Tensor:
    src, dst = step.before, step.after
    same_type = src.placement.type == dst.placement.type
    wire = local_device(src.placement.type) if same_type else torch.device("cpu")
    target = local_device(dst.placement.type)
    out = (
        x.new_empty(dst.local_shape(rank), dtype=dst.dtype, device=target)
        if rank in dst.placement
        else None
    )
    sends, recvs, places = [], [], []
    for t in step.transfers:
        if t.src == rank:
            piece = x[_slices(t.box, src.ranges(rank))]
            if t.dst == rank:
                out[_slices(t.box, dst.ranges(rank))].copy_(piece)
            else:
                sends.append((piece.to(wire).contiguous(), t.dst))
        elif t.dst == rank:
            buf = x.new_empty([hi - lo for lo, hi in t.box], dtype=dst.dtype, device=wire)
            recvs.append((buf, t.src))
            places.append(_slices(t.box, dst.ranges(rank)))
    comm.exchange_p2p(sends, recvs)
    for (buf, _), where in zip(recvs, places, strict=True):
        out[where].copy_(buf)
    return out if out is not None else empty_local(dst)


def _slices(box, ranges) -> tuple[slice, ...]:
    """`box` (logical coordinates) as slices into a local tensor that starts at `ranges`."""
    return tuple(slice(lo - r0, hi - r0) for (lo, hi), (r0, _) in zip(box, ranges, strict=True))


def _with(shape, dim, size) -> tuple[int, ...]:
    return tuple(size if i == dim else s for i, s in enumerate(shape))
