"""A rank's bad input, told to the peers that wait for it in a call it will not make.

A rank that raises on bad input (`agreement.announce`) where its peers go on into a
collective with it (a re-box checked before, `check_meta=False`) writes a mark in the
default store at the next call of each of its rank sets within the call's ranks: a key
per rank set, transport and call number, holding (rank, count, user call) per failure.
Every rank set numbers its calls on the transport it runs them on: its shared segment
(`shm.Segment.calls`) or its gloo frames (`inline`; `frames`). The user call (`scope`)
counts the outermost `to_global` and `module.to_global` calls entered and left: the same
on every rank at the same point (SPMD).

The failing rank cannot know which of its rank sets the call would have used (its
argument is bad): a mesh's re-box may gather over the rows only, or make no collective.
So a mark stops only a call made in its own user call. (A failure outside a counted user
call, in a re-box on some ranks or a checkpoint, cannot be placed among the calls: its
marks stop any call they name, which is then used up, as before user calls were counted.) A peer waiting in a marked call
looks the key up (in shared memory every 10 ms of waiting; a gloo frame between slices
of `POLL_S`). For a failure of its user call that it took no part in, it raises
`RankFailedError` naming the failing rank and its error, and answers "left" (in shared
memory the call is simply not read; gloo cannot take a call back, so the frame is left
running). For marks of earlier user calls only, it answers "void@u": it makes that call,
in user call u.

Every rank that took part in a failure (its own, or one it raised for) settles each
marked call, in order, before its next call on that rank set and transport: it answers
"did not make it@u" and waits for a verdict. One peer "left": the call was made, its
number is used up on every member, and a gloo frame left running is joined by a filler
frame. Every peer answered "void" (not from the user call of a failure marked there: that
may turn to "left" yet) or "did not make it" up to this user call: nobody made it, it is
this rank's next call, and the calls marked after it are nobody's (their marks go). Which
call is next depends on verdicts not in yet, so a failure marks each call still to settle
and the one after them, and refreshes the answers of every call it has still to settle:
it makes no more calls in this user call.

A rank that raises `RankFailedError` skips the rest of its call as the failing rank did,
so it fails too: it marks its own other rank sets within the ranks the failing rank told
(`RankFailedError.ranks`), so that a peer waiting for it in a later gather of a mesh
raises as well; so does a rank that settles a call marked by a failure of its own user
call. A healthy call pays a dict lookup (`begin`), and a store lookup per 10 ms (shared
memory) or 50 ms (gloo) of a wait that long.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import time
from collections.abc import Callable
from typing import Protocol

import torch

from sbp import env
from sbp.comm import fingerprint
from sbp.errors import CommTimeoutError, MetaMismatchError, RankFailedError

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
_left: list = []  # gloo frames left running (their work and buffers), until they complete
_answered: set[tuple[str, Key, int]] = set()  # marked calls this rank answered
_void: dict[tuple[str, Key, int], int] = {}  # marked calls it makes: the marks it saw there
_scope = [0]  # user calls entered and left: odd inside one (the same on every rank, SPMD)
_depth = [0]
_program = [0]  # the count this program started at (`start_counting_at`)


def scope() -> int:
    """Where this rank is: user calls (`user_call`) entered and left, odd inside one."""
    return _scope[0]


def start_counting_at(count: int) -> None:
    """Count user calls from `count` on (even, above any count so far, and the same on
    every rank): a harness that runs programs one after another on the same ranks."""
    _scope[0] = _program[0] = count


def user_call(fn: Callable | None = None, *, over: Callable | None = None) -> Callable:
    """`fn` is a user's call that may raise on bad input where its peers go on (`to_global`,
    `module.to_global`): a failure in it is told to the peers inside the same call, and
    to them alone (`scope`). Only calls that every rank of the world makes count, so that
    every rank counts alike: `over(*args)`, where given, is the placement the call is made
    on (re-boxes on some ranks are made by those alone: not counted; a failure in one
    stops any call of the rank sets it marks, as before). Only the outermost counts;
    traced code counts none."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args, **kwargs):
            if _depth[0] or torch.compiler.is_compiling():
                return fn(*args, **kwargs)
            counted = over is None or over(*args).size == env.get_world_size()
            _depth[0] = 1
            _scope[0] += counted
            try:
                return fn(*args, **kwargs)
            finally:
                _depth[0] = 0
                _scope[0] += counted

        return call

    return wrap if fn is None else wrap(fn)


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
    fp: int | None = None,
    block: bool = True,
) -> None:
    """Before a call (`fp`) of rank set `key` on the transport counted by `calls`: note the
    count, and settle the marked calls this rank took part in there (`settle`)."""
    known = (calls.tag, key)
    if _known.get(known) is not calls:
        _known[known] = calls
    if _to_settle:
        settle(key, calls, fill, lost, fp, block)


