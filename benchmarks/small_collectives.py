"""Small all-reduces: sbp.comm (shared memory between ranks of one host) vs gloo, under
several schedulers' conditions, same run.

A logical BatchNorm step makes ~100 all-reduces of a few hundred bytes, so their latency,
and their tail, is what matters. Each scenario times back-to-back all-reduces of 2 x 96
float32 (one BatchNorm layer's sums) through gloo (`dist.all_reduce`) and through
`sbp.comm.all_reduce`, interleaved in blocks, and reports the median, p90 and p99 of the
slowest rank:
- `2 ranks`: one rank per core;
- `2 ranks, 1 core`: both ranks pinned to the same core (the shared-memory path sees
  fewer cores than ranks and yields at once instead of spinning);
- `4 ranks`: more ranks than cores;
- `2 ranks + 2 busy`: two other processes spinning on the cores meanwhile.

    .venv/bin/python benchmarks/small_collectives.py            # ~1 min
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import fmt, gather_rows, machine_info, table, write_results  # noqa: E402

SCENARIOS = {
    "2 ranks": {"world": 2, "pin": False, "busy": 0},
    "2 ranks, 1 core": {"world": 2, "pin": True, "busy": 0},
    "4 ranks": {"world": 4, "pin": False, "busy": 0},
    "2 ranks + 2 busy": {"world": 2, "pin": False, "busy": 2},
}
BLOCK = 50  # calls of one path before switching to the other


def _quantiles(times: list[float]) -> dict[str, float]:
    q = statistics.quantiles(times, n=100)
    return {"median": statistics.median(times) * 1e3, "p90": q[89] * 1e3, "p99": q[98] * 1e3}


def worker(rank: int, world: int, cfg: dict, path: str) -> None:
    from sbp import comm

    if cfg["pin"]:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    ranks = tuple(range(world))
    t = torch.zeros(2, 96)
    paths = {
        "gloo": lambda: dist.all_reduce(t),
        "sbp": lambda: comm.all_reduce(t, "sum", ranks),
    }
    times: dict[str, list[float]] = {name: [] for name in paths}
    for fn in paths.values():  # warm-up (the shared segment is set up at the first call)
        for _ in range(20):
            fn()
    for _ in range(cfg["calls"] // BLOCK):
        for name, fn in paths.items():
            dist.barrier()
            for _ in range(BLOCK):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    stats = {name: _quantiles(v) for name, v in times.items()}
    flat = torch.tensor([stats[n][k] for n in paths for k in ("median", "p90", "p99")])
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)  # the slowest rank's
    if rank == 0:
        values = iter(flat.tolist())
        out = {n: {k: next(values) for k in ("median", "p90", "p99")} for n in paths}
        Path(path).write_text(json.dumps(out))


def _busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=1000, help="per path and scenario")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results = {}
    for name, scenario in SCENARIOS.items():
        busy = _busy(scenario["busy"])
        try:
            cfg = {"calls": args.calls, "pin": scenario["pin"]}
            results[name] = gather_rows(worker, scenario["world"], cfg)
        finally:
            for p in busy:
                p.kill()
                p.wait()
    rows = []
    for name, r in results.items():
        g, s = r["gloo"], r["sbp"]
        rows.append(
            [
                name,
                *(fmt(g[k], ".3f") for k in ("median", "p90", "p99")),
                *(fmt(s[k], ".3f") for k in ("median", "p90", "p99")),
                fmt(g["median"] / s["median"], ".1f"),
            ]
        )
    header = ["scenario", "gloo med", "p90", "p99", "sbp med", "p90", "p99", "gloo/sbp med"]
    print()
    print(table(rows, header))
    print("\nms per all-reduce of 2 x 96 float32, slowest rank; sbp: shared memory on one host")
    payload = {
        "benchmark": "small_collectives",
        "config": {"calls": args.calls, "bytes": 2 * 96 * 4, "scenarios": SCENARIOS},
        "machine": machine_info(),
        "results_ms": results,
    }
    for p in write_results("small-collectives", payload, args.out):
        print(f"wrote {p}")


if __name__ == "__main__":
    main()
