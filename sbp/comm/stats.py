"""Counting of collectives and bytes, for `sbp.comm_stats()` and for tests that assert them.

With `trace=True` every collective is also kept as an `Event` saying what caused it: the
op whose input was converted (or `to_global`, which the program asked for), the
conversion (source -> target sbp), the module running (see `sbp.trace`) and whether it
ran in forward or backward. The causes are set by the dispatcher and `to_global` only
while something watches (`watching()`): otherwise they cost one check per op.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Event:
    """One collective this rank ran, and what caused it."""

    kind: str
    nbytes: int
    op: str  # the op whose input moved, "to_global", "gradient buckets", or "" (unnoted)
    conversion: str  # "(P) -> (B)", or "" where the collective is the op's own
    module: str  # the module path running it in forward, "" outside modules / in backward
    phase: str  # "forward" or "backward"


@dataclass
class CommStats:
    """Collectives run by this rank inside a `comm_stats()` block; `bytes` counts bytes sent.

    `fallbacks` counts, per op, the calls that ran by the broadcast fallback (no SBP rule):
    they are not collectives, so `calls` leaves them out. `events` (with `trace=True`)
    keeps each collective with its cause; `table()` sums them.
    """

    calls: int = 0
    bytes: int = 0
    by_kind: Counter = field(default_factory=Counter)
    bytes_by_kind: Counter = field(default_factory=Counter)
    fallbacks: Counter = field(default_factory=Counter)
    trace: bool = False
    events: list = field(default_factory=list)

    def record(self, kind: str, nbytes: int) -> None:
        self.calls += 1
        self.bytes += nbytes
        self.by_kind[kind] += 1
        self.bytes_by_kind[kind] += nbytes
        if self.trace:
            self.events.append(_event(kind, nbytes))

    def table(self) -> str:
        """The traced collectives summed by (phase, module, op, conversion, kind)."""
        rows: dict[tuple, list[int]] = {}
        for e in self.events:
            row = rows.setdefault((e.phase, e.module, e.op, e.conversion, e.kind), [0, 0])
            row[0] += 1
            row[1] += e.nbytes
        header = ("phase", "module", "op", "conversion", "collective", "calls", "bytes")
        lines = [header] + [(*k, str(c), str(b)) for k, (c, b) in rows.items()]
        widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
        text = [
            "  ".join(str(v).ljust(w) for v, w in zip(line, widths, strict=True)) for line in lines
        ]
        text.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(text)


_active: list[CommStats] = []
_watchers = [0]  # tracing CommStats and strict blocks open: causes are noted while > 0
_ops: list[tuple[str, bool, str | None]] = []  # (op, implicit, phase) innermost last
_conversions: list[str] = []
modules: list[str] = []  # the paths of the modules running in forward (sbp.trace's hooks)


def watching() -> bool:
    return _watchers[0] > 0


@contextlib.contextmanager
def watch() -> Iterator[None]:
    _watchers[0] += 1
    try:
        yield
    finally:
        _watchers[0] -= 1


@contextlib.contextmanager
def cause(op: str, implicit: bool, phase: str | None = None) -> Iterator[None]:
    """Collectives inside run for `op`; `implicit`: conversions the program did not ask for;
    `phase` where autograd cannot tell (a callback at the end of backward)."""
    _ops.append((op, implicit, phase))
    try:
        yield
    finally:
        _ops.pop()


_NOTHING = contextlib.nullcontext()


def noted(op: str, implicit: bool, phase: str | None = None):
    """`cause(...)` while something watches, else a shared no-op context (cheap)."""
    return cause(op, implicit, phase) if _watchers[0] > 0 else _NOTHING


@contextlib.contextmanager
def converting(text: str) -> Iterator[None]:
    _conversions.append(text)
    try:
        yield
    finally:
        _conversions.pop()


def current_cause() -> tuple[str, bool, str | None] | None:
    return _ops[-1] if _ops else None


def _event(kind: str, nbytes: int) -> Event:
    op, _, phase = _ops[-1] if _ops else ("", False, None)
    backward = phase == "backward" or torch._C._current_autograd_node() is not None
    return Event(
        kind,
        nbytes,
        op,
        _conversions[-1] if _conversions else "",
        "" if backward or not modules else modules[-1],
        "backward" if backward else "forward",
    )


def record_fallback(op: str) -> None:
    for stats in _active:
        stats.fallbacks[op] += 1


def record(kind: str, nbytes: int) -> None:
    for stats in _active:
        stats.record(kind, nbytes)


@contextlib.contextmanager
def comm_stats(trace: bool = False) -> Iterator[CommStats]:
    """Count the collectives run inside the block (nested blocks each count); with `trace`
    keep each one's cause too (`sbp.comm_stats` adds the module path)."""
    stats = CommStats(trace=trace)
    _active.append(stats)
    try:
        if trace:
            with watch():
                yield stats
        else:
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
