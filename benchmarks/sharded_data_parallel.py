"""Sharded data parallelism (ZeRO-3 / ZeRO-2): sbp vs FSDP2 vs torch DDP, same run (issue 53).

Two models, each trained with AdamW (lr 1e-3, weight decay 0.01, torch's default kernels)
on cross-entropy, a batch of `batch` samples per rank on 2 ranks (gloo, CPU):

- mlp: 6 x Linear(1024, 1024), ReLU between them (not after the last: its 1024 outputs are
  the logits of 1024 classes), batch 32 per rank (`--quick`: width 256, batch 8);
- gpt: a GPT-2-like causal LM: token + position embedding (both `nn.Embedding`, the
  positions read as `pos.weight[:t]`), pre-LayerNorm blocks (causal self-attention through
  `F.scaled_dot_product_attention`, one qkv Linear and an out-projection; MLP 4x with
  GELU; residuals), a final LayerNorm and an LM head without bias; vocabulary 2048, width
  256, 4 heads, 4 blocks, 128 tokens, 8 sequences per rank (`--quick`: 256, 64, 4, 2, 32,
  4). The loss is `F.cross_entropy(logits.flatten(0, 1), targets.flatten())`.

Each row trains its own copy of the same initial weights on the same per-rank data; the
rows take turns step by step (`common.time_methods`: a barrier before each step, the
slowest rank's time, the order shuffled per round), so slow phases of this shared machine
hit them alike. Rows:

1. sbp ZeRO-3: `model.to_global(P, sbp.split(0))` (every parameter split along its dim 0),
   then `sbp.nn.data_parallel(model, reshard_after_forward=True)`;
2. sbp ZeRO-2: the same with `reshard_after_forward=False`. Where `data_parallel` rejects
   the keyword (or the split model altogether: it only knew broadcast models before issue
   53), the row runs without it, op by op on the split parameters, and the `path` column
   says so with the rejection in the JSON;
3. FSDP2: `torch.distributed.fsdp.fully_shard` on each Linear (mlp) / each block (gpt),
   then on the root, which holds the gpt's embeddings, final LayerNorm and head (a 1-D CPU
   `DeviceMesh`; default options: every group but the root's resharded after forward);
4. torch DDP: `torch.nn.parallel.DistributedDataParallel` (the anchor);
5. sbp broadcast: `model.to_global(P, sbp.broadcast)`, the data-parallel fast path.

The sbp rows take the batch as `sbp.to_global((x, y), P, sbp.split(0))` of each rank's
shard; the loss is `F.cross_entropy` on the global logits (the mean over the logical batch).

Columns: `step ms` the median step and `x DDP` its ratio to torch DDP's median in the same
run; `path` how the sbp model's last call ran (`fast` or `per-op`, the fast path's
`last_path`; `op by op` where `data_parallel` was rejected; `?` where it was accepted but
left no state to read; ` no kw` where it took the split model without the keyword);
`colls`/`KiB` the collectives this rank ran in one step and the bytes it sent (by sbp's
cost model, `sbp.comm.cost`, for every row): sbp rows by `sbp.comm_stats()` (`--trace`:
every collective of that step with its op and conversion, printed after the tables and kept
in the JSON), FSDP2 by wrapping `torch.distributed`'s collective functions for one step
(FSDP2 calls `dist.all_gather_single` / `dist.reduce_scatter_single` through the module
attribute), torch DDP *computed* from its logging data
(`_get_ddp_logging_data()["bucket_sizes"]`: one all-reduce per gradient bucket; DDP's
reducer calls the process group from C++, which no Python wrapper sees); `state MiB` per
rank the bytes of parameters + gradients + optimizer state (the local tensors: `to_local()`
of sbp's global tensors and of FSDP2's DTensors; rank 0 / rank 1 where they differ), taken
after a step, before the next zero_grad; `peak MiB` the peak of the bytes allocated during
one step over what existed before it (`common.peak_allocated`, the profiler's allocation
records, every thread; max over ranks); `|dloss|` and `|dgrad|` the difference of the row's
loss (the mean over the logical batch) and gradient norm (of the logical gradient, before
the optimizer's step) on a check step after all the others, relative to torch DDP's: every
row trains the same model on the same data, so they should agree to float32 rounding (`ok`
below 1e-3 relative; AdamW hardly sees a gradient's scale, so the gradient norm is what
shows a row that sums instead of averaging). Where `sbp.nn.memory_report` exists, its dict
for each sbp row is printed and kept in the JSON.

FSDP2 on CPU / gloo with torch 2.14.1 ran as is: `init_device_mesh("cpu", (2,))`, gloo's
all_gather_single and reduce_scatter_single; no workaround was needed.

    .venv/bin/python benchmarks/sharded_data_parallel.py            # ~2.5 min on 2 cores
    .venv/bin/python benchmarks/sharded_data_parallel.py --quick    # ~15 s
    .venv/bin/python benchmarks/sharded_data_parallel.py --models gpt --rounds 20
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    fmt,
    gather_rows,
    machine_info,
    peak_allocated,
    ratio,
    short_error,
    table,
    time_methods,
    write_results,
)

ROWS = ("sbp ZeRO-3", "sbp ZeRO-2", "FSDP2", "torch DDP", "sbp broadcast")
ANCHOR = "torch DDP"
TOLERANCE = 1e-3  # relative, loss and gradient norm against DDP's
MIB = 2**20

SIZES = {
    "full": {
        "mlp": {"width": 1024, "layers": 6, "batch": 32},
        "gpt": {"vocab": 2048, "width": 256, "heads": 4, "blocks": 4, "seq": 128, "batch": 8},
    },
    "quick": {
        "mlp": {"width": 256, "layers": 6, "batch": 8},
        "gpt": {"vocab": 256, "width": 64, "heads": 4, "blocks": 2, "seq": 32, "batch": 4},
    },
}


# ---------------------------------------------------------------- models


class MLP(torch.nn.Module):
    def __init__(self, width: int, layers: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


class Attention(torch.nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.proj(o.transpose(1, 2).reshape(b, t, d))


class Block(torch.nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.ln2 = torch.nn.LayerNorm(width)
        self.fc1 = torch.nn.Linear(width, 4 * width)
        self.fc2 = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(torch.nn.Module):
    def __init__(self, vocab: int, width: int, heads: int, blocks: int, seq: int):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, width)
        self.pos = torch.nn.Embedding(seq, width)
        self.blocks = torch.nn.ModuleList(Block(width, heads) for _ in range(blocks))
        self.ln_f = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, ids):
        x = self.tok(ids) + self.pos.weight[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _build(name: str, c: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "mlp":
        return MLP(c["width"], c["layers"])
    return GPT(c["vocab"], c["width"], c["heads"], c["blocks"], c["seq"])


def _batches(name: str, c: dict, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's shards of 4 logical batches (cycled)."""
    g = torch.Generator().manual_seed(100 + rank)
    n = c["batch"]
    out = []
    for _ in range(4):
        if name == "mlp":
            out.append(
                (
                    torch.randn(n, c["width"], generator=g),
                    torch.randint(0, c["width"], (n,), generator=g),
                )
            )
        else:
            ids = torch.randint(0, c["vocab"], (n, c["seq"] + 1), generator=g)
            out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out  # fmt: skip


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if out.dim() == 3:  # (batch, seq, vocab): every token's next-token loss
        return F.cross_entropy(out.flatten(0, 1), y.flatten())
    return F.cross_entropy(out, y)


