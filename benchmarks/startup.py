"""Startup benchmark: import time, time to the first op, time to the first training step.

What a user waits for before anything runs, for
  torch    plain torch tensors and module (the anchor);
  sbp      `import sbp`, then a split(0) GlobalTensor and a broadcast model (world of 1);
  dtensor  torch.distributed.tensor on a DeviceMesh of one rank (gloo).
Each measurement is a fresh interpreter (a second op, or a second run in one process, is
warm and measures nothing): the methods are run `--repeats` times, interleaved, and the
table shows medians and each method's excess over plain torch.

  import       `import torch` (+ `import sbp` / `import torch.distributed.tensor`)
  first op     after the imports: make the input (global / distributed), run `x * 2 + 1`
               (a tensor subclass also pays torch's own lazy imports here, such as its C++
               check for DTensor, which imports torch.distributed.tensor and sympy)
  first step   after that: build a small MLP (global / replicated), one forward +
               backward + SGD step (torch.optim imports torch._dynamo in every method)
  total        the three together: the wait before the first training step is done

Run `python benchmarks/startup.py` (about a minute); see benchmarks/README.md.
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


def _common():
    """benchmarks/common.py imports torch: only after the child has timed its imports."""
    try:  # `python -m benchmarks.startup` from the repository root
        from benchmarks import common
    except ImportError:  # `python benchmarks/startup.py`
        import common
    return common


METHODS = ("torch", "sbp", "dtensor")
PHASES = ("import", "first op", "first step", "total")


def _child(method: str) -> dict[str, float]:
    """Runs in a fresh interpreter: the three phases, in seconds."""
    t0 = time.perf_counter()
    import torch

    if method == "sbp":
        import sbp
    elif method == "dtensor":
        import torch.distributed as dist
        import torch.distributed.tensor as dt
    t_import = time.perf_counter() - t0

    t1 = time.perf_counter()
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    y = torch.randint(0, 4, (8,))
    if method == "sbp":
        P = sbp.placement.all("cpu")
        x = sbp.to_global(x, P, sbp.split(0))
        y = sbp.to_global(y, P, sbp.split(0))
    elif method == "dtensor":
        common = _common()
        os.environ.update(MASTER_ADDR=common.MASTER_ADDR, MASTER_PORT=str(common.free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
        mesh = dt.DeviceMesh("cpu", [0])
        x = dt.distribute_tensor(x, mesh, [dt.Shard(0)])
        y = dt.distribute_tensor(y, mesh, [dt.Shard(0)])
    z = x * 2 + 1
    t_op = time.perf_counter() - t1
    del z

    t2 = time.perf_counter()
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    if method == "sbp":
        model.to_global(P, sbp.broadcast)
    elif method == "dtensor":
        for name, p in list(model.named_parameters()):
            owner, attr = name.rsplit(".", 1)
            replicated = dt.distribute_tensor(p.data, mesh, [dt.Replicate()])
            setattr(model.get_submodule(owner), attr, torch.nn.Parameter(replicated))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    t_step = time.perf_counter() - t2
    if method == "dtensor":
        dist.destroy_process_group()
    total = t_import + t_op + t_step
    return {"import": t_import, "first op": t_op, "first step": t_step, "total": total}


def _run_child(method: str) -> dict[str, float]:
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH", "")]))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    out = subprocess.run(
        [sys.executable, __file__, "--child", method],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child)))
        return

    common = _common()
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
    for r in range(args.repeats):
        for m in METHODS:
            runs[m].append(_run_child(m))
        print(f"round {r + 1}/{args.repeats} done", flush=True)
    med = {m: {p: statistics.median(run[p] for run in runs[m]) for p in PHASES} for m in METHODS}
    rows = []
    for m in METHODS:
        rows.append(
            [m]
            + [common.fmt(med[m][p], ".3f") for p in PHASES]
            + [common.fmt(med[m][p] - med["torch"][p], "+.3f") for p in PHASES]
        )
    header = ["method", *(f"{p} s" for p in PHASES), *(f"{p} - torch" for p in PHASES)]
    print()
    print(common.table(rows, header))
    payload = {
        "benchmark": "startup",
        "machine": common.machine_info(),
        "repeats": args.repeats,
        "median_s": med,
        "runs_s": runs,
    }
    for path in common.write_results("startup", payload, args.out):
        print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
