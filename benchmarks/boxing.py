"""Boxing benchmark: every 1-D sbp conversion against its anchors, in the same run.

For each conversion, size, world size and even/uneven layout it times
  sbp      `g.to_global(sbp=target)` on a GlobalTensor (the user path: autograd Function,
           plan cache, executor, pack/unpack kernels, collective);
  raw      the bare torch.distributed collective on the same bytes, on buffers allocated
           beforehand (no pack, unpack, reduce or allocation): the floor sbp should
           approach (all_gather for S->B, all_reduce for P->B, all_to_all for S->S and P->S,
           the equivalent torch local op for the local cases);
  dtensor  `DTensor.redistribute` from torch.distributed.tensor on a CPU DeviceMesh;
plus, for P->S, reduce_scatter and all_reduce+slice as extra references, since sbp does
P->S as all_to_all + local reduce. It also records the bytes each method allocates (peak
and retained, from the profiler's allocation records) to check the issue's target of no
more than output + one shard per rank.

Run `python benchmarks/boxing.py --quick` for a smoke run, `python benchmarks/boxing.py`
for the full set; see benchmarks/README.md for the columns.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

try:  # `python -m benchmarks.boxing` from the repository root
    from benchmarks import common
except ImportError:  # `python benchmarks/boxing.py`
    import common

COLS = 256  # so S(1) shards are whole rows of floats, not a handful of bytes
SIZES_MIB = (1, 4, 16, 64)
WORLD_SIZES = (2, 4)
# (warm-up calls, timed rounds) by logical size: fewer rounds where one call is long.
ROUNDS = {1: (3, 25), 4: (3, 21), 16: (2, 11), 64: (1, 7)}
QUICK_ROUNDS = (1, 5)
TARGET_RAW = 1.15  # sbp within 1.15x of the raw collective from 4 MiB up
TARGET_UNEVEN = 1.25  # uneven within 1.25x of even
TARGET_MEM = 1.0  # peak bytes <= output + one shard

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class Case:
    """One conversion: source and target kinds in {S0, S1, B, P, Pmax}."""

    name: str
    src: str
    dst: str


CASES = (
    Case("S(0)->B", "S0", "B"),
    Case("S(1)->B", "S1", "B"),
    Case("P->B", "P", "B"),
    Case("P->S(0)", "P", "S0"),
    Case("P->S(1)", "P", "S1"),
    Case("S(0)->S(1)", "S0", "S1"),
    Case("S(1)->S(0)", "S1", "S0"),
    Case("B->S(0)", "B", "S0"),
    Case("S(0)->P", "S0", "P"),
    Case("B->P", "B", "P"),
    Case("P(max)->B", "Pmax", "B"),
)


def shape_for(size_mib: float, uneven: bool) -> tuple[int, int]:
    """(rows, COLS) float32 of `size_mib`; uneven adds one row and one column, so neither
    dim divides by 2 or 4 and balanced shards differ by one along both."""
    rows = max(int(size_mib * 2**20) // (4 * COLS), 1)
    return (rows + 1, COLS + 1) if uneven else (rows, COLS)


def rounds_for(size_mib: float, quick: bool) -> tuple[int, int]:
    if quick:
        return QUICK_ROUNDS
    for limit in sorted(ROUNDS):
        if size_mib <= limit:
            return ROUNDS[limit]
    return ROUNDS[max(ROUNDS)]


# ---------------------------------------------------------------- per-rank inputs


def _split_dim(kind: str) -> int | None:
    return int(kind[1]) if kind.startswith("S") else None


def sbp_local(kind: str, full: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """This rank's local tensor for `kind` in sbp's balanced layout; partials are `full`."""
    from sbp.layout import balanced_range

    d = _split_dim(kind)
    if d is None:
        return full
    a, b = balanced_range(full.shape[d], n, rank)
    return full.narrow(d, a, b - a).contiguous()


def dtensor_local(kind: str, full: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """DTensor shards like torch.chunk (ceil-sized, last one short), not balanced, so its
    uneven locals must follow its own layout."""
    d = _split_dim(kind)
    if d is None:
        return full
    chunks = torch.chunk(full, n, d)
    if rank < len(chunks):
        return chunks[rank].contiguous()
    return full.narrow(d, 0, 0).contiguous()


def logical_value(case: Case, full: torch.Tensor, n: int) -> torch.Tensor:
    return full * n if case.src == "P" else full


# ---------------------------------------------------------------- raw anchors


def raw_methods(
    case: Case, full: torch.Tensor, local: torch.Tensor, rank: int, n: int
) -> tuple[str, Callable[[], Any], dict[str, Callable[[], Any]]]:
    """(name, call) of the bare collective on the same bytes, plus extra references.

    Buffers are made here, outside the timed call, so the raw time is the collective alone.
    The extra "raw+alloc" is the same collective allocating its output inside the call (and
    cloning for all_reduce, which is in place): what any out-of-place API pays, and on this
    machine a lot, because glibc maps every block of 32 MiB or more afresh and each first
    touch of a page faults.
    """
    from sbp.layout import balanced_range, balanced_sizes

    rows, cols = full.shape
    src_d, dst_d = _split_dim(case.src), _split_dim(case.dst)
    op = dist.ReduceOp.MAX if case.src == "Pmax" else dist.ReduceOp.SUM
    extras: dict[str, Callable[[], Any]] = {}

    if src_d is not None and case.dst == "B":  # all-gather of the (padded) shards
        pad = max(balanced_sizes(full.shape[src_d], n))
        per = pad * (cols if src_d == 0 else rows)
        send = torch.zeros(per)
        send[: local.numel()].copy_(local.reshape(-1))
        recv = torch.empty(n * per)
        extras["raw+alloc"] = lambda: _all_gather(torch.empty(n * per), send)
        return "all_gather", lambda: _all_gather(recv, send), extras

    if case.src in ("P", "Pmax") and case.dst == "B":
        buf = full.clone()

        def clone_all_reduce() -> torch.Tensor:
            out = full.clone()
            dist.all_reduce(out, op=op)
            return out

        extras["raw+alloc"] = clone_all_reduce  # out-of-place, as sbp and DTensor must be
        return "all_reduce", lambda: dist.all_reduce(buf, op=op), extras

    if case.src == "P" and dst_d is not None:  # sbp: all_to_all + local reduce
        parts = balanced_sizes(full.shape[dst_d], n)
        rest = cols if dst_d == 0 else rows
        send = full.clone().reshape(-1)
        recv = torch.empty(n * parts[rank] * rest)
        in_splits = [p * rest for p in parts]
        out_splits = [parts[rank] * rest] * n

        pad = max(parts)
        rs_in = torch.zeros(n * pad * rest)
        rs_out = torch.empty(pad * rest)
        ar_buf = full.clone()
        a, b = balanced_range(full.shape[dst_d], n, rank)

        def all_reduce_slice() -> torch.Tensor:
            dist.all_reduce(ar_buf)
            return ar_buf.narrow(dst_d, a, b - a).contiguous()

        extras["raw+alloc"] = lambda: dist.all_to_all_single(
            torch.empty(recv.numel()), send, out_splits, in_splits
        )
        extras["reduce_scatter"] = lambda: _reduce_scatter(rs_out, rs_in)
        extras["all_reduce+slice"] = all_reduce_slice
        return (
            "all_to_all",
            lambda: dist.all_to_all_single(recv, send, out_splits, in_splits),
            extras,
        )

    if src_d is not None and dst_d is not None:  # S(i)->S(j): all-to-all
        parts = balanced_sizes(local.shape[dst_d], n)
        src_sizes = balanced_sizes(full.shape[src_d], n)
        in_splits = [p * local.shape[src_d] for p in parts]
        out_splits = [s * parts[rank] for s in src_sizes]
        send = local.reshape(-1).clone()
        recv = torch.empty(sum(out_splits))
        extras["raw+alloc"] = lambda: dist.all_to_all_single(
            torch.empty(recv.numel()), send, out_splits, in_splits
        )
        return (
            "all_to_all",
            lambda: dist.all_to_all_single(recv, send, out_splits, in_splits),
            extras,
        )

    if case.src == "B" and dst_d is not None:
        a, b = balanced_range(full.shape[dst_d], n, rank)
        return "narrow+contiguous", lambda: full.narrow(dst_d, a, b - a).contiguous(), extras

    if src_d is not None and case.dst == "P":
        a, b = balanced_range(full.shape[src_d], n, rank)

        def place() -> torch.Tensor:
            out = torch.zeros(rows, cols)
            out.narrow(src_d, a, b - a).copy_(local)
            return out

        return "zeros+copy", place, extras

    if case.src == "B" and case.dst == "P":
        return (
            "zeros (rank>0)",
            (lambda: full) if rank == 0 else (lambda: torch.zeros_like(full)),
            extras,
        )

    raise ValueError(f"no raw anchor for {case.name}")


# ---------------------------------------------------------------- one case


def _placements() -> dict[str, Any]:
    from torch.distributed.tensor import Partial, Replicate, Shard

    return {
        "S0": Shard(0),
        "S1": Shard(1),
        "B": Replicate(),
        "P": Partial("sum"),
        "Pmax": Partial("max"),
    }


def _sbps() -> dict[str, Any]:
    import sbp

    return {
        "S0": sbp.split(0),
        "S1": sbp.split(1),
        "B": sbp.broadcast,
        "P": sbp.partial_sum,
        "Pmax": sbp.partial_max,
    }


def check_sbp(case: Case, out: torch.Tensor, full: torch.Tensor, rank: int, n: int) -> str:
    """Compare sbp's local result with the single-process value; agreed over ranks."""
    from sbp.layout import balanced_range

    logical = logical_value(case, full, n)
    d = _split_dim(case.dst)
    if case.dst == "P":
        got = out.clone()
        dist.all_reduce(got)
        want = logical
    elif d is not None:
        a, b = balanced_range(logical.shape[d], n, rank)
        got, want = out, logical.narrow(d, a, b - a)
    else:
        got, want = out, logical
    ok = tuple(got.shape) == tuple(want.shape) and torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return "ok" if flag.item() else f"MISMATCH (rank {rank}: {ok})"


