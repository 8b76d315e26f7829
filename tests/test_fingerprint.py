"""Collectives out of step across ranks are caught by their fingerprints, on every rank,
before any data moves: never mixed data, never gloo's abort of the process.

Before: two conversions run in swapped order on one rank paired a 24-byte exchange with
a 32-byte one in shared memory (both ranks got wrong values), and with large tensors
gloo aborted the process ("Received data size doesn't match expected size"); a layer
frozen on one rank, or another bucket size, aborted in the gradient all-reduce.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import sbp
from sbp.comm import collectives, fingerprint, inline, shm

S0, B = sbp.split(0), sbp.broadcast


def _raises_mismatch(fn) -> tuple[str, float]:
    start = time.monotonic()
    with pytest.raises(sbp.MetaMismatchError) as info:
        fn()
    return str(info.value), time.monotonic() - start


def _swapped_reductions(numel_a: int, numel_b: int, shared_memory: bool) -> tuple[str, float]:
    """Rank 0 sums a then b, the others b then a; both are float32 of different sizes."""
    saved = shm._ENABLED
    shm._ENABLED = shared_memory
    try:
        ranks = tuple(range(sbp.env.get_world_size()))
        collectives.all_reduce(torch.ones(300_000), "sum", ranks)  # (the large segment made)
        a, b = torch.ones(numel_a), torch.ones(numel_b)
        first, second = (a, b) if sbp.env.get_rank() == 0 else (b, a)

        def run():
            collectives.all_reduce(first, "sum", ranks)
            collectives.all_reduce(second, "sum", ranks)

        message, seconds = _raises_mismatch(run)
        assert torch.equal(a, torch.ones(numel_a)) and torch.equal(b, torch.ones(numel_b))
        collectives.all_reduce(torch.ones(3), "sum", ranks)  # the ranks are in step again
        for value in (2.0, 3.0):  # (both slots of the large segment: in step there too)
            large = torch.full((300_000,), value * (sbp.env.get_rank() + 1))
            collectives.all_reduce(large, "sum", ranks)
            n = len(ranks)
            assert torch.equal(large, torch.full_like(large, value * n * (n + 1) / 2))
        return message, seconds
    finally:
        shm._ENABLED = saved


@pytest.mark.parametrize(
    "numel_a, numel_b, shared_memory",
    [
        (6, 8, True),  # 24 and 32 bytes in shared memory: wrong values before
        (300_000, 400_000, True),  # gloo, checked in the shared segment: SIGABRT before
        (6, 300_000, True),  # one rank in shared memory, the other in gloo
        (300_000, 400_000, False),  # gloo across hosts: the fingerprint's frame first
        (6, 8, False),  # across hosts, each inside its frame: wrong values or SIGABRT before
        (6, 300_000, False),  # one inside its frame, the other after its frame
    ],
)
@pytest.mark.parametrize("world", [2, 4])
def test_swapped_collectives_raise_on_every_rank(
    numel_a, numel_b, shared_memory, world, pool2, pool4
):
    pool = pool2 if world == 2 else pool4
    for message, seconds in pool.run(_swapped_reductions, numel_a, numel_b, shared_memory):
        assert "collectives out of step over ranks" in message
        assert seconds < 5
        a, b = f"all_reduce(sum) of {4 * numel_a} bytes", f"all_reduce(sum) of {4 * numel_b} bytes"
        others = ", ".join(f"rank {r}" for r in range(1, world))
        assert f"rank 0 ran {a}" in message and f"{others} ran {b}" in message, message


def _device_tensor_sizes_differ(shared_memory: bool) -> tuple[str, float]:
    """Rank 0 is about to sum 6 elements of a device tensor, the others 8 (a `meta` tensor
    stands in for a CUDA one: the meeting reads only its dtype and size, on the host)."""
    saved = shm._ENABLED
    shm._ENABLED = shared_memory
    try:
        ranks = tuple(range(sbp.env.get_world_size()))
        n = 6 if sbp.env.get_rank() == 0 else 8
        tensor = torch.empty(n, device="meta")
        message, seconds = _raises_mismatch(
            lambda: collectives._agree("all_reduce", tensor, ranks, "sum")
        )
        collectives._agree("all_reduce", torch.empty(3, device="meta"), ranks, "sum")  # in step
        return message, seconds
    finally:
        shm._ENABLED = saved


@pytest.mark.parametrize("world", [2, 4])
def test_device_tensors_collectives_are_fingerprinted_on_the_host(world, pool2, pool4):
    """A collective of device tensors (NCCL) between ranks of one host meets in the shared
    segment first, as a gloo one does: before, only CPU tensors were fingerprinted (no
    GPU here: NCCL itself is not run)."""
    pool = pool2 if world == 2 else pool4
    for message, seconds in pool.run(_device_tensor_sizes_differ, True):
        assert "all_reduce(sum) of 24 bytes" in message and "of 32 bytes" in message, message
        assert seconds < 5


def _gloo_calls(run) -> dict:
    """The gloo collectives `run()` made, by kind, without a shared segment (other hosts)."""
    saved, calls = shm._ENABLED, {}
    where = {"all_reduce": (dist, "all_reduce"), "all_gather": (inline, "_all_gather_single")}
    real = {kind: getattr(*at) for kind, at in where.items()}

    def counting(kind):
        return lambda *a, **kw: calls.update({kind: calls.get(kind, 0) + 1}) or real[kind](*a, **kw)

    shm._ENABLED = False
    for kind, (module, name) in where.items():
        setattr(module, name, counting(kind))
    try:
        run()
        return calls
    finally:
        shm._ENABLED = saved
        for kind, (module, name) in where.items():
            setattr(module, name, real[kind])


def _device_tensor_without_segment() -> dict:
    """Without a shared segment (ranks of other hosts), the gloo calls a device tensor's
    fingerprint made: none (sizes that differ are not caught there)."""
    ranks = tuple(range(sbp.env.get_world_size()))
    n = 6 if sbp.env.get_rank() == 0 else 8
    tensor = torch.empty(n, device="meta")
    return _gloo_calls(lambda: collectives._agree("all_reduce", tensor, ranks, "sum"))


def test_device_tensors_across_hosts_cost_no_round_trip(pool2):
    """Across hosts a gloo round trip per NCCL collective would cost more than the
    collective: a device tensor's fingerprint meets only in a shared segment."""
    assert pool2.run(_device_tensor_without_segment) == [{}, {}]


