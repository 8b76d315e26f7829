"""List ops (`_foreach_*`, `_fused_adam_`, ...) used by torch.optim and clip_grad_norm_.

They act elementwise on lists of tensors, so index i of every tensor list is
aligned to the layout of the first list's i-th tensor (partial sums reduced),
and the one fused or foreach kernel runs on the local lists; a tensor the op
writes keeps its own layout (a partial one is written reduced, then made partial
again). Norms go through the norm rule per tensor.
"""

from __future__ import annotations

import functools
from itertools import repeat
from operator import attrgetter, is_

import torch

from sbp import comm, env
from sbp.boxing.executor import empty_local
from sbp.errors import PlacementError
from sbp.ops.arguments import LOCAL_STATE_OPS, flatten, scan
from sbp.ops.registry import rebox, register, register_list_ops
from sbp.ops.writes import assign, written
from sbp.placement import placement as Placement
from sbp.ranges import written_args
from sbp.signature import broadcast, partials_to_broadcast
from sbp.tensor import GlobalTensor

aten = torch.ops.aten
# Fused optimizers take their step counts as 0-dim local tensors, equal on every rank.
LOCAL_STATE_OPS.update(
    getattr(aten, name)
    for name in ("_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_")
    if hasattr(aten, name)
)
# GradScaler's found_inf and inv_scale are 0-dim local tensors too (see amp_unscale).
LOCAL_STATE_OPS.add(aten._amp_foreach_non_finite_check_and_unscale_)


def is_list_op(func) -> bool:
    """Ops whose first argument is a list of tensors, and which return nothing or lists (one
    result per entry): the `_foreach_*` and fused optimizer ops. Not `block_diag`,
    `pad_sequence`, `_chunk_cat`, whose one result mixes the entries (they take the
    fallback, as any op without a rule)."""
    args, returns = func._schema.arguments, func._schema.returns
    return (
        bool(args)
        and str(args[0].type).startswith("List[Tensor")
        and all(str(r.type).startswith("List[Tensor") for r in returns)
    )


@functools.cache
def _scalars_index(func) -> int | None:
    """Where `func` takes `Tensor scalars`: the number per list entry, as a 1-d tensor
    (`_foreach_addcdiv_.Tensor`, which a compiled Adam step calls with its step sizes)."""
    for i, a in enumerate(func._schema.arguments):
        if a.name == "scalars" and str(a.type) == "Tensor":
            return i
    return None


def list_rule(func, args, kwargs):
    numbers = None
    at = _scalars_index(func)
    if at is not None and len(args) > at and type(args[at]) is torch.Tensor:
        # A local tensor of numbers, as the Scalar[] overload takes Python numbers: values
        # every rank computes alike (torch's own step sizes), passed on as they are.
        numbers = args[at]
        args = (*args[:at], None, *args[at + 1 :])
    aligned = _aligned_locals(args, kwargs)
    if aligned is not None:  # the usual optimizer step: nothing to check or move
        local_args, placement, specs = aligned
        return _run(func, _with(local_args, at, numbers), kwargs, placement, specs)
    groups = placement_groups(func, args)
    if len(groups) > 1:
        return _per_placement(func, args, kwargs, groups, at, numbers)

    # mixed placements or local tensors: a named error; copied views taken again if stale
    scan(func, flatten(args, kwargs)[0])
    lists = [
        i
        for i, a in enumerate(args)
        if isinstance(a, (list, tuple)) and any(isinstance(t, GlobalTensor) for t in a)
    ]
    written_at = {i for i, _ in written_args(func)}
    first = args[lists[0]]
    targets = [partials_to_broadcast(t._spec.nd_sbp) for t in first]
    placement = first[0]._spec.placement
    local_args = list(args)
    write_back = []
    for li in lists:
        locals_ = []
        for i, t in enumerate(args[li]):
            if type(t) is GlobalTensor and t._spec.nd_sbp == targets[i]:
                locals_.append(t._local)  # already aligned (the usual case: one placement)
                continue
            if not isinstance(t, GlobalTensor):
                locals_.append(t)
                continue
            aligned = rebox(t, targets[i])
            if li in written_at and aligned is not t:
                write_back.append((t, aligned))
            locals_.append(aligned._local)
        local_args[li] = locals_
    for i, a in enumerate(args):
        if isinstance(a, GlobalTensor):
            local_args[i] = rebox(a, (broadcast,) * placement.ndim)._local
    local_kwargs = {
        k: rebox(v, (broadcast,) * placement.ndim)._local if isinstance(v, GlobalTensor) else v
        for k, v in kwargs.items()
    }
    specs = [t._spec._replace(nd_sbp=nd) for t, nd in zip(first, targets, strict=True)]
    out = _run(func, _with(local_args, at, numbers), local_kwargs, placement, specs)
    for t, aligned in write_back:  # (in t's own layout: in-place ops keep it)
        assign(t, aligned._local, aligned._spec)
    for li in written_at.intersection(lists):
        for t in args[li]:
            if type(t) is GlobalTensor:
                written(t)  # (a copied view passes the write on to its base)
    return out


