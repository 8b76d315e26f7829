"""torch.compile benchmark: one mobilenet_v2 training step, compiled and eager, sbp vs torch.

One step is forward, cross-entropy, backward and an SGD step (the model is compiled; the
optimizer runs eagerly in every method). Methods, timed side by side in the same run:

world of one
  torch-eager       plain torch (the anchor)
  torch-compiled    torch.compile(model)
  global-eager      parameters broadcast, batch split(0) on a placement of one rank
  global-compiled   the same, torch.compile(model): the call leaves the graph for the
                    data-parallel fast path, which compiles the module's forward on the
                    local tensors (plain tensors in the graph, as compiled torch)
  global-traced     the same, torch.compile(model, fullgraph=True): one graph, traced op by
                    op through the global tensors (parameters are global tensors in it)
  dtensor-compiled  DTensor (Replicate parameters, Shard(0) batch), torch.compile(model)
world of two (each rank holds half the batch)
  ddp-eager         torch DistributedDataParallel (the anchor)
  ddp-compiled      torch.compile(DDP(model))
  ddp-syncbn-compiled  the same with SyncBatchNorm (GPU only: it has no CPU kernels): the
                    whole batch's BatchNorm statistics, the work of global-compiled
  global-eager      parameters broadcast, batch split(0) over both ranks
  global-compiled   the same, torch.compile(model): logical BatchNorm (the whole batch's
                    statistics: a small all-reduce per layer forward and backward), in
                    the fast path's compiled local forward
  global-local-compiled  the same with per-shard BatchNorm
                    (`sbp.nn.data_parallel(model, batch_norm="local")`), which is what
                    DDP computes: the same work as ddp-compiled; the fast path, its local
                    forward compiled

Target: global-compiled (and global-local-compiled) within 1.10x of torch-compiled (world
of one) and of ddp-compiled (world of two); where ddp-syncbn-compiled runs, it is
global-compiled's anchor instead, and on the CPU, where it cannot, that anchor is a floor
(DDP plus the added collectives). Compilation happens in the warm-up calls and is
reported apart. Run `python benchmarks/compile.py` (minutes: Inductor compiles each
model); `--backend aot_eager` traces without code generation; `--device cuda` runs on the
GPU (ranks share one over gloo where there are fewer GPUs than ranks).

`--width 0.1 --image 8 --batch 2` shrinks the model's work until a step is mostly host
work (Python, dispatch, kernel launches), as a compiled step of 32 images is on an H100:
on the CPU, the ratio to compiled torch then shows sbp's host work per step, which is what
the GPU ratio is made of.
"""

from __future__ import annotations

import argparse
import functools
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

try:  # `python -m benchmarks.compile` from the repository root
    from benchmarks import common
except ImportError:  # `python benchmarks/compile.py`
    import common

TARGET = 1.10
ANCHOR = {1: "torch-compiled", 2: "ddp-compiled"}
# Rows whose work differs from their world's anchor, and the torch row doing the same work.
SAME_WORK = {"global-compiled": "ddp-syncbn-compiled"}


def _model(width: float = 1.0):
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.mobilenet_v2(num_classes=10, dropout=0.0, width_mult=width)


def _step(model, opt, x, y) -> Callable[[], Any]:
    def step():
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


def _sgd(model):
    """SGD with foreach kernels for every method: torch picks them for CUDA tensors, and sbp
    for global parameters on any device, but torch steps CPU tensors one by one, which on the
    CPU would compare sbp's step with a slower algorithm than the GPU's (by ~0.2 ms, or 3%
    of the host-bound `--width 0.1 --image 8 --batch 2` step)."""
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=True)


