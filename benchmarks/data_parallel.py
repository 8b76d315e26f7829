"""Data-parallel training: global tensors vs torch DDP, same machine, same run.

mobilenet_v2 (10 classes; `--model vit`: a small vision transformer; `--model lstm`: a
2-layer LSTM reading each image row by row, `lstm-carried` passing its final state back
in with the next batch, `lstm-zeros` making its zero state in the forward; `--model bags`: an EmbeddingBag of ids
quantised from the image) on 3x32x32, SGD with momentum, a batch of
`--batch` per rank.
Each method trains its own copy of the model from the same initial weights on the same
data; the methods take turns step by step (a barrier before each step, the slowest rank's
time per step), so slow phases of this shared machine hit them alike.

Rows (world of `--world`):
- global, per-shard BN: `model.to_global(P, broadcast)`, `sbp.nn.data_parallel(model,
  batch_norm="local")`: the statistics torch DDP computes;
- global, logical BN: the default, statistics of the whole logical batch (one all-reduce
  per BatchNorm layer forward and one backward);
- global, op by op: the same with the fast path off (`fast=False`);
- torch DDP: `torch.nn.parallel.DistributedDataParallel` (and `+ SyncBatchNorm` on cuda);
- sbp DDP: `sbp.nn.parallel.DistributedDataParallel` when it exists.
World of one: plain torch and the global fast path in one process; its plain torch row is
also the one-process anchor for the scaling of the others.

The logical row's floor is the torch DDP step plus, for each small collective it adds per
step, the latency of a small all-reduce measured in the same run: through sbp.comm (the
path the row takes: shared memory on one host) and, for comparison, through gloo.

    .venv/bin/python benchmarks/data_parallel.py            # ~3 min on 2 cores
    .venv/bin/python benchmarks/data_parallel.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    fmt,
    gather_rows,
    machine_info,
    ratio,
    small_all_reduce_ms,
    synchronized,
    table,
    time_methods,
    use_cuda_device,
    write_results,
)


class RowLSTM(torch.nn.Module):
    """Each 3x32x32 image as a sequence of its 32 rows (96 values each): a 2-layer LSTM,
    then a linear head on the last step (torch's recurrent kernel, no BatchNorm)."""

    def __init__(self, hidden: int = 128, num_classes: int = 10):
        super().__init__()
        self.lstm = torch.nn.LSTM(96, hidden, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.permute(0, 2, 1, 3).flatten(2)  # (N, 32 rows, 3 * 32)
        out, _ = self.lstm(rows)
        return self.head(out[:, -1])


class CarriedLSTM(RowLSTM):
    """RowLSTM whose final state goes back in with the next batch (truncated backprop
    through time, detached between steps): the state comes in laid out as the batch on
    its dim 1."""

    def forward(self, x: torch.Tensor, state: tuple | None = None) -> tuple:
        out, state = self.lstm(x.permute(0, 2, 1, 3).flatten(2), state)
        return self.head(out[:, -1]), state


class ZeroStateLSTM(RowLSTM):
    """RowLSTM given its initial state as torch's tutorials make it in the forward:
    `x.new_zeros(layers, x.size(0), hidden)` (laid out as the batch by the check)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.new_zeros(2, x.size(0), self.lstm.hidden_size)
        out, _ = self.lstm(x.permute(0, 2, 1, 3).flatten(2), (h, torch.zeros_like(h)))
        return self.head(out[:, -1])


class TokenBags(torch.nn.Module):
    """A bag-of-words classifier: each image's first row of 3 x 32 values quantised to 96
    ids of a 2000-word vocabulary, their mean embedding (`nn.EmbeddingBag`, width 64),
    then a 2-layer MLP head."""

    def __init__(self, words: int = 2000, width: int = 64, num_classes: int = 10):
        super().__init__()
        self.words = words
        self.bag = torch.nn.EmbeddingBag(words, width, mode="mean")
        self.head = torch.nn.Sequential(
            torch.nn.Linear(width, 128), torch.nn.ReLU(), torch.nn.Linear(128, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = ((x[:, :, 0].flatten(1) + 4) * self.words / 8).long().clamp(0, self.words - 1)
        return self.head(self.bag(ids))


# --model: (what the JSON calls it, its constructor (a torchvision name or a class) and
# arguments)
MODELS = {
    "mobilenet_v2": ("mobilenet_v2(num_classes=10)", "mobilenet_v2", {"num_classes": 10}),
    # a small ViT for 32x32 images: torch's multi-head attention, LayerNorm, no BatchNorm
    "vit": (
        "VisionTransformer(32, patch 4, 4 layers, 4 heads, width 64, mlp 128, 10 classes)",
        "VisionTransformer",
        dict(
            image_size=32, patch_size=4, num_layers=4, num_heads=4, hidden_dim=64, mlp_dim=128,
            num_classes=10,
        ),
    ),
    "lstm": ("RowLSTM(96 -> 128, 2 layers, 10 classes)", RowLSTM, {}),
    "lstm-carried": ("CarriedLSTM(RowLSTM, its state passed back in)", CarriedLSTM, {}),
    "lstm-zeros": ("ZeroStateLSTM(RowLSTM, new_zeros state in forward)", ZeroStateLSTM, {}),
    "bags": ("TokenBags(2000 words, EmbeddingBag width 64, MLP 128, 10 classes)", TokenBags, {}),
}  # fmt: skip


def _model(device: str, name: str = "mobilenet_v2") -> torch.nn.Module:
    import torchvision

    torch.manual_seed(0)
    _, constructor, options = MODELS[name]
    if isinstance(constructor, str):
        constructor = getattr(torchvision.models, constructor)
    return constructor(**options).to(device)


def _batches(rank: int, cfg: dict, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    n = cfg["batch"]
    return [
        (
            torch.randn(n, 3, 32, 32, generator=g).to(device),
            torch.randint(0, 10, (n,), generator=g).to(device),
        )
        for _ in range(4)
    ]


class Trainer:
    """One method: a model, an optimizer and a step over a cycling list of batches."""

    def __init__(self, model, batches, wrap_batch):
        self.model, self.batches, self.wrap_batch = model, batches, wrap_batch
        self.opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        self.i = 0
        self.state = None  # a model returning (logits, state) gets its state back

    def step(self) -> torch.Tensor:
        x, y = self.wrap_batch(*self.batches[self.i % len(self.batches)])
        self.i += 1
        out = self.model(x) if self.state is None else self.model(x, self.state)
        if isinstance(out, tuple):
            out, state = out
            self.state = tuple(s.detach() for s in state)
        loss = F.cross_entropy(out, y)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return loss.detach()


def _global_trainer(base, batches, device, **options):
    import sbp
    import sbp.nn

    P = sbp.placement.all(device)
    model = copy.deepcopy(base).to_global(P, sbp.broadcast)
    sbp.nn.data_parallel(model, **options)
    return Trainer(model, batches, lambda x, y: sbp.to_global((x, y), P, sbp.split(0)))


def _ddp_trainer(base, batches, device, sync_bn=False, wrapper=None):
    model = copy.deepcopy(base)
    if sync_bn:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    ids = [torch.cuda.current_device()] if device == "cuda" else None
    ddp = (wrapper or torch.nn.parallel.DistributedDataParallel)(model, device_ids=ids)
    return Trainer(ddp, batches, lambda x, y: (x, y))


def _collectives_per_step(trainer) -> dict:
    """Collectives of one step, and how many of them are gradient buckets."""
    import sbp
    import sbp.nn

    with sbp.comm_stats() as st:
        trainer.step()
    reducer = sbp.nn.fast_path.state(trainer.model)._reducer
    buckets = len(reducer._buckets) if reducer is not None else 0
    return {"calls": dict(st.by_kind), "bytes": dict(st.bytes_by_kind), "buckets": buckets}


def worker(rank: int, world: int, cfg: dict, path: str) -> None:
    device = cfg["device"]
    if device == "cuda":
        use_cuda_device(rank)
    base = _model(device, cfg["model"])
    batches = _batches(rank, cfg, device)
    methods: dict = {}
    rows: dict = {"world": world}
    if world == 1:
        plain = Trainer(copy.deepcopy(base), batches, lambda x, y: (x, y))
        methods["plain torch"] = plain.step
        methods["global (fast path)"] = _global_trainer(base, batches, device).step
    else:
        shard = _global_trainer(base, batches, device, batch_norm="local")
        logical = _global_trainer(base, batches, device)
        ddp = _ddp_trainer(base, batches, device)
        methods["global, per-shard BN"] = shard.step
        methods["global, logical BN"] = logical.step
        if not cfg["quick"]:
            methods["global, op by op"] = _global_trainer(base, batches, device, fast=False).step
        methods["torch DDP"] = ddp.step
        if device == "cuda":
            methods["torch DDP + SyncBatchNorm"] = _ddp_trainer(base, batches, device, True).step
        try:
            from sbp.nn.parallel import DistributedDataParallel as SbpDDP

            methods["sbp DDP"] = _ddp_trainer(base, batches, device, wrapper=SbpDDP).step
        except ImportError:
            pass
    if device == "cuda":
        methods = synchronized(methods)
    timings = time_methods(methods, cfg["warmup"], cfg["steps"])
    rows["timings"] = {k: v.as_dict() for k, v in timings.items()}
    if world > 1:
        rows["small_all_reduce_ms"] = small_all_reduce_ms(device)
        rows["logical_step_collectives"] = _collectives_per_step(logical)
        rows["shard_step_collectives"] = _collectives_per_step(shard)
    if rank == 0:
        Path(path).write_text(json.dumps(rows))


def _small_calls(collectives: dict) -> int:
    """Collectives of a step other than the gradient buckets."""
    return sum(collectives["calls"].values()) - collectives["buckets"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32, help="per rank")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per method")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--quick", action="store_true", help="3 steps, no op-by-op row")
    parser.add_argument("--model", default="mobilenet_v2", choices=sorted(MODELS))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.world < 2:
        parser.error("--world must be 2 or more (the world of one runs in every case)")
    cfg = {
        "batch": args.batch,
        "steps": 3 if args.quick else args.steps,
        "warmup": 1 if args.quick else args.warmup,
        "device": args.device,
        "quick": args.quick,
        "model": args.model,
    }
    one = gather_rows(worker, 1, cfg)
    many = gather_rows(worker, args.world, cfg)

    def median(res, name):
        t = res["timings"].get(name, {})
        return t.get("median_ms")

    ddp_ms = median(many, "torch DDP")
    plain_ms = median(one, "plain torch")
    small = many["small_all_reduce_ms"]
    n_small = _small_calls(many["logical_step_collectives"])
    floors = {k: ddp_ms + n_small * v if ddp_ms else None for k, v in small.items()}
    floor_ms = floors["sbp"]  # the latency of the path the logical row takes
    images = args.batch * args.world
    rows, records = [], []
    for name in many["timings"]:
        ms = median(many, name)
        rec = {
            "method": name,
            "world": args.world,
            "step_ms": ms,
            "images_per_s": images / ms * 1e3 if ms else None,
            "vs_torch_ddp": ratio(ddp_ms, ms),
            "vs_one_process": ratio(plain_ms * args.world, ms) if ms else None,
            "error": many["timings"][name].get("error"),
        }
        if name == "global, logical BN":
            rec["floor_ms"] = floor_ms
            rec["vs_floor"] = ratio(ms, floor_ms)
            rec["floor_with_gloo_latency_ms"] = floors["gloo"]
            rec["vs_floor_with_gloo_latency"] = ratio(ms, floors["gloo"])
        records.append(rec)
    for name in one["timings"]:
        ms = median(one, name)
        records.append(
            {
                "method": name,
                "world": 1,
                "step_ms": ms,
                "images_per_s": args.batch / ms * 1e3 if ms else None,
                "vs_plain_torch": ratio(plain_ms, ms),
                "error": one["timings"][name].get("error"),
            }
        )
    for r in records:
        speed = r.get("vs_torch_ddp", r.get("vs_plain_torch"))
        rows.append(
            [
                r["method"],
                r["world"],
                fmt(r["step_ms"], ".1f"),
                fmt(r["images_per_s"], ".0f"),
                fmt(speed),
                fmt(r.get("vs_floor")),
                r["error"] or "",
            ]
        )
    header = ["method", "world", "step ms", "images/s", "speed vs anchor", "step / floor", "error"]
    print()
    print(table(rows, header))
    print(
        f"\nanchor: torch DDP in the world of {args.world}, plain torch in the world of 1; "
        "speed = anchor step time / method step time (higher is faster)."
    )
    for path, label in (("sbp", "sbp.comm (the path taken)"), ("gloo", "gloo")):
        print(
            f"logical BN floor with {label} latency = torch DDP step {fmt(ddp_ms, '.1f')} ms + "
            f"{n_small} small collectives x {small[path]:.3f} ms = {fmt(floors[path], '.1f')} ms"
        )
    print("collectives per step, logical BN:", many["logical_step_collectives"]["calls"])
    print("collectives per step, per-shard BN:", many["shard_step_collectives"]["calls"])
    payload = {
        "benchmark": "data_parallel",
        "config": cfg | {"world": args.world, "model": MODELS[args.model][0]},
        "machine": machine_info(),
        "rows": records,
        "small_all_reduce_ms": small,
        "small_collectives_per_logical_step": n_small,
        "logical_step_collectives": many["logical_step_collectives"],
        "shard_step_collectives": many["shard_step_collectives"],
        "raw": {"world_1": one, f"world_{args.world}": many},
    }
    name = "data-parallel-quick" if args.quick else "data-parallel"
    name += "" if args.model == "mobilenet_v2" else f"-{args.model}"
    name += "-cuda" if args.device == "cuda" else ""
    for p in write_results(name, payload, args.out):
        print(f"wrote {p}")


if __name__ == "__main__":
    main()
