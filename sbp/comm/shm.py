"""Small all-reduces and all-gathers between the processes of one host, in shared memory.

gloo sums a few KB in ~0.4 ms back to back on a quiet host, and several ms in the tail
on a busy one: each call goes through TCP loopback and wakes gloo's threads. Logical
BatchNorm makes ~100 such calls per training step. Instead, ranks of one host write
their part into a shared segment, publish a sequence number, wait for everyone's
(spinning briefly, then yielding the CPU, then sleeping), and each sums the parts in
rank order, so every rank holds bitwise the same result (~20 us for two ranks). The
metadata exchange of `to_global` (a small all-gather) takes the same path.

Used for CPU tensors of at most `SLOT_BYTES` (and, in a second segment with larger slots,
of up to `BIG_SLOT_BYTES`, its data written there and its fingerprint met in the first
segment, in one wait)
whose group runs on one host, on x86-64
(stores become visible to other cores in program order there; elsewhere gloo is used),
and never while tracing. The wait is bounded by sbp's timeout, and a peer that exits is
noticed within ~10 ms: both raise `CommTimeoutError`. `SBP_SHM=0` turns it off.
Collectives that do not fit keep to gloo: the two paths never wait on each other.

Every call n writes slot (n mod 2) of its rank and then publishes n. A rank reuses a
slot at call n+2 only after every rank published n+1, which each does after reading
call n's slots, so no part is overwritten before everyone has read it. Beside its
sequence number each rank writes the call's fingerprint (see `fingerprint`), one per
slot parity likewise, and every rank compares them before reading a part: ranks whose
n-th calls differ raise `MetaMismatchError` together. A gloo collective of the set meets
the others here first with its fingerprint alone (`agree`), so the two paths keep one
count of calls and a small call paired with a large one is caught as well.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import platform
import socket
import time
import uuid

import numpy as np
import torch
import torch.distributed as dist

from sbp import env
from sbp.comm import failure, fingerprint, inline
from sbp.errors import CommTimeoutError, MetaMismatchError

SLOT_BYTES = 64 * 1024
# A second, larger segment per rank set (`big_segment`) for all-reduces of 64 KiB-8 MiB and
# the sharded data-parallel path's all-gathers and reduce-scatters of whole units: gloo
# moves ~1 GB/s over loopback, shared memory at memcpy speed. Its memory is reserved when
# it is made (else: gloo).
BIG_SLOT_BYTES = 8 * 2**20
LINE = 64  # one cache line per rank's sequence number
SPINS = 500  # busy checks before yielding (~0.1-0.3 ms: most peers arrive sooner)
YIELD_S = 0.002  # then sched_yield until this long, then short sleeps
SLEEP_S = 50e-6
CHECK_EVERY_S = 0.01  # peers alive and the deadline, checked this often while waiting
# (read once: the switch is for a whole run, and os.environ costs microseconds per call)
_ENABLED = platform.machine().lower() in ("x86_64", "amd64") and os.environ.get("SBP_SHM") != "0"
_segments: dict[tuple[int, ...], tuple[object, Segment | None]] = {}
_big_segments: dict[tuple[int, ...], tuple[object, Segment | None]] = {}


class Segment:
    """The shared memory of one rank set: a sequence number and two slots per rank."""

    tag = "shm"  # (its calls' count, `calls`, numbers the failures' marks: `failure`)

    def __init__(
        self,
        ranks: tuple[int, ...],
        mapping: mmap.mmap,
        pids: list[int],
        slot_bytes: int = SLOT_BYTES,
    ):
        self.ranks, self.pids, self._map = ranks, pids, mapping
        self.slot_bytes = slot_bytes
        # (a large segment's calls meet in the small one first, which counts them for
        # `failure`: its own count is its slots' alone)
        self.small = slot_bytes == SLOT_BYTES
        n = len(ranks)
        self.me = ranks.index(env.get_rank())
        self.seq = np.ndarray((n,), dtype=np.int64, buffer=mapping, offset=0, strides=(LINE,))
        self.fingerprints = np.ndarray(  # (rank, slot parity), in the sequence number's line
            (n, 2), dtype=np.int64, buffer=mapping, offset=8, strides=(LINE, 8)
        )
        # A rank's mark while it waits in the store's arrival (`waiting_in_arrival`), and
        # the last call it took back on seeing a peer's mark.
        self.away = np.ndarray((n,), dtype=np.int64, buffer=mapping, offset=24, strides=(LINE,))
        self.undone = np.ndarray((n,), dtype=np.int64, buffer=mapping, offset=32, strides=(LINE,))
        self._answered: dict[int, int] = {}  # peer index -> the away mark it raised for
        with torch.inference_mode(False):
            self.slots = torch.frombuffer(
                mapping, dtype=torch.uint8, offset=_header(n), count=2 * n * slot_bytes
            ).view(2, n, slot_bytes)
        self.others = [k for k in range(n) if k != self.me]
        self._view_cache: dict = {}
        self.calls = 0
        # (busy checks only where every process of the job on this host has a core: a
        # spinning pair of ranks would take the cores of the others, 2 x 2 on 2 cores)
        host = int(os.environ.get("LOCAL_WORLD_SIZE") or 0)  # (torchrun, sbp's launcher)
        self.spins = SPINS if len(os.sched_getaffinity(0)) >= max(n, host) else 0

    def _views(self, parity: int, nbytes: int, dtype: torch.dtype) -> tuple:
        """(this rank's part, all parts as rows, each part) of slot `parity` as `dtype`,
        made once per shape (views cost microseconds; a training step repeats a few shapes)."""
        key = (parity, nbytes, dtype)
        views = self._view_cache.get(key)
        if views is None:
            if len(self._view_cache) > 512:
                self._view_cache.clear()
            with torch.inference_mode(False):  # (kept: usable outside inference_mode too)
                rows = self.slots[parity, :, :nbytes].view(dtype)
                parts = list(rows.unbind(0))
            views = self._view_cache[key] = (parts[self.me], rows, parts)
        return views

    def _exchange(
        self, tensor: torch.Tensor, fp: int, via: Segment | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Every rank's `tensor`: as rows in ascending rank order, and one by one (views of
        the slots, valid until the call after next). With `via` (the rank set's small
        segment, for the large one) the ranks meet there, with the fingerprint, in the
        one wait: each reads these slots before its next call there, so a slot is still
        rewritten only after every rank read it."""
        if via is None and self.small:
            self._begin(fp)
        self.calls += 1
        n = self.calls
        mine, rows, parts = self._views(n & 1, tensor.numel() * tensor.element_size(), tensor.dtype)
        mine.copy_(tensor.view(-1))
        if via is None:
            self._meet(n, fp)
            return rows, parts
        try:
            via.agree(fp)
        except BaseException:  # (no call here: a peer may not have come to this segment)
            self.calls -= 1
            raise
        return rows, parts

    def agree(self, fp: int) -> None:
        """Meet the other ranks with fingerprint `fp` alone (before a gloo collective)."""
        self._begin(fp)
        self.calls += 1
        self._meet(self.calls, fp)

    def _begin(self, fp: int | None, block: bool = True) -> None:
        """Before a call (`fp`): settle the failures this rank took part in (`failure`)."""
        failure.begin(self.ranks, self, lost=self._lost, fp=fp, block=block)

    def _lost(self, ranks: list[int]) -> list[int]:
        return [r for r in ranks if not _alive(self.pids[self.ranks.index(r)])]

    def _meet(self, n: int, fp: int) -> None:
        """Publish call `n` with its fingerprint, wait for every rank's, compare them."""
        self.away[self.me] = 0  # (back from an arrival that found the ranks out of step)
        self.fingerprints[self.me, n & 1] = fp
        self.seq[self.me] = n
        self._wait(n, fp)
        if fingerprint.ENABLED:
            self._check(n & 1, fp)

    def _check(self, parity: int, fp: int) -> None:
        fps = self.fingerprints
        for k in self.others:
            if fps[k, parity] != fp:
                sides = [(f"rank {r}", int(fps[i, parity])) for i, r in enumerate(self.ranks)]
                out_of_step(self.ranks)
                raise MetaMismatchError(fingerprint.mismatch(sides, self.ranks, "shared memory"))

    def all_reduce(self, tensor: torch.Tensor, op: str, via: Segment | None = None) -> torch.Tensor:
        """`tensor` (contiguous, CPU, at most the slot's bytes) reduced over the set, in place."""
        nbytes = tensor.numel() * tensor.element_size()
        fp = fingerprint.of("all_reduce", tensor.dtype, nbytes, op)
        rows, parts = self._exchange(tensor, fp, via)
        reduce_in_rank_order(rows, parts, op, tensor.view(-1))
        return tensor

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, via: Segment | None = None
    ) -> torch.Tensor:
        """Every rank's `input` stacked in ascending rank order into `output`."""
        nbytes = input.numel() * input.element_size()
        rows, _ = self._exchange(input, fingerprint.of("all_gather", input.dtype, nbytes), via)
        output.view(len(self.ranks), -1).copy_(rows)
        return output

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, via: Segment | None = None
    ) -> torch.Tensor:
        """This rank's chunk of the sum of every rank's `input` (n equal chunks along dim 0),
        summed in ascending rank order (the same sums on every rank)."""
        nbytes = input.numel() * input.element_size()
        rows, _ = self._exchange(
            input, fingerprint.of("reduce_scatter", input.dtype, nbytes, "sum"), via
        )
        n = len(self.ranks)
        mine = rows.view(n, n, -1)[:, self.me]
        return torch.sum(mine, 0, out=output.view(-1))

    def _arrived(self, n: int) -> bool:
        seq = self.seq
        return all(seq[k] >= n for k in self.others)

    def _wait(self, n: int, fp: int) -> None:
        for _ in range(self.spins):
            if self._arrived(n):
                return
        start = last_check = time.monotonic()
        timeout = env.get_timeout().total_seconds()
        while not self._arrived(n):
            now = time.monotonic()
            if now - start < YIELD_S:
                os.sched_yield()
            else:
                time.sleep(SLEEP_S)
            if now - last_check >= CHECK_EVERY_S:
                last_check = now
                self._check_peers(n, now - start, timeout, fp)

    def _in_arrival(self, index: int) -> bool:
        """Does peer `index` wait in an arrival this rank never made (and did not answer)?
        Its verdict is not written yet: once written (every rank came, or one gave up),
        the peer is leaving it, and no rank still runs a collective from before it."""
        mark = int(self.away[index])
        if not mark or self._answered.get(index) == mark:
            return False
        try:
            store = env.default_store()
            key = arrival_key(self.ranks, (mark & _CALL_BITS) - 1) + "verdict"
            return not store.check([key])
        except Exception:  # noqa: BLE001 - no store (or gone): say nothing
            return False

    def _check_peers(self, n: int, waited: float, timeout: float, fp: int) -> None:
        late = [r for r, s in zip(self.ranks, self.seq.tolist(), strict=True) if s < n]
        failed = failure.failed_at(self.ranks, self, n) if self.small else []
        if failed:  # (call n is used up, unread: no rank waits for this one in it; looked
            self.seq[self.me] = n - 1  # up first: a failing rank may go on into an arrival)
            raise failure.raised_for(failed, self.ranks, self, n, fp, "")
        away = [r for r in late if self._in_arrival(self.ranks.index(r))]
        if away and fingerprint.ENABLED:
            for r in away:
                self._answered[self.ranks.index(r)] = int(self.away[self.ranks.index(r)])
            self.calls, self.seq[self.me] = n - 1, n - 1  # (taken back: nobody read call n)
            self.undone[self.me] = n  # (which the waiting ranks read as the answer)
            out_of_step(self.ranks)
            raise MetaMismatchError(
                f"ranks {away} wait for every rank to arrive (through the store) while rank "
                f"{env.get_rank()} runs {fingerprint.describe(fp)} over ranks "
                f"{list(self.ranks)}: the ranks run different code (per-rank settings "
                "differ, or a call made on some ranks only)"
            )
        dead = self._lost(late)
        if dead or waited > timeout:
            why = f"ranks {dead} exited" if dead else f"ranks {late} did not arrive"
            raise CommTimeoutError(
                f"{fingerprint.describe(fp)} (shared memory) over ranks {list(self.ranks)} "
                "failed within the "
                f"timeout of {env.get_timeout()} (sbp.env.init(timeout=...)): {why}"
            )


