"""Checkpoint benchmark: save and load time of a sharded model, sbp against its anchors.

For a model of `--size-mib` (default 1024, float32 weights of 64 MiB each, split(0) over
the ranks, as a fully sharded model is) on 2 and 4 ranks, in the same run:
  sbp dcp     sbp.checkpoint.save / load: DCP on GlobalTensors, each rank writes and
              reads its own shards;
  dtensor     torch.distributed.checkpoint save / load of the same shards as DTensors
              (Shard(0) on a CPU DeviceMesh): the library's own sharded path;
  torch 1rk   the one-file hand-off: gather the state dict to rank 0
              (sbp.checkpoint.full_state_dict(rank=0)) and torch.save it there; load is
              torch.load(mmap=True, weights_only=True) on every rank and
              `load_state_dict`-style copy_ of each plain tensor into its global one.
Methods are interleaved round by round after a barrier; a round's time is the slowest
rank's. Files are written to one temporary directory (`--dir`), so loads read them back
from the page cache alike. Run `python benchmarks/checkpoint.py --quick` for a smoke run.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

try:  # `python -m benchmarks.checkpoint` from the repository root
    from benchmarks import common
except ImportError:  # `python benchmarks/checkpoint.py`
    import common

COLS = 4096
TENSOR_MIB = 64
METHODS = ("sbp dcp", "dtensor dcp", "torch 1rk")


def _dir_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def worker(rank: int, world: int, cfg: dict[str, Any], out: str) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import sbp

    warnings.filterwarnings("ignore", "Detected an existing checkpoint")  # rounds overwrite
    size_mib = cfg["size_mib"]
    tensor_mib = min(TENSOR_MIB, size_mib)
    rows = int(tensor_mib * 2**20 / 4 / COLS)
    shape = (rows, COLS)
    n_tensors = max(int(size_mib // tensor_mib), 1)
    P = sbp.placement.all("cpu")
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(rank)

    def global_zeros():
        return {
            f"layer{i}.weight": sbp.zeros(*shape, placement=P, sbp=sbp.split(0))
            for i in range(n_tensors)
        }

    source = {}
    for i in range(n_tensors):
        local = torch.randn(sbp.local_shape(shape, P, sbp.split(0), rank), generator=g)
        source[f"layer{i}.weight"] = sbp.to_global(local, P, sbp.split(0), shape=shape)

    def as_dtensors(state):
        """DTensors on the same local storage (methods run one at a time): half the memory."""
        return {
            k: DTensor.from_local(
                v.to_local(), mesh, [Shard(0)], run_check=False, shape=v.shape, stride=(COLS, 1)
            )
            for k, v in state.items()
        }

    dsource = as_dtensors(source)
    target = global_zeros()
    dtarget = as_dtensors(target)
    root = Path(cfg["dir"])
    paths = {"sbp dcp": root / "sbp", "dtensor dcp": root / "dtensor", "torch 1rk": root / "t.pt"}

    def torch_save():
        full = sbp.checkpoint.full_state_dict(source, rank=0)
        if rank == 0:
            torch.save(full, paths["torch 1rk"])
        dist.barrier()  # the file is complete for everyone

    @torch.no_grad()
    def torch_load():
        plain = torch.load(paths["torch 1rk"], mmap=True, weights_only=True)
        for k, v in target.items():
            v.copy_(plain[k])

    saves = {
        "sbp dcp": lambda: sbp.checkpoint.save({"model": source}, paths["sbp dcp"]),
        "dtensor dcp": lambda: dcp.save({"model": dsource}, checkpoint_id=paths["dtensor dcp"]),
        "torch 1rk": torch_save,
    }
    loads = {
        "sbp dcp": lambda: sbp.checkpoint.load({"model": target}, paths["sbp dcp"]),
        "dtensor dcp": lambda: dcp.load({"model": dtarget}, checkpoint_id=paths["dtensor dcp"]),
        "torch 1rk": torch_load,
    }
    warmup, rounds = cfg["warmup"], cfg["rounds"]
    save_t = common.time_methods(saves, warmup, rounds)
    on_disk = {m: _dir_bytes(paths[m]) for m in METHODS}
    checks = {}
    for name in METHODS:  # each load, from zeros, gives back the saved shards
        for v in target.values():  # dtarget shares these
            v.to_local().zero_()
        loads[name]()
        got = dtarget if name == "dtensor dcp" else target
        ok = all(torch.equal(got[k].to_local(), source[k].to_local()) for k in source)
        checks[name] = common.max_over_ranks([0.0 if ok else 1.0]) == [0.0]
    load_t = common.time_methods(loads, warmup, rounds)
    peak = common.max_over_ranks([_peak_rss_mib()])[0]
    total = torch.tensor([_peak_rss_mib()], dtype=torch.float64)
    dist.all_reduce(total)
    if rank != 0:
        return
    rows = []
    for op, timings in (("save", save_t), ("load", load_t)):
        for name in METHODS:
            rows.append(
                {
                    "world": world,
                    "op": op,
                    "method": name,
                    "size_mib": n_tensors * tensor_mib,
                    "bytes_on_disk": on_disk[name],
                    "check": checks[name],
                    "peak_rss_mib_max_rank": peak,
                    "peak_rss_mib_sum_ranks": total.item(),
                    **timings[name].as_dict(),
                }
            )
    import json

    Path(out).write_text(json.dumps(rows))


def print_table(rows: list[dict[str, Any]]) -> str:
    by = {(r["world"], r["op"], r["method"]): r for r in rows}
    out = []
    for world, op in sorted({(r["world"], r["op"]) for r in rows}, key=lambda k: (k[0], k[1])):
        ms = {m: by[(world, op, m)].get("median_ms") for m in METHODS}
        out.append(
            [
                world,
                op,
                common.fmt(ms["sbp dcp"], ".0f"),
                common.fmt(ms["dtensor dcp"], ".0f"),
                common.fmt(ms["torch 1rk"], ".0f"),
                common.fmt(common.ratio(ms["sbp dcp"], ms["dtensor dcp"])),
                common.fmt(common.ratio(ms["sbp dcp"], ms["torch 1rk"])),
                "ok" if all(by[(world, op, m)]["check"] for m in METHODS) else "FAIL",
            ]
        )
    header = ["ranks", "op", "sbp ms", "dtensor ms", "torch 1rk ms", "sbp/dt", "sbp/torch", "check"]
    return common.table(out, header)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-mib", type=float, default=1024, help="model size (float32 MiB)")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="64 MiB, 2 ranks, 2 rounds")
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: a tmp dir)")
    p.add_argument("--out", type=Path, default=None, help="one JSON file instead of results/")
    args = p.parse_args(argv)
    if args.quick:
        args.size_mib, args.world_sizes, args.rounds = 64, [2], 2
    started = time.time()
    rows: list[dict[str, Any]] = []
    for n in args.world_sizes:
        scratch = Path(tempfile.mkdtemp(prefix="sbp-ckpt-bench-", dir=args.dir))
        cfg = {
            "size_mib": args.size_mib,
            "rounds": args.rounds,
            "warmup": args.warmup,
            "dir": str(scratch),
        }
        try:
            rows += common.gather_rows(worker, n, cfg)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    text = print_table(rows)
    print()
    print(text)
    payload = {
        "benchmark": "checkpoint",
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "wall_s": round(time.time() - started, 1),
        "machine": common.machine_info(),
        "config": {
            "size_mib": args.size_mib,
            "world_sizes": args.world_sizes,
            "rounds": args.rounds,
            "warmup": args.warmup,
            "tensor_mib": TENSOR_MIB,
            "cols": COLS,
            "dtype": "float32",
            "sbp": "split(0)",
        },
        "rows": rows,
        "table": text,
    }
    name = "checkpoint-quick" if args.quick else "checkpoint"
    for path in common.write_results(name, payload, args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
