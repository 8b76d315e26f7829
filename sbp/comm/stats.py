"""Counting of collectives and bytes, for `sbp.comm_stats()` and for tests that assert them."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class CommStats:
    """Collectives run by this rank inside a `comm_stats()` block; `bytes` counts bytes sent.

    `fallbacks` counts, per op, the calls that ran by the broadcast fallback (no SBP rule):
    they are not collectives, so `calls` leaves them out.
    """

    calls: int = 0
    bytes: int = 0
    by_kind: Counter = field(default_factory=Counter)
    bytes_by_kind: Counter = field(default_factory=Counter)
    fallbacks: Counter = field(default_factory=Counter)

    def record(self, kind: str, nbytes: int) -> None:
        self.calls += 1
        self.bytes += nbytes
        self.by_kind[kind] += 1
        self.bytes_by_kind[kind] += nbytes


_active: list[CommStats] = []


def record_fallback(op: str) -> None:
    for stats in _active:
        stats.fallbacks[op] += 1


def record(kind: str, nbytes: int) -> None:
    for stats in _active:
        stats.record(kind, nbytes)


@contextlib.contextmanager
def comm_stats() -> Iterator[CommStats]:
    """Count the collectives run inside the block (nested blocks each count)."""
    stats = CommStats()
    _active.append(stats)
    try:
        yield stats
    finally:
        _active.remove(stats)


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Count nothing inside the block (sbp's own metadata checks)."""
    saved = _active[:]
    _active.clear()
    try:
        yield
    finally:
        _active[:] = saved