def announce(error: BaseException, ranks: tuple[int, ...], besides: Key = ()) -> None:
    """This rank raises `error` (bad input, or `RankFailedError`: it fails too) before a
    call over `ranks` whose peers may wait for it: mark the next call of each rank set
    within `ranks` it is a member of (that it ran a call in, and `ranks` itself); not
    `besides` (where it raises for a peer). On each transport the set has run calls on
    (where one process switched, as tests do: every rank that takes part settles them all).
    Which call is the next one depends on calls it has still to settle there (their peers
    may have made them, or not yet): each of those is marked too, and the one after them.
    Its answer for each marked call ("did not make it") goes with the mark: a fact."""
    store = env.default_store()
    me, within = env.get_rank(), set(ranks)
    own = tuple(sorted(ranks))
    keys = {k for _, k in _known} | ({own} if me in own else set())
    marked = []
    for k in keys:
        if me in k and within.issuperset(k) and k != besides:
            counts = [c for c in (_known.get(("shm", k)), _known.get(("gloo", k))) if c]
            if len(counts) == 2 and counts[1].calls <= 1 and not _to_settle.get(("gloo", k)):
                counts = counts[:1]  # (its one gloo frame made its segment: none waits there)
            for calls in counts or [frames(k)]:
                pending = sorted(_to_settle.get((calls.tag, k), ()))
                nexts = [n for n in pending if n > calls.calls] + [max([calls.calls, *pending]) + 1]
                marked.extend((calls.tag, k, n) for n in nexts)
    ahead = [  # (calls still to settle anywhere: its answers there are older than this)
        (tag, k, n)
        for (tag, k), pending in _to_settle.items()
        for n in pending
        if n > getattr(_known.get((tag, k)), "calls", 0)
    ]
    if store is None:
        return
    if marked:
        _mark(store, error, ranks, marked)
    with contextlib.suppress(Exception):  # (it makes no more calls in this user call; after
        for tag, k, n in ahead:  # its marks: an answer of a user call comes after its marks)
            store.set(_answer_key(tag, k, n, me), f"did not make it@{_scope[0]}")


def _mark(store, error: BaseException, ranks: tuple[int, ...], marked: list) -> None:
    """Write this rank's failure (`error`, told to `ranks`) at the calls `marked`, each
    mark before this rank's answer there."""
    me = env.get_rank()
    _count[0] += 1
    count = _count[0]
    where = ";".join(f"{tag}:{_name(k)}@{n}" for tag, k, n in marked)
    with contextlib.suppress(Exception):  # (a store gone with its host: the peers time out)
        told = f"{_name(tuple(ranks))}|{where}|{type(error).__name__}: {error}"
        store.set(_why_key(me, count), told)
        for tag, k, n in marked:
            store.append(_mark_key(tag, k, n), f"{me}:{count}:{_scope[0]};")
            store.set(_answer_key(tag, k, n, me), f"did not make it@{_scope[0]}")
            _answered.add((tag, k, n))
            _to_settle.setdefault((tag, k), set()).add(n)
        _took_part.add((me, count))


