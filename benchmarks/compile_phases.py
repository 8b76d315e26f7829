"""Where a compiled step's time goes: each phase of global-compiled against torch-compiled.

`compile.py` times whole steps; its ratio spreads by a few hundredths between runs of the
same tree on a shared CPU, which hides the host work one change saves. This benchmark
runs the two steps interleaved in one process (world of one, the same model and data as
`compile.py`) and times each phase on the thread's CPU clock: zero_grad, the model's
call, the loss, backward and the optimizer's step. The median of each phase over the
rounds, and sbp's extra over torch per phase, say where sbp's host work is.

Run `python benchmarks/compile_phases.py` (the `compile.py` proxy's shape by default:
`--width 0.1 --image 8 --batch 2`, a step that is mostly host work as on an H100). With
`--device cuda` the phases are still host time (what sbp adds is host work; the GPU's
kernels run behind it), and a last column gives each whole step's wall time, the GPU
waited for at its end.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

try:  # `python -m benchmarks.compile_phases` from the repository root
    from benchmarks import common
    from benchmarks.compile import _model, _sgd
except ImportError:  # `python benchmarks/compile_phases.py`
    import common
    from compile import _model, _sgd

PHASES = ("zero_grad", "forward", "loss", "backward", "step")
WALL = "wall"  # the whole step, synchronized at its end (not a phase: not in the sum)
TIMED = (*PHASES, WALL)


def _timed_step(model, opt, x, y, times: dict[str, list[float]], cuda: bool) -> None:
    clock = time.thread_time_ns
    w0 = time.perf_counter_ns()
    t0 = clock()
    opt.zero_grad(set_to_none=True)
    t1 = clock()
    out = model(x)
    t2 = clock()
    loss = F.cross_entropy(out, y)
    t3 = clock()
    loss.backward()
    t4 = clock()
    opt.step()
    t5 = clock()
    if cuda:
        torch.cuda.synchronize()
    times[WALL].append((time.perf_counter_ns() - w0) / 1e6)
    for name, ns in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
        times[name].append(ns / 1e6)


def _worker(rank: int, world: int, cfg: dict, path: str) -> None:
    import json

    import sbp
    import sbp.nn

    warnings.filterwarnings("ignore")
    device = cfg["device"]
    cuda = device == "cuda"
    if cuda:
        common.use_cuda_device(rank)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(cfg["batch"], 3, cfg["image"], cfg["image"], generator=g).to(device)
    y = torch.randint(0, 10, (cfg["batch"],), generator=g).to(device)
    P = sbp.placement(device, [0])
    gx, gy = sbp.to_global(x, P, sbp.split(0)), sbp.to_global(y, P, sbp.split(0))
    plain = _model(cfg["width"]).to(device)
    glob = _model(cfg["width"]).to(device).to_global(P, sbp.broadcast)
    sbp.nn.data_parallel(glob)
    runs: dict[str, Any] = {
        "torch-compiled": (torch.compile(plain), _sgd(plain), x, y),
        "global-compiled": (torch.compile(glob), _sgd(glob), gx, gy),
    }
    times = {name: {p: [] for p in TIMED} for name in runs}
    for rounds, kept in ((cfg["warmup"], False), (cfg["rounds"], True)):  # (warm-up compiles)
        for _ in range(rounds):
            for name, (model, opt, a, b) in runs.items():  # interleaved: drift hits both
                into = times[name] if kept else {p: [] for p in TIMED}
                _timed_step(model, opt, a, b, into, cuda)
    medians = {
        name: {p: statistics.median(ts) for p, ts in phases.items()}
        for name, phases in times.items()
    }
    with open(path, "w") as fh:
        json.dump([{"method": name, "phase_ms": m} for name, m in medians.items()], fh)


def _report(rows: list[dict]) -> str:
    by = {r["method"]: r["phase_ms"] for r in rows}
    torch_ms, global_ms = by["torch-compiled"], by["global-compiled"]
    lines = []
    for p in (*PHASES, "sum", WALL):
        t = sum(torch_ms[q] for q in PHASES) if p == "sum" else torch_ms[p]
        s = sum(global_ms[q] for q in PHASES) if p == "sum" else global_ms[p]
        lines.append((p, f"{t:.3f}", f"{s:.3f}", f"{s - t:+.3f}", common.fmt(common.ratio(s, t))))
    header = ("phase", "torch-compiled ms", "global-compiled ms", "extra ms", "x torch")
    return common.table(lines, header)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--width", type=float, default=0.1, help="mobilenet_v2's width_mult")
    ap.add_argument("--image", type=int, default=8, help="image side, pixels")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    keys = ("batch", "width", "image", "warmup", "rounds", "device")
    cfg = {k: getattr(args, k) for k in keys}
    rows = common.gather_rows(_worker, 1, cfg)
    common.print_report(_report(rows), {})
    payload = {"machine": common.machine_info(), "config": cfg, "rows": rows}
    out = None if args.out is None else Path(args.out)
    name = "compile-phases" + ("-cuda" if args.device == "cuda" else "")
    path = common.write_results(name, payload, out)
    print(f"wrote {path[0]}")


if __name__ == "__main__":
    main()
