"""An op's arguments: flattened, scanned, and the plain tensors among them.

`flatten` / `unflatten` take an aten call's arguments apart and back (the hot path of
every op: torch's pytree costs tens of microseconds). `scan` finds the global tensors,
checks their placements and builds the decision-cache key. It is also where a plain
(local) tensor meeting global ones is judged, the one policy for which may join them:
an index of `LOCAL_INDEX_OPS`, a 0-dim constant `trusted_constant` vouches for, a
backward formula's buffer (`formula_buffer`), and anything inside `implicit_replication()`
or a `global_mode` (`sbp.local_constants`, the user's side) are taken as the op's
broadcast value (`replicate_locals`: checked to be the same on every rank where asked);
anything else is a `PlacementError` naming the op.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
from collections.abc import Iterator
from typing import Any

import torch

from sbp import comm, env
from sbp.boxing.executor import empty_local, local_device
from sbp.errors import PlacementError
from sbp.layout import GlobalSpec
from sbp.ops.writes import fresh
from sbp.placement import placement as Placement
from sbp.ranges import written_args
from sbp.signature import broadcast
from sbp.tensor import GlobalTensor

PLAIN = ("plain",)  # the tree of positional-only calls with no list arguments


def flatten(args: tuple, kwargs: dict) -> tuple[list, tuple]:
    """Leaves of an aten call's arguments (lists nest one level at most) and how to rebuild them.

    torch's pytree costs tens of microseconds per call; this is the hot path of every op.
    """
    leaves: list = []
    shape = []
    for a in args:
        if type(a) is list or type(a) is tuple:
            shape.append((type(a), len(a)))
            leaves.extend(a)
        else:
            shape.append(None)
            leaves.append(a)
    if kwargs:
        leaves.extend(kwargs.values())
    elif not any(shape):
        return leaves, PLAIN
    return leaves, (tuple(shape), tuple(kwargs))


def unflatten(leaves: list, spec: tuple) -> tuple[tuple, dict]:
    if spec is PLAIN:
        return tuple(leaves), {}
    shape, keys = spec
    args, i = [], 0
    for entry in shape:
        if entry is None:
            args.append(leaves[i])
            i += 1
        else:
            kind, n = entry
            args.append(kind(leaves[i : i + n]))
            i += n
    return tuple(args), dict(zip(keys, leaves[i:], strict=True))


# The output tree of an op that returns nothing (`aten._linalg_check_errors`): its local
# call returns None, its global one too.
NO_RETURNS = (tuple, 0)


def flatten_outputs(out: Any, spec: Any = None) -> tuple[list, Any]:
    """The output leaves of a local call, and their tree (`spec`: the op's, where known)."""
    if spec == NO_RETURNS:
        return [], spec
    if type(out) is list or type(out) is tuple:
        return list(out), (type(out), len(out))
    return [out], None


def unflatten_outputs(leaves: list, spec: Any) -> Any:
    if spec == NO_RETURNS:
        return None
    return leaves[0] if spec is None else spec[0](leaves)


# Ops whose local integer tensors are constants (indices), not data to be placed.
LOCAL_INDEX_OPS: set = set()


# Ops whose 0-dim local tensors are state every rank keeps equal (the step counts of a
# fused optimizer), not data to be placed.
LOCAL_STATE_OPS: set = set()


# The step of each optimizer with global parameters, as (id, code) of the frame that runs
# it (`note_optimizer_step`): while it is on the stack, its 0-dim local tensors (ASGD's eta,
# the zero Rprop writes through a mask) are state every rank computes alike. A pair and
# not the frame, so nothing is kept alive; a finished step's frame is off the stack, and
# an id a later frame of the same code reuses is again an optimizer step.
_optimizer_steps: dict[int, tuple[int, Any]] = {}


def note_optimizer_step(optimizer_id: int, frame) -> None:
    """Called as an optimizer's step starts, with the frame that runs the step."""
    _optimizer_steps[optimizer_id] = (id(frame), frame.f_code)


def _inside_optimizer_step() -> bool:
    if not _optimizer_steps:
        return False
    running = set(_optimizer_steps.values())
    frame = sys._getframe(1)
    while frame is not None:
        if (id(frame), frame.f_code) in running:
            return True
        frame = frame.f_back
    return False


# Ops whose Python-number operands torch's C++ wraps into 0-dim tensors before they reach
# sbp (`torch.where(c, x, 0.0)`, and the `where` inside `logdet`): a 0-dim local tensor
# there is a number the caller wrote, as in `x + 0.5`.
NUMBER_OPERAND_OPS = frozenset({torch.ops.aten.where.self})


def trusted_constant(func) -> bool:
    """May a 0-dim local tensor join global ones in `func`? In torch's backward formulas
    (0-dim zeros in clamp's, say), in LOCAL_STATE_OPS and NUMBER_OPERAND_OPS and inside
    an optimizer's step."""
    return (
        torch._C._current_graph_task_id() >= 0
        or func.overloadpacket in LOCAL_STATE_OPS
        or func in NUMBER_OPERAND_OPS
        or _inside_optimizer_step()
    )


# Ops into which torch's backward formulas put a gradient together with a local tensor
# they make from shapes alone: a buffer of the logical shape that a gradient is scattered
# or filled into (zeros, in max.dim's backward in torch 2.11; trace's flat zeros and
# diagonal indices), or ones joined to the input (prod's exclusive cumulative products), or
# zeros written where `y[idx] = v` wrote (index_put's backward).
FORMULA_BUFFER_OPS = frozenset(
    {
        torch.ops.aten.scatter,
        torch.ops.aten.index_fill,
        torch.ops.aten.cat,
        torch.ops.aten.stack,  # (unbind's backward: zeros for the unused parts)
        torch.ops.aten.index_put,
        # (the backward of slice_scatter and kin: zeros where src was)
        torch.ops.aten.slice_scatter,
        torch.ops.aten.select_scatter,
        torch.ops.aten.diagonal_scatter,
    }
)


def formula_buffer(func, a: torch.Tensor) -> bool:
    """Is the local tensor `a` the buffer a backward formula made (see FORMULA_BUFFER_OPS)?
    Every rank makes it alike, so it joins the global tensors as their broadcast value."""
    return (
        func.overloadpacket in FORMULA_BUFFER_OPS
        and not a.requires_grad
        and torch._C._current_graph_task_id() >= 0
    )


def scan(func, flat: list, tree: tuple = PLAIN) -> tuple[tuple, list[int]]:
    """One pass over the arguments: check placements, find the global tensors, and build the
    decision-cache key (everything but floats and tensor values, so per-step scalars such as
    a learning rate never miss the cache). Mixing global and local tensors, or placements, is
    an error naming the op. The key holds the arguments' `tree` (`sum(x, [0], True)` and
    `sum(x, [0, 1])` flatten alike) and tells booleans from the integers equal to them."""
    GT = GlobalTensor
    placement = None
    key: list = [func, tree]
    gpos: list[int] = []
    implicit: list[int] = []  # local tensors taken as broadcast under implicit_replication()
    for i, a in enumerate(flat):
        if isinstance(a, GT):
            if a._copy_of is not None:  # (its base written since? taken again)
                fresh(a)
            spec = a._spec
            if placement is None:
                placement = spec.placement
            elif spec.placement is not placement and spec.placement != placement:
                raise PlacementError(
                    f"{func}: inputs are on different placements: {placement!r} and "
                    f"{spec.placement!r}"
                )
            gpos.append(i)
            key.append(spec)
            if a.requires_grad:  # (decisions price the gradient's conversions: `_decide`)
                key.append(True)
        elif isinstance(a, torch.Tensor):
            # A 0-dim local tensor too: its value may differ per rank (rank 0 holds 2.0,
            # rank 1 3.0), so taking it as broadcast would give silently different results.
            # Python scalars are the values every rank is trusted to agree on, and so are
            # the 0-dim constants of torch's backward formulas (zeros in clamp's, say).
            if not (func in LOCAL_INDEX_OPS and not a.is_floating_point()) and not (
                a.dim() == 0 and not a.requires_grad and trusted_constant(func)
            ):
                # sbp.global_mode / implicit_replication, or a backward formula's buffer
                if replicating() or formula_buffer(func, a):
                    implicit.append(i)
                    key.append(None)
                    continue
                if i == 0 and _writes_first(func):
                    raise PlacementError(_written_local_message(func, a))
                raise PlacementError(
                    f"{func}: mixes global tensors with a local torch.Tensor of shape "
                    f"{tuple(a.shape)}; make it global first (x.to_global(placement, sbp)), "
                    "or pass a Python number (t.item()) for a 0-dim constant; a tensor that "
                    "model code makes itself (torch.empty, arange, torchvision's stochastic "
                    "depth) is global under `with sbp.global_mode(placement):`"
                )
            key.append(("t", tuple(a.shape), a.dtype, scalar_class(a)))
        elif type(a) is float:
            # (scalar_class's test inline: every float argument of every op comes here)
            key.append(float if a and a - a == 0 else (float, scalar_class(a)))
        elif type(a) is bool:
            key.append((bool, a))
        else:
            key.append(a)
    if implicit:
        replicate_locals(func, flat, implicit, key, gpos, placement)
    return tuple(key), gpos


def _writes_first(func) -> bool:
    """Does `func` write its first argument (`copy_`, `add_`, an `out=` op's self)?"""
    return any(i == 0 for i, _ in written_args(func))


def _written_local_message(func, a: torch.Tensor) -> str:
    """The local tensor is the one written, global values written into it: most often a
    plain model loading a global model's state dict, whose own parameter it is."""
    return (
        f"{func}: writes a global tensor into a local torch.Tensor of shape {tuple(a.shape)} "
        "(the tensor written is the local one: a plain model's parameter where "
        "plain_model.load_state_dict(global_model.state_dict()) loads it); make the model "
        "global first (model.to_global(placement, sbp), then load_state_dict), or load plain "
        "values (sbp.checkpoint.full_state_dict(global_model), or g.full_tensor() for one "
        "tensor)"
    )


def scalar_class(v: Any) -> str | None:
    """ "zero" or "not finite" for a scalar (a Python number, or a 0-dim CPU tensor of floats:
    a wrapped number, read without a device sync), else None. Rules may depend on it (a
    partial sum scaled by it stays partial only where it is finite, and nonzero to divide
    by), so the decision cache keys on it."""
    if isinstance(v, torch.Tensor):
        if v.dim() or v.device.type != "cpu" or not (v.is_floating_point() or v.is_complex()):
            return None
        v = v.item()
    if v - v != 0:
        return "not finite"
    return "zero" if v == 0 else None


# ---------------------------------------------------------------- implicit replication

_replicating: list[bool] = []  # a stack: one entry per active implicit_replication


# The data-parallel fast path's local runs (sbp.nn.fast_path), entered through
# `sbp.local_constants.suspended`: nothing is replicated inside.
SUSPENDED: list[bool] = []


def replicating() -> bool:
    """Is an `implicit_replication()` active? (read by the dispatcher's argument scan)"""
    return bool(_replicating) and not SUSPENDED


def _checking() -> bool:
    return bool(_replicating) and _replicating[-1]


# ---------------------------------------------------------------- the cross-rank check


def value_hash(t: torch.Tensor) -> str:
    """A cheap fingerprint of a local value, equal across processes for equal values."""
    data = t.detach().to("cpu").contiguous()
    h = hashlib.blake2b(digest_size=8)
    h.update(repr((tuple(data.shape), data.dtype)).encode())
    h.update(data.view(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return h.hexdigest()


def check_same_on_ranks(t: torch.Tensor, P: Placement, what: str) -> None:
    """Raise `MetaMismatchError` on every rank of `P` if `t` differs between them."""
    if env.get_rank() in P:
        comm.exchange({"local value hash": value_hash(t)}, tuple(P.flat_ranks), what=what)


@contextlib.contextmanager
def replicated(check: bool) -> Iterator[None]:
    """Inside, local tensors meeting global ones are replicated (`check`: compared first)."""
    _replicating.append(check)
    try:
        yield
    finally:
        _replicating.pop()


def replicate_locals(func, flat: list, positions: list[int], key: list, gpos: list[int], P) -> None:
    """In place: the local tensors at `positions` of `flat` become broadcast global tensors on
    `P`, with their specs in the decision key and their positions among the global ones."""
    if P is None:
        raise PlacementError(f"{func}: implicit_replication needs a global input to place on")
    first = len(key) - len(flat)  # (the key holds one entry per argument, after its head)
    for i in positions:
        a = flat[i]
        if a.requires_grad:
            raise PlacementError(
                f"{func}: a local tensor of shape {tuple(a.shape)} that requires grad cannot be "
                "replicated implicitly (its gradient would be lost); make it global first"
            )
        if _checking():
            check_same_on_ranks(a, P, f"the local tensor argument {i} of {func}")
        flat[i] = as_broadcast(a, P)
        key[first + i] = flat[i]._spec
    gpos[:] = sorted([*gpos, *positions])


def as_broadcast(local: torch.Tensor, P: Placement):
    """`local`, a value every rank of `P` holds alike, as a broadcast global tensor on `P`
    (ranks outside `P` hold metadata only)."""
    spec = GlobalSpec(P, (broadcast,) * P.ndim, tuple(local.shape), local.dtype)
    inside = env.get_rank() in P
    return GlobalTensor(local.to(local_device(P.type)) if inside else empty_local(spec), spec)
