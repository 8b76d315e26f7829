"""Shared helpers for the multi-rank CPU benchmarks (boxing now, dispatch later).

Everything here serves one rule from DESIGN.md: compare sbp against its anchors (the raw
torch.distributed collective, DTensor) *in the same run*, because this box is shared and
noisy and only ratios taken side by side mean anything. So timings interleave the methods
round by round, put a barrier before every call, and keep the slowest rank's time of each
round (a collective is only as fast as its slowest member).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import random
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RESULTS_DIR = Path(__file__).resolve().parent / "results"
BACKEND = "gloo"
MASTER_ADDR = "127.0.0.1"
PG_TIMEOUT = datetime.timedelta(minutes=5)  # a benchmark that hangs should fail, not sit


# ---------------------------------------------------------------- launching


def free_port() -> int:
    """A TCP port nobody listens on now, so runs for several world sizes never collide."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((MASTER_ADDR, 0))
        return s.getsockname()[1]


def spawn(worker: Callable[..., None], world_size: int, *args: Any, retries: int = 1) -> None:
    """Run `worker(rank, world_size, *args)` in `world_size` fresh processes.

    OMP_NUM_THREADS=1 is set before the children start (spawn copies the environment), so
    n ranks on a few cores do not oversubscribe them, as torchrun and our launcher do. A
    worker killed by a signal is retried on a new port (`retries` times): the free port
    can be taken by another job between our probe and the rendezvous.
    """
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    for attempt in range(retries + 1):
        try:
            mp.spawn(
                _entry, args=(worker, world_size, free_port(), args), nprocs=world_size, join=True
            )
            return
        except mp.ProcessExitedException as e:
            if attempt == retries:
                raise
            print(f"worker died ({e}); retrying world size {world_size}", file=sys.stderr)


def _entry(rank: int, worker: Callable[..., None], world: int, port: int, args: tuple) -> None:
    init_worker(rank, world, port)
    try:
        worker(rank, world, *args)
    finally:
        dist.destroy_process_group()


def gather_rows(worker: Callable[..., None], world_size: int, cfg: dict[str, Any]) -> list[dict]:
    """Run `worker(rank, world, cfg, path)` on `world_size` ranks; return the rows it wrote."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        part = Path(tmp) / f"n{world_size}.json"
        print(f"world size {world_size}:", flush=True)
        spawn(worker, world_size, cfg, str(part))
        return json.loads(part.read_text())


def print_report(text: str, summary: dict[str, list], skip: Sequence[str] = ()) -> None:
    """The table, then each target's misses."""
    print()
    print(text)
    print()
    for key, items in summary.items():
        if key in skip:
            continue
        print(f"{key}: {len(items)}")
        for item in items:
            print(f"  {item}")


def init_worker(rank: int, world: int, port: int) -> None:
    """gloo over 127.0.0.1, the variables torchrun would set (sbp.env adopts the group)."""
    os.environ.update(
        MASTER_ADDR=MASTER_ADDR,
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    dist.init_process_group(BACKEND, rank=rank, world_size=world, timeout=PG_TIMEOUT)


def use_cuda_device(rank: int) -> None:
    """This rank's GPU. With fewer GPUs than ranks (one GPU here) ranks share them, as
    one-GPU nodes would, and a cuda placement keeps each rank's data on cuda:LOCAL_RANK."""
    local = rank % torch.cuda.device_count()
    os.environ["LOCAL_RANK"] = str(local)
    torch.cuda.set_device(local)


def synchronized(methods: dict[str, Callable[[], Any]]) -> dict[str, Callable[[], Any]]:
    """The same methods, each call ending when the GPU has done its work."""

    def wrap(step: Callable[[], Any]) -> Callable[[], Any]:
        def run():
            out = step()
            torch.cuda.synchronize()
            return out

        return run

    return {name: wrap(step) for name, step in methods.items()}


def machine_info() -> dict[str, Any]:
    """What the numbers depend on, stored next to them."""
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem_kib = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem_kib = int(Path("/proc/meminfo").read_text().split("\n")[0].split()[1])
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": model,
        "memory_gib": round(mem_kib / 2**20, 1),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "backend": BACKEND,
        "omp_num_threads_per_rank": 1,
        "hostname": platform.node(),
    }


# ---------------------------------------------------------------- timing


@dataclass
class Timing:
    """Per-round times (ms, slowest rank of each round) of one method, or why it has none."""

    rounds_ms: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def median_ms(self) -> float | None:
        return statistics.median(self.rounds_ms) if self.rounds_ms else None

    @property
    def min_ms(self) -> float | None:
        return min(self.rounds_ms) if self.rounds_ms else None

    def as_dict(self) -> dict[str, Any]:
        if self.error is not None:
            return {"error": self.error}
        return {
            "median_ms": self.median_ms,
            "min_ms": self.min_ms,
            "rounds_ms": [round(t, 4) for t in self.rounds_ms],
        }


def _agree_ok(ok: Sequence[bool]) -> list[bool]:
    """Every rank drops a method that failed on any rank, so collectives stay matched."""
    flags = torch.tensor([1 if o else 0 for o in ok], dtype=torch.int32)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    return [bool(f) for f in flags.tolist()]


