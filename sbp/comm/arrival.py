"""Did every rank get here? Asked through the default store, not a collective.

Ranks out of step, some waiting here and some inside a collective of the same rank set
(in shared memory), see each other through the segment (`shm.waiting_in_arrival`) and
raise `MetaMismatchError` together, each taking its step back so that they stay in step.

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
from sbp.comm import fingerprint, shm
from sbp.errors import CommTimeoutError, MetaMismatchError

POLL_S = 0.002
WITHDRAW_S = 1.0  # how long a rank out of step waits for its peers to see it (they check
# every 10 ms)
ALL = "every rank arrived"
_calls: Counter = Counter()


def arrived_together(ranks: tuple[int, ...], window_s: float, gave_up: str = "") -> str | None:
    """Wait up to `window_s` seconds for every rank of `ranks` to make this call; return
    `ALL` when all of them did, else the `gave_up` text of the first rank that stopped
    waiting (every rank gets the same answer: the first verdict written wins, and a rank
    that comes later reads it). None where there is no store. Every rank of `ranks` calls
    this at the same points (SPMD): the calls are numbered per rank set."""
    if len(ranks) == 1:
        return ALL
    store = env.default_store()
    if store is None:
        return None
    name = ",".join(map(str, sorted(ranks)))
    call = _calls[name]
    prefix = shm.arrival_key(ranks, call)
    _calls[name] += 1
    count, verdict = prefix + "count", prefix + "verdict"
    try:
        arrived = store.add(count, 1)
        deadline = time.monotonic() + window_s
        while not store.check([verdict]):
            if arrived >= len(ranks):
                return _back(ranks, store.compare_set(verdict, "", ALL).decode())
            if time.monotonic() > deadline:
                text = gave_up or f"rank {env.get_rank()} stopped waiting after {window_s} s"
                return _back(ranks, store.compare_set(verdict, "", text).decode())
            ahead = shm.waiting_in_arrival(ranks, call)
            if ahead and fingerprint.ENABLED and not store.check([verdict]):
                _withdraw(ranks, store, count, name, ahead)
                _out_of_step(ranks, sorted(ahead))
            time.sleep(POLL_S)
            arrived = store.add(count, 0)
        return _back(ranks, store.get(verdict).decode())
    except (MetaMismatchError, CommTimeoutError):
        raise
    except Exception:  # noqa: BLE001 - the store may be gone with the rank that hosted it
        return _back(ranks, None)


def _back(ranks: tuple[int, ...], verdict: str | None) -> str | None:
    shm.waiting_in_arrival(ranks, None)
    return verdict


def _withdraw(
    ranks: tuple[int, ...], store: dist.Store, count: str, name: str, ahead: dict[int, int]
) -> None:
    """Leave an arrival whose peers wait in a collective instead, so that the ranks stay in
    step for what comes after the error: wait (briefly) for them to see this rank's mark
    and take their call back (see `shm`), then take back this rank's arrival."""
    deadline = time.monotonic() + WITHDRAW_S
    while not shm.took_back(ranks, ahead) and time.monotonic() < deadline:
        time.sleep(POLL_S / 2)
    store.add(count, -1)
    _calls[name] -= 1
    shm.withdrawn(ranks)
    shm.out_of_step(ranks)


def _out_of_step(ranks: tuple[int, ...], ahead: list[int]) -> None:
    """Peers waiting inside a collective of the set that this rank never made: they wait
    for this rank there while it waits for them here (they raise alike, see `shm`)."""
    raise MetaMismatchError(
        f"ranks {ahead} wait inside a collective over ranks {list(ranks)} while rank "
        f"{env.get_rank()} waits for every rank to arrive (through the store): the "
        "ranks run different code (per-rank settings differ, or a call made on some "
        "ranks only)"
    )