# ---------------------------------------------------------------- rows


def _full(t: torch.Tensor) -> torch.Tensor:
    """The logical value of an sbp global tensor or a DTensor; a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of an sbp global tensor or a DTensor; a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


class Trainer:
    """One row: a model, its optimizer, a step over a cycling list of batches."""

    def __init__(self, model, batches, wrap_batch, kind: str):
        self.model, self.batches, self.wrap_batch, self.kind = model, batches, wrap_batch, kind
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        self.i = 0
        self.path = ""  # sbp rows: how the data_parallel call went
        self.rejected: str | None = None

    def step(self, check: bool = False):
        x, y = self.wrap_batch(*self.batches[self.i % len(self.batches)])
        self.i += 1
        loss = _loss(self.model(x), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        out = None
        if check:
            out = (self._loss_value(loss), self._grad_norm())
        self.opt.step()
        return out if check else loss.detach()

    def _loss_value(self, loss: torch.Tensor) -> float:
        if self.kind == "sbp":
            return float(loss.detach().full_tensor())
        t = loss.detach().reshape(1).clone()  # this rank's mean over equal shards
        dist.all_reduce(t)
        return float(t) / dist.get_world_size()

    def _grad_norm(self) -> float:
        total = 0.0
        for p in self.model.parameters():
            if p.grad is not None:
                total += float(_full(p.grad).double().pow(2).sum())
        return math.sqrt(total)

    def state_bytes(self) -> dict:
        """Bytes of this rank's parameters, gradients and optimizer state (local parts)."""
        params = list(self.model.parameters())
        p_bytes = sum(_nbytes(_local(p)) for p in params)
        g_bytes = sum(_nbytes(_local(p.grad)) for p in params if p.grad is not None)
        o_bytes = 0
        for st in self.opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    o_bytes += _nbytes(_local(v))
        return {"params": p_bytes, "grads": g_bytes, "optimizer": o_bytes}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _sbp_trainer(base, batches, layout: str) -> Trainer:
    import sbp
    import sbp.nn

    P = sbp.placement.all("cpu")
    model = copy.deepcopy(base)
    if layout == "broadcast":
        model.to_global(P, sbp.broadcast)
        path, rejected = "", None
    else:
        model.to_global(P, sbp.split(0))
        path, rejected = _sharded(model, reshard=layout == "zero3")
    t = Trainer(model, batches, lambda x, y: sbp.to_global((x, y), P, sbp.split(0)), "sbp")
    t.path, t.rejected = path, rejected
    return t