def failed_at(key: Key, calls: Calls, n: int) -> list[tuple[int, int]]:
    """The failures marked at call `n` of rank set `key` on `calls`' transport that this
    rank, which is in that call, took no part in and raises for: (rank, count) each. A
    failure in another user call (`scope`) than this rank's is not: its rank made no call
    there that this rank's call could be, so this rank answers that it makes the call
    ("void", the marked call's rank set had no call in that user call)."""
    tag = calls.tag
    store = env.default_store()
    if store is None or (tag, key, n) in _settled:
        return []
    entries = _entries(store, tag, key, n)
    failed = _stopping(entries)
    if entries and not failed and ((tag, key, n) in _void or (tag, key, n) not in _answered):
        _answer_void(store, tag, key, n, entries)
    return failed


def _stopping(entries: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """The failures among one call's marks that stop this rank's call there, taken no part
    in: of its user call; or of none (outside a counted user call: a re-box on some ranks,
    a checkpoint), which stop any call marked in this program, as they cannot be placed."""
    now = _scope[0]
    return [(r, c) for r, c, s in entries if _stops(s, now) and (r, c) not in _took_part]


def _stops(scope_of_failure: int, now: int) -> bool:
    if scope_of_failure % 2:
        return scope_of_failure == now
    return scope_of_failure >= _program[0]


def _answer_void(store, tag: str, key: Key, n: int, entries: list) -> None:
    """This rank makes call `n` in this user call, past the first `len(entries)` marks
    there (none stops it; a later one of this user call may, and then it says so)."""
    if _void.get((tag, key, n)) != len(entries):
        with contextlib.suppress(Exception):
            store.set(_answer_key(tag, key, n, env.get_rank()), f"void@{_scope[0]}:{len(entries)}")
            _void[tag, key, n] = len(entries)
            _answered.add((tag, key, n))


def _entries(store, tag: str, key: Key, n: int) -> list[tuple[int, int, int]]:
    """The failures marked at call `n` of rank set `key` on `tag`: (rank, count, scope)."""
    mark = _mark_key(tag, key, n)
    if not _has(store, mark):
        return []
    try:
        entries = [e.split(":") for e in store.get(mark).decode().split(";") if e]
    except Exception:  # noqa: BLE001 - the store gone with its host: the call's own error
        return []
    return [(int(r), int(c), int(s)) for r, c, s in entries]


def raised_for(
    failed: list[tuple[int, int]], key: Key, calls: Calls, n: int, fp: int, via: str
) -> RankFailedError:
    """This rank leaves call `n` of rank set `key` (fingerprint `fp`, through `via`) for
    the failures `failed` (`failed_at`): it fails too, takes part in them, and answers
    that it left the call. Returns the error to raise, naming the first."""
    error = _fail_too(failed, key, fp, via)
    with contextlib.suppress(Exception):
        env.default_store().set(_answer_key(calls.tag, key, n, env.get_rank()), "left")
        _answered.add((calls.tag, key, n))
    _to_settle.setdefault((calls.tag, key), set()).add(n)  # (see `settle`)
    return error


def _fail_too(failed: list[tuple[int, int]], key: Key, fp: int | None, via: str) -> RankFailedError:
    """This rank raises for `failed` (the first named) where it would call rank set `key`:
    it marks its own other calls (it fails too), and takes part in them."""
    whys = [_why(rank, count) for rank, count in failed]
    told, message, _ = whys[0]
    error = rank_failed(failed[0][0], message, fp, key, told, via)
    announce(error, error.ranks, key)  # (before taking part: numbered before these' calls)
    for (rank, count), (_, _, where) in zip(failed, whys, strict=True):
        _take_part(rank, count, where)
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
    keep(work)
    raise raised_for(failed, key, calls, n, fp, " (gloo)")


def keep(work, *buffers: torch.Tensor) -> None:
    """Keep a gloo call that was left running (and its buffers) until it completes."""
    _left[:] = [w for w in _left if not w[0].is_completed()] + [(work, buffers)]


def settle(
    key: Key,
    calls: Calls,
    fill: Callable[[], None] | None = None,
    lost: Callable[[list[int]], list[int]] | None = None,
    fp: int | None = None,
    block: bool = True,
) -> None:
    """Before this rank's next call (`fp`) of rank set `key` on `calls`' transport: settle
    the marked calls there of failures it took part in, in order. A call it did not make
    was made by its peers (one answered "left": it is used up on every member, and where
    they left a gloo frame behind, `fill` joins it), or not (every peer answered "void" or
    "did not make it": it is this rank's next call, and the later ones marked are nobody's).
    A call it left is waited for too: in shared memory its next call writes the slot of
    the call before the marked one, which a late peer may still read. `lost(ranks)` says
    which of `ranks` are gone; with `block=False` (before an arrival in the store, where
    peers may wait instead of making the call) a call not yet answered stays to settle."""
    tag = calls.tag
    pending = sorted(_to_settle.pop((tag, key), ()))
    store, me = env.default_store(), env.get_rank()
    others = [r for r in key if r != me]
    for i, n in enumerate(pending):
        answers = [_answer_key(tag, key, n, r) for r in others]
        made = calls.calls >= n  # (it left that call: answered "left" then)
        if not made:
            now = _scope[0]  # (a fact up to now: it may have made the call since its answer)
            store.set(_answer_key(tag, key, n, me), f"did not make it@{now}")
            _answered.add((tag, key, n))
            _fail_if_marked_now(store, tag, key, pending[i:], fp)
            verdict = _verdict(store, tag, key, n, answers, others, lost, block)
            if verdict is None:  # (not known yet: settled before the next call)
                _to_settle[tag, key] = set(pending[i:])
                return
            if verdict == "void":  # (made by nobody: this rank's next call, from now on)
                _fail_if_marked_now(store, tag, key, pending[i:], fp)
                _same_user_call(store, answers, others, key, pending[i:], tag)
                _void.pop((tag, key, n), None)
                _answer_void(store, tag, key, n, _entries(store, tag, key, n))
                _forget(store, tag, key, pending[i + 1 :])
                return
        _poll(lambda a=answers: _all_out(store, a), answers, others, key, lost)
        if not made and fill is not None:
            fill()
        calls.calls = max(calls.calls, n)  # (one call on every member, filled or not)
        _settled.add((tag, key, n))
        if not made:
            _fail_if_marked_now(store, tag, key, [n, *pending[i + 1 :]], fp)


def _all_out(store, answers: list[str]) -> bool:
    """Every member answered, and none is in the call (a "void" that turns to "left": a
    filler frame must not complete a frame that a peer still waits in)."""
    got = [_get(store, a) for a in answers]
    return all(v is not None and _void_answer(v) is None for v in got)


def _void_answer(answer: bytes | None) -> tuple[int, int] | None:
    """A peer's answer that it makes the call (`_answer_void`): its user call, and the
    number of marks it saw there; None for any other answer."""
    if answer is None or not answer.startswith(b"void@"):
        return None
    scope, _, seen = answer[5:].decode().partition(":")
    return int(scope), int(seen)


def _same_user_call(store, answers, others, key: Key, rest: list[int], tag: str) -> None:
    """The peers that wait in the call `rest[0]` this rank is about to make wait there in
    this rank's user call, or the ranks made user calls on some ranks only (counted apart:
    the call would pair two user calls)."""
    now = _scope[0]
    voids = [_void_answer(_get(store, a)) for a in answers]
    elsewhere = [r for r, v in zip(others, voids, strict=True) if v is not None and v[0] != now]
    if elsewhere:
        _to_settle.setdefault((tag, key), set()).update(rest)
        raise MetaMismatchError(
            f"ranks {elsewhere} wait in a call over ranks {list(key)} that rank "
            f"{env.get_rank()} makes in another user call (to_global, module.to_global): "
            "those were made on some ranks only"
        )


def _fail_if_marked_now(store, tag: str, key: Key, rest: list[int], fp: int | None) -> None:
    """Call `rest[0]` of rank set `key`, which this rank would make in this user call, is
    marked by a failure in this user call that it took no part in: it fails too (and
    settles `rest` later)."""
    if _scope[0] % 2 == 0:  # (outside a user call: where this rank is, among the calls, is unknown)
        return
    failed = _stopping(_entries(store, tag, key, rest[0]))
    if failed:
        done = (tag, key, rest[0]) in _settled
        if rest[1:] or not done:
            _to_settle.setdefault((tag, key), set()).update(rest[1:] if done else rest)
        raise _fail_too(failed, key, fp, " (settled)" if fp is None else "")


def _forget(store, tag: str, key: Key, numbers: list[int]) -> None:
    """Marked calls past one that nobody made are nobody's: their numbers name the next
    calls made, so their marks and this rank's answers go (before it makes the first)."""
    me = env.get_rank()
    for n in numbers:
        with contextlib.suppress(Exception):
            store.delete_key(_mark_key(tag, key, n))
            store.delete_key(_answer_key(tag, key, n, me))
        _answered.discard((tag, key, n))


def _verdict(store, tag, key, n, answers, others, lost, block) -> str | None:
    """Was call `n` made by a peer ("left": one left it) or by none ("void": every peer
    answered that it makes the call, though not in the user call of a failure marked there,
    where it may leave it yet; or that it did not make it, up to this rank's user call)?
    None while unknown and not `block`."""
    got: list[bytes | None] = []
    now = _scope[0]

    def final(answer: bytes | None, entries: list) -> bool:
        if answer is None:
            return False
        void = _void_answer(answer)
        if void is None:  # ("did not make it", up to its user call then)
            return int(answer.decode().partition("@")[2]) >= now
        scope, seen = void  # (in the call; a later mark of its user call may stop it)
        return all(s != scope for _, _, s in entries[seen:])

    def known() -> bool:
        got[:] = [_get(store, a) for a in answers]
        if any(v == b"left" for v in got):
            return True
        entries = _entries(store, tag, key, n)
        if any(s % 2 == 0 and _stops(s, now) for _, _, s in entries):
            got.append(b"left")  # (stops any call there: used up, as it always was)
            return True
        return all(final(v, entries) for v in got)

    if not block and not known():
        return None
    _poll(known, answers, others, key, lost)
    return "left" if b"left" in got else "void"


def _get(store, key: str) -> bytes | None:
    return store.get(key) if _has(store, key) else None


def _poll(done: Callable[[], bool], answers: list[str], others: list[int], key: Key, lost) -> None:
    """Until `done()` (every member of `key` answered, or one is lost, or the timeout)."""
    timeout = env.get_timeout().total_seconds()
    start = last_check = time.monotonic()
    store = env.default_store()
    try:
        while not done():
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
    rank: int, what: str, fp: int | None, ranks: tuple[int, ...], told: tuple[int, ...], via: str
) -> RankFailedError:
    """This rank raises for `rank`'s failure (`what`, told to `told`) in a call `fp` over
    `ranks` (through `via`, or shared memory)."""
    runs = "a call" if fp is None else fingerprint.describe(fp)
    return RankFailedError(
        f"rank {rank} raised {what} -- at a call it then did not make: rank {env.get_rank()} "
        f"runs {runs} over ranks {list(ranks)} there{via}, which rank "
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
    _answered.clear()
    _void.clear()


env.at_shutdown(clear)