def _small_and_large_across_hosts() -> list:
    """Without a shared segment: small all-reduces (sum, max, min; NaN; integers; half)
    and an all-gather in a permuted rank order, each inside its fingerprint's frame, and a
    large all-reduce after its frame; each with the gloo calls it made."""
    me, n = sbp.env.get_rank(), sbp.env.get_world_size()
    ranks = tuple(range(n))
    out = []
    for dtype, op in [
        (torch.float64, "sum"),
        (torch.float32, "max"),
        (torch.float32, "min"),
        (torch.int64, "sum"),
        (torch.int8, "sum"),
        (torch.float16, "sum"),
    ]:
        t = (torch.arange(5, dtype=torch.float64) * (me + 1) - 3).to(dtype)
        if dtype == torch.float32 and me == 1:
            t[2] = float("nan")
        calls = _gloo_calls(lambda t=t, op=op: collectives.all_reduce(t, op, ranks))
        out.append((dtype, op, t, calls))
    order = tuple(reversed(ranks))
    got = torch.empty(n, 3)
    calls = _gloo_calls(lambda: collectives.all_gather(got, torch.full((3,), float(me)), order))
    out.append(("all_gather", order, got, calls))
    big = torch.full((100_000,), float(me))
    calls = _gloo_calls(lambda: collectives.all_reduce(big, "sum", ranks))
    out.append(("large", "sum", big[:3], calls))
    return out


def _first_frame_in_inference_mode() -> list:
    """A rank set's first frame made inside inference_mode (an evaluation before
    training), then collectives outside it: the cached frames must serve both."""
    saved, frames = shm._ENABLED, dict(inline._frames)
    shm._ENABLED = False
    inline._frames.clear()
    try:
        ranks = tuple(range(sbp.env.get_world_size()))
        with torch.inference_mode():
            inside = collectives.all_reduce(torch.ones(3), "sum", ranks)
        outside = collectives.all_reduce(torch.ones(3), "sum", ranks)
        return [inside.tolist(), outside.tolist()]
    finally:
        shm._ENABLED = saved
        inline._frames.clear()
        inline._frames.update(frames)