def reduce_in_rank_order(rows: torch.Tensor, parts: list, op: str, out: torch.Tensor) -> None:
    """Every rank's part (`rows`, and one by one) reduced into `out` in rank order on every
    rank: the same bits everywhere."""
    if op == "sum":
        if len(parts) == 2:
            torch.add(parts[0], parts[1], out=out)
        else:
            out.copy_(parts[0])
            for part in parts[1:]:
                out.add_(part)
    elif op == "max":
        torch.amax(rows, 0, out=out)  # (amax and amin keep NaN)
    else:
        torch.amin(rows, 0, out=out)


def _header(n: int) -> int:
    """Bytes before the slots: a line per rank."""
    return LINE * n


def _alive(pid: int) -> bool:
    """Is `pid` running (not gone, not a zombie)?"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def arrival_key(ranks: tuple[int, ...], call: int) -> str:
    """The store prefix of the `call`-th arrival of a rank set (see `arrival`)."""
    return f"sbp/arrived/{','.join(map(str, sorted(ranks)))}/{call}/"


_out_of_step_listeners: list = []


def on_out_of_step(listener) -> None:
    """Call `listener(sorted ranks)` where a rank set is found out of step: every rank of
    the set then raises together, and what each kept of the set's past (conversions seen
    and checked) may differ between them, so it is dropped alike."""
    _out_of_step_listeners.append(listener)


def out_of_step(ranks: tuple[int, ...]) -> None:
    for listener in _out_of_step_listeners:
        listener(tuple(sorted(ranks)))


def _segment_of(ranks: tuple[int, ...]) -> Segment | None:
    known = _segments.get(tuple(sorted(ranks)))
    return None if known is None else known[1]


_CALL_BITS = (1 << 32) - 1
_withdrawn = [0]  # arrivals this process left out of step: part of its next marks


def waiting_in_arrival(ranks: tuple[int, ...], call: int | None) -> dict[int, int]:
    """Mark this rank as waiting in the store in arrival number `call` (None: back) in the
    rank set's segment, if it has one; return the ranks that wait meanwhile inside a call
    of the set that this rank has not made (they published a later call: out of step),
    with the call each published."""
    segment = _segment_of(ranks)
    if segment is None:
        return {}
    if call is not None:  # (a failure this rank took part in is settled first: a peer in
        # its marked call answers it, and then is not ahead; where none is, it waits)
        segment._begin(None, block=bool(_ahead(segment)))
    segment.away[segment.me] = 0 if call is None else (call + 1) | (_withdrawn[0] << 32)
    return _ahead(segment)


def _ahead(segment: Segment) -> dict[int, int]:
    """The ranks that published a call this rank has not made, with the call each did."""
    seq = segment.seq.tolist()
    return {r: seq[i] for i, r in enumerate(segment.ranks) if seq[i] > segment.calls}


def took_back(ranks: tuple[int, ...], ahead: dict[int, int]) -> bool:
    """Did each rank of `ahead` take back the call it had published (on seeing the mark)?"""
    segment = _segment_of(ranks)
    if segment is None:
        return True
    return all(segment.undone[segment.ranks.index(r)] == n for r, n in ahead.items())


def withdrawn(ranks: tuple[int, ...]) -> None:
    """This rank left its arrival out of step: its mark goes, and its next one differs."""
    _withdrawn[0] += 1
    waiting_in_arrival(ranks, None)


def enabled() -> bool:
    """Is the shared-memory path on in this process (x86-64, SBP_SHM not 0)?"""
    return _ENABLED


def usable(tensor: torch.Tensor) -> bool:
    """May this tensor's all-reduce go through shared memory (same answer on every rank)?"""
    return (
        _ENABLED
        and tensor.dtype != torch.bool
        and tensor.numel() * tensor.element_size() <= SLOT_BYTES
        and tensor.is_contiguous()
        and tensor.device.type == "cpu"
    )


