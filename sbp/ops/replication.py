"""Implicit replication: which plain tensors may join global ones in an op, and how.

A plain (local) tensor that meets global tensors in an op is a `PlacementError`, except
where the dispatcher's argument scan (`sbp.ops.registry.scan`) finds it may be taken as
the op's broadcast value: inside `implicit_replication()` or a `global_mode` (user code,
`sbp.local_constants`), and for the ops' own constants (`registry.trusted_constant`,
`registry.formula_buffer`). Then it becomes a broadcast global tensor here, checked to be
the same on every rank where asked (`check=True`).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import torch

from sbp import comm, env
from sbp.boxing.executor import empty_local, local_device
from sbp.errors import PlacementError
from sbp.layout import GlobalSpec
from sbp.placement import placement as Placement
from sbp.signature import broadcast
from sbp.tensor import GlobalTensor

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