def run_case(
    case: Case,
    full: torch.Tensor,
    rank: int,
    n: int,
    mesh: Any,
    placement: Any,
    rounds: tuple[int, int],
    memory: bool,
    with_dtensor: bool,
) -> dict[str, Any]:
    """Time sbp, raw and DTensor for one case (interleaved), then measure their memory."""
    import sbp

    sbps = _sbps()
    shape = tuple(full.shape)
    src_local = sbp_local(case.src, full, rank, n)
    g = sbp.to_global(
        src_local, placement, sbps[case.src], shape=shape, check_meta=False, sync_data=False
    )
    target = sbps[case.dst]
    methods: dict[str, Callable[[], Any]] = {"sbp": lambda: g.to_global(sbp=target)}
    raw_op, raw, extras = raw_methods(case, full, src_local, rank, n)
    methods["raw"] = raw
    dt_error = None
    if with_dtensor:
        from torch.distributed.tensor import DTensor

        dts = _placements()
        try:
            dt = DTensor.from_local(
                dtensor_local(case.src, full, rank, n),
                mesh,
                [dts[case.src]],
                run_check=False,
                shape=torch.Size(shape),
                stride=full.stride(),
            )
            dst_pl = [dts[case.dst]]
            methods["dtensor"] = lambda: dt.redistribute(mesh, dst_pl)
        except Exception as e:
            dt_error = common.short_error(e)
    methods.update(extras)

    try:
        out = g.to_global(sbp=target).to_local()
        check = check_sbp(case, out, full, rank, n)
        out_bytes = out.numel() * out.element_size()
        plan = [" ".join(str(s).split()) for s in sbp.boxing.plan(g, sbp=target).steps]
        del out
    except Exception as e:
        check, out_bytes, plan = f"error: {common.short_error(e)}", 0, []

    warmup, nrounds = rounds
    timings = common.time_methods(methods, warmup, nrounds)
    if dt_error is not None:
        timings["dtensor"] = common.Timing(error=dt_error)

    logical_bytes = full.numel() * full.element_size()
    shard_bytes = math.ceil(full.numel() / n) * full.element_size()
    mem: dict[str, Any] = {}
    if memory:
        keys = ["sbp", "raw"] + (
            ["dtensor"] if timings.get("dtensor") and timings["dtensor"].error is None else []
        )
        values: list[float | None] = []
        for k in keys:
            peak, retained = common.peak_allocated(methods[k])
            values += [peak, retained]
        values.append(common.rss_growth(methods["sbp"]))
        values.append(common.rss_growth(methods["raw"]))
        values.append(out_bytes)
        got = common.max_over_ranks(values)
        for i, k in enumerate(keys):
            mem[f"{k}_peak_bytes"] = int(got[2 * i])
            mem[f"{k}_retained_bytes"] = int(got[2 * i + 1])
        rss_sbp, rss_raw, out_max = got[2 * len(keys) :]
        mem["sbp_rss_growth_bytes"] = None if rss_sbp is None else int(rss_sbp)
        mem["raw_rss_growth_bytes"] = None if rss_raw is None else int(rss_raw)
        mem["out_bytes"] = int(out_max)
        mem["shard_bytes"] = shard_bytes
        peak = mem["sbp_peak_bytes"]
        mem["sbp_staging_bytes"] = max(peak - mem["out_bytes"], 0)
        mem["peak_over_out"] = common.ratio(peak, mem["out_bytes"])
        mem["peak_over_out_plus_shard"] = common.ratio(peak, mem["out_bytes"] + shard_bytes)
        # What the executor adds over the bare collective's own temporaries (gloo's
        # all_gather stages the whole output once more, so raw's peak is not zero).
        mem["executor_bytes"] = max(peak - mem["raw_peak_bytes"], 0)
        mem["executor_over_out_plus_shard"] = common.ratio(
            mem["executor_bytes"], mem["out_bytes"] + shard_bytes
        )

    row: dict[str, Any] = {
        "case": case.name,
        "ranks": n,
        "size_mib": None,  # filled by the caller
        "layout": None,
        "shape": list(shape),
        "logical_bytes": logical_bytes,
        "check": check,
        "plan": plan,
        "raw_op": raw_op,
        "warmup": warmup,
        "rounds": nrounds,
    }
    for name, t in timings.items():
        row[name] = t.as_dict()
    row["sbp_over_raw"] = common.ratio(timings["sbp"].median_ms, timings["raw"].median_ms)
    dtt = timings.get("dtensor")
    row["sbp_over_dtensor"] = common.ratio(timings["sbp"].median_ms, dtt and dtt.median_ms)
    row["memory"] = mem
    return row


