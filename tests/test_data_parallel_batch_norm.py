"""BatchNorm on the data-parallel fast path: logical statistics (one all-reduce) and
per-shard ones (`batch_norm="local"`, torch DDP's arithmetic), eager and compiled.

Float64 where it can, so that 1e-12 separates semantics from rounding."""

import pytest
import torch
import torch.nn.functional as F
from data_parallel_helpers import (
    S0,
    B,
    ConvBN,
    _conv_bn_cumulative,
    _data,
    _fast_and_per_op,
    _global,
    _rel,
    _shard,
    _train,
    _train_recording,
)

import sbp


@pytest.mark.parametrize("world", [1, 2])
def test_batch_norm_cumulative_average_on_the_fast_path(pool2, world):
    data = _data(n=6, steps=3, shape=(3, 5, 5), classes=4)
    if world == 1:  # in this process: a world of one (a rank outside has no number to read)
        fast, per_op = _fast_and_per_op(_conv_bn_cumulative, 1, S0, data)
    else:
        fast, per_op = pool2.run(_fast_and_per_op, _conv_bn_cumulative, world, S0, data)[0]
    ref = _train(_conv_bn_cumulative, None, None, None, data)
    assert fast[3] == ["fast"] * 3 and per_op[3] == ["per-op"] * 3
    for got in (fast, per_op):
        for a, b in zip(got[0], ref[0], strict=True):
            assert abs(a - b) <= 1e-12 * abs(b)
        assert _rel(got[1], ref[1]) < 1e-12
        assert _rel(got[2], ref[2]) < 1e-12  # running statistics and num_batches_tracked


@pytest.mark.parametrize("path", ["fast", "per-op", "compiled", "compile-local", "compile-model"])
def test_per_shard_batch_norm_equals_torch_ddp(pool2, path):
    """The fast path, op by op (`sbp::shard_batch_norm`), torch.compile (the same op in
    the graph, one broadcast of the running statistics) and the fast path with its local
    forward compiled (torch's BatchNorm in the graph) all compute what torch DDP does."""
    data = _data(n=8, steps=3, shape=(3, 8, 8), classes=4)

    def run():
        import torch.distributed as dist

        P = sbp.placement("cpu", [0, 1])
        got = _train(
            ConvBN,
            P,
            S0,
            path in ("fast", "compile-local", "compile-model"),
            data,
            batch_norm="local",
            compiled={"compiled": True, "compile-model": "aot_eager"}.get(path, False),
            compile_local={"backend": "aot_eager"} if path == "compile-local" else None,
        )
        torch.manual_seed(0)
        ddp = torch.nn.parallel.DistributedDataParallel(ConvBN().double())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
        for x, y in data:
            loss = F.cross_entropy(ddp(_shard(x, P, S0)), _shard(y, P, S0))
            opt.zero_grad()
            loss.backward()
            opt.step()
        buffers = [b.clone() for b in ddp.module.buffers()]
        for b in buffers:
            dist.broadcast(b, 0)  # torch DDP's buffers are rank 0's (it broadcasts them)
        return got, [p.detach() for p in ddp.module.parameters()], buffers

    expected_path = {"per-op": "per-op", "compiled": "traced"}.get(path, "fast")
    for got, ddp_params, ddp_buffers in pool2.run(run):  # every rank's buffers: rank 0's
        assert got[3] == [expected_path] * 3
        assert _rel(got[1], ddp_params) < 1e-12
        for a, b in zip(got[2], ddp_buffers, strict=True):
            assert torch.allclose(a.double(), b.double(), rtol=1e-12, atol=1e-12)