def ready(ranks: tuple[int, ...], group) -> bool:
    """Was the rank set's segment (or its absence) settled for `group` already?"""
    known = _segments.get(ranks)
    return known is not None and known[0] is group


def big_ready(ranks: tuple[int, ...], group) -> bool:
    """Was the rank set's large segment (or its absence) settled for `group` already?"""
    known = _big_segments.get(ranks)
    return known is not None and known[0] is group


def segment(ranks: tuple[int, ...], group) -> Segment | None:
    """The rank set's segment, made at its first use (a collective over `group`), or None
    when the set spans hosts or shared memory is not available on one of them."""
    return _settled(_segments, ranks, group, SLOT_BYTES)


def big_segment(ranks: tuple[int, ...], group) -> Segment | None:
    """The rank set's second segment, for collectives of up to `BIG_SLOT_BYTES` per rank
    (made as `segment`; None also where its memory cannot be reserved)."""
    return _settled(_big_segments, ranks, group, BIG_SLOT_BYTES)


def _settled(table: dict, ranks: tuple[int, ...], group, slot_bytes: int) -> Segment | None:
    known = table.get(ranks)
    if known is not None and known[0] is group:
        return known[1]
    key = tuple(sorted(ranks))
    known = table.get(key)
    if known is None or known[0] is not group:
        known = table[key] = (group, _make(key, group, slot_bytes))
    table[ranks] = known
    return known[1]