def _methods(rank: int, world: int, cfg: dict) -> dict[str, Callable[[], Any]]:
    import sbp
    import sbp.nn

    device = cfg["device"]
    g = torch.Generator().manual_seed(1)
    size = cfg["image"]
    x = torch.randn(cfg["batch"], 3, size, size, generator=g).to(device)
    y = torch.randint(0, 10, (cfg["batch"],), generator=g).to(device)
    P = sbp.placement(device, list(range(world)))
    local = sbp.local_slices(x.shape, P, sbp.split(0), P.coord(rank))
    xl, yl = x[local].contiguous(), y[local[:1]].contiguous()
    gx, gy = sbp.to_global(xl, P, sbp.split(0)), sbp.to_global(yl, P, sbp.split(0))
    backend = cfg["backend"]
    model = functools.partial(_model, cfg["width"])
    methods: dict[str, Callable[[], Any]] = {}

    def add(name, build):
        try:
            methods[name] = build()
        except Exception as e:  # a method that cannot be set up is reported, not fatal
            methods[name] = _failing(_reason(e))

    def global_model(compiled, batch_norm="global", fullgraph=False):
        m = model().to(device).to_global(P, sbp.broadcast)
        sbp.nn.data_parallel(m, batch_norm=batch_norm)
        run = torch.compile(m, backend=backend, fullgraph=fullgraph) if compiled else m
        return _step(run, _sgd(m), gx, gy)

    if world == 1:
        add("torch-eager", lambda: _plain(model, False, backend, x, y))
        add("torch-compiled", lambda: _plain(model, True, backend, x, y))
        add("global-eager", lambda: global_model(False))
        add("global-compiled", lambda: global_model(True))
        add("global-traced", lambda: global_model(True, fullgraph=True))
        add("dtensor-compiled", lambda: _dtensor(model, world, backend, xl, yl, device))
    else:
        add("ddp-eager", lambda: _ddp(model, False, backend, xl, yl))
        add("ddp-compiled", lambda: _ddp(model, True, backend, xl, yl))
        add("global-eager", lambda: global_model(False))
        add("global-compiled", lambda: global_model(True))
        add("global-local-compiled", lambda: global_model(True, "local"))
        # Last: SyncBatchNorm breaks the graph at every layer, and the recompilations that
        # follow reach Dynamo's limit for mobilenet_v2's code objects, which are shared by
        # every model in the process; compiled first, later rows fell back to eager frames.
        if device == "cuda":
            add(
                "ddp-syncbn-compiled",
                lambda: _ddp(model, True, backend, xl, yl, sync_batch_norm=True),
            )
    return methods


# The rows whose collectives are counted in a world of two: logical BatchNorm adds small
# all-reduces to what the per-shard step (the work of torch DDP) does.
LOGICAL_FLOOR = ("global-compiled", "global-local-compiled")


def _shared_memory_calls(step: Callable[[], Any]) -> int:
    """All-reduces sbp.comm runs in one call of `step`, inside compiled graphs too (their
    collectives are sbp's ops, `sbp::all_reduce`, calling sbp.comm when they run)."""
    import sbp

    with sbp.comm_stats() as stats:
        step()
    return stats.by_kind["all_reduce"]


def _logical_floor_parts(methods: dict[str, Callable[[], Any]], device: str) -> dict:
    """What the logical row's floor is made of: the small all-reduces logical BatchNorm adds
    to the per-shard step, and the latency of one, measured now. Logical BatchNorm computes
    more than torch DDP (the whole batch's statistics), so DDP alone is not its floor; on
    the GPU, the ddp-syncbn-compiled row is its anchor instead, so the floor is given on
    the CPU only."""
    if device != "cpu":  # (the same on every rank, so no rank waits alone below)
        return {}
    calls = {name: _shared_memory_calls(methods[name]) for name in LOGICAL_FLOOR}
    added = calls["global-compiled"] - calls["global-local-compiled"]
    small = common.small_all_reduce_ms(device)  # (a collective: every rank calls it)
    return {"small_collectives_added": added, "small_all_reduce_ms": small} if added > 0 else {}


def _reason(e: BaseException) -> str:
    """First and last lines of the error (a compiler failure names its cause last)."""
    lines = [ln.strip() for ln in f"{type(e).__name__}: {e}".splitlines() if ln.strip()]
    return " ... ".join(dict.fromkeys([lines[0], lines[-1]]))[:400] if lines else repr(e)


def _failing(error: str) -> Callable[[], Any]:
    def fail():
        raise RuntimeError(error)

    return fail


def _plain(model, compiled, backend, x, y):
    m = model().to(x.device)
    return _step(torch.compile(m, backend=backend) if compiled else m, _sgd(m), x, y)


def _ddp(model, compiled, backend, x, y, sync_batch_norm=False):
    from torch.nn.parallel import DistributedDataParallel

    device = x.device
    ids = [device.index] if device.type == "cuda" else None
    net = model()
    if sync_batch_norm:
        net = torch.nn.SyncBatchNorm.convert_sync_batchnorm(net)
    m = DistributedDataParallel(net.to(device), device_ids=ids)
    return _step(torch.compile(m, backend=backend) if compiled else m, _sgd(m), x, y)


def _dtensor(model, world, backend, x, y, device):
    from torch.distributed.tensor import DTensor, Shard, distribute_module, init_device_mesh

    mesh = init_device_mesh(device, (world,))
    m = distribute_module(model().to(device), mesh)
    dx = DTensor.from_local(x, mesh, [Shard(0)])
    dy = DTensor.from_local(y, mesh, [Shard(0)])
    return _step(torch.compile(m, backend=backend), _sgd(m), dx, dy)


