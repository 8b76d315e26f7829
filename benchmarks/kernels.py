"""Kernel benchmark (GPU only): GB/s of the raw pack / unpack / reduce kernels of boxing.cu
against two anchors measured in the same run on the same tensors:
  copy    a device-to-device copy (`dst.copy_(src)`) moving the same number of bytes;
  torch   the torch-op composition that the kernels replace (sbp.kernels.reference, what
          SBP_KERNELS=torch runs).
Bandwidth counts bytes read plus bytes written (padding is neither). Targets (issue 13):
kernel >= 90% of copy from 16 MiB up; kernel faster than torch for inner-axis and uneven
packs.

    python benchmarks/kernels.py                 # 1, 4, 16, 64, 256, 1024 MiB
    python benchmarks/kernels.py --sizes 16 64 --ranks 4

GB/s is of GPU time: each method's calls are captured in a CUDA graph and replayed, so the
host's launch overhead (Python, CuPy) is not counted; methods are interleaved round by round
and timed with CUDA events, and the table shows the median round. The "call us" columns give
one eager call with its host overhead, what a small conversion pays. Needs a CUDA GPU and
CuPy (the `cuda` extra); without them it exits with a message saying so.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

try:  # `python -m benchmarks.kernels` from the repository root
    from benchmarks.common import fmt, ratio, table, write_results
except ImportError:  # `python benchmarks/kernels.py`
    from common import fmt, ratio, table, write_results

from sbp.kernels import raw, reference
from sbp.layout import balanced_sizes

MiB = 2**20
DEVICE = "cuda"


@dataclass
class Case:
    """One kernel call on prepared tensors: `kernel()` and `torch_op()` do the same work,
    `moved` bytes read plus written."""

    name: str
    kernel: Callable[[], object]
    torch_op: Callable[[], object]
    moved: int
    check: Callable[[], bool]


def _shape2(nbytes: int, esize: int, cols: int) -> tuple[int, int]:
    return max(1, nbytes // esize // cols), cols


def _pack_case(name, launcher, x, dim, sizes, pad_to=None) -> Case:
    rest = x.numel() // x.shape[dim]

    def check():
        a = raw.pack_chunks(launcher, x, dim, sizes, pad_to).clone()
        b = reference.pack_chunks(x, dim, sizes, pad_to)
        rows = [pad_to or s for s in sizes]
        return all(
            torch.equal(
                a[sum(rows[:i]) * rest :][: s * rest], b[sum(rows[:i]) * rest :][: s * rest]
            )
            for i, s in enumerate(sizes)
        )

    return Case(
        name,
        lambda: raw.pack_chunks(launcher, x, dim, sizes, pad_to),
        lambda: reference.pack_chunks(x, dim, sizes, pad_to),
        2 * x.numel() * x.element_size(),
        check,
    )


def _unpack_case(name, launcher, out, dim, sizes, stride=None) -> Case:
    shapes = [out.shape[:dim] + (s,) + out.shape[dim + 1 :] for s in sizes]
    total = len(sizes) * stride if stride else out.numel()
    buf = torch.randn(total, device=out.device).to(out.dtype)
    other = torch.empty_like(out)

    def check():
        raw.unpack_chunks(launcher, buf, shapes, dim, out, stride)
        reference.unpack_chunks(buf, shapes, dim, other, stride)
        return torch.equal(out, other)

    return Case(
        name,
        lambda: raw.unpack_chunks(launcher, buf, shapes, dim, out, stride),
        lambda: reference.unpack_chunks(buf, shapes, dim, other, stride),
        2 * out.numel() * out.element_size(),
        check,
    )


def _reduce_case(name, launcher, nbytes, dtype, k, op) -> Case:
    esize = torch.empty((), dtype=dtype).element_size()
    n = max(1, nbytes // esize // k)
    buf = torch.randn(k * n, device=DEVICE).to(dtype)
    chunks = [buf[i * n : (i + 1) * n] for i in range(k)]

    def check():
        a = raw.reduce_chunks(launcher, chunks, op)
        want = reference.reduce_chunks([c.float() for c in chunks], op).to(dtype)
        return torch.equal(a, want)

    return Case(
        name,
        lambda: raw.reduce_chunks(launcher, chunks, op),
        lambda: reference.reduce_chunks(chunks, op),
        (k + 1) * n * esize,
        check,
    )


def cases(launcher, nbytes: int, ranks: int) -> list[Case]:
    f32 = torch.float32
    r, c = _shape2(nbytes, 4, 1024)
    x_even = torch.randn(r, c, device=DEVICE)
    x_uneven = torch.randn(r, c + 3, device=DEVICE)
    a = max(1, nbytes // 4 // (64 * 37))
    x3 = torch.randn(a, 37, 64, device=DEVICE)
    x_shard = torch.randn(r, c, device=DEVICE)  # an all-gather shard one row short
    gather_rows = balanced_sizes(r + 3, ranks)
    out_inner = torch.empty(r, c + 3, device=DEVICE)
    inner_sizes = balanced_sizes(c + 3, ranks)
    out_gather = torch.empty(sum(gather_rows), c, device=DEVICE)
    return [
        _pack_case("pack inner even", launcher, x_even, 1, balanced_sizes(c, ranks)),
        _pack_case("pack inner uneven", launcher, x_uneven, 1, balanced_sizes(c + 3, ranks)),
        _pack_case("pack middle uneven", launcher, x3, 1, balanced_sizes(37, ranks)),
        _pack_case(
            "pack outer padded",
            launcher,
            x_shard,
            0,
            [r],
            pad_to=r + 1,
        ),
        _unpack_case("unpack inner uneven", launcher, out_inner, 1, inner_sizes),
        _unpack_case(
            "unpack gather padded",
            launcher,
            out_gather,
            0,
            gather_rows,
            stride=max(gather_rows) * c,
        ),
        _reduce_case(f"reduce sum f32 k={ranks}", launcher, nbytes, f32, ranks, "sum"),
        _reduce_case(f"reduce max bf16 k={ranks}", launcher, nbytes, torch.bfloat16, ranks, "max"),
        _reduce_case("reduce sum f16 k=2", launcher, nbytes, torch.float16, 2, "sum"),
    ]


def _graph(fn: Callable[[], object], calls: int) -> torch.cuda.CUDAGraph:
    """`calls` back-to-back calls of `fn` captured in one CUDA graph (after a warm-up on
    the capturing stream, which compiles and fills the kernels' caches)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    return graph


def device_ms(fns: dict[str, Callable[[], object]], rounds: int, calls: int = 10) -> dict:
    """Median GPU ms per call of each fn: `calls` calls replayed from a CUDA graph, so the
    host's launch overhead is not counted (the GPU never waits for the host). Methods are
    interleaved round by round."""
    graphs = {k: _graph(fn, calls) for k, fn in fns.items()}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for key, graph in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times[key].append(start.elapsed_time(end) / calls)
    return {k: statistics.median(v) for k, v in times.items()}


def call_us(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median microseconds of one eager call, host overhead included (CUDA events around
    the call, the GPU idle before it): what a small boxing call pays."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for key, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[key].append(start.elapsed_time(end) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    parser.add_argument("--ranks", type=int, default=8, help="chunks per pack / reduce")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels.py needs a CUDA GPU, and torch sees none: nothing measured.")
    try:
        from sbp.kernels.cupy_launcher import CupyLauncher
    except ImportError as e:
        sys.exit(f"benchmarks/kernels.py needs CuPy (pip install -e '.[cuda]'): {e}")
    launcher = CupyLauncher()
    device = torch.cuda.get_device_name()

    rows, records = [], []
    for mib in args.sizes:
        nbytes = mib * MiB
        for case in cases(launcher, nbytes, args.ranks):
            ok = case.check()
            copy_src = torch.empty(case.moved // 2, dtype=torch.uint8, device=DEVICE)
            copy_dst = torch.empty_like(copy_src)
            fns = {
                "kernel": case.kernel,
                "copy": lambda s=copy_src, d=copy_dst: d.copy_(s),
                "torch": case.torch_op,
            }
            rounds = args.rounds if mib <= 64 else max(5, args.rounds // 4)
            ms = device_ms(fns, rounds)
            us = call_us({k: fns[k] for k in ("kernel", "torch")}, rounds)
            gbs = {k: case.moved / (v * 1e-3) / 1e9 for k, v in ms.items()}
            rows.append(
                [
                    case.name,
                    mib,
                    fmt(gbs["kernel"], ".0f"),
                    fmt(gbs["copy"], ".0f"),
                    fmt(gbs["torch"], ".0f"),
                    fmt(ratio(gbs["kernel"], gbs["copy"])),
                    fmt(ratio(gbs["kernel"], gbs["torch"])),
                    fmt(us["kernel"], ".0f"),
                    fmt(us["torch"], ".0f"),
                    "yes" if ok else "NO",
                ]
            )
            records.append(
                {
                    "case": case.name,
                    "mib": mib,
                    "moved_bytes": case.moved,
                    "device_ms": ms,
                    "call_us": us,
                    "gb_per_s": gbs,
                    "matches_torch": ok,
                }
            )
            del copy_src, copy_dst
        reference.empty_cache()
        torch.cuda.empty_cache()

    header = [
        "case",
        "MiB",
        "kernel GB/s",
        "copy GB/s",
        "torch GB/s",
        "kernel/copy",
        "kernel/torch",
        "kernel call us",
        "torch call us",
        "same",
    ]
    print(
        f"device: {device}; GB/s of GPU time (bytes read + written; calls replayed from a CUDA "
        "graph, median of interleaved rounds); call us: one eager call, host overhead included"
    )
    print(table(rows, header))
    misses = [
        f"{r['case']} {r['mib']} MiB: {r['gb_per_s']['kernel'] / r['gb_per_s']['copy']:.2f} of copy"
        for r in records
        if r["mib"] >= 16 and r["gb_per_s"]["kernel"] < 0.9 * r["gb_per_s"]["copy"]
    ]
    slower = [
        f"{r['case']} {r['mib']} MiB"
        for r in records
        if r["case"].startswith("pack") and r["gb_per_s"]["kernel"] <= r["gb_per_s"]["torch"]
    ]
    print(f"\nbelow 90% of copy from 16 MiB up: {len(misses)}")
    for m in misses:
        print(f"  {m}")
    print(f"packs not faster than torch: {len(slower)}")
    for m in slower:
        print(f"  {m}")
    payload = {"device": device, "torch": torch.__version__, "ranks": args.ranks, "rows": records}
    from pathlib import Path

    for path in write_results("kernels", payload, Path(args.out) if args.out else None):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
