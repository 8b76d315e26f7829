"""Dispatch benchmark: what one small op costs through sbp and DTensor over plain torch.

For small tensors the collective is absent or tiny and what a user pays is the wrapper's
per-op overhead: `__torch_dispatch__`, the rule lookup, the strategy decision cache,
argument flattening, wrapping the outputs, autograd bookkeeping. This script measures it
side by side, in the same run on the same ranks, for
  torch       the op on plain tensors of the logical shape (the floor of B/R methods);
  torch-S     the op on plain tensors of this rank's split(0) shard (the floor of the split
              methods, whose kernels see half the rows); for Linear, torch-S also does what
              any data-parallel step must: one all_reduce of all gradients in a flat buffer;
  pywrap      a minimal Python `__torch_dispatch__` wrapper subclass (unwrap, run, wrap; no
              placement logic), the floor of any design that dispatches in Python;
  sbp-B       GlobalTensors, every input broadcast;
  sbp-S       GlobalTensors, the batch input split(0) (weights broadcast);
  dtensor-R   torch.distributed.tensor DTensors, every input Replicate;
  dtensor-S   DTensors, the batch input Shard(0) (weights Replicate);
and reports each overhead (method - its floor) and sbp's overhead over DTensor's, whose
target is <= 0.5.

Run `python benchmarks/dispatch.py` (about 45 s); `--profile` adds a cProfile of
the sbp methods on rank 0 (top functions by own time) to the output and the JSON. See
benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import json
import pstats
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

try:  # `python -m benchmarks.dispatch` from the repository root
    from benchmarks import common
except ImportError:  # `python benchmarks/dispatch.py`
    import common

WORLD_SIZE = 2
METHODS = ("torch", "torch-S", "pywrap", "sbp-B", "sbp-S", "dtensor-R", "dtensor-S")
FLOOR = {  # which plain-torch run each method's overhead is taken against
    "pywrap": "torch",
    "sbp-B": "torch",
    "dtensor-R": "torch",
    "sbp-S": "torch-S",
    "dtensor-S": "torch-S",
}
TARGET = 0.5  # sbp overhead / DTensor overhead
REPEATS = 9
BATCH, FEATURES = 16, 64


@dataclass(frozen=True)
class Case:
    """One op; `iters` calls make one timed repeat (the repeat's mean is what we keep)."""

    name: str
    label: str
    iters: int


CASES = (
    Case("add", "add (8,8)+(8,8)", 2000),
    Case("mm", "mm (64,64)@(64,64)", 2000),
    Case("linear", "Linear(64,64) fwd+bwd, batch 16", 500),
)


@dataclass
class Method:
    """One iteration of a method, and how to read its logical result for the check."""

    step: Callable[[], Any]
    value: Callable[[], torch.Tensor] | None  # None: not comparable (a shard-shaped floor)


class PyWrap(torch.Tensor):
    """The least a Python `__torch_dispatch__` wrapper can do: unwrap, run, wrap. Whatever
    sbp costs beyond this is its own logic; this much any Python-dispatch design pays."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor, requires_grad: bool = False) -> PyWrap:
        out = torch.Tensor._make_wrapper_subclass(
            cls, elem.shape, dtype=elem.dtype, device=elem.device, requires_grad=requires_grad
        )
        out.elem = elem
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        def unwrap(a: Any) -> Any:
            if type(a) is PyWrap:
                return a.elem
            if type(a) is list or type(a) is tuple:
                return type(a)(unwrap(b) for b in a)
            return a

        out = func(*unwrap(args), **(kwargs or {}))
        if type(out) is list or type(out) is tuple:
            return type(out)(PyWrap(o) if isinstance(o, torch.Tensor) else o for o in out)
        return PyWrap(out) if isinstance(out, torch.Tensor) else out


def _unwrap_value(t: torch.Tensor) -> torch.Tensor:
    """A method's result as a plain full tensor (collective for sbp and DTensor)."""
    if isinstance(t, PyWrap):
        return t.elem
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# ---------------------------------------------------------------- inputs per method


class _Ctx:
    """Per-rank handles every builder needs (placement, mesh, rank), made once."""

    def __init__(self, rank: int, n: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        import sbp

        self.rank, self.n = rank, n
        self.placement = sbp.placement("cpu", list(range(n)))
        self.mesh = init_device_mesh("cpu", (n,))

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of `full` (balanced = torch.chunk for the even shapes used here)."""
        return torch.chunk(full, self.n, 0)[self.rank].contiguous()

    def sbp_global(self, full: torch.Tensor, split: bool) -> torch.Tensor:
        """A GlobalTensor of `full` (split(0) or broadcast) without any communication."""
        import sbp

        local = self.shard(full) if split else full
        kind = sbp.split(0) if split else sbp.broadcast
        return sbp.to_global(
            local, self.placement, kind, shape=full.shape, check_meta=False, sync_data=False
        )

    def dtensor(self, full: torch.Tensor, split: bool) -> torch.Tensor:
        """A DTensor of `full` (Shard(0) or Replicate) without any communication."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        local = self.shard(full) if split else full
        return DTensor.from_local(
            local,
            self.mesh,
            [Shard(0) if split else Replicate()],
            run_check=False,
            shape=full.shape,
            stride=full.stride(),
        )


def _inputs(shapes: list[tuple[int, ...]], seed: int) -> list[torch.Tensor]:
    """The same full tensors on every rank (seeded), so every method computes one value."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in shapes]


def _two(
    ctx: _Ctx, op: Callable, a: torch.Tensor, b: torch.Tensor, split_b: bool
) -> dict[str, Method]:
    """`op(a, b)` by every method; the split methods split `a` along dim 0, and `b` too
    when `split_b` (pointwise ops), else keep `b` broadcast/Replicate (x @ w)."""
    sa, sb = ctx.shard(a), ctx.shard(b) if split_b else b
    gb_a, gb_b = ctx.sbp_global(a, False), ctx.sbp_global(b, False)
    gs_a, gs_b = ctx.sbp_global(a, True), ctx.sbp_global(b, split_b)
    dr_a, dr_b = ctx.dtensor(a, False), ctx.dtensor(b, False)
    ds_a, ds_b = ctx.dtensor(a, True), ctx.dtensor(b, split_b)
    pw_a, pw_b = PyWrap(a), PyWrap(b)
    return {
        "torch": Method(lambda: op(a, b), lambda: op(a, b)),
        "torch-S": Method(lambda: op(sa, sb), None),
        "pywrap": Method(lambda: op(pw_a, pw_b), lambda: _unwrap_value(op(pw_a, pw_b))),
        "sbp-B": Method(lambda: op(gb_a, gb_b), lambda: op(gb_a, gb_b).full_tensor()),
        "sbp-S": Method(lambda: op(gs_a, gs_b), lambda: op(gs_a, gs_b).full_tensor()),
        "dtensor-R": Method(lambda: op(dr_a, dr_b), lambda: op(dr_a, dr_b).full_tensor()),
        "dtensor-S": Method(lambda: op(ds_a, ds_b), lambda: op(ds_a, ds_b).full_tensor()),
    }


def _train_step(model: torch.nn.Module, x: torch.Tensor, finish: Callable[[], None]) -> None:
    """One forward+backward; grads are set to None first, so every method assigns fresh
    grads (no accumulation op) exactly as a training loop with zero_grad() does."""
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    finish()


def _linear(ctx: _Ctx) -> dict[str, Method]:
    """Linear(64, 64) forward+backward on a batch of 16; params broadcast/Replicate.

    Every split method must end with whole gradients, as a data-parallel step needs. sbp
    reduces its partial-sum weight gradient after backward (the leaf-gradient hook, one
    bucketed all-reduce); DTensor leaves the weight gradient Partial, so its step
    redistributes it to Replicate inside the timed region; the torch-S floor all-reduces
    all gradients in one flat buffer, as DDP would.
    """
    from torch.distributed.tensor import Replicate, distribute_module

    import sbp

    torch.manual_seed(0)
    base = torch.nn.Linear(FEATURES, FEATURES)
    (x,) = _inputs([(BATCH, FEATURES)], seed=2)

    def clone() -> torch.nn.Module:
        return copy.deepcopy(base)

    plain, plain_s = clone(), clone()
    sbp_b = clone().to_global(ctx.placement, sbp.broadcast)
    sbp_s = clone().to_global(ctx.placement, sbp.broadcast)
    dt_r = distribute_module(clone(), ctx.mesh)  # default partition: Replicate params
    dt_s = distribute_module(clone(), ctx.mesh)
    pywrap = clone()
    for name, p in list(pywrap.named_parameters()):
        setattr(pywrap, name, torch.nn.Parameter(PyWrap(p.detach().clone())))
    replicate = [Replicate()]

    def nothing() -> None:
        return None

    def ddp_all_reduce() -> None:
        flat = torch.cat([p.grad.reshape(-1) for p in plain_s.parameters()])
        dist.all_reduce(flat)
        flat /= ctx.n  # the mean over ranks, as DDP; the value is not checked

    def dt_replicate_grads() -> None:
        for p in dt_s.parameters():
            if p.grad is not None and not all(q.is_replicate() for q in p.grad.placements):
                p.grad = p.grad.redistribute(ctx.mesh, replicate)

    def grads_of(model: torch.nn.Module) -> Callable[[], torch.Tensor]:
        def read() -> torch.Tensor:
            return torch.cat([_unwrap_value(p.grad).reshape(-1) for p in model.parameters()])

        return read

    def method(model: torch.nn.Module, inp: torch.Tensor, finish: Callable, check: bool) -> Method:
        return Method(lambda: _train_step(model, inp, finish), grads_of(model) if check else None)

    return {
        "torch": method(plain, x, nothing, True),
        "torch-S": method(plain_s, ctx.shard(x), ddp_all_reduce, False),
        "pywrap": method(pywrap, PyWrap(x), nothing, True),
        "sbp-B": method(sbp_b, ctx.sbp_global(x, False), nothing, True),
        "sbp-S": method(sbp_s, ctx.sbp_global(x, True), nothing, True),
        "dtensor-R": method(dt_r, ctx.dtensor(x, False), nothing, True),
        "dtensor-S": method(dt_s, ctx.dtensor(x, True), dt_replicate_grads, True),
    }


def build(case: Case, ctx: _Ctx) -> dict[str, Method]:
    """The methods of one case, inputs made here (outside the timed region)."""
    if case.name == "add":
        a, b = _inputs([(8, 8), (8, 8)], seed=0)
        return _two(ctx, torch.add, a, b, split_b=True)
    if case.name == "mm":
        x, w = _inputs([(64, 64), (64, 64)], seed=1)
        return _two(ctx, torch.mm, x, w, split_b=False)
    if case.name == "linear":
        return _linear(ctx)
    raise ValueError(f"unknown case {case.name}")


# ---------------------------------------------------------------- measuring


def check(methods: dict[str, Method]) -> dict[str, str]:
    """Each method's logical result against plain torch's (the first method), agreed over
    ranks: a wrapper that is fast because it is wrong must not look good."""
    want = None
    out: dict[str, str] = {}
    for name, m in methods.items():
        if m.value is None:
            continue
        ok = True
        try:
            m.step()
            got = m.value()
            if want is None:
                want = got
            ok = tuple(got.shape) == tuple(want.shape) and torch.allclose(
                got, want, rtol=1e-5, atol=1e-6
            )
            out[name] = "ok" if ok else "MISMATCH"
        except Exception as e:  # recorded; time_methods drops a method that raises
            ok = False
            out[name] = f"error: {common.short_error(e)}"
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if not flag.item() and out[name] == "ok":
            out[name] = "MISMATCH on another rank"
    return out


def _loop(step: Callable[[], Any], iters: int) -> Callable[[], None]:
    """`iters` back-to-back calls: one timed repeat; its time / iters is the mean per op."""

    def run() -> None:
        for _ in range(iters):
            step()

    return run


def profile_text(step: Callable[[], Any], iters: int, top: int) -> str:
    """cProfile of `iters` calls, `top` functions by own time (run on every rank, so the
    collectives inside still match; rank 0 keeps the text)."""
    prof = cProfile.Profile()
    prof.enable()
    _loop(step, iters)()
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(top)
    lines = buf.getvalue().splitlines()
    body = [ln for ln in lines if ln.strip()]
    # drop pstats' preamble (file name, "Ordered by"), keep totals and the table
    return "\n".join(ln for ln in body if not ln.lstrip().startswith(("Ordered", "List reduced")))


def run_case(case: Case, ctx: _Ctx, cfg: dict[str, Any]) -> dict[str, Any]:
    """Check, then time every method interleaved repeat by repeat; optionally profile."""
    methods = build(case, ctx)
    checks = check(methods)
    iters = max(int(case.iters * cfg["iters_scale"]), 1)
    loops = {name: _loop(m.step, iters) for name, m in methods.items()}
    timings = common.time_methods(loops, cfg["warmup"], cfg["repeats"])
    us = {name: (t.median_ms * 1e3 / iters if t.median_ms is not None else None)
          for name, t in timings.items()}  # fmt: skip
    overhead = {
        name: (us[name] - us[floor] if us[name] is not None and us[floor] is not None else None)
        for name, floor in FLOOR.items()
    }
    row: dict[str, Any] = {
        "case": case.name,
        "label": case.label,
        "iters": iters,
        "repeats": cfg["repeats"],
        "check": checks,
        "us": us,
        "overhead_us": overhead,
        "sbp_over_dtensor_overhead": {
            "B": common.ratio(overhead["sbp-B"], overhead["dtensor-R"]),
            "S": common.ratio(overhead["sbp-S"], overhead["dtensor-S"]),
        },
        "timings": {
            name: (
                {"error": t.error}
                if t.error is not None
                else {"repeat_us_per_iter": [round(r * 1e3 / iters, 3) for r in t.rounds_ms]}
            )
            for name, t in timings.items()
        },
    }
    if cfg["profile"]:
        row["profile"] = {
            name: profile_text(methods[name].step, iters, cfg["profile_top"])
            for name in ("sbp-B", "sbp-S")
        }
    return row


def worker(rank: int, n: int, cfg: dict[str, Any], out_path: str) -> None:
    """One rank: every case in the same order on all ranks."""
    warnings.filterwarnings("ignore")
    import sbp

    sbp.env.init()
    ctx = _Ctx(rank, n)
    rows = []
    for case in CASES:
        if cfg["cases"] and case.name not in cfg["cases"]:
            continue
        t0 = time.perf_counter()
        row = run_case(case, ctx, cfg)
        rows.append(row)
        if rank == 0:
            cells = "  ".join(f"{k} {common.fmt(v, '.1f')}" for k, v in row["us"].items())
            print(f"  {case.label:<32} {cells} us  [{time.perf_counter() - t0:.1f}s]", flush=True)
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows))


# ---------------------------------------------------------------- output


def print_tables(rows: list[dict[str, Any]]) -> str:
    """Two tables: microseconds per iteration, then overheads over the floors."""
    times = [[r["label"], *(common.fmt(r["us"].get(m), ".1f") for m in METHODS)] for r in rows]
    header = ["case", *(f"{m} us" for m in METHODS)]
    over = []
    for r in rows:
        ovh, q = r["overhead_us"], r["sbp_over_dtensor_overhead"]
        bad = [k for k, v in r["check"].items() if v != "ok"]
        over.append(
            [
                r["label"],
                common.fmt(ovh["pywrap"], ".1f"),
                common.fmt(ovh["sbp-B"], ".1f"),
                common.fmt(ovh["dtensor-R"], ".1f"),
                common.fmt(q["B"]),
                common.fmt(ovh["sbp-S"], ".1f"),
                common.fmt(ovh["dtensor-S"], ".1f"),
                common.fmt(q["S"]),
                "ok" if not bad else "FAIL " + ",".join(bad),
            ]
        )
    over_header = [
        "overhead us (- floor)", "pywrap", "sbp-B", "dtensor-R", "sbp-B/dt-R", "sbp-S",
        "dtensor-S", "sbp-S/dt-S", "check",
    ]  # fmt: skip
    return common.table(times, header) + "\n\n" + common.table(over, over_header)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Rows whose sbp overhead exceeds TARGET x DTensor's, and every failed check."""
    over, failed = [], []
    for r in rows:
        for kind, q in r["sbp_over_dtensor_overhead"].items():
            if q is None or q > TARGET:
                over.append(f"{r['label']} [{kind}]: {common.fmt(q)}x dtensor overhead")
        failed += [f"{r['label']} {k}: {v}" for k, v in r["check"].items() if v != "ok"]
    return {f"sbp_overhead_over_{TARGET}x_dtensor": over, "check_failures": failed}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", nargs="+", choices=[c.name for c in CASES], default=None)
    p.add_argument("--repeats", type=int, default=REPEATS, help="timed repeats per method")
    p.add_argument("--warmup", type=int, default=1, help="untimed repeats per method")
    p.add_argument("--iters-scale", type=float, default=1.0, help="scale the iterations")
    p.add_argument("--quick", action="store_true", help="1/10 of the iterations, 3 repeats")
    p.add_argument("--profile", action="store_true", help="cProfile the sbp methods (rank 0)")
    p.add_argument("--profile-top", type=int, default=25)
    p.add_argument("--out", type=Path, default=None, help="one JSON file instead of results/")
    args = p.parse_args(argv)
    if args.quick:
        args.iters_scale, args.repeats = min(args.iters_scale, 0.1), min(args.repeats, 3)
    cfg = {
        "cases": args.cases,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "iters_scale": args.iters_scale,
        "profile": args.profile,
        "profile_top": args.profile_top,
    }
    started = time.time()
    rows = common.gather_rows(worker, WORLD_SIZE, cfg)
    text = print_tables(rows)
    summary = summarize(rows)
    common.print_report(text, summary)
    if args.profile:
        for r in rows:
            for name, prof in r.get("profile", {}).items():
                print(f"\n--- cProfile {name} {r['label']} ({r['iters']} iterations, rank 0)")
                print(prof)
    payload = {
        "benchmark": "dispatch",
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "wall_s": round(time.time() - started, 1),
        "machine": common.machine_info(),
        "config": {**cfg, "world_size": WORLD_SIZE, "floors": FLOOR},
        "target_sbp_over_dtensor_overhead": TARGET,
        "rows": rows,
        "summary": summary,
        "table": text,
    }
    name = "dispatch-quick" if args.quick else "dispatch"  # a smoke run keeps the full one
    for path in common.write_results(name, payload, args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
