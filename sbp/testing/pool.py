"""A pool of SPMD worker processes (gloo on 127.0.0.1) that lives for a whole test session.

Starting a torch process and a process group costs seconds; a property test
runs hundreds of examples. So workers start once, and each test ships a
function (pickled with cloudpickle) to every rank and gets every rank's
result back. A function that raises reports each failing rank's traceback.
A worker that dies or hangs fails the call with what it printed (stacks are
dumped with faulthandler), and the whole world is started again: a gloo
world cannot replace one member.
"""

from __future__ import annotations

import atexit
import faulthandler
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import cloudpickle

HOST = "127.0.0.1"
# Each run is a program of its own on long-lived ranks: they start it with one count of
# user calls (`sbp.comm.failure.scope`), above any count so far, so that a test that made
# one on some ranks only (a divergence it checks is named) leaves no trace in the next.
RUN_USER_CALLS = 2**24


class SpmdError(AssertionError):
    """A call on the pool failed on at least one rank.

    `errors` maps rank -> traceback text; `exceptions` maps rank -> the exception
    object where it could be pickled back.
    """

    def __init__(self, message: str, errors: dict[int, str], exceptions: dict[int, BaseException]):
        super().__init__(message)
        self.errors = errors
        self.exceptions = exceptions


def _compact(result: Any) -> Any:
    """Plain tensors that view part of a larger storage are copied before pickling: pickle
    writes a view's whole storage, once per view (158 gradients that are views of one 9 MB
    gradient bucket, over a few steps, came to gigabytes)."""
    import torch
    from torch.utils._pytree import tree_map

    def own(t):
        if type(t) is torch.Tensor and t.device.type != "meta":
            if t.untyped_storage().nbytes() > t.numel() * t.element_size():
                return t.clone()
        return t

    return tree_map(own, result)