def test_batch_norm_mode_switches_back(pool2):
    """batch_norm="local" gives the BatchNorm modules the per-shard forward; "global" gives
    them torch's back: op by op, the logical batch's statistics again, as one process."""
    x, _ = _data(n=8, steps=1, shape=(3, 8, 8), classes=4)[0]

    def run():
        import sbp.nn

        P = sbp.placement("cpu", [0, 1])
        torch.manual_seed(0)
        model = ConvBN().double().to_global(P, B)
        sbp.nn.data_parallel(model, fast=False, batch_norm="local")
        installed = "forward" in model.bn.__dict__
        sbp.nn.data_parallel(model, batch_norm="global")
        out = model(_global(x, P))
        still = "forward" in model.bn.__dict__
        return installed, still, out.full_tensor(), model.bn.running_var.to_local()

    torch.manual_seed(0)
    ref = ConvBN().double()
    want = ref(x)
    for installed, still, out, running_var in pool2.run(run):
        assert installed and not still
        assert torch.allclose(out, want, rtol=1e-12, atol=1e-12)
        assert torch.allclose(running_var, ref.bn.running_var, rtol=1e-12, atol=1e-12)


def test_compiled_model_follows_a_change_of_batch_norm_mode(pool2):
    """A compiled model recompiles when its BatchNorm mode changes: per shard, then logical,
    each equal to its reference (torch DDP's per-shard numbers; one process)."""
    x, _ = _data(n=8, steps=1, shape=(3, 8, 8), classes=4)[0]

    def run():
        import sbp.nn

        P = sbp.placement("cpu", [0, 1])
        torch.manual_seed(0)
        model = ConvBN().double().to_global(P, B)
        compiled = torch.compile(model, backend="aot_eager")
        sbp.nn.data_parallel(model, batch_norm="local")
        local = compiled(_global(x, P)).to_local()
        sbp.nn.data_parallel(model, batch_norm="global")
        logical = compiled(_global(x, P)).full_tensor()
        torch._dynamo.reset()
        return local, logical

    torch.manual_seed(0)
    ref = ConvBN().double()
    for rank, (local, logical) in enumerate(pool2.run(run)):
        part = ConvBN().double()
        part.load_state_dict(ref.state_dict())
        assert torch.allclose(local, part(x[4 * rank : 4 * rank + 4]), rtol=1e-12, atol=1e-12)
        assert torch.allclose(logical, ref(x), rtol=1e-12, atol=1e-12)


def _per_shard_with_an_empty_shard(path):
    import sbp.nn

    P = sbp.placement("cpu", [0, 1, 2, 3])
    x, y = _data(n=3, steps=1, shape=(3, 8, 8), classes=4)[0]  # rank 3's part is empty
    torch.manual_seed(0)
    model = ConvBN().double().to_global(P, B)
    sbp.nn.data_parallel(model, fast=path == "fast", batch_norm="local")
    run = torch.compile(model, backend="aot_eager") if path == "compiled" else model
    out = run(_global(x, P))
    F.cross_entropy(out, _global(y, P)).backward()
    grad = model.bn.weight.grad.to_local()
    return out.to_local().detach(), model.bn.running_mean.to_local(), grad


@pytest.mark.parametrize("path", ["fast", "per-op", "compiled"])
def test_per_shard_batch_norm_with_an_empty_shard(pool4, path):
    """An uneven batch leaves a rank nothing: its shard has no statistics and contributes no
    gradient; the others normalise theirs, every rank ends with the first rank's running
    statistics, and the weight gradient is that of the logical loss."""
    x, y = _data(n=3, steps=1, shape=(3, 8, 8), classes=4)[0]
    torch.manual_seed(0)
    ref = ConvBN().double()
    parts, expected_outs = [], []
    for r in range(3):  # one sample each; the loss is the mean over all three
        part = ConvBN().double()
        part.load_state_dict(ref.state_dict())
        out = part(x[r : r + 1])
        (F.cross_entropy(out, y[r : r + 1]) / 3).backward()
        parts.append(part)
        expected_outs.append(out.detach())
    want_grad = sum(p.bn.weight.grad for p in parts)
    results = pool4.run(_per_shard_with_an_empty_shard, path, timeout=300)
    for rank, (out, running_mean, grad) in enumerate(results):
        if rank < 3:
            assert torch.allclose(out, expected_outs[rank], rtol=1e-12, atol=1e-12)
        else:
            assert out.shape[0] == 0
        assert torch.allclose(running_mean, parts[0].bn.running_mean, rtol=1e-12, atol=1e-14)
        assert torch.allclose(grad, want_grad, rtol=1e-10, atol=1e-12)


