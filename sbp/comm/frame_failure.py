"""A rank's bad input, told to the peers that wait for it inside a gloo frame.

Where a rank set has a shared segment, a rank that raises on bad input
(`agreement.announce`) marks it there, and the peers waiting in the call it will not make
raise `RankFailedError` at once (`shm.announce_failure`). Across hosts the peers wait
inside gloo, where no mark reaches them; but every gloo collective there starts with a
frame (`inline`), the same fixed-size all-gather on every rank, and the frame is waited for
in slices of `POLL_S`. Between slices the waiting rank looks in the default store for a
mark of this very call: `announce` writes one for the next frame of each rank set of the
failing rank within the call's ranks (a key per rank set and call number: one lookup). On
a mark of a failure it did not take part in, the rank raises `RankFailedError` naming the
failing rank and its error, and leaves its frame behind (gloo cannot take a call back).

In step again: a frame left behind is an all-gather the other members must still join
(gloo pairs a group's calls by their order). So a rank that took part in a failure (its
own, or one it raised for) settles each marked call before its next frame in that rank
set: it says in the store that it did not make the call, waits until every member said
whether it left the call behind or did not make it, and if one left it behind, joins it
with a filler frame (`settle`'s `fill`). Every member has then made that call once, and
the next frames pair as before. Costs nothing on the collectives' path: the slices of a
frame that completes within `POLL_S` never look at the store.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable

from sbp import env
from sbp.comm import shm
from sbp.errors import CommTimeoutError

Key = tuple[int, ...]  # a rank set, ascending
POLL_S = 0.05  # how long a frame is waited for before each look at the store
_SLICE = datetime.timedelta(seconds=POLL_S)
_SLICE_OVER = "Operation timed out!"  # (torch's Work.wait(timeout) message, op still running)
_calls: dict[Key, int] = {}  # frames this rank started, per rank set
_count = [0]  # failures this rank announced (part of each mark: every one differs)
_took_part: set[tuple[int, int]] = set()  # (rank, count): announced, or raised for
_to_settle: dict[Key, set[int]] = {}  # marked calls to settle before the next frame there
_settled: set[tuple[Key, int]] = set()  # marked calls settled (never raised for)
_left: list = []  # frames left behind (their work and buffers), until they complete


def start(key: Key) -> int:
    """Number this rank's next frame of rank set `key` (after `settle`)."""
    n = _calls[key] = _calls.get(key, 0) + 1
    return n


def announce(
    error: BaseException, ranks: tuple[int, ...], marked_in_shm: set[Key], besides: Key = ()
) -> None:
    """This rank raises `error` (bad input, or `RankFailedError`: see `shm.failed_too`)
    before a call over `ranks` whose peers may wait for it in a frame: mark the next frame
    of each rank set within `ranks` it is a member of (that it ran a frame in, and `ranks`
    itself), in the store, past the calls it has still to settle there; not the sets whose
    shared segment holds the mark (`shm.announce_failure`), nor `besides` (the set of the
    frame it leaves). Its answer for each marked call ("did not make it") goes with the
    mark: it is a fact already."""
    store = env.default_store()
    me, within = env.get_rank(), set(ranks)
    own = tuple(sorted(ranks))
    keys = set(_calls) | ({own} if me in own else set())
    marked = [
        (k, max([_calls.get(k, 0), *_to_settle.get(k, ())]) + 1)  # (past unsettled calls)
        for k in keys
        if me in k and within.issuperset(k) and k not in marked_in_shm and k != besides
    ]
    if store is None or not marked:
        return
    _count[0] += 1
    count = _count[0]
    where = ";".join(f"{_name(k)}@{n}" for k, n in marked)
    with contextlib.suppress(Exception):  # (a store gone with its host: the peers time out)
        told = f"{_name(tuple(ranks))}|{where}|{type(error).__name__}: {error}"
        store.set(_why_key(me, count), told)
        for k, n in marked:
            store.append(_mark_key(k, n), f"{me}:{count};")
            store.set(_answer_key(k, n, me), "did not make it")  # (a fact already)
            _to_settle.setdefault(k, set()).add(n)
        _took_part.add((me, count))


