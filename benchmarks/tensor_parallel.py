"""Tensor parallelism: sbp vs DTensor vs a hand-written Megatron, same machine, same run.

Two models, each trained with AdamW on a mean-squared-error loss against a fixed target:

- mlp: 4 Megatron MLP blocks, fc1 (hidden 512 -> 2048) + GELU + fc2 (2048 -> 512), batch 64
  (no residual, no norm: the blocks of issue 51's first measurement);
- gpt: 2 pre-LayerNorm GPT blocks (hidden 256, 8 heads, seq 64, batch 8, MLP 4x): causal
  self-attention with one qkv Linear whose output is laid out head-major, (heads, 3, head
  dim), so that splitting its weight's rows gives each rank whole heads, attention with
  `F.scaled_dot_product_attention` (`--attention softmax`: an explicit softmax of q @ k^T
  on (batch, heads, seq, dim)), and an out-projection; both sublayers have a residual.

Two layouts: 1-D tensor parallel on 2 ranks (column-parallel fc1/qkv: weight and bias
split(0); row-parallel fc2/proj: weight split(1), bias broadcast; the batch broadcast), and
2-D DP x TP on 4 ranks with placement [[0, 1], [2, 3]] (hierarchy dim 0 = data parallel:
batch split(0), weights broadcast; dim 1 = tensor parallel as in 1-D). The logical batch
is the same in both layouts.

Three methods, each its own copy of the same initial weights:

- sbp: the plain module, then every parameter replaced by `torch.nn.Parameter(sbp.tensor(
  p, placement=P, sbp=nd_sbp))` (the logical value, laid out as above), the batch and
  target made global once; forward, backward and step run op by op on global tensors.
- dtensor: `parallelize_module` with `ColwiseParallel` on fc1/qkv and `RowwiseParallel` on
  fc2/proj (LayerNorm parameters stay plain tensors, replicated). For 2-D: a 2-D
  `DeviceMesh` ("dp", "tp"), the plan applied on `mesh["tp"]`, each rank fed its dp shard of
  the batch, and the gradients all-reduced over the "dp" mesh dim after backward by hand,
  in one flat bucket (the composition with FSDP2/`replicate` is not used: one manual
  bucket is the floor any of them can reach).
- megatron: local shards of the same weights in plain torch modules with Megatron's two
  functions, f (identity forward, all-reduce backward) on each column-parallel input and g
  (all-reduce forward, identity backward) after each row-parallel product, before the
  bias. For 2-D, one bucketed all-reduce of all gradients over the dp group after
  backward. This is the floor.

Per method: the median step time (interleaved rounds, barrier before each call, slowest
rank; `common.time_methods`) and its ratio to megatron's; the collectives and bytes per
step split into forward (forward + loss), backward (backward + the dp bucket of the
other methods) and optimizer step, counted with `sbp.comm_stats()`,
`torch.distributed.tensor.debug.CommDebugMode` (bytes by sbp's cost model,
`sbp.comm.cost`, for every method alike) and by the hand-written code itself; and the
largest |loss - loss of one process| over `--check-steps` + 1 steps in float64 (every
method retrained in float64 from the same weights; the reference is the logical model
trained in one process). Timing is float32.

For sbp, a tracing pass (one more step, with a recorder in `sbp.comm.stats` that reads
the op and the conversion from its calling frames: nothing in sbp is changed or
observed) attributes each collective to the op whose input conversion ran it (and that
conversion), or to the code path that ran it otherwise
(leaf gradients): printed after the table, and kept in the JSON under "sbp_trace".

    .venv/bin/python benchmarks/tensor_parallel.py            # a few minutes on 2 cores
    .venv/bin/python benchmarks/tensor_parallel.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import contextlib
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
    ratio,
    short_error,
    table,
    time_methods,
    write_results,
)

COLWISE = ("fc1", "qkv")  # weight and bias split(0) on the tp dim
ROWWISE = ("fc2", "proj")  # weight split(1), bias broadcast
METHODS = ("sbp", "sbp plan", "dtensor", "megatron")
KIND_SHORT = {
    "all_reduce": "AR",
    "all_gather": "AG",
    "reduce_scatter": "RS",
    "all_to_all": "A2A",
    "broadcast": "BC",
    "send": "P2P",
}


# ---------------------------------------------------------------- models


class TP:
    """The hand-written method's tensor-parallel group and its collective counter."""

    def __init__(self, group, size: int):
        self.group, self.size = group, size
        self.log: list[tuple[str, str, int]] = []  # (phase, kind, bytes) while counting
        self.phase: str | None = None

    def all_reduce(self, t: torch.Tensor, group=None, size: int | None = None) -> None:
        from sbp.comm import cost

        n = size or self.size
        if self.phase is not None:
            self.log.append(
                (self.phase, "all_reduce", cost.all_reduce_bytes(n, t.numel() * t.element_size()))
            )
        dist.all_reduce(t, group=group or self.group)