def short_error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return text[0][:300] if text else type(e).__name__


def time_methods(
    methods: dict[str, Callable[[], Any]], warmup: int, rounds: int
) -> dict[str, Timing]:
    """Time each method `rounds` times after `warmup` calls, interleaved round by round.

    Every call is preceded by a barrier; the time of a round is the max over ranks. A method
    that raises during warm-up on any rank is dropped on all ranks and keeps its error.
    Interleaving means slow phases of the shared machine hit every method alike; the order
    is shuffled each round, so what one method leaves behind (freed memory, busy threads)
    does not always fall on the same next one.
    """
    out = {name: Timing() for name in methods}
    live = list(methods)
    for _ in range(max(warmup, 1)):
        ok = []
        for name in live:
            dist.barrier()
            try:
                methods[name]()
                ok.append(True)
            except Exception as e:  # recorded per case, never fatal
                out[name].error = short_error(e)
                ok.append(False)
        agreed = _agree_ok(ok)
        for name, good in zip(list(live), agreed, strict=True):
            if not good:
                out[name].error = out[name].error or "failed on another rank"
                live.remove(name)
    times = torch.zeros(len(live), rounds, dtype=torch.float64)
    for r in range(rounds):
        order = list(range(len(live)))
        random.Random(r).shuffle(order)  # (seeded: every rank runs the same order)
        for i in order:
            name = live[i]
            fn = methods[name]
            dist.barrier()
            t0 = time.perf_counter()
            result = fn()
            times[i, r] = time.perf_counter() - t0
            del result
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    for i, name in enumerate(live):
        out[name].rounds_ms = [t * 1e3 for t in times[i].tolist()]
    return out


# ---------------------------------------------------------------- memory


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Silence fd 2 (kineto prints start/stop lines there that no log level turns off)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_allocated(fn: Callable[[], Any]) -> tuple[int, int]:
    """(peak, retained) CPU bytes allocated while `fn` runs, on every thread of this rank.

    Uses the profiler's allocation records (profile_memory=True): each c10 allocation and
    free, including the ones gloo's worker threads make inside a collective. Peak is the
    highest running sum of those records; retained is what is still allocated at the end
    (the output, when it is a new tensor). Bytes that existed before the call (the input)
    do not count.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    del result
    records = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == DeviceType.CPU
    )
    current = peak = 0
    retained = 0
    for _, nbytes in records:
        current += nbytes
        peak = max(peak, current)
    retained = current
    return peak, retained


def _proc_status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def rss_growth(fn: Callable[[], Any]) -> int | None:
    """Peak RSS growth (bytes) during `fn`: reset VmHWM, run, VmHWM - VmRSS before.

    A cross-check only: malloc reuses freed pages and untouched pages never count, so it
    is noisy and usually below the allocated bytes. None where /proc cannot do this.
    """
    try:
        dist.barrier()
        Path("/proc/self/clear_refs").write_text("5")
        before = _proc_status_kib("VmRSS")
        result = fn()
        peak = _proc_status_kib("VmHWM")
        del result
    except OSError:
        return None
    return max(peak - before, 0) * 1024


def small_all_reduce_ms(device: str, n: int = 64) -> dict[str, float]:
    """Median latency of an all-reduce of 2 x 96 floats (a BatchNorm layer's sums) on
    `device`, through gloo (torch.distributed) and through sbp.comm (shared memory on one
    host for CPU tensors; CUDA tensors go through gloo, which stages them in host memory)."""
    from sbp import comm

    out = {}
    ranks = tuple(range(dist.get_world_size()))
    for name, reduce in (
        ("gloo", lambda t: dist.all_reduce(t)),
        ("sbp", lambda t: comm.all_reduce(t, "sum", ranks)),
    ):
        t = torch.zeros(2, 96, device=device)
        reduce(t)
        times = []
        for _ in range(n):
            dist.barrier()
            t0 = time.perf_counter()
            reduce(t)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        worst = torch.tensor([statistics.median(times) * 1e3], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        out[name] = worst.item()
    return out


def max_over_ranks(values: Sequence[float | None]) -> list[float | None]:
    """Elementwise max over ranks; None counts as missing (None only if missing everywhere)."""
    missing = float("-inf")
    t = torch.tensor([missing if v is None else float(v) for v in values], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [None if v == missing else v for v in t.tolist()]


# ---------------------------------------------------------------- output


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fmt(v: Any, spec: str = ".2f") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    """Plain fixed-width text table (no dependency)."""
    cells = [[str(h) for h in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [
        "  ".join(
            c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_results(name: str, payload: dict[str, Any], out: Path | None = None) -> list[Path]:
    """Write `payload` to results/<name>-latest.json (or to `out` alone).

    One file per benchmark, overwritten: the repository keeps the latest numbers, and git
    history, not a pile of timestamped copies, keeps the old ones.
    """
    text = json.dumps(payload, indent=1, sort_keys=False) + "\n"
    path = out if out is not None else RESULTS_DIR / f"{name}-latest.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return [path]
