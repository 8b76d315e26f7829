"""Causal-LM benchmark: a transformers GPT-2 step whose loss the model computes (`labels=`).

A Hugging Face model given `labels=` returns its own loss: the cross-entropy is inside its
forward. The data-parallel fast path runs such a forward on the local shards and computes
that loss over the logical batch (`sbp.nn.fast_path`); before, the loss made the model
run op by op. One step is zero_grad, forward (the loss included) and backward of a small
randomly initialised GPT-2, timed side by side for
  torch        plain torch on this rank's shard of the batch (the anchor in a world of 1)
  ddp          torch DistributedDataParallel on the shard (the anchor in a world of 2)
  sbp-fast     global model and batch under `sbp.global_mode`: the fast path
  sbp-op-by-op the same with the fast path off (`sbp.nn.data_parallel(model, fast=False)`)
Worlds of 1 and 2. `--padded` passes an attention mask, with padding in every other
sequence (whose labels are -100), as a tokenizer padding a batch gives it; `--dropout 0.1`
sets GPT-2's three dropouts (attention's included) to its default. Needs the `hf` extra
(transformers).

Run `python benchmarks/causal_lm.py` (about a minute).
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

try:  # `python -m benchmarks.causal_lm` from the repository root
    from benchmarks import common
except ImportError:  # `python benchmarks/causal_lm.py`
    import common

METHODS = ("torch", "ddp", "sbp-fast", "sbp-op-by-op")


def _model(cfg: dict):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=cfg["vocab"],
        n_positions=cfg["seq"],
        n_embd=cfg["width"],
        n_layer=cfg["layers"],
        n_head=4,
        resid_pdrop=cfg["dropout"],
        embd_pdrop=cfg["dropout"],
        attn_pdrop=cfg["dropout"],
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def _step(model, batch: dict, context=None) -> Callable[[], Any]:
    def step():
        model.zero_grad(set_to_none=True)
        if context is None:
            loss = model(**batch, use_cache=False).loss
        else:
            with context():
                loss = model(**batch, use_cache=False).loss
        loss.backward()
        return loss

    return step


def _batch(cfg: dict) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)
    if not cfg["padded"]:
        return {"input_ids": ids, "labels": ids}
    mask = torch.ones_like(ids)
    mask[1::2, cfg["seq"] * 3 // 4 :] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _methods(rank: int, world: int, cfg: dict) -> tuple[dict[str, Callable[[], Any]], Any]:
    """The steps to time, and the sbp-fast row's model."""
    import sbp
    import sbp.nn

    P = sbp.placement("cpu", list(range(world)))
    local = {
        k: v[sbp.local_slices(v.shape, P, sbp.split(0), P.coord(rank))].contiguous()
        for k, v in _batch(cfg).items()
    }
    methods = {"torch": _step(_model(cfg), local)}
    if world > 1:
        methods["ddp"] = _step(torch.nn.parallel.DistributedDataParallel(_model(cfg)), local)
    placed = sbp.to_global(local, P, sbp.split(0))
    models = {}
    for name, fast in (("sbp-fast", True), ("sbp-op-by-op", False)):
        models[name] = _model(cfg).to_global(P, sbp.broadcast)
        sbp.nn.data_parallel(models[name], fast=fast)
        methods[name] = _step(models[name], placed, lambda: sbp.global_mode(P))
    return methods, models["sbp-fast"]


def _worker(rank: int, world: int, cfg: dict, path: str) -> None:
    import json

    import sbp.nn

    warnings.filterwarnings("ignore")
    methods, fast_model = _methods(rank, world, cfg)
    timings = common.time_methods(methods, cfg["warmup"], cfg["rounds"])
    if rank == 0:
        rows = [{"world": world, "method": n, **t.as_dict()} for n, t in timings.items()]
        # how the sbp-fast row's last call ran: "fast" unless the model was declined
        ran = sbp.nn.fast_path.state(fast_model).last_path
        rows.append({"world": world, "method": "path", "sbp-fast": ran})
        Path(path).write_text(json.dumps(rows))


def _report(rows: list[dict]) -> str:
    by = {(r["world"], r["method"]): r.get("median_ms") for r in rows}
    paths = {r["world"]: r["sbp-fast"] for r in rows if r["method"] == "path"}
    lines = []
    for world in sorted({r["world"] for r in rows}):
        anchor = by.get((world, "torch" if world == 1 else "ddp"))
        fast, per_op = by.get((world, "sbp-fast")), by.get((world, "sbp-op-by-op"))
        lines.append(
            (
                world,
                *(common.fmt(by.get((world, m)), ".2f") for m in METHODS),
                paths.get(world, "-"),
                common.fmt(common.ratio(fast, anchor)),
                common.fmt(common.ratio(per_op, anchor)),
                common.fmt(common.ratio(per_op, fast)),
            )
        )
    header = (
        "world",
        *(f"{m} ms" for m in METHODS),
        "sbp-fast ran",
        "fast x anchor",
        "op-by-op x anchor",
        "op-by-op / fast",
    )
    return common.table(lines, header)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8, help="the logical batch")
    ap.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    ap.add_argument("--width", type=int, default=64, help="n_embd")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--padded", action="store_true", help="with an attention mask")
    ap.add_argument("--dropout", type=float, default=0.0, help="GPT-2's three (default 0.1)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    keys = ("batch", "seq", "width", "layers", "vocab", "warmup", "rounds", "padded", "dropout")
    cfg = {k: getattr(args, k) for k in keys}
    rows = [row for world in args.worlds for row in common.gather_rows(_worker, world, cfg)]
    common.print_report(_report(rows), {})
    payload = {"machine": common.machine_info(), "config": cfg, "rows": rows}
    out = None if args.out is None else Path(args.out)
    name = "causal-lm" + ("-padded" if args.padded else "") + ("-dropout" if args.dropout else "")
    path = common.write_results(name, payload, out)
    print(f"wrote {path[0]}")


if __name__ == "__main__":
    main()
