"""Cheap checks that every rank is about to run the same communication.

Ranks that disagree on a conversion (another sbp or placement on one rank) or on
`requires_grad` enter mismatched collectives: gloo aborts the process ("Received
data size doesn't match") or waits out the timeout. `check_rebox` exchanges a hash
of the conversion over the ranks of both placements the first time a rank meets it (mode "first",
the default: one small all-gather per new conversion), on every call ("always"),
or never ("never"); a divergence raises `MetaMismatchError` on every rank.
`raise_everywhere` sends a rank's own bad-input error through the same exchange,
so that every rank raises it at once instead of waiting for the bad one; where the others
do not exchange (a re-box checked before), `announce` marks it where they wait instead.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import torch

from sbp import env
from sbp.comm import failure, functional, shm, stats
from sbp.comm.meta import exchange
from sbp.errors import SbpError

MODE = "first"
MAX_SEEN = 4096
_seen: dict[tuple[int, ...], set] = {}


def world() -> tuple[int, ...]:
    return tuple(range(env.get_world_size()))


def raise_everywhere(error: BaseException, what: str = "to_global") -> None:
    """Raise `error` here and (named as this rank's) on every other rank of the world.

    The other ranks must be in their own metadata exchange of the same call (SPMD).
    """
    exchange({}, world(), (), what, error=error)
    raise error  # a world of one


def announce(error: BaseException, ranks: object = None) -> None:
    """This rank raises `error` (bad input) before a call over `ranks` (a tuple, or a
    placement's; else the world)
    whose peers skip the exchange (a re-box checked before, `check_meta=False`) and go
    straight into its collectives: they raise `RankFailedError` naming this rank there, at
    once (see `failure`)."""
    if env.get_world_size() > 1:
        ranks = getattr(ranks, "flat_ranks", ranks)
        ranks = ranks if isinstance(ranks, tuple) else world()
        failure.announce(error, ranks)


@contextlib.contextmanager
def announcing(ranks: object = None) -> Iterator[None]:
    """Checks of arguments found bad on some ranks only, whose peers go on into a first
    exchange or a later collective with this rank: an `SbpError` raised inside is
    announced to them (`announce`) on its way out."""
    try:
        yield
    except SbpError as e:
        announce(e, ranks)
        raise


def check_rebox(
    src: object, dst: object, requires_grad: bool, local=None, what: str = "a re-box (to_global)"
) -> None:
    """Every rank re-boxes the same (src -> dst) with the same `requires_grad` (see MODE).

    What was seen is kept per rank set: every member of a set meets the same conversions in
    the same order (SPMD), so all of them check, or forget, the same ones.
    """
    if MODE == "never" or env.get_world_size() == 1 or functional.tracing(local):
        return  # (a traced graph holds no checks: it runs what was checked in eager)
    ranks = _ranks(src, dst)
    if env.get_rank() not in ranks:
        return
    key = (src, dst, requires_grad)
    seen = _seen.setdefault(ranks, set())
    if MODE == "first":
        if key in seen:
            return
        if len(seen) >= MAX_SEEN:
            seen.clear()
    with stats.paused():  # a check, not a collective of the conversion
        exchange(
            {"from": repr(src), "to": repr(dst), "requires_grad": requires_grad},
            ranks,
            what=what,
        )
    seen.add(key)


def _forget(ranks: tuple[int, ...]) -> None:
    """The set was found out of step: its ranks may have seen different conversions."""
    _seen.pop(ranks, None)


shm.on_out_of_step(_forget)


def _ranks(src, dst) -> tuple[int, ...]:
    return tuple(sorted({*src.placement.flat_ranks, *dst.placement.flat_ranks}))


def data_hash(x: torch.Tensor) -> int:
    """A 56-bit hash of `x`'s bytes (CPU copy for other devices; about 1 GB/s)."""
    data = x.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    return int.from_bytes(hashlib.blake2b(data, digest_size=7).digest(), "little")
