"""The cost of checking every collective's fingerprint (sbp.comm.fingerprint), same run.

On 2 ranks, each case runs with the check on and off (`fingerprint.ENABLED`), the two
interleaved round by round (common.time_methods: a barrier before every call, the
slowest rank's time):
  all_reduce of 384 B      shared memory: the fingerprint rides in the same write;
  all_reduce of 256 KiB,   gloo: the ranks first meet in the shared segment with the
  4 MiB, 16 MiB            fingerprint alone;
  all_to_all of 4 MiB      gloo, likewise;
  step (logical BN), step (per-shard BN)
                           a mobilenet_v2 data-parallel training step (batch 32 per
                           rank): ~100 small BatchNorm all-reduces, and the bucketed
                           gradient all-reduces in backward.
A small call is timed as a block of 50 back-to-back calls.

    .venv/bin/python benchmarks/fingerprint.py            # ~2 min
    .venv/bin/python benchmarks/fingerprint.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import data_parallel  # noqa: E402
from common import fmt, gather_rows, machine_info, ratio, table, time_methods, write_results  # noqa: E402

SMALL_BLOCK = 50


def _with_check(on: bool, fn):
    from sbp.comm import fingerprint

    def run():
        fingerprint.ENABLED = on
        try:
            return fn()
        finally:
            fingerprint.ENABLED = True

    return run


def _collective_cases(world: int) -> dict:
    from sbp.comm import collectives

    ranks = tuple(range(world))
    cases = {}
    small = torch.ones(96)

    def small_block():
        for _ in range(SMALL_BLOCK):
            collectives.all_reduce(small, "sum", ranks)

    cases[f"all_reduce 384 B x{SMALL_BLOCK}"] = small_block
    for label, numel in (("256 KiB", 64 << 10), ("4 MiB", 1 << 20), ("16 MiB", 4 << 20)):
        t = torch.ones(numel)
        cases[f"all_reduce {label}"] = lambda t=t: collectives.all_reduce(t, "sum", ranks)
    rows = 1 << 10
    src, dst = torch.ones(rows, 1024), torch.empty(rows, 1024)
    splits = [rows // world] * world
    cases["all_to_all 4 MiB"] = lambda: collectives.all_to_all(dst, src, splits, splits, ranks)
    return cases


def worker(rank: int, world: int, cfg: dict, path: str) -> None:
    cases = _collective_cases(world)
    base = data_parallel._model("cpu", "mobilenet_v2")
    batches = data_parallel._batches(rank, {**cfg, "batch": 32}, "cpu")
    logical = data_parallel._global_trainer(base, batches, "cpu")
    shard = data_parallel._global_trainer(base, batches, "cpu", batch_norm="local")
    cases["step (logical BN)"] = logical.step
    cases["step (per-shard BN)"] = shard.step
    methods = {}
    for name, fn in cases.items():
        methods[f"{name} | on"] = _with_check(True, fn)
        methods[f"{name} | off"] = _with_check(False, fn)
    timings = time_methods(methods, cfg["warmup"], cfg["rounds"])
    out = {k: v.as_dict() for k, v in timings.items()}
    if rank == 0:
        Path(path).write_text(json.dumps({"world": world, "timings": out, "cases": list(cases)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="5 rounds")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    cfg = {"rounds": 5 if args.quick else args.rounds, "warmup": args.warmup, "quick": True}
    rows = gather_rows(worker, 2, cfg)
    timings = rows["timings"]
    lines = []
    for case in rows["cases"]:
        on = timings[f"{case} | on"].get("median_ms")
        off = timings[f"{case} | off"].get("median_ms")
        lines.append([case, fmt(off, ".3f"), fmt(on, ".3f"), fmt(ratio(on, off), ".3f")])
    print()
    print(table(lines, ["2 ranks, median of rounds", "check off ms", "check on ms", "on/off"]))
    payload = {"machine": machine_info(), "config": cfg, "results": rows}
    for p in write_results("fingerprint", payload, args.out):
        print(f"wrote {p}")


if __name__ == "__main__":
    main()