def test_frames_made_in_inference_mode_serve_later_calls(pool2):
    """(Before: every later collective raised torch's "Inplace update to inference tensor
    outside InferenceMode".)"""
    assert pool2.run(_first_frame_in_inference_mode) == [[[2.0] * 3] * 2] * 2


@pytest.mark.parametrize("world", [2, 4])
def test_small_gloo_collectives_carry_their_fingerprint_inside(world, pool2, pool4):
    """Across hosts (no shared segment) a small all-reduce or all-gather is one gloo call,
    its fingerprint in the same buffer (before: a 2-element all-reduce first, then the
    collective); every rank reduces in rank order, so all hold the same bits. A large
    one is its frame, then its all-reduce. Values equal the reduction in one process."""
    pool = pool2 if world == 2 else pool4
    results = pool.run(_small_and_large_across_hosts)
    parts = [(torch.arange(5, dtype=torch.float64) * (r + 1) - 3) for r in range(world)]
    for res in results:
        for (dtype, op, got, calls), first in zip(res, results[0], strict=True):
            if dtype == "all_gather":
                want = torch.tensor([[float(r)] * 3 for r in op])
                assert calls == {"all_gather": 1}
            elif dtype == "large":
                want = torch.full((3,), float(sum(range(world))))
                assert calls == {"all_gather": 1, "all_reduce": 1}
            else:
                p = [x.to(dtype) for x in parts]
                if dtype == torch.float32:
                    p[1][2] = float("nan")
                stacked = torch.stack(p)
                want = {"sum": stacked.sum(0), "max": stacked.amax(0), "min": stacked.amin(0)}[op]
                assert calls == {"all_gather": 1}
                torch.testing.assert_close(got, want.to(dtype), equal_nan=True)
                assert torch.equal(got.view(torch.uint8), first[2].view(torch.uint8))
                continue
            torch.testing.assert_close(got, want)


def _swapped_conversions() -> tuple[str, float]:
    """Two re-boxings, checked once in one order (the metadata check is then cached), then
    in swapped order on rank 1: (6, 1) and (8, 1) split(0) -> broadcast."""
    P = sbp.placement.all("cpu")
    x = sbp.ones(6, 1, placement=P, sbp=S0)
    y = sbp.ones(8, 1, placement=P, sbp=S0)
    x.to_global(sbp=B), y.to_global(sbp=B)
    first, second = (x, y) if sbp.env.get_rank() == 0 else (y, x)

    def run():
        first.to_global(sbp=B)
        second.to_global(sbp=B)

    return _raises_mismatch(run)


def test_conversions_in_swapped_order_raise_on_every_rank(pool2):
    for message, seconds in pool2.run(_swapped_conversions):
        assert "all_gather of 12 bytes" in message and "all_gather of 16 bytes" in message
        assert seconds < 5


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _diverged_training(divergence: str) -> tuple[str, float]:
    """Data-parallel training where rank 1 froze a layer or has another bucket size."""
    torch.manual_seed(0)
    P = sbp.placement.all("cpu")
    model = _Net().to_global(P, B)
    one = sbp.env.get_rank() == 1
    if divergence == "frozen" and one:
        model.a.weight.requires_grad_(False)
    if divergence == "bucket":
        sbp.nn.data_parallel(model, bucket_mb=(64 * 64 * 4 / 2**20) if one else 25)
    x = torch.randn(8, 64).to_global(P, S0)
    y = torch.randint(0, 8, (8,)).to_global(P, S0)

    def step():
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        for p in model.parameters():
            if p.grad is not None:
                p.grad.full_tensor()

    return _raises_mismatch(step)


@pytest.mark.parametrize("divergence", ["frozen", "bucket"])
def test_per_rank_differences_in_data_parallel_raise_on_every_rank(divergence, pool2):
    for message, seconds in pool2.run(_diverged_training, divergence):
        assert "collectives out of step" in message and "all_reduce(sum)" in message
        assert seconds < 10