def _sharded(model, reshard: bool) -> tuple[str, str | None]:
    """`sbp.nn.data_parallel(model, reshard_after_forward=...)`; where it is rejected, the
    same without the keyword, and where that is rejected too, nothing (op by op)."""
    import sbp.nn

    try:
        sbp.nn.data_parallel(model, reshard_after_forward=reshard)
        return "", None
    except Exception as e:  # an older sbp: no such keyword, or no split models
        first = short_error(e)
    try:
        sbp.nn.data_parallel(model)  # (split models taken, the keyword not: path + " no kw")
        return "", f"reshard_after_forward: {first}"
    except Exception as e:
        return "op by op", f"reshard_after_forward: {first}; without it: {short_error(e)}"


def _fsdp2_trainer(base, batches, name: str) -> Trainer:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = copy.deepcopy(base)
    for sub in model.layers if name == "mlp" else model.blocks:
        fully_shard(sub, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return Trainer(model, batches, lambda x, y: (x, y), "fsdp2")


def _ddp_trainer(base, batches) -> Trainer:
    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    return Trainer(ddp, batches, lambda x, y: (x, y), "ddp")


def _path(t: Trainer) -> str:
    """How an sbp row's last call ran: the fast path's own word, else op by op."""
    if t.kind != "sbp":
        return ""
    import sbp.nn

    if t.path:  # data_parallel was rejected: op by op
        return t.path
    try:
        ran = sbp.nn.fast_path.state(t.model).last_path or "?"
    except Exception:  # accepted, but the fast path keeps no state we can read
        ran = "?"
    return ran + (" no kw" if t.rejected else "")


# ---------------------------------------------------------------- counting


_DIST_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "broadcast",
    "all_to_all",
    "all_to_all_single",
)