def _worker_main(
    rank: int, world: int, port: int, conn, sys_path: list[str], log: str, comm_timeout: float
) -> None:
    sys.path[:] = sys_path
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR=HOST,
        MASTER_PORT=str(port),
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import datetime

    import torch
    import torch.distributed as dist

    import sbp
    from sbp.comm import failure

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=comm_timeout)
    store = dist.TCPStore(HOST, port, world, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    sbp.env.init(timeout=comm_timeout)
    conn.send_bytes(b"ready")
    while True:
        try:
            payload = conn.recv_bytes()
        except EOFError:
            payload = b"stop"
        if payload == b"stop":
            dist.destroy_process_group()  # else gloo may abort at interpreter exit
            return
        try:
            run, fn, args, kwargs = cloudpickle.loads(payload)
            failure.start_counting_at(run * RUN_USER_CALLS)  # (see `RUN_USER_CALLS`)
            result = ("ok", cloudpickle.dumps(_compact(fn(*args, **kwargs))))
        except BaseException as e:  # noqa: BLE001 - everything goes back to the test
            try:
                exc = cloudpickle.dumps(e)
            except Exception:  # noqa: BLE001
                exc = None
            result = ("err", traceback.format_exc(), exc)
        sys.stdout.flush()
        conn.send_bytes(cloudpickle.dumps(result))


class SpmdPool:
    """`world_size` ranks that run shipped functions; `run(fn, *args)` returns every rank's result."""

    def __init__(self, world_size: int = 4, timeout: float = 120.0, comm_timeout: float = 60.0):
        self.world_size = world_size
        self.timeout = timeout
        self.comm_timeout = comm_timeout
        self._procs: list = []
        self._conns: list = []
        self._logdir = tempfile.mkdtemp(prefix=f"sbp-pool{world_size}-")
        self._start()

    def _log(self, rank: int) -> str:
        return os.path.join(self._logdir, f"rank{rank}.log")

    def _start(self) -> None:
        import datetime

        import torch.distributed as dist

        ctx = mp.get_context("spawn")
        self._runs = 0
        self._store = dist.TCPStore(
            HOST,
            0,
            self.world_size,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=self.comm_timeout),
        )
        port = self._store.port
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_worker_main,
                args=(
                    rank,
                    self.world_size,
                    port,
                    child,
                    list(sys.path),
                    self._log(rank),
                    self.comm_timeout,
                ),
                daemon=True,
            )
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)
        deadline = time.monotonic() + max(self.timeout, 120.0)
        for rank, conn in enumerate(self._conns):
            if not conn.poll(max(deadline - time.monotonic(), 0)) or conn.recv_bytes() != b"ready":
                tails = self._tails()
                self._kill()
                raise RuntimeError(f"SPMD pool rank {rank} did not start:\n{tails}")

    def _tails(self, chars: int = 3000) -> str:
        out = []
        for rank in range(self.world_size):
            try:
                with open(self._log(rank)) as f:
                    text = f.read()[-chars:]
            except OSError:
                text = ""
            if text.strip():
                out.append(f"--- rank {rank} output ---\n{text}")
        return "\n".join(out)

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5)
        for c in self._conns:
            c.close()
        self._procs, self._conns = [], []

    def restart(self) -> None:
        self._kill()
        self._start()

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> list[Any]:
        """Run `fn(*args, **kwargs)` on every rank; return the results in rank order."""
        self._runs += 1
        payload = cloudpickle.dumps((self._runs, fn, args, kwargs))
        for rank in range(self.world_size):
            with open(self._log(rank), "a") as f:
                f.truncate(0)
        for conn in self._conns:
            conn.send_bytes(payload)
        deadline = time.monotonic() + (timeout or self.timeout)
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        exceptions: dict[int, BaseException] = {}
        dead: dict[int, int | None] = {}
        pending = set(range(self.world_size))
        while pending and time.monotonic() < deadline:
            for rank in sorted(pending):
                conn, proc = self._conns[rank], self._procs[rank]
                if conn.poll(0):
                    try:
                        reply = cloudpickle.loads(conn.recv_bytes())
                    except EOFError:
                        proc.join(timeout=5)
                        dead[rank] = proc.exitcode
                        pending.discard(rank)
                        continue
                    pending.discard(rank)
                    if reply[0] == "ok":
                        results[rank] = cloudpickle.loads(reply[1])
                    else:
                        errors[rank] = reply[1]
                        if reply[2] is not None:
                            try:
                                exceptions[rank] = cloudpickle.loads(reply[2])
                            except Exception:  # noqa: BLE001
                                pass
                elif not proc.is_alive():
                    proc.join()
                    dead[rank] = proc.exitcode
                    pending.discard(rank)
            if (errors or dead) and pending:
                # Others may wait forever in a collective the failed rank never joins.
                deadline = min(deadline, time.monotonic() + 5.0)
            if pending:
                time.sleep(0.002)
        if not pending and not errors and not dead:
            return [results[r] for r in range(self.world_size)]
        return self._fail(errors, exceptions, dead, pending)

    def _fail(self, errors, exceptions, dead, pending) -> list[Any]:
        lines = []
        for rank, tb in sorted(errors.items()):
            lines.append(f"rank {rank} raised:\n{tb}")
        for rank, code in sorted(dead.items()):
            lines.append(f"rank {rank} died (exit code {code})")
        if pending:
            lines.append(f"ranks {sorted(pending)} did not finish in time")
            for rank in pending:
                try:
                    os.kill(self._procs[rank].pid, signal.SIGUSR1)
                except OSError:
                    pass
            time.sleep(0.5)
        if dead or pending:
            lines.append(self._tails())
            self.restart()
            lines.append("(the pool was restarted)")
        raise SpmdError("\n".join(lines), errors, exceptions)

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send_bytes(b"stop")
            except OSError:
                pass
        for p in self._procs:
            p.join(timeout=5)
        self._kill()


_pools: dict[int, SpmdPool] = {}


def get_pool(world_size: int = 4) -> SpmdPool:
    """The session-wide pool of `world_size` ranks (started on first use)."""
    pool = _pools.get(world_size)
    if pool is None:
        pool = _pools[world_size] = SpmdPool(world_size)
    return pool


def spmd(fn: Callable[..., Any], *args: Any, world_size: int = 4, **kwargs: Any) -> list[Any]:
    """Run `fn` on every rank of the session's pool of `world_size`; results in rank order."""
    return get_pool(world_size).run(fn, *args, **kwargs)


@atexit.register
def close_all() -> None:
    for pool in list(_pools.values()):
        pool.close()
    _pools.clear()
