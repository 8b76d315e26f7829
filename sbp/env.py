"""Rank, world size and local rank; process-group start-up from torchrun or Slurm variables.

`init()` runs implicitly on first use. With no launcher variables the world is
one process and no process group is created, so single-device scripts run
unchanged.
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import gc
import math
import os
import re
import signal
import sys

import torch
import torch.distributed as dist

from sbp.errors import InputTypeError, InputValueError, SbpError


def _positive_seconds(seconds: float, what: str) -> datetime.timedelta:
    """`seconds` as a timedelta, where it is a positive, finite number that one fits (torch
    keeps a group's timeout in milliseconds); else `InputValueError` naming `what`."""
    if seconds > 0 and math.isfinite(seconds):
        try:
            out = datetime.timedelta(seconds=seconds)
        except OverflowError:
            pass
        else:
            if out <= _LONGEST_TIMEOUT:
                return out
    raise InputValueError(
        f"{what} must be a positive, finite number of seconds (at most ~68 years), got "
        f"{seconds!r}; pass a number of seconds such as 300"
    )


_LONGEST_TIMEOUT = datetime.timedelta(milliseconds=2**31 - 1) * 1000  # (int64 ms, spare room)


def _timeout_from_environment() -> tuple[datetime.timedelta, SbpError | None]:
    """`SBP_TIMEOUT` (seconds, default 300), and what is wrong with it: raised by `init`,
    not at import (`import sbp` works, and `init(timeout=...)` overrides the variable)."""
    text = os.environ.get("SBP_TIMEOUT")
    fallback = datetime.timedelta(seconds=300)
    if text is None:
        return fallback, None
    try:
        seconds = float(text)
    except ValueError:
        return fallback, InputValueError(
            f"SBP_TIMEOUT={text!r} is not a number of seconds; set it to one "
            "(SBP_TIMEOUT=300, not 5min) or unset it for the default, 300"
        )
    try:
        return _positive_seconds(seconds, f"SBP_TIMEOUT={text!r}"), None
    except InputValueError as e:
        return fallback, e


# torch's default is 30 minutes: a script with a bug on one rank would hang that long. Five
# minutes outlasts slow first steps (data loading, compilation) and still fails an interactive
# job in reasonable time; `SBP_TIMEOUT` (seconds) or `init(timeout=...)` change it.
DEFAULT_TIMEOUT, _ENVIRONMENT_ERROR = _timeout_from_environment()

_state: dict = {"ready": False, "rank": 0, "world": 1, "local_rank": 0, "timeout": DEFAULT_TIMEOUT}


def _as_timedelta(timeout: float | datetime.timedelta | None) -> datetime.timedelta:
    """`init`'s timeout: None takes `SBP_TIMEOUT`'s. A bool is no number of seconds (True
    was taken as 1 s), and infinity overflowed inside datetime."""
    if timeout is None:
        if _ENVIRONMENT_ERROR is not None:
            raise _ENVIRONMENT_ERROR
        return DEFAULT_TIMEOUT
    if isinstance(timeout, datetime.timedelta):
        if timeout > datetime.timedelta(0):
            return _positive_seconds(timeout.total_seconds(), "sbp.env.init: timeout")
        raise InputValueError(
            f"sbp.env.init: timeout must be positive, got {timeout!r}; pass a number of "
            "seconds such as 300"
        )
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise InputTypeError(
            f"sbp.env.init: timeout must be a number of seconds or a datetime.timedelta, got "
            f"{timeout!r}"
        )
    return _positive_seconds(float(timeout), "sbp.env.init: timeout")


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list such as `gpu[03-05,07],cpu1`."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise SbpError(f"cannot parse SLURM_NODELIST {nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _launcher_vars() -> dict | None:
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return {
            "rank": int(env["RANK"]),
            "world": int(env["WORLD_SIZE"]),
            "local_rank": int(env.get("LOCAL_RANK", 0)),
        }
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        env.setdefault("MASTER_ADDR", first_slurm_host(env.get("SLURM_NODELIST", "127.0.0.1")))
        env.setdefault("MASTER_PORT", "29500")
        return {
            "rank": int(env["SLURM_PROCID"]),
            "world": int(env["SLURM_NTASKS"]),
            "local_rank": int(env.get("SLURM_LOCALID", 0)),
        }
    return None


def default_backend() -> str:
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def init(backend: str | None = None, timeout: float | datetime.timedelta | None = None) -> None:
    """Start (or adopt) the default process group. Idempotent; a new `timeout` applies at once
    to every process group that already exists, and to those made later."""
    if backend is not None and not isinstance(backend, str):
        raise InputTypeError(
            f"sbp.env.init: backend must be a string such as 'gloo', 'nccl' or "
            f"'cpu:gloo,cuda:nccl', got {backend!r}"
        )
    if timeout is not None or not _state["ready"]:
        _state["timeout"] = _as_timedelta(timeout)
    if _state["ready"]:
        if timeout is not None:
            _apply_timeout(_state["timeout"])
        return
    if dist.is_available() and dist.is_initialized():
        _state.update(rank=dist.get_rank(), world=dist.get_world_size())
        _state["local_rank"] = int(os.environ.get("LOCAL_RANK", _state["local_rank"]))
        _state["ready"] = True
        # (the user's group: sbp's cached subgroups must still go before the interpreter
        # does, also after the user's own destroy_process_group)
        atexit.register(_shutdown)
        if timeout is not None:
            _apply_timeout(_state["timeout"])
        return
    found = _launcher_vars()
    if found is None or found["world"] == 1:
        found = found or {"rank": 0, "world": 1, "local_rank": 0}
        _state.update(found, ready=True)
        return
    dist.init_process_group(
        backend=backend or default_backend(),
        init_method="env://",
        rank=found["rank"],
        world_size=found["world"],
        timeout=_state["timeout"],
    )
    atexit.register(_shutdown)
    _state.update(found, ready=True)


def _apply_timeout(timeout: datetime.timedelta) -> None:
    """Set `timeout` on every process group this rank belongs to (torch keeps it per group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    set_timeout = getattr(dist, "set_timeout", None)
    for group in list(getattr(dist.distributed_c10d._world, "pg_map", {})):
        if set_timeout is not None:
            set_timeout(timeout, group)
        else:  # torch < 2.9
            dist.distributed_c10d._set_pg_timeout(timeout, group)


_before_shutdown: list = []  # callables run before the process group is destroyed


def at_shutdown(fn) -> None:
    """Run `fn` at exit before the process group goes (layers above drop what they hold)."""
    _before_shutdown.append(fn)


def _shutdown() -> None:
    """Destroy the process group (sbp's, or the user's if still alive) before the
    interpreter exits.

    Left alive, gloo's threads are torn down during static destruction and about one
    exit in five aborts with "terminate called without an active exception" (SIGABRT),
    which a launcher reports as a failed worker. References kept above (sbp's cache of
    groups) are dropped first, so no group outlives this.
    """
    for fn in _before_shutdown:
        try:
            fn()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
    gc.collect()  # cyclic garbage (autograd graphs, modules) may still hold a group's work
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


def _ensure() -> None:
    if not _state["ready"]:
        init()


def get_rank() -> int:
    _ensure()
    return _state["rank"]


def get_world_size() -> int:
    _ensure()
    return _state["world"]


def get_local_rank() -> int:
    _ensure()
    return _state["local_rank"]


def get_timeout() -> datetime.timedelta:
    return _state["timeout"]


def default_store() -> dist.Store | None:
    """The world's default store, or None where there is none (or it is gone)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no group, or the rank that hosted it exited
        return None


def is_distributed() -> bool:
    """True when a process group is running (world > 1 or adopted)."""
    _ensure()
    return dist.is_available() and dist.is_initialized()


def reset() -> None:
    """Forget the adopted state (tests and worker pools that re-create the world)."""
    _state.update(ready=False, rank=0, world=1, local_rank=0, timeout=DEFAULT_TIMEOUT)


PR_SET_PDEATHSIG = 1


def die_with_launcher() -> None:
    """Under `sbp.distributed.launch`, have the kernel kill this worker when the launcher dies.

    A launcher killed with SIGKILL cannot stop its workers, which would keep running (and
    holding ports and GPUs). The launcher puts its pid in `SBP_LAUNCHER_PID`; a direct child
    asks for SIGKILL on its parent's death (Linux `prctl(PR_SET_PDEATHSIG)`). A worker started
    through a wrapper (`--no_python` with a shell script) is not a direct child and is left
    alone. Runs when `sbp` is imported.
    """
    pid = os.environ.get("SBP_LAUNCHER_PID", "")
    if not pid.isdigit() or not sys.platform.startswith("linux"):
        return
    if os.getppid() != int(pid):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(pid):  # it died before prctl took effect
        os._exit(1)


die_with_launcher()