def _logical_compiled_with_an_empty_shard(backend):
    import sbp.nn

    P = sbp.placement("cpu", [0, 1, 2, 3])
    x, y = _data(n=3, steps=1, shape=(3, 8, 8), classes=4)[0]
    torch.manual_seed(0)
    model = ConvBN().double().to_global(P, B)
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        out = torch.compile(model, backend=backend)(_global(x, P))
        F.cross_entropy(out, _global(y, P)).backward()
    torch._dynamo.reset()
    grads = [p.grad.full_tensor() for p in model.parameters()]
    state = sbp.nn.fast_path.state(model)
    return state.last_path, out.full_tensor().detach(), grads, model.bn.running_var.to_local()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_logical_batch_norm_compiled_with_an_empty_shard(pool4, backend):
    """Three samples over four ranks: the last rank's shard is empty. Inductor's own
    convolution backward fails on an empty batch (plain torch too), on that rank alone,
    and the others waited: a layout that leaves a rank no samples runs its local forward
    eagerly, on every rank alike; equal to one process."""
    x, y = _data(n=3, steps=1, shape=(3, 8, 8), classes=4)[0]
    torch.manual_seed(0)
    ref = ConvBN().double()
    want = ref(x)
    F.cross_entropy(want, y).backward()
    results = pool4.run(_logical_compiled_with_an_empty_shard, backend, timeout=300)
    for path, out, grads, running_var in results:
        assert path == "fast"
        assert torch.allclose(out, want.detach(), rtol=1e-12, atol=1e-12)
        assert _rel(grads, [p.grad for p in ref.parameters()]) < 1e-12
        assert torch.allclose(running_var, ref.bn.running_var, rtol=1e-12, atol=1e-14)


def _per_shard_on_two_of_four(path):
    import sbp.nn

    P = sbp.placement("cpu", [0, 1])
    x, _ = _data(n=8, steps=1, shape=(3, 8, 8), classes=4)[0]
    torch.manual_seed(0)
    model = ConvBN().double().to_global(P, B)
    sbp.nn.data_parallel(model, fast=False, batch_norm="local")
    run = torch.compile(model, backend="aot_eager") if path == "compiled" else model
    out = run(_global(x, P))
    inside = sbp.env.get_rank() in P
    return (out.to_local().detach() if inside else None), model.bn.running_mean.to_local()


@pytest.mark.parametrize("path", ["per-op", "compiled"])
def test_per_shard_batch_norm_with_ranks_outside_the_placement(pool4, path):
    """Ranks 2 and 3 hold nothing of a placement of ranks 0 and 1: they take no part in the
    statistics' broadcast, and nobody waits for them."""
    x, _ = _data(n=8, steps=1, shape=(3, 8, 8), classes=4)[0]
    torch.manual_seed(0)
    ref = ConvBN().double()
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    first = None
    for rank, (out, running_mean) in enumerate(pool4.run(_per_shard_on_two_of_four, path)):
        if rank < 2:
            part = ConvBN().double()
            part.load_state_dict(state)
            assert torch.allclose(out, part(x[4 * rank : 4 * rank + 4]), rtol=1e-12, atol=1e-12)
            first = part.bn.running_mean if rank == 0 else first
            assert torch.allclose(running_mean, first, rtol=1e-12, atol=1e-14)
        else:
            assert out is None and running_mean.numel() == 0


