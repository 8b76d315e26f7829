"""Integer ranges of global tensors, and the writes through global tensors that end them.

`to_global` learns the logical range of a small integer tensor from its metadata exchange
(labels, token ids): a loss can then see that no label is `ignore_index` without a
collective. A write through any global tensor on a storage forgets it, on every rank
alike (SPMD); the count of such writes per storage also tells copied views and kept
conversions (`sbp.ops.writes`, `sbp.ops.converted`) that what they hold is stale.
Nothing here imports `sbp.tensor`: the type and the rules both build on it.
"""

from __future__ import annotations

from typing import Any

import torch

from sbp import env
from sbp.errors import MetaMismatchError

BOUNDED_NUMEL = 2**20  # integer tensors up to this size report their range (labels, token ids)


def local_bounds(x: torch.Tensor) -> list[int]:
    """[min, max] of a small nonempty integer tensor, else []: with every rank's, the logical
    tensor's range is known, so a loss can see that no label is `ignore_index` without a
    collective (see `known_range`).

    CPU tensors only: reading a GPU tensor's range waits for the GPU (a host sync every
    batch, which stops the host queueing work ahead). There the loss all-reduces its
    divisor instead, which a GPU backend queues without waiting."""
    if x.device.type == "cpu" and x.dtype in BOUNDED_DTYPES and 0 < x.numel() <= BOUNDED_NUMEL:
        lo, hi = torch.aminmax(x)
        return [int(lo), int(hi)]
    return []


BOUNDED_DTYPES = {torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64}


def known_range(g: Any) -> tuple[int, int] | None:
    """The logical tensor's (min, max), when `to_global` learnt it and no rank wrote it since.

    Writes through global tensors run on every rank (SPMD) and forget the range there
    (`forget_range`), so every rank decides alike. A rank's local tensor written on its own
    (its version moved) is an error: the other ranks cannot know."""
    recorded = g.__dict__.get("_bounds")
    if recorded is None:
        return None
    lo, hi, local, version, writes = recorded
    if g._local is not local or global_writes(local) != writes:
        return None  # replaced, or written through another global tensor on its storage
    if local._version != version:
        raise MetaMismatchError(
            f"the local tensor of a global {g.dtype} tensor was written on rank "
            f"{env.get_rank()} alone after to_global; write through the global tensor, or "
            "make the new local data global again (to_global)"
        )
    return lo, hi


def forget_range(g: Any) -> None:
    """`g` is written on every rank. Global tensors sharing its storage (`g.detach()`,
    `g.data`, views) hold ranges too, and copied views of them must be taken again: a
    count per storage tells them (`global_writes`)."""
    g.__dict__.pop("_bounds", None)
    if g.dtype in BOUNDED_DTYPES or COPIED_VIEWS[0]:
        key = _storage_key(g._local)
        _global_writes[key] = _global_writes.get(key, 0) + 1


def global_writes(local: torch.Tensor) -> int:
    """Writes through global tensors into `local`'s storage so far (counted for integer
    tensors, and for every tensor once a copied view was made or a conversion kept:
    `COPIED_VIEWS`)."""
    return _global_writes.get(_storage_key(local), 0)


# writes through global tensors per storage of integer local tensors (the ones with ranges),
# and of every local tensor once sbp made a copied view (sbp.ops.writes.CopyOf) or kept a
# conversion for reuse (sbp.ops.converted)
_global_writes: dict[int, int] = {}
COPIED_VIEWS = [False]


def _storage_key(local: torch.Tensor) -> int:
    return local.untyped_storage()._cdata


def learn_range(g: Any, logical: torch.Tensor) -> None:
    """`logical` is `g`'s logical value, the same on every rank (`sbp.tensor`'s checked
    data): its range is then known alike everywhere, as `to_global`'s is."""
    bounds = local_bounds(logical)
    if bounds:
        record_range(g, (bounds[0], bounds[1]))


def record_range(g: Any, bounds: tuple[int, int]) -> None:
    local = g._local
    g._bounds = (*bounds, local, local._version, global_writes(local))


_mutable: dict = {}


def written_args(func) -> tuple[tuple[int, str], ...]:
    """(position, name) of each argument the aten op writes (cached: this runs on every op)."""
    w = _mutable.get(func)
    if w is None:
        w = _mutable[func] = tuple(
            (i, a.name)
            for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
    return w
