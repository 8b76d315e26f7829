"""A rank's bad input, told to the peers that wait for it in a call it will not make.

A rank that raises on bad input (`agreement.announce`) where its peers go on into a
collective with it (a re-box checked before, `check_meta=False`) writes a mark in the
default store for the next call of each of its rank sets within the call's ranks: a key
per rank set, transport and call number. Every rank set numbers its calls on the
transport it runs them on: its shared segment (`shm.Segment.calls`, one host) or its
gloo frames (`inline`, across hosts; `frames`). A peer waiting for the failing rank looks
that key up now and then (in shared memory every 10 ms of waiting; a gloo frame is waited
for in slices of `POLL_S`, and a frame that completes within one never looks). On a mark
of a failure it took no part in, it raises `RankFailedError` naming the failing rank and
its error, and answers in the store that it left that call. In shared memory the call is
simply not read; gloo cannot take a call back, so the frame is left behind.

Every rank that took part in a failure (its own, or one it raised for) settles each
marked call before its next call on that rank set and transport: it answers that it did
not make the call, waits until every member answered, and if one left a gloo frame
behind, joins it with a filler frame (`settle`'s `fill`). A settled call's number is used
up on every member, filled or not, and a failure marks past the calls its rank has still
to settle, so every mark names a call no rank made yet and failures in a row are each
named once. Ranks that failed at the same call answered each other with their marks.

A rank that raises `RankFailedError` skips the rest of its call as the failing rank did,
so it fails too: before it answers, it marks its own other rank sets within the ranks the
failing rank told (`RankFailedError.ranks`), so that a peer waiting for it in a later
gather of a mesh raises as well. A healthy call pays a dict lookup (`begin`), and a
store lookup per 10 ms (shared memory) or 50 ms (gloo) of a wait that long.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Callable
from typing import Protocol

from sbp import env
from sbp.comm import fingerprint
from sbp.errors import CommTimeoutError, RankFailedError

Key = tuple[int, ...]  # a rank set, ascending
POLL_S = 0.05  # how long a gloo frame is waited for before each look at the store
_SLICE = datetime.timedelta(seconds=POLL_S)
_SLICE_OVER = "Operation timed out!"  # (torch's Work.wait(timeout) message, op still running)
CHECK_EVERY_S = 0.01  # a settle checks for lost peers this often


class Calls(Protocol):
    """A rank set's count of calls on one transport (`tag`)."""

    tag: str
    calls: int


class FrameCalls:
    """A rank set's count of gloo frames (`inline`)."""

    tag = "gloo"

    def __init__(self) -> None:
        self.calls = 0


_known: dict[tuple[str, Key], Calls] = {}  # (transport, rank set): its count of calls
_count = [0]  # failures this rank announced (part of each mark: every one differs)
_took_part: set[tuple[int, int]] = set()  # (rank, count): announced, or raised for
_to_settle: dict[tuple[str, Key], set[int]] = {}  # marked calls to settle before the next
_settled: set[tuple[str, Key, int]] = set()  # marked calls settled (never raised for)
_left: list = []  # gloo frames left behind (their work and buffers), until they complete


def frames(key: Key) -> FrameCalls:
    """Rank set `key`'s count of gloo frames."""
    calls = _known.get(("gloo", key))
    if calls is None:
        calls = _known["gloo", key] = FrameCalls()
    return calls  # type: ignore[return-value]


def begin(
    key: Key,
    calls: Calls,
    fill: Callable[[], None] | None = None,
    lost: Callable[[list[int]], list[int]] | None = None,
) -> None:
    """Before a call of rank set `key` on the transport counted by `calls`: note the
    count, and settle the marked calls this rank took part in there (`settle`)."""
    known = (calls.tag, key)
    if _known.get(known) is not calls:
        _known[known] = calls
    if _to_settle:
        settle(key, calls, fill, lost)