def _dist_bytes(kind: str, args: tuple, kwargs: dict, n: int) -> tuple[str, int]:
    """(kind, bytes sent by this rank) of a torch.distributed call, by sbp's cost model."""
    from sbp.comm import cost

    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    lists = [a for a in (*args, *kwargs.values()) if isinstance(a, list)]
    if kind == "all_reduce":
        return kind, cost.all_reduce_bytes(n, _nbytes(tensors[0]))
    if kind.startswith("all_gather"):
        shard = _nbytes(tensors[1]) if len(tensors) > 1 else _nbytes(tensors[0])
        return "all_gather", cost.all_gather_bytes(n, shard)
    if kind.startswith("reduce_scatter"):
        full = _nbytes(tensors[1]) if len(tensors) > 1 else sum(map(_nbytes, lists[-1]))
        return "reduce_scatter", cost.reduce_scatter_bytes(n, full)
    if kind == "broadcast":
        return kind, cost.broadcast_bytes(n, _nbytes(tensors[0]))
    return "all_to_all", (_nbytes(tensors[-1]) if tensors else 0) * (n - 1) // n


def _count_torch(t: Trainer) -> dict:
    """Collectives and bytes of one step of a torch row (see the module docstring)."""
    n = dist.get_world_size()
    calls: Counter = Counter()
    nbytes: Counter = Counter()
    saved = {k: getattr(dist, k) for k in _DIST_COLLECTIVES if hasattr(dist, k)}

    depth = [0]  # (count the outermost call: one collective may call another)

    def wrap(kind, fn):
        def counted(*args, **kwargs):
            if depth[0] == 0:
                k, b = _dist_bytes(kind, args, kwargs, n)
                calls[k] += 1
                nbytes[k] += b
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        return counted

    for k, fn in saved.items():
        setattr(dist, k, wrap(k, fn))
    try:
        t.step()
    finally:
        for k, fn in saved.items():
            setattr(dist, k, fn)
    how = "torch.distributed calls"
    if t.kind == "ddp":
        from sbp.comm import cost

        data = t.model._get_ddp_logging_data()
        sizes = [int(s) for s in str(data.get("bucket_sizes", "")).split(",") if s.strip()]
        calls["all_reduce"] += len(sizes)
        nbytes["all_reduce"] += sum(cost.all_reduce_bytes(n, s) for s in sizes)
        how = f"computed: {len(sizes)} gradient bucket(s) of {sizes} bytes"
    return {"calls": dict(calls), "bytes": dict(nbytes), "how": how}


def _count_sbp(t: Trainer, trace: bool) -> dict:
    import sbp

    with sbp.comm_stats(trace=trace, model=t.model if trace else None) as st:
        t.step()
    out = {"calls": dict(st.by_kind), "bytes": dict(st.bytes_by_kind), "how": "sbp.comm_stats()"}
    if trace:
        out["trace"] = st.table()
    return out


def _memory_report(t: Trainer) -> Any:
    """`sbp.nn.memory_report` where this sbp has it (issue 53), else None."""
    import sbp.nn

    report = getattr(sbp.nn, "memory_report", None)
    if report is None:
        return None
    for args in ((t.model, t.opt), (t.model,)):
        try:
            return report(*args)
        except TypeError:
            continue
        except Exception as e:
            return {"error": short_error(e)}
    return {"error": "memory_report took neither (model, optimizer) nor (model)"}


