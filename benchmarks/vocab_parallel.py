"""Vocabulary-parallel loss: a language model's head and cross-entropy with the vocabulary split.

The head's weight `(vocab, hidden)` is split along the vocabulary over the ranks, so each
rank's logits are its slice of the classes. One step is the head, the loss and backward
(the gradient of the hidden states all-reduced, as a column-parallel layer's input
gradient is), timed side by side in the same run for
  megatron  hand-written: local logits, Megatron's vocab_parallel_cross_entropy (three
            all-reduces of one number per token forward, none backward), the input
            gradient all-reduced
  gathered  hand-written, naive: the logits all-gathered, torch's cross_entropy on them
            (what a layout without a vocabulary-parallel loss must do)
  sbp       hidden states `to_global(P, broadcast)`, head weight `split(0)`,
            `F.cross_entropy(logits, targets)` on the global tensors
and each method's collectives per step (counted on rank 0), its ratio to megatron, and the
largest |loss - one process's loss| in float64 (every method must be exact).

Run `python benchmarks/vocab_parallel.py` (about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

try:  # `python -m benchmarks.vocab_parallel` from the repository root
    from benchmarks import common
except ImportError:  # `python benchmarks/vocab_parallel.py`
    import common

METHODS = ("megatron", "gathered", "sbp")


class _Counted:
    """torch.distributed's all_reduce/all_gather_into_tensor, counted (the hand-written
    methods' collectives; sbp's are counted by `sbp.comm_stats`)."""

    calls: Counter = Counter()

    @classmethod
    def all_reduce(cls, t: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        cls.calls["all_reduce"] += 1
        dist.all_reduce(t, op=op)

    @classmethod
    def all_gather(cls, out: torch.Tensor, t: torch.Tensor) -> None:
        cls.calls["all_gather"] += 1
        dist.all_gather_into_tensor(out, t)


class _VocabParallelCE(torch.autograd.Function):
    """Megatron's vocab_parallel_cross_entropy (mean over tokens), on this rank's logits."""

    @staticmethod
    def forward(ctx, logits, target, lo):
        top = logits.max(dim=-1)[0]
        _Counted.all_reduce(top, dist.ReduceOp.MAX)
        shifted = logits - top.unsqueeze(-1)
        width = logits.shape[-1]
        here = (target >= lo) & (target < lo + width)
        at = (target - lo).clamp(0, width - 1)
        predicted = torch.where(here, shifted.gather(-1, at.unsqueeze(-1)).squeeze(-1), 0)
        _Counted.all_reduce(predicted)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        _Counted.all_reduce(total)
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), here, at)
        return (total.log() - predicted).mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, here, at = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, at.unsqueeze(-1), -here.to(g.dtype).unsqueeze(-1))
        return g * (grad / softmax.shape[0]), None, None


class _CopyToTP(torch.autograd.Function):
    """Identity forward; the input gradient all-reduced (Megatron's copy to the TP region)."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        _Counted.all_reduce(grad)
        return grad


def _data(cfg: dict, dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens, hidden, vocab = cfg["tokens"], cfg["hidden"], cfg["vocab"]
    h = torch.randn(tokens, hidden, generator=g, dtype=dtype)
    w = torch.randn(vocab, hidden, generator=g, dtype=dtype) / hidden**0.5
    y = torch.randint(0, vocab, (tokens,), generator=g)
    return h, w, y


def _methods(rank: int, world: int, cfg: dict, dtype) -> dict[str, Callable[[], Any]]:
    import sbp

    h, w, y = _data(cfg, dtype)
    P = sbp.placement("cpu", list(range(world)))
    (rows,) = sbp.local_slices((cfg["vocab"],), P, sbp.split(0), P.coord(rank))
    lo = rows.start
    w_local = w[rows].clone().requires_grad_()
    h_leaf = h.clone().requires_grad_()

    def megatron():
        h_leaf.grad = w_local.grad = None
        logits = F.linear(_CopyToTP.apply(h_leaf), w_local)
        loss = _VocabParallelCE.apply(logits, y, lo)
        loss.backward()
        return loss.detach()

    def gathered():
        h_leaf.grad = w_local.grad = None
        logits = F.linear(_CopyToTP.apply(h_leaf), w_local)
        whole = logits.new_empty(world * logits.shape[0], logits.shape[1])
        _Counted.all_gather(whole, logits.detach().contiguous())
        whole = whole.view(world, *logits.shape).requires_grad_()
        loss = F.cross_entropy(torch.cat(whole.unbind(0), dim=-1), y)
        loss.backward()
        logits.backward(whole.grad[rank])
        return loss.detach()

    weight = torch.nn.Parameter(sbp.to_global(w, P, sbp.broadcast).to_global(P, sbp.split(0)))
    x_leaf = sbp.tensor(h, P, sbp.broadcast).requires_grad_()
    y_global = sbp.to_global(y, P, sbp.broadcast)

    def global_step():
        x_leaf.grad = weight.grad = None
        # (its gradient comes back whole, as the other methods' does)
        hidden = x_leaf.to_global(P, sbp.broadcast, grad_sbp=sbp.broadcast)
        loss = F.cross_entropy(F.linear(hidden, weight), y_global)
        loss.backward()
        return loss.detach()

    return {"megatron": megatron, "gathered": gathered, "sbp": global_step}


def _counts(methods: dict[str, Callable[[], Any]]) -> dict[str, dict[str, int]]:
    import sbp

    out = {}
    for name, fn in methods.items():
        _Counted.calls = Counter()
        with sbp.comm_stats() as st:
            fn()
        calls = _Counted.calls + Counter({k: n for k, n in st.by_kind.items() if n})
        out[name] = dict(sorted(calls.items()))
    return out


def _loss_errors(rank: int, world: int, cfg: dict) -> dict[str, float]:
    """|loss - one process's loss| per method, float64."""
    h, w, y = _data(cfg, torch.float64)
    want = F.cross_entropy(h @ w.t(), y).item()
    errors = {}
    for name, fn in _methods(rank, world, cfg, torch.float64).items():
        loss = fn()
        value = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        errors[name] = abs(float(value) - want)
    return errors


def _worker(rank: int, world: int, cfg: dict, path: str) -> None:
    import json
    import warnings

    warnings.filterwarnings("ignore")
    errors = _loss_errors(rank, world, cfg)
    methods = _methods(rank, world, cfg, torch.float32)
    timings = common.time_methods(methods, cfg["warmup"], cfg["rounds"])
    counts = _counts(methods)
    if rank == 0:
        rows = [
            {
                "world": world,
                "method": n,
                "collectives": counts[n],
                "loss_error": errors[n],
                **t.as_dict(),
            }
            for n, t in timings.items()
        ]
        Path(path).write_text(json.dumps(rows))


def _report(rows: list[dict]) -> str:
    anchor = {r["world"]: r.get("median_ms") for r in rows if r["method"] == "megatron"}
    lines = [
        (
            r["world"],
            r["method"],
            ", ".join(f"{k} {n}" for k, n in r["collectives"].items()),
            common.fmt(r.get("median_ms"), ".2f"),
            common.fmt(common.ratio(r.get("median_ms"), anchor[r["world"]])),
            f"{r['loss_error']:.1e}",
        )
        for r in rows
    ]
    header = ("world", "method", "collectives per step", "step ms", "x megatron", "|loss err|")
    return common.table(lines, header)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024, help="batch x sequence")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cfg = {k: getattr(args, k) for k in ("tokens", "hidden", "vocab", "warmup", "rounds")}
    rows = common.gather_rows(_worker, args.world, cfg)
    common.print_report(_report(rows), {})
    payload = {"machine": common.machine_info(), "config": cfg, "rows": rows}
    out = None if args.out is None else Path(args.out)
    path = common.write_results("vocab_parallel", payload, out)
    print(f"wrote {path[0]}")


if __name__ == "__main__":
    main()
