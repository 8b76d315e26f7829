"""Metadata exchange: ranks agree on a tensor's description before any data moves.

The common case costs one small all-gather of a fixed-size int64 row per rank:
a hash of the description plus a few integers (local shape, say). Only when the
hashes differ do ranks gather the full descriptions, and then every rank raises
the same `MetaMismatchError` naming what differs, instead of entering a
mismatched collective and hanging.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from sbp.comm import collectives
from sbp.comm.groups import get_group, group_order
from sbp.errors import MetaMismatchError

MAX_INTS = 61  # a row of 64 int64: the shapes and ranges of a nest of a few tensors


def stable_hash(obj: object) -> int:
    """A hash of `repr(obj)` that is equal across processes (unlike `hash`)."""
    return int.from_bytes(hashlib.blake2b(repr(obj).encode(), digest_size=7).digest(), "little")


def gather_objects(obj: object, ranks: tuple[int, ...]) -> list[object]:
    """Every rank's `obj` (small, picklable) in the order of `ranks`; a lost peer is
    `CommTimeoutError`. Not fingerprinted (see `fingerprint`)."""
    if len(ranks) == 1:
        return [obj]
    out: list[object] = [None] * len(ranks)
    with collectives.guarded("all_gather_object", ranks):
        dist.all_gather_object(out, obj, group=get_group(ranks))
    order = group_order(ranks)
    return out if order is None else [out[j] for j in order]


def describe_mismatch(descriptions: Sequence[Mapping], ranks: Sequence[int], what: str) -> str:
    keys = list(descriptions[0])
    for d in descriptions[1:]:
        keys += [k for k in d if k not in keys]
    parts = []
    for k in keys:
        values = [d.get(k) for d in descriptions]
        if any(v != values[0] for v in values):
            per_rank = ", ".join(f"rank {r}: {v!r}" for r, v in zip(ranks, values, strict=True))
            parts.append(f"{k} differs ({per_rank})")
    return f"ranks disagree on {what}: " + "; ".join(parts or ["(values differ)"])


def exchange(
    description: Mapping,
    ranks: tuple[int, ...],
    ints: Sequence[int] = (),
    what: str = "a tensor",
    error: BaseException | None = None,
) -> list[tuple[int, ...]]:
    """Check every rank of `ranks` passed an equal `description`; return every rank's `ints`.

    Raises `MetaMismatchError` on every rank if the descriptions differ. A rank that
    found its own input bad passes that `error`: every rank then raises it (same type,
    message naming the rank), so no rank is left waiting in a later collective.
    """
    if len(ranks) == 1:
        if error is not None:
            raise error
        return [tuple(ints)]
    fits = len(ints) <= MAX_INTS
    header = [
        stable_hash(sorted(description.items(), key=lambda kv: kv[0])),
        len(ints) if fits else -1,
        int(error is not None),
    ]
    body = list(ints) if fits else []
    row = torch.tensor([header + body + [0] * (MAX_INTS - len(body))], dtype=torch.int64)
    table = torch.empty(len(ranks), 3 + MAX_INTS, dtype=torch.int64)
    collectives.all_gather(table, row, ranks)
    rows = table.tolist()  # (one conversion: reading the table element by element is slow)
    if any(r[2] for r in rows):
        errors = gather_objects(None if error is None else (type(error), str(error)), ranks)
        if error is not None:
            raise error
        rank, (cls, message) = next((r, e) for r, e in zip(ranks, errors, strict=True) if e)
        raise cls(f"on rank {rank}: {message}")
    if any(r[0] != rows[0][0] for r in rows):
        descriptions = gather_objects(dict(description), ranks)
        raise MetaMismatchError(describe_mismatch(descriptions, ranks, what))
    if any(r[1] < 0 for r in rows):
        return [tuple(x) for x in gather_objects(tuple(ints), ranks)]
    return [tuple(r[3 : 3 + r[1]]) for r in rows]
