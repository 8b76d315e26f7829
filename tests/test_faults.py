"""Faults: a rank that never arrives, a rank that dies mid-collective, a launcher killed hard.

Each ends in a named error on the ranks left (`CommTimeoutError` naming the missing rank)
within the timeout, or with no process left behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import sbp
from sbp import comm
from sbp.testing import SpmdError, SpmdPool

TIMEOUT = 2.0


def _rank_one_never_comes():
    sbp.env.init(timeout=TIMEOUT)  # after the process group exists: must apply
    start = time.monotonic()
    if sbp.env.get_rank() == 1:
        time.sleep(2.5 * TIMEOUT)
        return "away", "", 0.0
    try:
        comm.all_reduce(torch.ones(2), "sum", (0, 1))
    except sbp.CommTimeoutError as e:
        return "CommTimeoutError", str(e), time.monotonic() - start
    return "no error", "", time.monotonic() - start


def _rank_one_dies():
    sbp.env.init(timeout=30.0)
    if sbp.env.get_rank() == 1:
        time.sleep(0.5)
        os._exit(3)
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(2), "sum", (0, 1))
    except sbp.CommTimeoutError as e:
        raise sbp.CommTimeoutError(f"{e} [after {time.monotonic() - start:.1f} s]") from None


def test_timeout_applies_and_names_the_rank_that_did_not_arrive():
    pool = SpmdPool(2, timeout=60, comm_timeout=60.0)  # its own: the faults break its world
    try:
        kind, message, seconds = pool.run(_rank_one_never_comes)[0]
        assert kind == "CommTimeoutError"
        assert message.startswith("all_reduce over ranks [0, 1]")
        assert "ranks [1] did not arrive" in message
        assert TIMEOUT <= seconds < 2 * TIMEOUT  # not the pool's 60 s
        with pytest.raises(SpmdError) as info:
            pool.run(_rank_one_dies, timeout=60)
        assert "rank 1 died (exit code 3)" in str(info.value)
        rank0 = info.value.errors[0]
        assert "CommTimeoutError: all_reduce over ranks [0, 1]" in rank0
        assert "ranks [1] did not arrive" in rank0
        took = float(rank0.rsplit("[after ", 1)[1].split(" s]")[0])
        assert took < 10.0  # a lost peer is noticed long before the 30 s timeout
    finally:
        pool.close()


SLEEPER = """\
import os
import sys
import time

import sbp

with open(os.path.join(sys.argv[1], "pid" + os.environ["RANK"]), "w") as f:
    f.write(str(os.getpid()))
time.sleep(120)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line for line in f)
    except FileNotFoundError:
        return True