def announce(error: BaseException, ranks: tuple[int, ...], besides: Key = ()) -> None:
    """This rank raises `error` (bad input, or `RankFailedError`: it fails too) before a
    call over `ranks` whose peers may wait for it: mark the next call of each rank set
    within `ranks` it is a member of (that it ran a call in, and `ranks` itself), past the
    calls it has still to settle there; not `besides` (where it raises for a peer). On
    each transport the set has run calls on (where one process switched, as tests do:
    every rank that takes part settles them all). Its answer for each marked call ("did
    not make it") goes with the mark: a fact already."""
    store = env.default_store()
    me, within = env.get_rank(), set(ranks)
    own = tuple(sorted(ranks))
    keys = {k for _, k in _known} | ({own} if me in own else set())
    marked = []
    for k in keys:
        if me in k and within.issuperset(k) and k != besides:
            counts = [c for c in (_known.get(("shm", k)), _known.get(("gloo", k))) if c]
            for calls in counts or [frames(k)]:
                pending = _to_settle.get((calls.tag, k), ())
                marked.append((calls.tag, k, max([calls.calls, *pending]) + 1))
    if store is None or not marked:
        return
    _count[0] += 1
    count = _count[0]
    where = ";".join(f"{tag}:{_name(k)}@{n}" for tag, k, n in marked)
    with contextlib.suppress(Exception):  # (a store gone with its host: the peers time out)
        told = f"{_name(tuple(ranks))}|{where}|{type(error).__name__}: {error}"
        store.set(_why_key(me, count), told)
        for tag, k, n in marked:
            store.append(_mark_key(tag, k, n), f"{me}:{count};")
            store.set(_answer_key(tag, k, n, me), "did not make it")  # (a fact already)
            _to_settle.setdefault((tag, k), set()).add(n)
        _took_part.add((me, count))


def failed_at(key: Key, calls: Calls, n: int) -> list[tuple[int, int]]:
    """The failures marked at call `n` of rank set `key` on `calls`' transport that this
    rank took no part in: (rank, count) each."""
    tag = calls.tag
    store = env.default_store()
    mark = _mark_key(tag, key, n)
    if store is None or (tag, key, n) in _settled or not _has(store, mark):
        return []
    try:
        entries = [e.split(":") for e in store.get(mark).decode().split(";") if e]
    except Exception:  # noqa: BLE001 - the store gone with its host: the call's own error
        return []
    return [(int(r), int(c)) for r, c in entries if (int(r), int(c)) not in _took_part]


def raised_for(
    failed: list[tuple[int, int]], key: Key, calls: Calls, n: int, fp: int, via: str
) -> RankFailedError:
    """This rank leaves call `n` of rank set `key` (fingerprint `fp`, through `via`) for
    the failures `failed` (`failed_at`): it fails too, takes part in them, and answers
    that it left the call. Returns the error to raise, naming the first."""
    whys = [_why(rank, count) for rank, count in failed]
    told, message, _ = whys[0]
    error = rank_failed(failed[0][0], message, fp, key, told, via)
    announce(error, error.ranks, key)  # (before the answer; numbered before these' calls)
    for (rank, count), (_, _, where) in zip(failed, whys, strict=True):
        _take_part(rank, count, where)
    with contextlib.suppress(Exception):
        env.default_store().set(_answer_key(calls.tag, key, n, env.get_rank()), "left")
    _to_settle.setdefault((calls.tag, key), set()).add(n)  # (see `settle`)
    return error


def wait(work, key: Key, calls: Calls, n: int, fp: int, leave: Callable[[], None]) -> None:
    """Wait for gloo frame `n` of rank set `key` (fingerprint `fp`). Where a member failed
    before it (a mark this rank took no part in): call `leave` (the frame's buffers are
    the work's from now on) and raise `RankFailedError` naming that member."""
    while True:
        try:
            work.wait(_SLICE)
            return
        except RuntimeError as e:
            if _SLICE_OVER not in str(e):
                raise  # (the collective's own error: a lost peer, gloo's timeout)
            if work.is_completed():
                continue  # (done just after the slice: the next wait returns, or raises)
        failed = failed_at(key, calls, n)
        if failed:
            break
    leave()
    _left[:] = [w for w in _left if not w.is_completed()] + [work]
    raise raised_for(failed, key, calls, n, fp, " (gloo)")