def test_per_shard_statistics_reach_every_rank(pool2):
    """The first rank's running statistics are copied to the others while backward runs:
    every rank holds them after backward, state_dict gives them after a forward alone, and
    a load_state_dict after a forward is not overwritten by the copy still in flight."""
    data = _data(n=8, steps=2, shape=(3, 8, 8), classes=4)

    def run():
        import sbp.nn

        P = sbp.placement("cpu", [0, 1])
        torch.manual_seed(0)
        model = ConvBN().double().to_global(P, B)
        sbp.nn.data_parallel(model, batch_norm="local")
        (x1, y1), (x2, _) = data
        F.cross_entropy(model(_global(x1, P)), _global(y1, P)).backward()
        after_backward = [b.to_local().clone() for b in model.buffers()]
        model(_global(x2, P))  # no backward
        state = {k: v.clone() for k, v in model.state_dict().items()}
        saved = {k: v.to_local().clone() for k, v in state.items()}
        model(_global(x1, P))  # a forward, then a load: the loaded values stay
        model.load_state_dict(state)
        sbp.nn.fast_path.state(model).settle_buffers()
        loaded = [model.bn.running_mean.to_local(), model.bn.running_var.to_local()]
        return after_backward, [saved["bn.running_mean"], saved["bn.running_var"]], loaded

    results = pool2.run(run)
    torch.manual_seed(0)
    ref = ConvBN().double()
    first_rank_part = [x[:4] for x, _ in data]  # rank 0's shard of each batch
    ref(first_rank_part[0])
    ref_after_backward = [b.clone() for b in ref.buffers()]
    ref(first_rank_part[1])
    ref_saved = [ref.bn.running_mean, ref.bn.running_var]
    for after_backward, saved, loaded in results:  # every rank
        assert [a.dtype for a in after_backward] == [b.dtype for b in ref_after_backward]
        assert _rel(after_backward[:2], ref_after_backward[:2]) < 1e-12
        assert torch.equal(after_backward[2], ref_after_backward[2])  # num_batches_tracked
        assert _rel(saved, ref_saved) < 1e-12
        assert _rel(loaded, ref_saved) < 1e-12