def test_fingerprints_tell_kinds_ops_dtypes_and_sizes_apart():
    kinds = [
        fingerprint.of(kind, dtype, nbytes, op)
        for kind in ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
        for dtype in (torch.float32, torch.int64, torch.bfloat16)
        for nbytes in (0, 24, 32, 2**39)
        for op in (None, "sum", "max")
    ]
    assert len(set(kinds)) == len(kinds)
    fp = fingerprint.of("reduce_scatter", torch.bfloat16, 4096, "max")
    assert fingerprint.describe(fp) == "reduce_scatter(max) of 4096 bytes of torch.bfloat16"
    assert 0 < fp < 2**63


class _ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.bn = torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def _diverged_state(divergence: str) -> tuple[str, str, float]:
    """Two data-parallel steps where rank 1 alone is in eval mode, inside no_sync, or has
    other data_parallel options: the error on every rank, and how long it took."""
    torch.manual_seed(0)
    P = sbp.placement.all("cpu")
    model = _ConvNet().double().to_global(P, B)
    one = sbp.env.get_rank() == 1
    if divergence == "batch_norm='local'" and one:
        sbp.nn.data_parallel(model, batch_norm="local")
    if divergence == "fast=False" and one:
        sbp.nn.data_parallel(model, fast=False)
    if divergence == "eval" and one:
        model.eval()
    x = torch.randn(8, 3, 6, 6, dtype=torch.float64).to_global(P, S0)
    y = torch.randint(0, 4, (8,)).to_global(P, S0)
    start = time.monotonic()
    try:
        for _ in range(2):
            with sbp.nn.no_sync(model) if divergence == "no_sync" and one else _nothing():
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
            loss.item()
            [p.grad.full_tensor() for p in model.parameters()]
    except sbp.SbpError as e:
        seconds = time.monotonic() - start
        ranks = tuple(range(sbp.env.get_world_size()))
        in_step = collectives.all_reduce(torch.ones(3), "sum", ranks)  # (the ranks go on)
        assert torch.equal(in_step, torch.full((3,), 2.0))
        return type(e).__name__, str(e), seconds
    return "no error", "", time.monotonic() - start


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("divergence", ["eval", "no_sync", "batch_norm='local'", "fast=False"])
def test_divergent_per_rank_state_raises_on_every_rank_at_once(divergence, pool2):
    """(Before: CommTimeoutError after the full timeout, or gloo's abort.)"""
    for name, message, seconds in pool2.run(_diverged_state, divergence):
        assert name == "MetaMismatchError", message
        assert "out of step" in message or "the ranks run different code" in message
        assert seconds < 10


def _skipped_step() -> tuple:
    """A data-parallel loop where rank 1 skips step 2 (every step runs the same
    collectives), then an evaluation with a batch of another size: the error, the steps
    each rank finished, the time."""
    torch.manual_seed(0)
    P = sbp.placement.all("cpu")
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model = model.to_global(P, B)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    done: list = []
    start = time.monotonic()
    try:
        for step in range(5):
            if sbp.env.get_rank() == 1 and step == 2:
                continue
            g = torch.Generator().manual_seed(step)
            x = torch.randn(8, 16, generator=g).to_global(P, S0)
            y = torch.randint(0, 4, (8,), generator=g).to_global(P, S0)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss.item()
            done.append(step)
        with torch.no_grad():
            model(torch.randn(4, 16).to_global(P, S0)).sum().item()
    except sbp.SbpError as e:
        return type(e).__name__, str(e), done, time.monotonic() - start
    return "no error", "", done, time.monotonic() - start


def test_a_skipped_step_is_named_at_the_first_call_that_differs(pool2):
    """Steps that run the same collectives cannot be told apart: with step 2 skipped on
    rank 1, its steps 3 and 4 pair with rank 0's steps 2 and 3 (no fingerprint differs),
    and rank 0's step 4 meets rank 1's evaluation: its batch's metadata (checked at every
    `to_global` of a local tensor) differs, named on both ranks at once. (Had rank 1
    exited instead, rank 0 would raise CommTimeoutError naming it within ~10 ms.)"""
    (name0, message0, done0, s0), (name1, message1, done1, s1) = pool2.run(_skipped_step)
    assert done0 == [0, 1, 2, 3] and done1 == [0, 1, 3, 4]
    assert name0 == name1 == "MetaMismatchError" and message0 == message1
    assert "local shapes [(8, 16), (4, 16)] of ranks [0, 1]" in message0
    assert s0 < 10 and s1 < 10