def settle(
    key: Key,
    calls: Calls,
    fill: Callable[[], None] | None = None,
    lost: Callable[[list[int]], list[int]] | None = None,
) -> None:
    """Before this rank's next call of rank set `key` on `calls`' transport: settle every
    marked call there of a failure it took part in (see the module's docstring); `fill`
    joins a gloo frame left behind, `lost(ranks)` says which of `ranks` are gone. A rank
    that left the call waits for the answers too: in shared memory its next call writes
    the slot of the call before the marked one, which a late peer may still read."""
    pending = _to_settle.pop((calls.tag, key), None)
    if not pending:
        return
    store, me = env.default_store(), env.get_rank()
    others = [r for r in key if r != me]
    for n in sorted(pending):
        made = calls.calls >= n  # (it left that call: answered "left" then)
        if not made:
            store.set(_answer_key(calls.tag, key, n, me), "did not make it")
        answers = [_answer_key(calls.tag, key, n, r) for r in others]
        _wait_for(store, answers, others, key, lost)
        _settled.add((calls.tag, key, n))
        if not made and fill is not None and any(store.get(a) == b"left" for a in answers):
            fill()
        calls.calls = max(calls.calls, n)  # (one call on every member, filled or not)


def _wait_for(store, answers: list[str], others: list[int], key: Key, lost) -> None:
    """Until every member of `key` answered (or one is lost, or the timeout)."""
    timeout = env.get_timeout().total_seconds()
    start = last_check = time.monotonic()
    try:
        while not store.check(answers):
            now = time.monotonic()
            gone = []
            if now - last_check >= CHECK_EVERY_S:
                last_check = now
                gone = lost(others) if lost is not None else []
            if gone or now - start > timeout:
                missing = [r for r, a in zip(others, answers, strict=True) if not _has(store, a)]
                why = f"ranks {gone} exited" if gone else f"ranks {missing} did not answer"
                raise CommTimeoutError(
                    f"{why} within the timeout of {env.get_timeout()} while rank "
                    f"{env.get_rank()} waited to settle a failed call over ranks {list(key)}"
                )
            time.sleep(0.0005 if now - start < CHECK_EVERY_S else CHECK_EVERY_S / 5)
    except CommTimeoutError:
        raise
    except Exception as e:  # noqa: BLE001 - the store gone with its host
        raise CommTimeoutError(
            f"rank {env.get_rank()} could not settle a failed call over ranks {list(key)}: "
            f"the store is gone ({e})"
        ) from e


def rank_failed(
    rank: int, what: str, fp: int, ranks: tuple[int, ...], told: tuple[int, ...], via: str
) -> RankFailedError:
    """This rank raises for `rank`'s failure (`what`, told to `told`) in a call `fp` over
    `ranks` (through `via`, or shared memory)."""
    return RankFailedError(
        f"rank {rank} raised {what} -- at a call it then did not make: rank {env.get_rank()} "
        f"runs {fingerprint.describe(fp)} over ranks {list(ranks)} there{via}, which rank "
        f"{rank} will not join; every rank raises (none waits out the timeout)",
        rank,
        told,
    )


def _take_part(rank: int, count: int, where: str) -> None:
    """This rank raises for `rank`'s failure `count`, marked at `where`: settle its other
    marked calls later."""
    _took_part.add((rank, count))
    me = env.get_rank()
    for part in where.split(";"):
        tag, _, rest = part.partition(":")
        name, _, n = rest.partition("@")
        key = tuple(int(r) for r in name.split(","))
        calls = _known.get((tag, key))
        if me in key and (calls.calls if calls is not None else 0) < int(n):
            _to_settle.setdefault((tag, key), set()).add(int(n))


def _why(rank: int, count: int) -> tuple[Key, str, str]:
    """The ranks `rank`'s failure `count` told, its error, and its marked calls."""
    names, where, message = env.default_store().get(_why_key(rank, count)).decode().split("|", 2)
    return tuple(int(r) for r in names.split(",")), message, where


def _has(store, key: str) -> bool:
    with contextlib.suppress(Exception):
        return store.check([key])
    return False


def _name(key: Key) -> str:
    return ",".join(map(str, key))


def _mark_key(tag: str, key: Key, n: int) -> str:
    return f"sbp/failed/{tag}/{_name(key)}/{n}"


def _answer_key(tag: str, key: Key, n: int, rank: int) -> str:
    return f"sbp/failed-answer/{tag}/{_name(key)}/{n}/{rank}"


def _why_key(rank: int, count: int) -> str:
    return f"sbp/failed-why/{rank}/{count}"


def clear() -> None:
    """Forget the calls and failures (the world was re-created)."""
    _known.clear()
    _to_settle.clear()
    _settled.clear()
    _took_part.clear()
    _left.clear()


env.at_shutdown(clear)
