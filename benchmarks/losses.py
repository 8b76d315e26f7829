"""Loss benchmark: a data-parallel step's loss on the fast path's output, local vs op by op.

The data-parallel fast path runs the model on local tensors; the loss of its output runs on
the local tensors too where `sbp.data_parallel.outputs` knows the loss (cross-entropy, K-dim
cross-entropy, mse, binary cross-entropy with logits, ...), else op by op through the
rules. One step here is forward, loss and backward of a small model (a step that is mostly
host work, as a GPU step is), timed side by side for
  torch        plain torch on this rank's shard of the batch (the anchor in a world of 1)
  ddp          torch DistributedDataParallel on the shard (the anchor in a world of 2: the
               same work, the gradients' all-reduce included)
  sbp-local    global model and batch, the loss on the local tensors
  sbp-op-by-op the same, the output a plain GlobalTensor: the loss dispatches each aten op
so sbp-op-by-op minus sbp-local is what the local loss saves per step. Worlds of 1 and 2;
the anchor is torch in a world of 1 and DDP in a world of 2.

Run `python benchmarks/losses.py` (about a minute).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

try:  # `python -m benchmarks.losses` from the repository root
    from benchmarks import common
except ImportError:  # `python benchmarks/losses.py`
    import common

CLASSES, POSITIONS, FEATURES = 10, 4, 16

# name: (the loss, scores per position (N, C, POSITIONS)?, float targets?)
LOSSES: dict[str, tuple[Callable, bool, bool]] = {
    "cross_entropy": (F.cross_entropy, False, False),
    "cross_entropy_kdim": (F.cross_entropy, True, False),
    "mse": (F.mse_loss, False, True),
    "bce_with_logits": (F.binary_cross_entropy_with_logits, False, True),
}


class _Model(torch.nn.Module):
    def __init__(self, positions: bool):
        super().__init__()
        self.positions = positions
        width = CLASSES * (POSITIONS if positions else 1)
        self.body = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.Tanh())
        self.head = torch.nn.Linear(32, width)

    def forward(self, x):
        out = self.head(self.body(x))
        return out.view(len(x), CLASSES, POSITIONS) if self.positions else out


def _step(model, loss, x, y) -> Callable[[], Any]:
    def step():
        model.zero_grad(set_to_none=True)
        value = loss(model(x), y)
        value.backward()
        return value

    return step


def _methods(rank: int, world: int, cfg: dict) -> dict[str, Callable[[], Any]]:
    import sbp
    import sbp.nn

    g = torch.Generator().manual_seed(0)
    batch = cfg["batch"]
    P = sbp.placement("cpu", list(range(world)))
    rows = sbp.local_slices((batch,), P, sbp.split(0), P.coord(rank))[0]
    methods: dict[str, Callable[[], Any]] = {}
    for name, (loss, positions, regression) in LOSSES.items():
        x = torch.randn(batch, FEATURES, generator=g)
        if regression:
            y = torch.rand(batch, CLASSES, generator=g)
        else:
            y = torch.randint(
                0, CLASSES, (batch, POSITIONS) if positions else (batch,), generator=g
            )
        xl, yl = x[rows].contiguous(), y[rows].contiguous()
        gx, gy = sbp.to_global(xl, P, sbp.split(0)), sbp.to_global(yl, P, sbp.split(0))
        torch.manual_seed(0)
        methods[f"{name} torch"] = _step(_Model(positions), loss, xl, yl)
        if world > 1:
            torch.manual_seed(0)
            ddp = torch.nn.parallel.DistributedDataParallel(_Model(positions))
            methods[f"{name} ddp"] = _step(ddp, loss, xl, yl)
        for kind in ("local", "op-by-op"):
            torch.manual_seed(0)
            model = _Model(positions).to_global(P, sbp.broadcast)
            sbp.nn.fast_path.state(model).twins = kind == "local"
            methods[f"{name} sbp-{kind}"] = _step(model, loss, gx, gy)
    return methods


def _worker(rank: int, world: int, cfg: dict, path: str) -> None:
    import json
    import warnings

    warnings.filterwarnings("ignore")
    timings = common.time_methods(_methods(rank, world, cfg), cfg["warmup"], cfg["rounds"])
    if rank == 0:
        rows = [{"world": world, "method": n, **t.as_dict()} for n, t in timings.items()]
        Path(path).write_text(json.dumps(rows))


def _report(rows: list[dict]) -> str:
    by = {(r["world"], r["method"]): r.get("median_ms") for r in rows}
    lines = []
    for world in sorted({r["world"] for r in rows}):
        anchor = "torch" if world == 1 else "ddp"
        for name in LOSSES:
            torch_ms, local, per_op = (by.get((world, f"{name} {m}")) for m in METHODS)
            anchor_ms = by.get((world, f"{name} {anchor}"))
            lines.append(
                (
                    world,
                    name,
                    common.fmt(torch_ms, ".3f"),
                    common.fmt(by.get((world, f"{name} ddp")), ".3f"),
                    common.fmt(local, ".3f"),
                    common.fmt(per_op, ".3f"),
                    common.fmt(common.ratio(local, anchor_ms)),
                    common.fmt(common.ratio(per_op, anchor_ms)),
                    common.fmt(None if None in (local, per_op) else per_op - local, ".3f"),
                )
            )
    header = (
        "world",
        "loss",
        "torch ms",
        "ddp ms",
        "sbp-local ms",
        "sbp-op-by-op ms",
        "local x anchor",
        "op-by-op x anchor",
        "saved ms",
    )
    return common.table(lines, header)


METHODS = ("torch", "sbp-local", "sbp-op-by-op")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32, help="the logical batch")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cfg = {"batch": args.batch, "warmup": args.warmup, "rounds": args.rounds}
    rows = [row for world in args.worlds for row in common.gather_rows(_worker, world, cfg)]
    common.print_report(_report(rows), {})
    payload = {"machine": common.machine_info(), "config": cfg, "rows": rows}
    path = common.write_results("losses", payload, None if args.out is None else Path(args.out))
    print(f"wrote {path[0]}")


if __name__ == "__main__":
    main()