def _gathered(value: Any) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _run_model(rank: int, name: str, cfg: dict) -> dict:
    c = cfg["sizes"][name]
    base = _build(name, c)
    batches = _batches(name, c, rank)
    makers = {
        "sbp ZeRO-3": lambda: _sbp_trainer(base, batches, "zero3"),
        "sbp ZeRO-2": lambda: _sbp_trainer(base, batches, "zero2"),
        "FSDP2": lambda: _fsdp2_trainer(base, batches, name),
        "torch DDP": lambda: _ddp_trainer(base, batches),
        "sbp broadcast": lambda: _sbp_trainer(base, batches, "broadcast"),
    }
    trainers: dict[str, Trainer] = {}
    errors: dict[str, str] = {}
    for row in cfg["rows"]:
        try:
            trainers[row] = makers[row]()
        except Exception as e:  # (every rank builds alike; a failure is the row's)
            errors[row] = f"build: {short_error(e)}"
    timings = time_methods({k: t.step for k, t in trainers.items()}, cfg["warmup"], cfg["rounds"])
    out: dict[str, Any] = {"sizes": c, "parameters": sum(p.numel() for p in base.parameters())}
    rows: dict[str, dict] = {}
    for row in cfg["rows"]:
        if row in errors:
            rows[row] = {"error": errors[row]}
            continue
        t = trainers[row]
        rec: dict[str, Any] = timings[row].as_dict()
        rows[row] = rec
        if timings[row].error is not None:
            continue
        rec["path"] = _path(t)
        if t.rejected:
            rec["rejected"] = t.rejected
        # the same extra steps for every row, in the same order: counted, profiled, checked
        try:
            trace = t.kind == "sbp" and cfg["trace"]
            rec["comm"] = _count_sbp(t, trace) if t.kind == "sbp" else _count_torch(t)
            peak, _ = peak_allocated(t.step)
            rec["peak_allocated"] = _gathered(peak)
            loss, gnorm = t.step(check=True)
            rec["check"] = {"loss": loss, "grad_norm": gnorm}
            rec["state_bytes"] = _gathered(t.state_bytes())
            if t.kind == "sbp":
                rec["memory_report"] = _memory_report(t)
        except Exception as e:
            rec["error"] = f"after timing: {short_error(e)}"
    out["rows"] = rows
    return out


def worker(rank: int, world: int, cfg: dict, path: str) -> None:
    result = {name: _run_model(rank, name, cfg) for name in cfg["models"]}
    if rank == 0:
        Path(path).write_text(json.dumps(result))


# ---------------------------------------------------------------- report


def _tree_state() -> dict:
    """The sbp imported (PYTHONPATH picks the tree), its commit and uncommitted sbp files."""
    import subprocess

    import sbp

    root = Path(sbp.__file__).resolve().parent.parent

    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=root, capture_output=True, text=True).stdout
        except OSError:
            return ""

    changed = git("status", "--porcelain", "--", "sbp").splitlines()
    head = git("rev-parse", "--short", "HEAD").strip()
    return {"sbp_root": str(root), "head": head, "sbp_uncommitted": changed}


KIND_SHORT = {
    "all_reduce": "AR",
    "all_gather": "AG",
    "reduce_scatter": "RS",
    "all_to_all": "A2A",
    "broadcast": "BC",
    "send": "P2P",
}


def _kinds(calls: dict) -> str:
    return " ".join(f"{KIND_SHORT.get(k, k)}{v}" for k, v in sorted(calls.items())) or "0"


def _per_rank_mib(values: list[int]) -> str:
    mib = [f"{v / MIB:.1f}" for v in values]
    return mib[0] if len(set(mib)) == 1 else "/".join(mib)