# ---------------------------------------------------------------- workers and driver


def worker(rank: int, n: int, cfg: dict[str, Any], out_path: str) -> None:
    """One rank: every (size, layout, case) of the config, in the same order on all ranks."""
    warnings.filterwarnings("ignore")
    from torch.distributed.device_mesh import init_device_mesh

    import sbp

    sbp.env.init()
    placement = sbp.placement("cpu", list(range(n)))
    mesh = init_device_mesh("cpu", (n,)) if cfg["dtensor"] else None
    cases = [c for c in CASES if not cfg["cases"] or c.name in cfg["cases"]]
    rows = []
    for size in cfg["sizes"]:
        for layout in cfg["layouts"]:
            shape = shape_for(size, layout == "uneven")
            full = torch.randn(shape, generator=torch.Generator().manual_seed(1234))
            for case in cases:
                t0 = time.perf_counter()
                row = run_case(
                    case,
                    full,
                    rank,
                    n,
                    mesh,
                    placement,
                    rounds_for(size, cfg["quick"]),
                    cfg["memory"],
                    cfg["dtensor"],
                )
                row["size_mib"] = size
                row["layout"] = layout
                rows.append(row)
                if rank == 0:
                    print(
                        f"  n={n} {size:>4g} MiB {layout:<6} {case.name:<11} "
                        f"sbp {common.fmt(row['sbp'].get('median_ms'), '.3f')} ms  "
                        f"raw {common.fmt(row['raw'].get('median_ms'), '.3f')} ms  "
                        f"dtensor {common.fmt(row.get('dtensor', {}).get('median_ms'), '.3f')} ms"
                        f"  [{time.perf_counter() - t0:.1f}s]",
                        flush=True,
                    )
            del full
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows))