def _conv_bn_under_autocast(world, fast, dtype):
    """Two steps of ConvBN (float32) under CPU autocast to `dtype`: the paths, the BatchNorm
    running statistics and the losses."""
    import sbp.nn

    torch.manual_seed(0)
    model = ConvBN()
    if world:
        P = sbp.placement("cpu", list(range(world)))
        model.to_global(P, B)
        sbp.nn.data_parallel(model, fast=fast)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    paths, losses = [], []
    for x, y in _data(n=8, steps=2, shape=(3, 4, 4), classes=4):  # (planes of 16: summed
        x = x.float()  # by product, `sbp.ops.batch_norm.SUM_BY_PRODUCT`)
        with torch.autocast("cpu", dtype=dtype):
            out = model(_global(x, P) if world else x)
        loss = F.cross_entropy(out.float(), _global(y, P) if world else y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        paths.append(sbp.nn.fast_path.state(model).last_path if world else None)
    stats = [model.bn.running_mean, model.bn.running_var]
    return paths, [t.full_tensor() if world else t for t in stats], losses


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_logical_batch_norm_under_autocast_runs_on_the_fast_path(pool2, dtype):
    """The local run's BatchNorm statistics are summed with autocast off, as the op-by-op
    rule's kernels are (below autocast): under autocast their `ones @ t` and `torch.mv`
    ran in half precision, the first local run differed from the check and torchvision's
    resnet18 and mobilenet_v2 ran op by op (before). Statistics equal op by op's and one
    process's (its convolutions round otherwise: the half-precision activations differ)."""
    _, want, want_losses = _conv_bn_under_autocast(0, True, dtype)
    per_op = pool2.run(_conv_bn_under_autocast, 2, False, dtype)[0]
    for paths, stats, losses in pool2.run(_conv_bn_under_autocast, 2, True, dtype):
        assert paths == ["fast", "fast"]
        for got, op_by_op, ref in zip(stats, per_op[1], want, strict=True):
            torch.testing.assert_close(got, op_by_op, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-3)
        assert losses == pytest.approx(want_losses, rel=1e-3)


class FunctionalNorm(torch.nn.Module):
    """Calls F.batch_norm itself (no BatchNorm module): the fast path intercepts it with a
    mode over the whole forward instead of inside BatchNorm modules."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = torch.nn.Linear(8, 6), torch.nn.Linear(6, 3)
        self.weight = torch.nn.Parameter(torch.ones(6))
        self.register_buffer("mean", torch.zeros(6))
        self.register_buffer("var", torch.ones(6))

    def forward(self, x):
        h = F.batch_norm(self.inp(x), self.mean, self.var, self.weight, None, self.training)
        return self.out(torch.relu(h))


def _functional_norm(data):
    return _train_recording(FunctionalNorm, True, data)


def test_functional_batch_norm_outside_modules_equals_one_process(pool2):
    data = _data()
    ref_losses, ref_params, ref_buffers, _, _ = _train(FunctionalNorm, None, None, None, data)
    for (losses, params, buffers, paths, _), in_modules in pool2.run(_functional_norm, data):
        assert paths == ["fast"] * len(data) and in_modules == [False]
        assert losses == pytest.approx(ref_losses, abs=1e-12)
        assert _rel(params, ref_params) < 1e-12 and _rel(buffers, ref_buffers) < 1e-12


def _far_from_zero_batch():
    """A column of years (mean 2020, spread 1e-3: a shifted sum's square loses it all)."""
    g = torch.Generator().manual_seed(4)
    x = 2020 + 1e-3 * torch.randn(9, 4, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 3, (9,), generator=g)


def _batch_norm_far_from_zero(world, fast):
    import sbp.nn

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 3)).double()
    x, y = _far_from_zero_batch()
    if world is not None:
        P = sbp.placement("cpu", list(range(world)))
        model.to_global(P, B)
        sbp.nn.data_parallel(model, fast=fast)
        x, y = _global(x, P), _global(y, P)
    out = model(x)
    F.cross_entropy(out, y).backward()
    values = [out, *(p.grad for p in model.parameters()), *model[0].buffers()]
    return [v.full_tensor() if world is not None else v.detach() for v in values]


@pytest.mark.parametrize("fast", [True, False])
def test_logical_batch_norm_of_data_far_from_zero(pool2, fast):
    """The variance came from E[(x-K)^2] - E[x-K]^2 with K the running mean (0 at first):
    on data far from zero (years), cancellation took most of it (relative errors of 1e-4
    here, in float64). Each rank's own two-pass statistics, merged, equal one process's to
    the rounding that data 2e6 spreads from zero carry (x - mean loses ~2e-10 in float64)."""
    want = _batch_norm_far_from_zero(None, None)
    for got in pool2.run(_batch_norm_far_from_zero, 2, fast):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-10)


class GroupNormed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.norm = torch.nn.GroupNorm(4, 8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.conv(x))).mean((2, 3)))


def test_group_norm_takes_the_fast_path(pool2):
    """GroupNorm's statistics are each sample's: its rule gives the local batch size, as
    F.group_norm does on local tensors, so the local run is exact (before: op by op,
    'native_group_norm adjusts its local arguments')."""
    data = _data(n=7, shape=(3, 4, 4))
    want = _train(GroupNormed, None, None, None, data)
    for losses, params, _, paths, _ in pool2.run(
        _train, GroupNormed, sbp.placement("cpu", [0, 1]), S0, True, data
    ):
        assert paths == ["fast"] * len(data)
        assert losses == pytest.approx(want[0], rel=1e-12)
        for got, ref in zip(params, want[1], strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