class _F(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient backward."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        ctx.tp.all_reduce(grad)
        return grad, None


class _G(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, tp):
        x = x.contiguous().clone()
        tp.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _colwise_in(x: torch.Tensor, tp: TP | None) -> torch.Tensor:
    return x if tp is None else _F.apply(x, tp)


def _rowwise(lin: torch.nn.Linear, h: torch.Tensor, tp: TP | None) -> torch.Tensor:
    if tp is None:
        return lin(h)
    return _G.apply(F.linear(h, lin.weight), tp) + lin.bias


class MLP(torch.nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.fc1 = torch.nn.Linear(hidden, ffn)
        self.fc2 = torch.nn.Linear(ffn, hidden)
        self.tp: TP | None = None  # set on the hand-written copy only

    def forward(self, x):
        return _rowwise(self.fc2, F.gelu(self.fc1(_colwise_in(x, self.tp))), self.tp)


class Attention(torch.nn.Module):
    def __init__(self, hidden: int, heads: int, kind: str):
        super().__init__()
        self.hd, self.kind = hidden // heads, kind
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)  # rows: (heads, {q, k, v}, head dim)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.tp: TP | None = None

    def forward(self, x):
        b, t, _ = x.shape
        qkv = self.qkv(_colwise_in(x, self.tp)).view(b, t, -1, 3, self.hd)  # -1: this rank's heads
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))  # (b, heads, t, hd)
        if self.kind == "sdpa":
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = q @ k.transpose(-2, -1) / math.sqrt(self.hd)
            mask = torch.ones(t, t, dtype=torch.bool).triu(1)
            o = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        o = o.transpose(1, 2).reshape(b, t, -1)
        return _rowwise(self.proj, o, self.tp)


class GPTBlock(torch.nn.Module):
    def __init__(self, hidden: int, heads: int, kind: str):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads, kind)
        self.ln2 = torch.nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, 4 * hidden)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def _build(name: str, cfg: dict) -> tuple[torch.nn.Module, tuple[int, ...]]:
    """The logical float32 model (seeded) and the logical batch's shape."""
    torch.manual_seed(0)
    if name == "mlp":
        c = cfg["mlp"]
        model = torch.nn.Sequential(*[MLP(c["hidden"], c["ffn"]) for _ in range(c["blocks"])])
        return model, (c["batch"], c["hidden"])
    c = cfg["gpt"]
    blocks = [GPTBlock(c["hidden"], c["heads"], cfg["attention"]) for _ in range(c["blocks"])]
    return torch.nn.Sequential(*blocks), (c["batch"], c["seq"], c["hidden"])