def _with(args: list, at: int | None, numbers: torch.Tensor | None) -> list:
    """`args` with the local tensor of numbers put back at `at`."""
    if numbers is None:
        return args
    args = list(args)
    args[at] = numbers
    return args


def _aligned_locals(args, kwargs):
    """(local arguments, placement, specs of the first list) when every tensor argument is in
    a list of global tensors on one placement, laid out as the first list's at its index,
    with no partial sums; else None (the general path checks and moves).

    An optimizer step passes lists of hundreds of tensors, so the checks run as C loops
    (`map`) over attributes that a model's tensors mostly share as the same objects."""

    placement = specs = nds = None
    local_args = list(args)
    for li, a in enumerate(args):
        if type(a) is not list and type(a) is not tuple:
            if isinstance(a, torch.Tensor):
                return None
            continue
        if not a or type(a[0]) is not GlobalTensor:
            if any(isinstance(t, torch.Tensor) for t in a):
                return None
            continue
        if not all(map(is_, map(type, a), repeat(GlobalTensor))):
            return None
        if any(map(_COPY_OF, a)):  # copied views: read fresh, written through (general path)
            return None
        these = list(map(_SPEC, a))
        if specs is None:
            specs, placement = these, these[0].placement
            nds = list(map(_ND_SBP, specs))
            distinct = {id(nd): nd for nd in nds}.values()  # (hashing SBPs runs Python)
            if any(partials_to_broadcast(nd) is not nd for nd in distinct):
                return None
        elif len(these) != len(specs) or list(map(_ND_SBP, these)) != nds:
            return None
        if not _all_are(map(_PLACEMENT, these), placement):
            return None
        local_args[li] = list(map(_LOCAL, a))
    if specs is None or any(isinstance(v, torch.Tensor) for v in kwargs.values()):
        return None
    return local_args, placement, specs


_SPEC, _LOCAL, _COPY_OF = attrgetter("_spec"), attrgetter("_local"), attrgetter("_copy_of")
_ND_SBP, _PLACEMENT = attrgetter("nd_sbp"), attrgetter("placement")


def _all_are(objects, first) -> bool:
    """Every object is `first` or equal to it (checked by identity first, in C)."""
    objects = list(objects)
    return all(map(is_, objects, repeat(first))) or all(o == first for o in objects)


def _run(func, local_args, local_kwargs, placement, specs):
    """Run the list op on this rank's locals; its outputs (if any) laid out as `specs`."""

    inside = env.get_rank() in placement
    if inside:
        out = func(*local_args, **local_kwargs)
    if not func._schema.returns or len(func._schema.returns) == 0:
        return None
    if not inside:
        return [GlobalTensor(empty_local(s), s) for s in specs]
    return [GlobalTensor(o, s._replace(dtype=o.dtype)) for o, s in zip(out, specs, strict=True)]


