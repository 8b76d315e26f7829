"""Did every rank get here? Asked through the default store, not a collective.

A rank that left a run of collectives early (its forward raised) cannot meet the others
in a collective to say so: they may be waiting inside one of the run's, and a collective
of another size would meet that one (gloo then aborts, or reads the wrong bytes). The
store answers without entering any group, so the ranks learn whether all of them left
the run, and go on together, or one gave up waiting for the others.
"""

from __future__ import annotations

import time
from collections import Counter

import torch.distributed as dist

from sbp import env

POLL_S = 0.002
ALL = "every rank arrived"
_calls: Counter = Counter()


def default_store() -> dist.Store | None:
    """The world's default store, or None where there is none (or it is gone)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no group, or the rank that hosted it exited
        return None


def arrived_together(ranks: tuple[int, ...], window_s: float, gave_up: str = "") -> str | None:
    """Wait up to `window_s` seconds for every rank of `ranks` to make this call; return
    `ALL` when all of them did, else the `gave_up` text of the first rank that stopped
    waiting (every rank gets the same answer: the first verdict written wins, and a rank
    that comes later reads it). None where there is no store. Every rank of `ranks` calls
    this at the same points (SPMD): the calls are numbered per rank set."""
    if len(ranks) == 1:
        return ALL
    store = default_store()
    if store is None:
        return None
    name = ",".join(map(str, sorted(ranks)))
    prefix = f"sbp/arrived/{name}/{_calls[name]}/"
    _calls[name] += 1
    count, verdict = prefix + "count", prefix + "verdict"
    try:
        arrived = store.add(count, 1)
        deadline = time.monotonic() + window_s
        while not store.check([verdict]):
            if arrived >= len(ranks):
                return store.compare_set(verdict, "", ALL).decode()
            if time.monotonic() > deadline:
                text = gave_up or f"rank {env.get_rank()} stopped waiting after {window_s} s"
                return store.compare_set(verdict, "", text).decode()
            time.sleep(POLL_S)
            arrived = store.add(count, 0)
        return store.get(verdict).decode()
    except Exception:  # noqa: BLE001 - the store may be gone with the rank that hosted it
        return None