def _rel(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    return abs(a - b) / max(abs(b), 1e-30)


def _report(result: dict) -> tuple[str, list[dict]]:
    lines, records = [], []
    for name, res in result.items():
        rows = res["rows"]
        anchor = rows.get(ANCHOR, {})
        a_ms = anchor.get("median_ms")
        a_check = anchor.get("check", {})
        table_rows = []
        for row, rec in rows.items():
            ms = rec.get("median_ms")
            check = rec.get("check", {})
            comm = rec.get("comm", {})
            states = rec.get("state_bytes") or []
            dloss = _rel(check.get("loss"), a_check.get("loss"))
            dgrad = _rel(check.get("grad_norm"), a_check.get("grad_norm"))
            ok = None
            if dloss is not None and dgrad is not None:
                ok = dloss < TOLERANCE and dgrad < TOLERANCE
            r = {
                "model": name,
                "row": row,
                "step_ms": ms,
                "x_ddp": ratio(ms, a_ms),
                "path": rec.get("path", ""),
                "collectives": comm.get("calls"),
                "bytes_sent": sum(comm.get("bytes", {}).values()) if comm else None,
                "counted_by": comm.get("how"),
                "state_bytes_per_rank": [sum(s.values()) for s in states] or None,
                "state_bytes_detail": states or None,
                "peak_allocated_per_rank": rec.get("peak_allocated"),
                "loss": check.get("loss"),
                "grad_norm": check.get("grad_norm"),
                "dloss_rel": dloss,
                "dgrad_rel": dgrad,
                "matches_ddp": ok,
                "error": rec.get("error"),
            }
            records.append(r)
            peaks = rec.get("peak_allocated")
            table_rows.append(
                [
                    row,
                    fmt(ms, ".1f"),
                    fmt(r["x_ddp"]),
                    r["path"] or "-",
                    _kinds(comm["calls"]) if comm else "-",
                    fmt(r["bytes_sent"] / 1024, ".0f") if r["bytes_sent"] is not None else "-",
                    _per_rank_mib(r["state_bytes_per_rank"]) if states else "-",
                    fmt(max(peaks) / MIB, ".1f") if peaks else "-",
                    fmt(dloss, ".1e"),
                    fmt(dgrad, ".1e"),
                    {True: "ok", False: "DIFFERS", None: "-"}[ok],
                    (r["error"] or "")[:100],
                ]
            )
        header = [
            "row", "step ms", "x DDP", "path", "colls", "KiB", "state MiB", "peak MiB",
            "|dloss|", "|dgrad|", "check", "error",
        ]  # fmt: skip
        c = res["sizes"]
        size = ", ".join(f"{k} {v}" for k, v in c.items())
        lines.append(f"{name} ({size}; {res['parameters'] / 1e6:.2f} M parameters)")
        lines.append(table(table_rows, header))
        for row, rec in rows.items():
            if rec.get("rejected"):
                lines.append(f"  {row}: data_parallel rejected {rec['rejected']}")
            if rec.get("memory_report") is not None:
                lines.append(f"  {row}: sbp.nn.memory_report = {rec['memory_report']}")
            how = rec.get("comm", {}).get("how", "")
            if how.startswith("computed"):
                lines.append(f"  {row}: collectives {how}")
        lines.append("")
    return "\n".join(lines), records


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--models", nargs="+", default=["mlp", "gpt"], choices=["mlp", "gpt"])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--rounds", type=int, default=12, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="small sizes, 3 timed steps")
    parser.add_argument("--trace", action="store_true", help="keep sbp's traced step in JSON")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if ANCHOR not in args.rows:
        args.rows.append(ANCHOR)
    rows = [r for r in ROWS if r in args.rows]
    size = "quick" if args.quick else "full"
    cfg = {
        "world": 2,
        "models": args.models,
        "rows": rows,
        "sizes": SIZES[size],
        "rounds": 3 if args.quick else args.rounds,
        "warmup": 1 if args.quick else args.warmup,
        "trace": args.trace,
        "optimizer": "AdamW(lr=1e-3, weight_decay=0.01)",
    }
    result = gather_rows(worker, 2, cfg)
    text, records = _report(result)
    print()
    print(text)
    print(
        f"x DDP = step time / torch DDP's in the same run (lower is faster); KiB = bytes this "
        f"rank sends per step; check: |dloss| and |dgrad| relative to DDP below {TOLERANCE}."
    )
    for name, res in result.items():
        for row, rec in res["rows"].items():
            trace = rec.get("comm", {}).get("trace")
            if trace:
                print(f"\n{name}, {row}: every collective of one step (rank 0)\n{trace}")
    payload = {
        "benchmark": "sharded_data_parallel",
        "config": cfg | {"sbp_tree": _tree_state()},
        "machine": machine_info(),
        "rows": records,
        "raw": result,
    }
    name = "sharded-data-parallel-quick" if args.quick else "sharded-data-parallel"
    for p in write_results(name, payload, args.out):
        print(f"wrote {p}")


if __name__ == "__main__":
    main()