@register(aten._foreach_norm.Scalar)
def foreach_norm(func, args, kwargs):
    """Each tensor's norm by the norm rule. Over several placements (a pipeline's stages,
    clip_grad_norm_ of all its parameters) every norm goes broadcast to the placement of all
    their ranks, where torch can stack them and every stage can read the total (one move
    per placement; OneFlow's clip_grad_norm_ gathers them on the first stage's)."""
    ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
    norms = [torch.linalg.vector_norm(t, ord_, dtype=dtype) for t in args[0]]
    groups = placement_groups(func, args)
    if len(groups) < 2:
        return norms
    ranks = sorted({r for p in groups for r in p.flat_ranks})
    every = Placement(next(iter(groups)).type, ranks)
    for at in groups.values():
        moved = torch.stack([norms[i] for i in at]).to_global(placement=every, sbp=broadcast)
        for i, n in zip(at, moved.unbind(0), strict=True):
            norms[i] = n
    return norms


def placement_groups(func, args: tuple) -> dict:
    """{placement: positions} of the first tensor list's global tensors (one key: one
    placement). A local tensor among global ones raises PlacementError naming `func`."""

    first = next((a for a in args if type(a) in (list, tuple) and a), ())
    groups: dict = {}
    for i, t in enumerate(first):
        if not isinstance(t, GlobalTensor):
            if isinstance(t, torch.Tensor) and groups:
                raise PlacementError(f"{func}: mixes global tensors with a local torch.Tensor")
            return groups
        groups.setdefault(t._spec.placement, []).append(i)
    return groups


def _per_placement(func, args: tuple, kwargs: dict, groups: dict, at=None, numbers=None):
    """The list op once per placement, on the entries of every list at that placement's
    positions, and of the local tensor of `numbers` (one per entry) at `at`; a lone global
    tensor argument (clip_grad_norm_'s scale, a 0-d broadcast) goes to each placement,
    broadcast."""

    n = next(len(a) for a in args if type(a) in (list, tuple) and a)
    many = len(func._schema.returns) > 1  # (lists of results: `_fused_adam`, functional)
    results: list | None = None

    def to(placement, a):
        if type(a) in (list, tuple) and len(a) == n:
            return [a[i] for i in positions]
        if isinstance(a, GlobalTensor) and a._spec.placement != placement:
            return a.to_global(placement=placement, sbp=(broadcast,) * placement.ndim)
        return a

    for placement, positions in groups.items():
        mine = [to(placement, a) for a in args]
        if numbers is not None:
            mine[at] = numbers[positions]
        out = func(*mine, **{k: to(placement, v) for k, v in kwargs.items()})
        if out is None:
            continue
        parts = out if many else (out,)
        results = results or [[None] * n for _ in parts]
        for whole, part in zip(results, parts, strict=True):
            for i, o in zip(positions, part, strict=True):
                whole[i] = o
    if results is None:
        return None
    return tuple(results) if many else results[0]


@register(aten._amp_foreach_non_finite_check_and_unscale_.default)
def amp_unscale(func, args, kwargs):
    """GradScaler's unscale: each rank unscales its local gradients in place (elementwise,
    so any layout) and notes an inf or NaN in `found_inf`, a local tensor (or a global one
    under implicit_replication). A rank sees only its part of a gradient that is split or
    partial, so then found_inf is max-reduced over the placement: every rank skips the same
    steps, as one process would."""

    names = ("self", "found_inf", "inv_scale")
    grads, found_inf, inv_scale = (*args, *(kwargs[n] for n in names[len(args) :]))
    if not all(type(g) is GlobalTensor for g in grads):  # (implicit_replication lets them in)
        raise PlacementError(
            f"{func}: a gradient is a local tensor; make it global first (g.to_global(...))"
        )
    placements = {g._spec.placement for g in grads}
    if len(placements) != 1:
        raise PlacementError(
            f"{func}: the gradients of one unscale must be on one placement "
            f"(got {len(placements)} placements); give each placement its own optimizer"
        )
    placement = placements.pop()
    if env.get_rank() not in placement:
        return None
    found, inv = (t._local if type(t) is GlobalTensor else t for t in (found_inf, inv_scale))
    func([g._local for g in grads], found, inv)
    whole = (broadcast,) * placement.ndim
    if any(g._spec.nd_sbp != whole for g in grads):
        comm.all_reduce(found, "max", placement.flat_ranks)
    return None


register_list_ops(is_list_op, list_rule)