def _data(shape: tuple[int, ...], dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(shape, generator=g, dtype=dtype), torch.randn(
        shape, generator=g, dtype=dtype
    )


def _loss(out, y):
    return ((out - y) ** 2).mean()


def _opt(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def _role(pname: str) -> tuple[str, str]:
    """(module kind, 'weight' | 'bias') of a parameter name, e.g. ('fc1', 'weight')."""
    parts = pname.split(".")
    return parts[-2], parts[-1]


# ---------------------------------------------------------------- methods


class Runner:
    """One method: a model, its batch, an optimizer, and how to count its collectives."""

    def __init__(self, model, x, y, after_backward=None, loss_value=None, context=None):
        self.model, self.x, self.y = model, x, y
        self.context = context or contextlib.nullcontext  # (sbp: tensors made in forward)
        self.opt = _opt([p for p in model.parameters() if p.requires_grad])
        self.after_backward = after_backward or (lambda: None)
        self.loss_value = loss_value or (lambda loss: float(loss))

    def forward(self):
        with self.context():
            return _loss(self.model(self.x), self.y)

    def step(self):
        loss = self.forward()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.after_backward()
        self.opt.step()
        return loss.detach()


def _sbp_runner(base, x_log, y_log, world: int) -> Runner:
    import sbp

    model = copy.deepcopy(base)
    if world == 2:
        P = sbp.placement("cpu", [0, 1])
        wrap = lambda s: (s,)  # noqa: E731
        batch = (sbp.broadcast,)
    else:
        P = sbp.placement("cpu", [[0, 1], [2, 3]])
        wrap = lambda s: (sbp.broadcast, s)  # noqa: E731
        batch = (sbp.split(0), sbp.broadcast)
    for mname, mod in model.named_modules():
        for pname, p in list(mod._parameters.items()):
            mkind, which = _role(f"{mname}.{pname}")
            if mkind in COLWISE:
                s = sbp.split(0)
            elif mkind in ROWWISE and which == "weight":
                s = sbp.split(1)
            else:
                s = sbp.broadcast
            value = sbp.tensor(p.detach(), placement=P, sbp=wrap(s))
            mod._parameters[pname] = torch.nn.Parameter(value, requires_grad=True)
    x = sbp.tensor(x_log, placement=P, sbp=batch)
    y = sbp.tensor(y_log, placement=P, sbp=batch)
    return Runner(
        model, x, y, loss_value=lambda loss: float(loss.full_tensor()), context=_context(base, P)
    )


def _context(base: torch.nn.Module, P):
    """sbp.global_mode where the model makes a tensor in forward: the softmax attention's
    causal mask (torch.ones), made global there. (A mode sees every torch call of the
    forward, ~0.5 ms a step here: not entered where nothing needs it.)"""
    import sbp

    if any(getattr(m, "kind", None) == "softmax" for m in base.modules()):
        return lambda: sbp.global_mode(P)
    return None


def _dp_shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    if world == 2:
        return t
    return t.chunk(2, 0)[rank // 2].contiguous()


def _dp_bucket(params, group, tp: TP, local=lambda g: g) -> None:
    """All-reduce every gradient over the dp group in one flat bucket, then average."""
    grads = [local(p.grad) for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    tp.all_reduce(flat, group=group, size=2)
    flat /= 2
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def _dp_loss(group):
    def value(loss):
        t = loss.detach().clone().reshape(1)
        dist.all_reduce(t, group=group)
        return float(t) / 2

    return value


def _groups(world: int) -> dict:
    """This rank's tp and dp process groups (every rank makes every group, in order)."""
    rank = dist.get_rank()
    if world == 2:
        return {"tp": dist.new_group([0, 1]), "dp": None}
    out = {}
    for ranks in ([0, 1], [2, 3]):
        g = dist.new_group(ranks)
        if rank in ranks:
            out["tp"] = g
    for ranks in ([0, 2], [1, 3]):
        g = dist.new_group(ranks)
        if rank in ranks:
            out["dp"] = g
    return out


def _megatron_runner(base, x_log, y_log, world: int, groups: dict) -> Runner:
    rank = dist.get_rank()
    tp_rank = rank % 2
    tp = TP(groups["tp"], 2)
    model = copy.deepcopy(base)
    for name, mod in model.named_modules():
        if isinstance(mod, (MLP, Attention)):
            mod.tp = tp
        short = name.rsplit(".", 1)[-1]
        if short in COLWISE:
            mod.weight = torch.nn.Parameter(mod.weight.detach().chunk(2, 0)[tp_rank].clone())
            mod.bias = torch.nn.Parameter(mod.bias.detach().chunk(2, 0)[tp_rank].clone())
        elif short in ROWWISE:
            mod.weight = torch.nn.Parameter(mod.weight.detach().chunk(2, 1)[tp_rank].clone())
    x, y = _dp_shard(x_log, rank, world), _dp_shard(y_log, rank, world)
    params = list(model.parameters())
    if world == 2:
        r = Runner(model, x, y)
    else:
        r = Runner(
            model,
            x,
            y,
            after_backward=lambda: _dp_bucket(params, groups["dp"], tp),
            loss_value=_dp_loss(groups["dp"]),
        )
    r.tp = tp
    return r


def _dtensor_runner(base, x_log, y_log, world: int, groups: dict) -> Runner:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    rank = dist.get_rank()
    model = copy.deepcopy(base)
    if world == 2:
        tp_mesh = DeviceMesh("cpu", [0, 1])
    else:
        mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
        tp_mesh = mesh["tp"]
    plan = {}
    for name, _ in model.named_modules():
        short = name.rsplit(".", 1)[-1]
        if short in COLWISE:
            plan[name] = ColwiseParallel()
        elif short in ROWWISE:
            plan[name] = RowwiseParallel()
    parallelize_module(model, tp_mesh, plan)
    x, y = _dp_shard(x_log, rank, world), _dp_shard(y_log, rank, world)
    tp = TP(None, 2)
    if world == 2:
        r = Runner(model, x, y)
    else:
        params = list(model.parameters())

        def local(g):
            return g._local_tensor if hasattr(g, "_local_tensor") else g

        r = Runner(
            model,
            x,
            y,
            after_backward=lambda: _dp_bucket(params, mesh.get_group("dp"), tp, local),
            loss_value=_dp_loss(mesh.get_group("dp")),
        )
    r.tp = tp  # counts the dp bucket
    return r


# ---------------------------------------------------------------- counting


def _dtensor_mode():
    """CommDebugMode, also noting each collective's bytes (sbp's cost model)."""
    from torch.distributed.tensor.debug import CommDebugMode

    from sbp.comm import cost

    class Mode(CommDebugMode):
        def __init__(self):
            super().__init__()
            self.log: list[tuple[str, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before = self.get_total_counts()
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if out is not NotImplemented and self.get_total_counts() > before:
                name = func._overloadpacket.__name__
                t = args[0] if args and isinstance(args[0], torch.Tensor) else None
                nbytes = t.numel() * t.element_size() if t is not None else 0
                n = 2  # every DTensor collective here runs on the tp mesh of 2
                if "all_reduce" in name:
                    kind, b = "all_reduce", cost.all_reduce_bytes(n, nbytes)
                elif "all_gather" in name:
                    kind, b = "all_gather", cost.all_gather_bytes(n, nbytes)
                elif "reduce_scatter" in name:
                    kind, b = "reduce_scatter", cost.reduce_scatter_bytes(n, nbytes)
                elif "all_to_all" in name:
                    kind, b = "all_to_all", nbytes // 2
                else:
                    kind, b = name, nbytes
                self.log.append((kind, b))
            return out

    return Mode()


def _phase(calls: Counter, nbytes: int) -> dict:
    return {"calls": sum(calls.values()), "bytes": nbytes, "by_kind": dict(calls)}


def _count(method: str, r: Runner) -> dict:
    """Collectives and bytes of one step, per phase (fwd, bwd, opt)."""
    out = {}
    if method.startswith("sbp"):
        import sbp

        with sbp.comm_stats() as st:
            loss = r.forward()
        out["fwd"] = _phase(Counter(st.by_kind), st.bytes)
        r.opt.zero_grad(set_to_none=True)
        with sbp.comm_stats() as st:
            loss.backward()
            r.after_backward()
        out["bwd"] = _phase(Counter(st.by_kind), st.bytes)
        with sbp.comm_stats() as st:
            r.opt.step()
        out["opt"] = _phase(Counter(st.by_kind), st.bytes)
        return out
    if method == "megatron":
        r.tp.log.clear()
        r.tp.phase = "fwd"
        loss = r.forward()
        r.opt.zero_grad(set_to_none=True)
        r.tp.phase = "bwd"
        loss.backward()
        r.after_backward()
        r.tp.phase = "opt"
        r.opt.step()
        r.tp.phase = None
        for ph in ("fwd", "bwd", "opt"):
            rows = [(k, b) for p, k, b in r.tp.log if p == ph]
            out[ph] = _phase(Counter(k for k, _ in rows), sum(b for _, b in rows))
        return out
    # dtensor: DTensor's own collectives by CommDebugMode, the dp bucket by our counter
    r.tp.log.clear()
    mode = _dtensor_mode()
    with mode:
        loss = r.forward()
    out["fwd"] = _phase(Counter(k for k, _ in mode.log), sum(b for _, b in mode.log))
    r.opt.zero_grad(set_to_none=True)
    mode = _dtensor_mode()
    r.tp.phase = "bwd"
    with mode:
        loss.backward()
    r.after_backward()  # (outside the mode: c10d's own all_reduce would count twice)
    r.tp.phase = None
    calls = Counter(k for k, _ in mode.log) + Counter(k for _, k, _ in r.tp.log)
    out["bwd"] = _phase(calls, sum(b for _, b in mode.log) + sum(b for _, _, b in r.tp.log))
    mode = _dtensor_mode()
    with mode:
        r.opt.step()
    out["opt"] = _phase(Counter(k for k, _ in mode.log), sum(b for _, b in mode.log))
    return out


# ---------------------------------------------------------------- sbp trace


def _nd(spec) -> str:
    from sbp.signature import format_nd_sbp

    return format_nd_sbp(spec.nd_sbp)


class _Trace:
    """One step of sbp with every collective attributed, passively: a recorder in
    `sbp.comm.stats` (as `comm_stats()` is) that reads, from the calling frames, the op
    being run (`registry.run_strategy`'s func and inputs) and the conversion being executed
    (`boxing.executor.execute`'s plan). No observer is registered (sbp changes what it does
    while `sbp.ops.registry.observers` watches: it keeps no conversion for reuse then)."""

    SKIP = ("/sbp/comm/", "/sbp/boxing/", "/sbp/kernels/")

    def __init__(self):
        self.phase = "fwd"
        self.rows: list[dict] = []

    @staticmethod
    def _op(f) -> str:
        loc = f.f_locals
        func, flat, gpos, d = loc.get("func"), loc.get("flat"), loc.get("gpos"), loc.get("d")
        try:
            ins = ", ".join(f"{tuple(flat[i].shape)}{_nd(flat[i]._spec)}" for i in gpos)
            outs = ", ".join(_nd(s) for s in (d.out_specs or ()) if s is not None)
            return f"{func.__name__}[{ins}] -> {outs}"
        except Exception:  # (a frame in another state: name the op alone)
            return str(func)

    def record(self, kind: str, nbytes: int) -> None:
        where, op, conv = [], None, None
        f = sys._getframe(1)
        while f is not None:
            fn, name = f.f_code.co_filename, f.f_code.co_name
            if conv is None and name == "execute" and fn.endswith("boxing/executor.py"):
                plan = f.f_locals.get("plan")
                if plan is not None:
                    conv = f"{_nd(plan.src)}->{_nd(plan.dst)} {tuple(plan.src.shape)}"
            if op is None and name == "run_strategy" and fn.endswith("ops/registry.py"):
                op = self._op(f)
            if "/sbp/" in fn and not any(s in fn for s in self.SKIP) and len(where) < 3:
                mod = fn.rsplit("/sbp/", 1)[1].removesuffix(".py").replace("/", ".")
                where.append(f"{mod}.{f.f_code.co_qualname}")
            f = f.f_back
        self.rows.append(
            {
                "phase": self.phase,
                "kind": kind,
                "bytes": nbytes,
                "op": op,
                "conversion": conv,
                "where": " < ".join(where),
            }
        )


def _sbp_trace(r: Runner) -> list[dict]:
    from sbp.comm import stats

    tr = _Trace()
    stats._active.append(tr)
    try:
        loss = r.forward()
        r.opt.zero_grad(set_to_none=True)
        tr.phase = "bwd"
        loss.backward()
        tr.phase = "opt"
        r.opt.step()
    finally:
        stats._active.remove(tr)
    return tr.rows


def _trace_summary(rows: list[dict]) -> list[dict]:
    """Rows grouped by (phase, op, conversion, kind, where), in order of first use."""
    groups: dict = {}
    for row in rows:
        key = (row["phase"], row["op"], row["conversion"], row["kind"], row["where"])
        g = groups.setdefault(key, {**row, "calls": 0, "bytes": 0})
        g["calls"] += 1
        g["bytes"] += row["bytes"]
    return list(groups.values())


# ---------------------------------------------------------------- worker


def _agree(ok: bool) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag)


def _sbp_plan_runner(base, x_log, y_log, world: int) -> Runner:
    """The same layouts stated at module boundaries: sbp.nn.parallelize (on 2-D along
    hierarchy dim 1, the batch split along dim 0)."""
    import sbp
    from sbp.nn import ColwiseParallel, RowwiseParallel

    if world == 2:
        P, batch = sbp.placement("cpu", [0, 1]), (sbp.broadcast,)
    else:
        P, batch = sbp.placement("cpu", [[0, 1], [2, 3]]), (sbp.split(0), sbp.broadcast)
    kinds = {name.rsplit(".", 1)[-1] for name, _ in base.named_modules()}
    plan = {f"*{k}": ColwiseParallel() for k in COLWISE if k in kinds}
    plan.update({f"*{k}": RowwiseParallel() for k in ROWWISE if k in kinds})
    model = sbp.nn.parallelize(copy.deepcopy(base), plan, P)
    x = sbp.tensor(x_log, placement=P, sbp=batch)
    y = sbp.tensor(y_log, placement=P, sbp=batch)
    return Runner(
        model, x, y, loss_value=lambda loss: float(loss.full_tensor()), context=_context(base, P)
    )


def _make(method, base, x, y, world, groups):
    if method == "sbp":
        return _sbp_runner(base, x, y, world)
    if method == "sbp plan":
        return _sbp_plan_runner(base, x, y, world)
    if method == "dtensor":
        return _dtensor_runner(base, x, y, world, groups)
    return _megatron_runner(base, x, y, world, groups)


def _reference_losses(base, x, y, steps: int) -> list[float]:
    r = Runner(copy.deepcopy(base), x, y)
    return [float(r.step()) for _ in range(steps)]


def _run_model(name: str, world: int, cfg: dict, groups: dict) -> dict:
    import sbp  # noqa: F401  (adds to_global; the first op imports the rest)

    base, shape = _build(name, cfg)
    out: dict[str, Any] = {"methods": {}}
    # float64: every method against one process on the logical model
    base64 = copy.deepcopy(base).double()
    x64, y64 = _data(shape, torch.float64)
    steps = cfg["check_steps"] + 1
    ref = _reference_losses(base64, x64, y64, steps)
    out["reference_losses"] = ref
    for m in METHODS:
        rec: dict[str, Any] = {}
        err = None
        try:
            r = _make(m, base64, x64, y64, world, groups)
            losses = [r.loss_value(r.step()) for _ in range(steps)]
            rec["losses"] = losses
            rec["max_abs_loss_diff"] = max(abs(a - b) for a, b in zip(losses, ref, strict=True))
        except Exception as e:  # recorded per case, never fatal
            err = short_error(e)
        if not _agree(err is None):
            rec["check_error"] = err or "failed on another rank"
        out["methods"][m] = rec
    # float32: collectives per step and timing
    x32, y32 = _data(shape, torch.float32)
    runners = {}
    for m in METHODS:
        err = None
        try:
            runners[m] = _make(m, base, x32, y32, world, groups)
            runners[m].step()  # warm (first-call costs, optimizer state)
        except Exception as e:
            err = short_error(e)
        if not _agree(err is None):
            out["methods"][m]["error"] = err or "failed on another rank"
            runners.pop(m, None)
    for m, r in list(runners.items()):
        err = None
        try:
            out["methods"][m]["collectives"] = _count(m, r)
        except Exception as e:
            err = short_error(e)
        if not _agree(err is None):
            out["methods"][m]["count_error"] = err or "failed on another rank"
    if "sbp" in runners and not cfg["no_trace"]:
        try:
            out["sbp_trace"] = _trace_summary(_sbp_trace(runners["sbp"]))
        except Exception as e:
            out["sbp_trace_error"] = short_error(e)
        _agree(True)
    timings = time_methods({m: r.step for m, r in runners.items()}, cfg["warmup"], cfg["rounds"])
    for m, t in timings.items():
        out["methods"][m]["timing"] = t.as_dict()
    return out


def worker(rank: int, world: int, cfg: dict, path: str) -> None:
    torch.set_num_threads(1)
    groups = _groups(world)
    res = {"world": world, "models": {}}
    for name in cfg["models"]:
        res["models"][name] = _run_model(name, world, cfg, groups)
    if rank == 0:
        Path(path).write_text(json.dumps(res))


# ---------------------------------------------------------------- report


def _kinds(by_kind: dict) -> str:
    return " ".join(f"{KIND_SHORT.get(k, k)}{v}" for k, v in sorted(by_kind.items())) or "0"


def _records(results: dict) -> list[dict]:
    records = []
    for layout, res in results.items():
        for model, mres in res["models"].items():
            floor = mres["methods"].get("megatron", {}).get("timing", {}).get("median_ms")
            for m in METHODS:
                rec = mres["methods"].get(m, {})
                col = rec.get("collectives", {})
                ms = rec.get("timing", {}).get("median_ms")
                errors = [
                    rec.get(k) or rec.get("timing", {}).get(k)
                    for k in ("error", "check_error", "count_error")
                ]
                records.append(
                    {
                        "model": model,
                        "layout": layout,
                        "method": m,
                        "step_ms": ms,
                        "min_ms": rec.get("timing", {}).get("min_ms"),
                        "vs_megatron": ratio(ms, floor),
                        "collectives": col,
                        "max_abs_loss_diff_float64": rec.get("max_abs_loss_diff"),
                        "error": "; ".join(e for e in errors if e) or None,
                    }
                )
    return records


def _report(records: list[dict]) -> str:
    rows = []
    for r in records:
        c = r["collectives"]

        def n(ph, c=c):
            return c.get(ph, {}).get("calls")

        def kib(ph, c=c):
            b = c.get(ph, {}).get("bytes")
            return None if b is None else b / 1024

        total = {}
        for ph in ("fwd", "bwd", "opt"):
            for k, v in c.get(ph, {}).get("by_kind", {}).items():
                total[k] = total.get(k, 0) + v
        rows.append(
            [
                r["model"],
                r["layout"],
                r["method"],
                fmt(r["step_ms"], ".1f"),
                fmt(r["vs_megatron"]),
                fmt(n("fwd")),
                fmt(n("bwd")),
                fmt(n("opt")),
                _kinds(total) if c else "-",
                fmt(kib("fwd"), ".0f"),
                fmt(kib("bwd"), ".0f"),
                fmt(kib("opt"), ".0f"),
                fmt(r["max_abs_loss_diff_float64"], ".1e"),
                (r["error"] or "")[:90],
            ]
        )
    header = [
        "model", "layout", "method", "step ms", "x megatron", "fwd", "bwd", "opt", "kinds",
        "fwd KiB", "bwd KiB", "opt KiB", "|dloss| f64", "error",
    ]  # fmt: skip
    return table(rows, header)


def _trace_report(results: dict) -> str:
    parts = []
    for layout, res in results.items():
        for model, mres in res["models"].items():
            rows = mres.get("sbp_trace")
            if rows is None:
                if mres.get("sbp_trace_error"):
                    parts.append(f"sbp trace, {model} {layout}: {mres['sbp_trace_error']}")
                continue
            lines = [
                [
                    r["phase"],
                    r["calls"],
                    KIND_SHORT.get(r["kind"], r["kind"]),
                    f"{r['bytes'] / 1024:.0f}",
                    (r["op"] or "-")[:80],
                    r["conversion"] or "-",
                    r["where"] if not r["op"] else "",
                ]
                for r in rows
            ]
            head = ["phase", "n", "kind", "KiB", "op [inputs] -> out", "conversion", "else where"]
            parts.append(f"sbp, {model} {layout}: every collective of one step (rank 0)")
            parts.append(table(lines, head))
    return "\n\n".join(parts)


def _tree_state() -> dict:
    """The commit and the uncommitted files under sbp/ the numbers were measured with."""
    import subprocess

    root = Path(__file__).resolve().parent.parent

    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=root, capture_output=True, text=True).stdout
        except OSError:
            return ""

    changed = git("status", "--porcelain", "--", "sbp").splitlines()
    return {"head": git("rev-parse", "--short", "HEAD").strip(), "sbp_uncommitted": changed}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="2 rounds, 1 warm-up, 1 check step")
    parser.add_argument("--layouts", nargs="+", default=["1d", "2d"], choices=["1d", "2d"])
    parser.add_argument("--models", nargs="+", default=["mlp", "gpt"], choices=["mlp", "gpt"])
    parser.add_argument("--rounds", type=int, default=12, help="timed steps per method")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--check-steps", type=int, default=3, help="AdamW steps of the check")
    parser.add_argument("--attention", default="sdpa", choices=["sdpa", "softmax"])
    parser.add_argument("--no-trace", action="store_true", help="skip sbp's traced step")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    cfg = {
        "models": args.models,
        "rounds": 2 if args.quick else args.rounds,
        "warmup": 1 if args.quick else args.warmup,
        "check_steps": 1 if args.quick else args.check_steps,
        "attention": args.attention,
        "no_trace": args.no_trace,
        "mlp": {"hidden": 512, "ffn": 2048, "blocks": 4, "batch": 64},
        "gpt": {"hidden": 256, "heads": 8, "seq": 64, "batch": 8, "blocks": 2},
        "optimizer": "AdamW(lr=1e-3, weight_decay=0.01)",
        "timing_dtype": "float32",
        "check_dtype": "float64",
    }
    cfg["sbp_tree"] = _tree_state()
    results = {}
    for layout in args.layouts:
        world = 2 if layout == "1d" else 4
        name = "1d tp2" if layout == "1d" else "2d dp2xtp2"
        results[name] = gather_rows(worker, world, cfg)
    records = _records(results)
    print()
    print(_report(records))
    print()
    print(_trace_report(results))
    payload = {
        "benchmark": "tensor_parallel",
        "config": cfg,
        "machine": machine_info(),
        "rows": records,
        "sbp_trace": {
            f"{model} {layout}": res["models"][model].get("sbp_trace")
            for layout, res in results.items()
            for model in res["models"]
        },
        "raw": results,
    }
    name = "tensor_parallel-quick" if args.quick else "tensor_parallel"
    for p in write_results(name, payload, args.out):
        print(f"wrote {p}")


if __name__ == "__main__":
    main()