def wait(work, key: Key, n: int, fp: int, leave: Callable[[], None]) -> None:
    """Wait for frame `n` of rank set `key` (fingerprint `fp`). Where a member failed
    before it (a mark this rank took no part in): call `leave` (the frame's buffers are
    the work's from now on), answer, and raise `RankFailedError` naming that member."""
    while True:
        try:
            work.wait(_SLICE)
            return
        except RuntimeError as e:
            if _SLICE_OVER not in str(e):
                raise  # (the collective's own error: a lost peer, gloo's timeout)
            if work.is_completed():
                continue  # (done just after the slice: the next wait returns, or raises)
        failed = _failed_at(key, n)
        if failed:
            break
    leave()
    _left[:] = [w for w in _left if not w.is_completed()] + [work]
    whys = [_why(rank, count) for rank, count in failed]
    ranks, message, _ = whys[0]
    error = shm.rank_failed(failed[0][0], message, fp, key, ranks, " (gloo)")
    shm.failed_too(error, key)  # (before the answer; numbered before this failure's calls)
    for (rank, count), (_, _, where) in zip(failed, whys, strict=True):
        _take_part(rank, count, where)
    env.default_store().set(_answer_key(key, n, env.get_rank()), "left")
    raise error


def settle(key: Key, fill: Callable[[], None]) -> None:
    """Before this rank's next frame of rank set `key`: settle every marked call there of
    a failure it took part in (see the module's docstring); `fill` runs a filler frame."""
    calls = _to_settle.pop(key, None)
    if not calls:
        return
    store, me = env.default_store(), env.get_rank()
    for n in sorted(calls):
        if _calls.get(key, 0) >= n:
            continue  # (this rank left that call behind: the others fill it)
        store.set(_answer_key(key, n, me), "did not make it")
        others = [r for r in key if r != me]
        answers = [_answer_key(key, n, r) for r in others]
        try:
            store.wait(answers, env.get_timeout())
        except Exception as e:  # noqa: BLE001 - a timeout, or the store gone with its host
            missing = [r for r, a in zip(others, answers, strict=True) if not _has(store, a)]
            raise CommTimeoutError(
                f"ranks {missing} did not answer within the timeout of {env.get_timeout()} "
                f"while rank {me} waited to settle a failed call over ranks {list(key)} "
                f"(gloo): {e}"
            ) from e
        _settled.add((key, n))
        if any(store.get(a) == b"left" for a in answers):
            fill()
        _calls[key] = n  # (a settled call is one call on every member, filled or not)


def _failed_at(key: Key, n: int) -> list[tuple[int, int]]:
    """The failures marked at frame `n` of `key` that this rank took no part in."""
    store = env.default_store()
    mark = _mark_key(key, n)
    if store is None or (key, n) in _settled or not _has(store, mark):
        return []
    try:
        entries = [e.split(":") for e in store.get(mark).decode().split(";") if e]
    except Exception:  # noqa: BLE001 - the store gone with its host: the frame's own error
        return []
    return [(int(r), int(c)) for r, c in entries if (int(r), int(c)) not in _took_part]


def _take_part(rank: int, count: int, where: str) -> None:
    """This rank raises for `rank`'s failure `count`, marked at `where`: settle its other
    marked calls later."""
    _took_part.add((rank, count))
    me = env.get_rank()
    for part in where.split(";"):
        name, _, n = part.partition("@")
        key = tuple(int(r) for r in name.split(","))
        if me in key and _calls.get(key, 0) < int(n):
            _to_settle.setdefault(key, set()).add(int(n))


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


def _mark_key(key: Key, n: int) -> str:
    return f"sbp/frame-failed/{_name(key)}/{n}"


def _answer_key(key: Key, n: int, rank: int) -> str:
    return f"sbp/frame-answer/{_name(key)}/{n}/{rank}"


def _why_key(rank: int, count: int) -> str:
    return f"sbp/frame-failed-why/{rank}/{count}"


def clear() -> None:
    """Forget the frames and failures (the world was re-created)."""
    _calls.clear()
    _to_settle.clear()
    _settled.clear()
    _took_part.clear()
    _left.clear()


env.at_shutdown(clear)
shm.on_failed_too(lambda error, besides, marked: announce(error, error.ranks, marked, besides))