def _ms(row: dict[str, Any], key: str) -> float | None:
    return (row.get(key) or {}).get("median_ms")


def print_table(rows: list[dict[str, Any]]) -> str:
    header = [
        "case", "ranks", "MiB", "layout", "sbp ms", "raw ms", "dtensor ms", "sbp/raw",
        "sbp/dt", "raw+a ms", "sbp/raw+a", "rs ms", "ar+sl ms", "peak/(o+s)", "exec/(o+s)",
        "check",
    ]  # fmt: skip
    body = []
    for r in rows:
        dt = r.get("dtensor") or {}
        dt_cell = common.fmt(_ms(r, "dtensor"), ".3f") if "error" not in dt else "refused/err"
        body.append(
            [
                r["case"],
                r["ranks"],
                common.fmt(r["size_mib"], "g"),
                r["layout"],
                common.fmt(_ms(r, "sbp"), ".3f"),
                common.fmt(_ms(r, "raw"), ".3f"),
                dt_cell,
                common.fmt(r["sbp_over_raw"]),
                common.fmt(r["sbp_over_dtensor"]),
                common.fmt(_ms(r, "raw+alloc"), ".3f"),
                common.fmt(common.ratio(_ms(r, "sbp"), _ms(r, "raw+alloc"))),
                common.fmt(_ms(r, "reduce_scatter"), ".3f"),
                common.fmt(_ms(r, "all_reduce+slice"), ".3f"),
                common.fmt(r["memory"].get("peak_over_out_plus_shard")),
                common.fmt(r["memory"].get("executor_over_out_plus_shard")),
                r["check"] if r["check"] == "ok" else "FAIL",
            ]
        )
    return common.table(body, header)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, checked row by row."""
    slow_raw, slow_alloc, slow_dt, errors, mem_over, uneven = [], [], [], [], [], []
    by_key = {(r["case"], r["ranks"], r["size_mib"], r["layout"]): r for r in rows}
    for r in rows:
        tag = f"{r['case']} n={r['ranks']} {r['size_mib']:g}MiB {r['layout']}"
        if r["size_mib"] >= 4 and (r["sbp_over_raw"] or 0) > TARGET_RAW:
            slow_raw.append(f"{tag}: {r['sbp_over_raw']:.2f}x raw ({r['raw_op']})")
        q = common.ratio(_ms(r, "sbp"), _ms(r, "raw+alloc"))
        if r["size_mib"] >= 4 and (q or 0) > TARGET_RAW:
            slow_alloc.append(f"{tag}: {q:.2f}x raw+alloc")
        if (r["sbp_over_dtensor"] or 0) > 1.0:
            slow_dt.append(f"{tag}: {r['sbp_over_dtensor']:.2f}x dtensor")
        if "error" in (r.get("dtensor") or {}):
            errors.append(f"{tag}: dtensor {r['dtensor']['error']}")
        if "error" in r["sbp"] or r["check"] != "ok":
            errors.append(f"{tag}: sbp {r['sbp'].get('error', r['check'])}")
        m = r["memory"].get("peak_over_out_plus_shard")
        if m is not None and m > TARGET_MEM:
            mib = {k: v / 2**20 for k, v in r["memory"].items() if k.endswith("bytes") and v}
            mem_over.append(
                f"{tag}: sbp peak {mib.get('sbp_peak_bytes', 0):.2f} MiB = {m:.2f}x (out+shard), "
                f"{r['memory']['executor_over_out_plus_shard']:.2f}x without the collective's "
                f"own {mib.get('raw_peak_bytes', 0):.2f} MiB; dtensor peak "
                f"{mib.get('dtensor_peak_bytes', 0):.2f} MiB"
            )
        if r["layout"] == "uneven":
            even = by_key.get((r["case"], r["ranks"], r["size_mib"], "even"))
            if even and _ms(even, "sbp") and _ms(r, "sbp"):
                q = _ms(r, "sbp") / _ms(even, "sbp")
                uneven.append(
                    {
                        "case": r["case"],
                        "ranks": r["ranks"],
                        "size_mib": r["size_mib"],
                        "uneven_over_even": q,
                        "raw_uneven_over_even": common.ratio(_ms(r, "raw"), _ms(even, "raw")),
                        "over_target": q > TARGET_UNEVEN,
                    }
                )
    return {
        "sbp_over_1.15x_raw_from_4MiB": slow_raw,
        "sbp_over_1.15x_raw_alloc_from_4MiB": slow_alloc,
        "sbp_slower_than_dtensor": slow_dt,
        "uneven_over_even": uneven,
        "uneven_over_1.25x_even": [
            f"{u['case']} n={u['ranks']} {u['size_mib']:g}MiB: {u['uneven_over_even']:.2f}x"
            for u in uneven
            if u["over_target"]
        ],
        "memory_over_out_plus_shard": mem_over,
        "errors": errors,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=float, nargs="+", default=list(SIZES_MIB), help="MiB")
    p.add_argument("--world-sizes", type=int, nargs="+", default=list(WORLD_SIZES))
    p.add_argument("--layouts", nargs="+", choices=["even", "uneven"], default=["even", "uneven"])
    p.add_argument("--cases", nargs="+", choices=[c.name for c in CASES], default=None)
    p.add_argument("--quick", action="store_true", help="1 and 4 MiB, 2 ranks, 5 rounds")
    p.add_argument("--no-memory", action="store_true", help="skip the allocation measurements")
    p.add_argument("--no-dtensor", action="store_true")
    p.add_argument("--out", type=Path, default=None, help="one JSON file instead of results/")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes = [1, 4] if args.sizes == list(SIZES_MIB) else args.sizes
        args.world_sizes = [2] if args.world_sizes == list(WORLD_SIZES) else args.world_sizes
    cfg = {
        "sizes": [int(s) if float(s).is_integer() else s for s in args.sizes],
        "layouts": args.layouts,
        "cases": args.cases,
        "quick": args.quick,
        "memory": not args.no_memory,
        "dtensor": not args.no_dtensor,
    }
    started = time.time()
    rows: list[dict[str, Any]] = []
    for n in args.world_sizes:
        rows += common.gather_rows(worker, n, cfg)
    text = print_table(rows)
    summary = summarize(rows)
    common.print_report(text, summary, skip=("uneven_over_even",))
    payload = {
        "benchmark": "boxing",
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "wall_s": round(time.time() - started, 1),
        "machine": common.machine_info(),
        "config": {**cfg, "world_sizes": args.world_sizes, "cols": COLS, "dtype": "float32"},
        "targets": {
            "sbp_over_raw": TARGET_RAW,
            "uneven_over_even": TARGET_UNEVEN,
            "peak_over_out_plus_shard": TARGET_MEM,
        },
        "rows": rows,
        "summary": summary,
        "table": text,
    }
    name = "boxing-quick" if args.quick else "boxing"  # a smoke run never replaces the full one
    for path in common.write_results(name, payload, args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