def usable_big(tensor: torch.Tensor) -> bool:
    """May this tensor (a rank's part) go through the large segment (`BIG_SLOT_BYTES`)?"""
    return (
        _ENABLED
        and tensor.numel() * tensor.element_size() <= BIG_SLOT_BYTES
        and tensor.is_contiguous()
        and tensor.device.type == "cpu"
    )


def _host() -> str:
    """This host (and boot), as a short digest."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return hashlib.blake2b(f"{socket.gethostname()}/{boot}".encode(), digest_size=8).hexdigest()


INFO_BYTES = 256  # a rank's (host, pid, segment path) as JSON, padded with spaces
_INFO_FP = fingerprint.of("all_gather", torch.uint8, INFO_BYTES)


def _gather_info(ranks: tuple[int, ...], group, created: str | None) -> list:
    """Every rank's (host, pid, path of the segment it created or None), in rank order,
    through a gloo frame (`inline`): a rank that raised on bad input before the set's
    first call, and will not come, is named there (`failure`)."""
    text = json.dumps([_host(), os.getpid(), created]).encode()
    if len(text) > INFO_BYTES:  # (a path too long to share: this rank makes none)
        text = json.dumps([_host(), os.getpid(), None]).encode()
    data = torch.frombuffer(bytearray(text.ljust(INFO_BYTES)), dtype=torch.uint8)
    rows = inline.exchange(_INFO_FP, ranks, group, data)
    return [json.loads(bytes(row.tolist())) for row in rows]


def _make(ranks: tuple[int, ...], group, slot_bytes: int = SLOT_BYTES) -> Segment | None:
    size = _header(len(ranks)) + 2 * len(ranks) * slot_bytes
    leader = env.get_rank() == ranks[0]
    created, fd = None, None
    if leader:
        created = f"/dev/shm/sbp-{uuid.uuid4().hex}"
        try:
            fd = os.open(created, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, size)
            if slot_bytes > SLOT_BYTES:  # (reserved now: a full /dev/shm would SIGBUS later)
                os.posix_fallocate(fd, 0, size)
        except OSError:
            if fd is not None:
                os.close(fd)
                fd = None
                with contextlib.suppress(OSError):
                    os.unlink(created)
            created = None
    try:
        info = _gather_info(ranks, group, created)
        hosts = {h for h, _, _ in info}
        path = info[0][2]
        mapping = None
        if len(hosts) == 1 and path is not None:
            try:
                if fd is None:
                    fd = os.open(path, os.O_RDWR)
                mapping = mmap.mmap(fd, size)
            except OSError:
                mapping = None
        ok = torch.tensor([int(mapping is not None)])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)  # everyone attached, or none uses it
    finally:  # the mappings stay; nothing is left behind, even when a peer never came
        if fd is not None:
            os.close(fd)
        if created is not None:
            with contextlib.suppress(OSError):
                os.unlink(created)
    if not ok.item():
        return None
    return Segment(ranks, mapping, [pid for _, pid, _ in info], slot_bytes)


def clear() -> None:
    _segments.clear()
    _big_segments.clear()


env.at_shutdown(clear)