def _listening_addresses(pid: int) -> list[str]:
    """Local addresses of the TCP sockets `pid` listens on (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in list(f)[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                    addr = cols[1].split(":")[0]
                    if table == "tcp":
                        found.append(".".join(str(int(addr[i : i + 2], 16)) for i in (6, 4, 2, 0)))
                    else:
                        found.append("ipv6:" + addr)
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux")
def test_workers_die_with_a_sigkilled_launcher_whose_store_binds_127_0_0_1(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(textwrap.dedent(SLEEPER))
    cmd = [sys.executable, "-m", "sbp.distributed.launch", "--nproc_per_node", "2"]
    launcher = subprocess.Popen(
        [*cmd, str(script), str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 90
        pids = []
        while time.monotonic() < deadline and len(pids) < 2:
            pids = [
                int((tmp_path / f"pid{r}").read_text())
                for r in range(2)
                if (tmp_path / f"pid{r}").exists() and (tmp_path / f"pid{r}").read_text()
            ]
            time.sleep(0.2)
        assert len(pids) == 2, "the workers did not start"
        listening = _listening_addresses(launcher.pid)
        assert listening and all(addr == "127.0.0.1" for addr in listening), listening
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not all(_gone(p) for p in pids):
            time.sleep(0.1)
        left = [p for p in pids if not _gone(p)]
        for p in left:
            os.kill(p, signal.SIGKILL)
        assert not left, f"workers {left} outlived their launcher by 5 s"
    finally:
        if launcher.poll() is None:
            launcher.kill()


def _shared_memory_peer(fate):
    """A first all-reduce sets up the shared segment of ranks {0, 1}; then rank 1 stays away
    or exits while rank 0 waits in the second."""
    sbp.env.init(timeout=TIMEOUT)
    comm.all_reduce(torch.ones(2), "sum", (0, 1))
    if sbp.env.get_rank() == 1:
        if fate == "exits":
            time.sleep(0.3)
            os._exit(3)
        time.sleep(2.5 * TIMEOUT)
        return "away", 0.0
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(2), "sum", (0, 1))
    except sbp.CommTimeoutError as e:
        return str(e), time.monotonic() - start
    return "no error", time.monotonic() - start


def test_shared_memory_all_reduce_is_bounded_and_notices_a_dead_peer():
    from sbp.comm import shm

    if not shm.usable(torch.ones(2)):
        pytest.skip("no shared-memory path on this platform")
    pool = SpmdPool(2, timeout=60, comm_timeout=60.0)
    try:
        message, seconds = pool.run(_shared_memory_peer, "stays away")[0]
        assert (
            "all_reduce(sum) of 8 bytes of torch.float32 (shared memory) over ranks [0, 1]"
            in message
        )
        assert "ranks [1] did not arrive" in message
        assert TIMEOUT <= seconds < 2 * TIMEOUT
        with pytest.raises(SpmdError) as info:
            pool.run(_shared_memory_peer, "exits", timeout=60)
        rank0 = info.value.errors[0]
        assert "CommTimeoutError: all_reduce(sum) of 8 bytes" in rank0 and "[1] exited" in rank0
    finally:
        pool.close()


def _arrival_beside_a_peer_ahead() -> tuple:
    """Rank 0 waits in the store's arrival while rank 1, ahead, waits for it inside a
    shared-memory all-reduce; then each makes the other's call, and both arrive again."""
    from sbp.comm import arrival, fingerprint

    assert not fingerprint.ENABLED  # SBP_CHECK_COLLECTIVES=0
    ranks = (0, 1)
    comm.all_reduce(torch.ones(2), "sum", ranks)  # (the segment is made)
    start = time.monotonic()
    if sbp.env.get_rank() == 0:
        first = arrival.arrived_together(ranks, 0.5, "rank 0 gave up")
        total = comm.all_reduce(torch.ones(2), "sum", ranks)
    else:
        total = comm.all_reduce(torch.ones(2), "sum", ranks)
        first = arrival.arrived_together(ranks, 0.5, "rank 1 gave up")
    second = arrival.arrived_together(ranks, 10.0, "gave up")
    return first, second, total.tolist(), time.monotonic() - start


def test_arrival_with_the_check_off_waits_without_withdrawing(monkeypatch):
    """With SBP_CHECK_COLLECTIVES=0 a rank in the arrival that sees a peer ahead (waiting in
    a collective) neither raises nor withdraws: it gives up after its window, as the store
    says to every rank, and the arrivals stay numbered alike (the next one meets). Before
    (bfbe17f): it took its arrival back at every poll, so its later arrivals were numbered
    apart from the peer's and never met (both gave up)."""
    from sbp.comm import shm

    if not shm.usable(torch.ones(2)):
        pytest.skip("no shared-memory path on this platform")
    monkeypatch.setenv("SBP_CHECK_COLLECTIVES", "0")
    pool = SpmdPool(2, timeout=60, comm_timeout=60.0)
    try:
        for first, second, total, seconds in pool.run(_arrival_beside_a_peer_ahead):
            assert first == "rank 0 gave up"
            assert second == "every rank arrived"
            assert total == [2.0, 2.0]
            assert seconds < 10
    finally:
        pool.close()