def _worker(rank: int, world: int, cfg: dict, path: str) -> None:
    import json

    warnings.filterwarnings("ignore")
    if cfg["device"] == "cuda":
        common.use_cuda_device(rank)
    methods = _methods(rank, world, cfg)
    if cfg["device"] == "cuda":
        methods = common.synchronized(methods)
    first = {}
    for name, fn in methods.items():  # the first call compiles; time it apart
        dist.barrier()
        t0 = time.perf_counter()
        try:
            fn()
            first[name] = time.perf_counter() - t0
        except Exception as e:
            methods[name] = _failing(_reason(e))
            first[name] = None
    timings = common.time_methods(methods, cfg["warmup"], cfg["rounds"])
    firsts = common.max_over_ranks(list(first.values()))
    extra: dict[str, dict] = {name: {} for name in methods}
    if world > 1:
        ok = all(timings[name].error is None for name in LOGICAL_FLOOR)  # agreed by all ranks
        extra["global-compiled"] = _logical_floor_parts(methods, cfg["device"]) if ok else {}
    if rank == 0:
        rows = [
            {
                "world": world,
                "method": name,
                "first_call_s": f,
                **timings[name].as_dict(),
                **extra[name],
            }
            for name, f in zip(methods, firsts, strict=True)
        ]
        with open(path, "w") as fh:
            json.dump(rows, fh)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--width", type=float, default=1.0, help="mobilenet_v2's width_mult")
    ap.add_argument("--image", type=int, default=32, help="image side, pixels")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    keys = ("batch", "warmup", "rounds", "backend", "device", "width", "image")
    cfg = {k: getattr(args, k) for k in keys}
    rows = []
    for world in args.world_sizes:
        rows += common.gather_rows(_worker, world, cfg)
    report, misses, notes = _report(rows)
    common.print_report(
        report, {"misses of the 1.10x target": misses, "same-work anchors and floors": notes}
    )
    payload = {"machine": common.machine_info(), "config": cfg, "rows": rows}
    name = "compile" if args.backend == "inductor" else f"compile-{args.backend}"
    name += "-cuda" if args.device == "cuda" else ""
    if (args.width, args.image) != (1.0, 32):  # (a host-bound step: see the docstring)
        name += f"-w{args.width:g}-i{args.image}"
    path = common.write_results(name, payload, None if args.out is None else _path(args.out))
    print(f"wrote {path[0]}")


def _path(p: str):
    from pathlib import Path

    return Path(p)


def _floor_ms(row: dict, anchor: float | None) -> float | None:
    """The anchor plus the latency of the small collectives the row adds (logical BN)."""
    if anchor is None or "small_collectives_added" not in row:
        return None
    return anchor + row["small_collectives_added"] * row["small_all_reduce_ms"]["sbp"]


def _report(rows: list[dict]) -> tuple[str, list[str], list[str]]:
    table, misses, notes = [], [], []
    for world in sorted({r["world"] for r in rows}):
        mine = {r["method"]: r for r in rows if r["world"] == world}
        anchor = mine.get(ANCHOR[world], {}).get("median_ms")
        same_work = {
            name: mine[torch_row]["median_ms"]
            for name, torch_row in SAME_WORK.items()
            if mine.get(torch_row, {}).get("median_ms") is not None
        }
        eager = "torch-eager" if world == 1 else "ddp-eager"
        base = mine.get(eager, {}).get("median_ms")
        for name, r in mine.items():
            med = r.get("median_ms")
            vs_anchor = common.ratio(med, anchor)
            vs_target = vs_anchor
            if name in same_work:
                vs_target = common.ratio(med, same_work[name])
                notes.append(
                    f"world {world}: {name} / {SAME_WORK[name]} (the same work) "
                    f"{common.fmt(vs_target)}"
                )
            floor = _floor_ms(r, anchor)
            if floor is not None:
                notes.append(
                    f"world {world}: {name} floor = {ANCHOR[world]} {anchor:.1f} ms + "
                    f"{r['small_collectives_added']} small all-reduces x "
                    f"{r['small_all_reduce_ms']['sbp']:.3f} ms = {floor:.1f} ms; "
                    f"step / floor {common.fmt(common.ratio(med, floor))}"
                )
            table.append(
                [
                    world,
                    name,
                    common.fmt(med, ".1f"),
                    common.fmt(common.ratio(med, base)),
                    common.fmt(vs_anchor),
                    common.fmt(r.get("first_call_s"), ".1f"),
                    r.get("error", "")[:60] if "error" in r else "",
                ]
            )
            if name.endswith("-compiled") and name.startswith("global"):
                if vs_target is None or vs_target > TARGET:
                    against = SAME_WORK[name] if name in same_work else ANCHOR[world]
                    misses.append(f"world {world}: {name} {common.fmt(vs_target)}x {against}")
    header = ["world", "method", "median ms", f"x {eager}", "x anchor", "1st call s", "error"]
    header[3] = "x eager torch/DDP"
    return common.table(table, header), misses, notes


if __name__ == "__main__":
    main()
