"""Bad input and faults end in a named `sbp.SbpError` on every rank, fast; no wrong numbers.

Each case runs on every rank of a pool of 2 and of 4 with a short communication timeout
(`sbp.env.init(timeout=...)`, applied to the live process groups). A case returns its value
or the name of the error it raised, and how long it took; the test asserts the error type
on every rank and that every rank failed well within the timeout.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch

import sbp

TIMEOUT = 5.0  # seconds: what the cases run under
FAST = 1.0  # seconds: most ranks fail this fast (every rank within 2 x TIMEOUT)
HANG = 120.0  # seconds: the pool's guard (first calls import torch._dynamo on a busy box)


def _run_case(case, *args):
    """On each rank: run `case` under a short timeout; (result or error type, message, seconds)."""
    sbp.env.init(timeout=TIMEOUT)
    start = time.monotonic()
    try:
        out = ("ok", case(sbp.env.get_rank(), sbp.env.get_world_size(), *args), "")
    except sbp.SbpError as e:
        out = (type(e).__name__, None, str(e))
    finally:
        sbp.env.init(timeout=60.0)  # the pool's own
    return (*out, time.monotonic() - start)


def _expect_error(pool, case, error, *args, match=""):
    results = pool.run(_run_case, case, *args, timeout=HANG)
    for rank, (kind, _, message, seconds) in enumerate(results):
        assert kind == error.__name__, f"rank {rank}: {kind} {message}"
        assert match in message, f"rank {rank}: {message}"
        assert seconds < 2 * TIMEOUT, f"rank {rank} took {seconds:.2f} s"
    print(f"{case.__name__}: {error.__name__} in", [f"{r[-1]:.3f}" for r in results], "s")
    fast = [seconds < FAST for *_, seconds in results]
    assert sum(fast) >= len(results) / 2, [r[-1] for r in results]
    return results


def _expect_values(pool, case, *args):
    results = pool.run(_run_case, case, *args, timeout=HANG)
    for rank, (kind, _, message, _) in enumerate(results):
        assert kind == "ok", f"rank {rank}: {kind} {message}"
    return [r[1] for r in results]


@pytest.fixture(params=[2, 4], ids=["world2", "world4"])
def pool(request):
    return request.getfixturevalue(f"pool{request.param}")


def _all(world):
    return sbp.placement("cpu", list(range(world)))


# ---------------------------------------------------------------- silent wrong numbers


def _nan_reductions(rank, world):
    logical = torch.arange(2.0 * world).reshape(world, 2)
    logical[world - 1, 0] = float("nan")
    P = _all(world)
    g = sbp.to_global(logical[rank : rank + 1], P, sbp.split(0))
    partial = sbp.to_global(logical[rank], P, sbp.partial_max).to_global(sbp=sbp.broadcast)
    return {
        "max": g.max().item(),
        "min": g.min().item(),
        "amax0": g.amax(0).tolist(),
        "amin0": g.amin(0).tolist(),
        "partial_max": partial.tolist(),
        "logical": logical,
    }


def test_nan_survives_max_and_min_on_every_path(pool):
    for got in _expect_values(pool, _nan_reductions):
        x = got["logical"]
        assert math.isnan(got["max"]) and math.isnan(x.max().item())
        assert math.isnan(got["min"])
        torch.testing.assert_close(torch.tensor(got["amax0"]), x.amax(0), equal_nan=True)
        torch.testing.assert_close(torch.tensor(got["amin0"]), x.amin(0), equal_nan=True)
        torch.testing.assert_close(torch.tensor(got["partial_max"]), x.amax(0), equal_nan=True)


def _zero_dim_local(rank, world):
    g = sbp.to_global(torch.ones(2), _all(world), sbp.broadcast)
    return (g + torch.tensor(float(rank))).tolist()


def test_zero_dim_local_tensor_mixed_with_global(pool):
    _expect_error(pool, _zero_dim_local, sbp.PlacementError, match="local torch.Tensor")


def _broadcast_unsynced(rank, world):
    x = torch.full((3,), float(rank))
    return sbp.to_global(x, _all(world), sbp.broadcast, sync_data=False).tolist()


def test_broadcast_without_sync_checks_the_data(pool):
    _expect_error(pool, _broadcast_unsynced, sbp.MetaMismatchError, match="sync_data=True")


def _sbp_tensor_differs(rank, world):
    return sbp.tensor([1.0, float(rank)], _all(world), sbp.broadcast).tolist()


def test_sbp_tensor_with_different_data(pool):
    _expect_error(pool, _sbp_tensor_differs, sbp.MetaMismatchError, match="data hash")


# ---------------------------------------------------------------- hangs


def _empty_shard_reductions(rank, world):
    logical = torch.tensor([[3.0, -1.0, 7.0]])  # 1 row: every rank but the first is empty
    g = sbp.to_global(logical[rank : rank + 1], _all(world), sbp.split(0))
    return [
        g.max().item(),
        g.min().item(),
        g.amax(0).tolist(),
        g.amin(0).tolist(),
        g.amax(1).tolist(),
        g.amax((0, 1)).item(),
    ]


def test_max_and_min_over_empty_shards(pool):
    x = torch.tensor([[3.0, -1.0, 7.0]])
    want = [7.0, -1.0, x.amax(0).tolist(), x.amin(0).tolist(), x.amax(1).tolist(), 7.0]
    for got in _expect_values(pool, _empty_shard_reductions):
        assert got == want


def _bad_sbp_on_last_rank(rank, world):
    s = sbp.split(5) if rank == world - 1 else sbp.split(0)
    return sbp.to_global(torch.ones(2, 2), _all(world), s)


def _bad_placement_on_last_rank(rank, world):
    P = "cpu" if rank == world - 1 else _all(world)
    return sbp.to_global(torch.ones(2, 2), P, sbp.split(0))


def _bad_shape_on_first_rank(rank, world):
    return sbp.to_global(
        torch.ones(2), _all(world), sbp.split(0), shape=(-1,) if rank == 0 else None
    )


def _numpy_on_first_rank(rank, world):
    x = np.ones(2) if rank == 0 else torch.ones(2)
    return sbp.to_global(x, _all(world), sbp.split(0))


def _outside_world_on_last_rank(rank, world):
    P = sbp.placement("cpu", [0, world]) if rank == world - 1 else _all(world)
    return sbp.to_global(torch.ones(2), P, sbp.broadcast)


@pytest.mark.parametrize(
    "case, error, match",
    [
        (_bad_sbp_on_last_rank, sbp.SbpSignatureError, "split dim 5"),
        (_bad_placement_on_last_rank, sbp.PlacementError, "'cpu'"),
        (_bad_shape_on_first_rank, sbp.InputValueError, "negative"),
        (_numpy_on_first_rank, sbp.InputTypeError, "ndarray"),
        (_outside_world_on_last_rank, sbp.PlacementError, "outside the world"),
    ],
    ids=["sbp", "placement", "shape", "numpy", "rank outside world"],
)
def test_bad_argument_on_one_rank_raises_on_every_rank(pool, case, error, match):
    results = _expect_error(pool, case, error, match=match)
    bad = 0 if "first" in case.__name__ else len(results) - 1
    for rank, (_, _, message, _) in enumerate(results):
        if rank != bad:
            assert message.startswith(f"on rank {bad}:")


def _rebox_disagrees(rank, world, what):
    P = _all(world)
    g = sbp.to_global(torch.ones(world, 4), P, sbp.broadcast)
    if what == "sbp":
        return g.to_global(sbp=sbp.split(1) if rank == 0 else sbp.split(0)).to_local().shape
    other = sbp.placement("cpu", list(reversed(range(world))))
    return g.to_global(placement=other if rank == 0 else P, sbp=sbp.split(0)).to_local().shape


@pytest.mark.parametrize("what", ["sbp", "placement"])
def test_ranks_disagreeing_on_a_rebox(pool, what):
    _expect_error(pool, _rebox_disagrees, sbp.MetaMismatchError, what, match="re-box")


def _factory_disagrees(rank, world, what):
    """A factory given a rank-dependent argument (a shape no other case makes, so no rank
    has checked it before): the split one summed wrong silently, the broadcast one hung."""
    size = (world + 3, 5)
    if what == "split":
        layout = sbp.split(1) if rank == 0 else sbp.split(0)
    elif what == "broadcast":
        layout = sbp.broadcast if rank == 0 else sbp.split(0)
    else:
        layout, size = sbp.split(0), (world + 3, 5 + (rank == 0))
    return (sbp.ones(size, placement=_all(world), sbp=layout) * 2).sum().item()


@pytest.mark.parametrize("what", ["split", "broadcast", "shape"])
def test_ranks_disagreeing_on_a_factory_s_layout(pool, what):
    _expect_error(pool, _factory_disagrees, sbp.MetaMismatchError, what, match="factory")


def _requires_grad_disagrees(rank, world):
    x = torch.ones(2, requires_grad=rank == 0)
    return sbp.to_global(x, _all(world), sbp.split(0))


def test_ranks_disagreeing_on_requires_grad(pool):
    _expect_error(pool, _requires_grad_disagrees, sbp.MetaMismatchError, match="requires_grad")


# ---------------------------------------------------------------- wrong error types


def _factory_bad_placement(rank, world, placement):
    return sbp.zeros(2, placement=placement, sbp=sbp.broadcast)


def _rebox_bad_placement(rank, world, placement):
    g = sbp.to_global(torch.ones(2), _all(world), sbp.broadcast)
    return g.to_global(placement="cpu", sbp=sbp.broadcast)


def _tensor_bad_placement(rank, world, placement):
    return sbp.tensor([1.0], placement, sbp.broadcast)


@pytest.mark.parametrize(
    "case", [_factory_bad_placement, _rebox_bad_placement, _tensor_bad_placement]
)
@pytest.mark.parametrize("placement", ["cpu", None])
def test_placement_that_is_not_a_placement(pool, case, placement):
    _expect_error(pool, case, sbp.PlacementError, placement, match="sbp.placement")


def _factory_bad_argument(rank, world, what):
    P = _all(world)
    if what == "dtype string":
        return sbp.ones(2, 3, placement=P, sbp=sbp.broadcast, dtype="float32")
    if what == "negative size":
        return sbp.zeros(-1, 3, placement=P, sbp=sbp.split(0))
    if what == "integer randn":
        return sbp.randn(4, placement=P, sbp=sbp.split(0), dtype=torch.int64)
    if what == "no sbp":
        return sbp.full((2,), 1.0, placement=P)
    if what == "sparse data":
        return sbp.tensor(torch.eye(3).to_sparse_csr(), placement=P, sbp=sbp.broadcast)
    if what == "sparse local":
        return sbp.to_global(torch.eye(3).to_sparse(), P, sbp.split(0))
    g = sbp.to_global(torch.ones(world, 3), P, sbp.split(0))
    return g.to_global(sbp=sbp.broadcast, shape=(world + 1, 3))


@pytest.mark.parametrize(
    "what, error, match",
    [
        ("dtype string", sbp.InputTypeError, "sbp.ones"),
        ("negative size", sbp.InputTypeError, "sbp.zeros"),
        ("integer randn", sbp.InputTypeError, "sbp.randn"),
        ("no sbp", sbp.SbpSignatureError, "sbp= is required"),
        ("sparse data", sbp.InputTypeError, "dense"),
        ("sparse local", sbp.InputTypeError, "dense"),
        ("shape of a global", sbp.MetaMismatchError, "shape="),
    ],
)
def test_factory_and_rebox_arguments_raise_named_errors(pool, what, error, match):
    """torch's TypeError, RuntimeError and NotImplementedError before."""
    _expect_error(pool, _factory_bad_argument, error, what, match=match)


def _global_given_its_shape(rank, world):
    g = sbp.to_global(torch.ones(world, 3), _all(world), sbp.split(0))
    return world, tuple(g.to_global(sbp=sbp.broadcast, shape=(world * world, 3)).to_local().shape)


def test_a_global_tensor_s_to_global_takes_its_own_shape(pool):
    for world, shape in _expect_values(pool, _global_given_its_shape):
        assert shape == (world * world, 3)  # (broadcast: the whole logical tensor)


def _cuda_without_gpu(rank, world, how):
    P = sbp.placement("cuda", list(range(world)))
    if how == "factory":
        return sbp.zeros(2, placement=P, sbp=sbp.broadcast)
    return sbp.to_global(torch.ones(2), P, sbp.broadcast)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine with no GPU")
@pytest.mark.parametrize("how", ["factory", "to_global"])
def test_cuda_placement_without_gpu(pool, how):
    _expect_error(pool, _cuda_without_gpu, sbp.DeviceMismatchError, how)


@pytest.mark.parametrize("obj", [np.ones(2), 3, "text", [np.ones(2)], 2.5], ids=repr)
def test_to_global_on_what_is_not_a_tensor(pool, obj):
    def case(rank, world, obj):
        out = sbp.to_global(obj, _all(world), sbp.broadcast)
        return [type(v).__name__ for v in out] if isinstance(out, list) else type(out).__name__

    if isinstance(obj, list):  # containers: non-tensor leaves pass through, documented
        assert _expect_values(pool, case, obj) == [["ndarray"]] * pool.world_size
    else:
        _expect_error(pool, case, sbp.InputTypeError, obj, match=type(obj).__name__)


def _module_bad_sbp(rank, world):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    try:
        m.to_global(_all(world), sbp.split(1))  # the biases are 1-D
    except sbp.SbpError as e:
        converted = [isinstance(p, sbp.GlobalTensor) for p in m.parameters()]
        return type(e).__name__, converted
    return "no error", []


def test_module_to_global_validates_before_converting(pool):
    for kind, converted in _expect_values(pool, _module_bad_sbp):
        assert kind == "SbpSignatureError"
        assert converted == [False] * 4


def _labelled_batch(world, label, first):
    """A model and a batch of 2 per rank: the last rank holds `label`, rank 0 `first`."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 5).double()
    x = torch.randn(2 * world, 3, dtype=torch.float64)
    y = torch.arange(2 * world) % 5
    y[0], y[-1] = first, label
    return model, x, y


def _loss_with_label(rank, world, label, first, ignore_index, fast):
    """Cross-entropy of `_labelled_batch` on global tensors: the loss and weight gradient."""
    import torch.nn.functional as F

    import sbp.nn

    P = _all(world)
    model, x, y = _labelled_batch(world, label, first)
    model.to_global(P, sbp.broadcast)
    if fast:
        sbp.nn.data_parallel(model)
    gx, gy = (sbp.to_global(t[2 * rank : 2 * rank + 2], P, sbp.split(0)) for t in (x, y))
    loss = F.cross_entropy(model(gx), gy, ignore_index=ignore_index)
    loss.backward()
    return loss.item(), model.weight.grad.full_tensor()


_PATHS = pytest.mark.parametrize("fast", [False, True], ids=["op by op", "fast path"])


@_PATHS
@pytest.mark.parametrize(
    "label, first", [(5, -100), (7, -100), (-1, 0)], ids=["C", "above C", "negative"]
)
def test_label_out_of_range_on_one_rank_raises_on_every_rank(pool, fast, label, first):
    """torch's kernel raises on the rank holding the label alone (the others would wait for
    it in backward's all-reduce); the range `to_global` learnt tells every rank. (A bad label
    between `ignore_index` and the classes, -1 beside an ignored -100, hides in the range:
    it is left to the kernel.)"""
    _expect_values(pool, _loss_with_label, 1, first, -100, fast)  # warm: time the error alone
    _expect_error(
        pool,
        _loss_with_label,
        sbp.LabelRangeError,
        label,
        first,
        -100,
        fast,
        match=f"label {label}, outside [0, 5)",
    )


@_PATHS
@pytest.mark.parametrize("ignore_index", [5, -1], ids=["at C", "negative"])
def test_ignore_index_outside_the_classes_is_not_an_error(pool, fast, ignore_index):
    """A label equal to `ignore_index` is ignored wherever it lies: equal to one process."""
    import torch.nn.functional as F

    model, x, y = _labelled_batch(pool.world_size, ignore_index, 0)
    want = F.cross_entropy(model(x), y, ignore_index=ignore_index)
    want.backward()
    for loss, grad in _expect_values(pool, _loss_with_label, ignore_index, 0, ignore_index, fast):
        assert loss == pytest.approx(want.item(), rel=1e-12)
        torch.testing.assert_close(grad, model.weight.grad, rtol=1e-12, atol=1e-12)


class _LossInside(torch.nn.Module):
    """Its forward returns the loss of labels it computes (no range known), as
    transformers' models do with `labels=`."""

    def __init__(self, linear):
        super().__init__()
        self.linear = linear

    def forward(self, x, y):
        import torch.nn.functional as F

        return F.cross_entropy(self.linear(x), y.clone())


def _loss_inside_with_label(rank, world, label):
    """The fast path's local run of `_LossInside`, checked first on good labels."""
    import sbp.nn

    P = _all(world)
    model, x, y = _labelled_batch(world, 1, 0)
    model = _LossInside(model).to_global(P, sbp.broadcast)
    gx = sbp.to_global(x[2 * rank : 2 * rank + 2], P, sbp.split(0))
    model(gx, sbp.to_global(y[2 * rank : 2 * rank + 2], P, sbp.split(0)))  # the check
    y[-1] = label
    loss = model(gx, sbp.to_global(y[2 * rank : 2 * rank + 2], P, sbp.split(0)))
    path = sbp.nn.fast_path.state(model).last_path
    loss.backward()
    return path, loss.item()


@pytest.mark.parametrize("label", [5, -1], ids=["C", "negative"])
def test_label_out_of_range_inside_the_forward_raises_on_every_rank(pool, label):
    """A loss the fast path computes in its local run: the ranks learn of a bad label on any
    of them with the divisor's all-reduce, and raise together."""
    for path, _ in _expect_values(pool, _loss_inside_with_label, 1):
        assert path == "fast"
    _expect_error(pool, _loss_inside_with_label, sbp.LabelRangeError, label, match="outside [0, 5)")


def _pick_with_index(rank, world, op, bad, made_by):
    """`op` of a broadcast float64 table by a split index tensor whose last row (on the last
    rank alone) is `bad`: the sum of the result and the table's gradient."""
    import torch.nn.functional as F

    P = _all(world)
    table = torch.arange(15.0, dtype=torch.float64).reshape(5, 3).requires_grad_()
    gtable = sbp.to_global(table.detach(), P, sbp.broadcast).requires_grad_()
    index = torch.arange(2 * world).remainder(5)
    index[-1] = bad
    if op != "embedding":
        index = index.unsqueeze(1).expand(-1, 3).contiguous()
    if made_by == "sbp.tensor":
        gindex = sbp.tensor(index, placement=P, sbp=sbp.split(0))
    else:
        gindex = sbp.to_global(index[2 * rank : 2 * rank + 2], P, sbp.split(0))
    picks = {
        "embedding": lambda t, i: F.embedding(i, t),
        "gather": lambda t, i: t.gather(0, i),
        "scatter_add": lambda t, i: t.scatter_add(0, i, t.new_ones(i.shape)),
    }[op]
    out = picks(gtable, gindex)
    out.sum().backward()
    want = picks(table, index)
    want.sum().backward()
    torch.testing.assert_close(out.full_tensor(), want, rtol=0, atol=0)
    torch.testing.assert_close(gtable.grad.full_tensor(), table.grad, rtol=0, atol=0)
    return out.sum().item()


_PICKS = pytest.mark.parametrize("op", ["embedding", "gather", "scatter_add"])
_MADE_BY = pytest.mark.parametrize("made_by", ["to_global", "sbp.tensor"])


@_PICKS
@_MADE_BY
@pytest.mark.parametrize("bad", [5, -1], ids=["size", "negative"])
def test_index_out_of_range_on_one_rank_raises_on_every_rank(pool, op, made_by, bad):
    """torch's kernel raises on the rank holding the bad index alone, and the other ranks
    would wait for it in their next collective; the range `to_global` (or `sbp.tensor`)
    learnt tells every rank. Good indices give one process's values and gradients."""
    _expect_values(pool, _pick_with_index, op, 4, made_by)  # (warm: time the error alone)
    _expect_error(
        pool,
        _pick_with_index,
        sbp.IndexRangeError,
        op,
        bad,
        made_by,
        match=f"{op}: {'indices' if op == 'embedding' else 'index'} holds index {bad}",
    )


class _Embedder(torch.nn.Module):
    """Token ids in, as transformers' models take them (`input_ids.view(-1, n)` first)."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(5, 3).double()
        self.head = torch.nn.Linear(3, 2).double()

    def forward(self, ids):
        ids = ids[0] if isinstance(ids, tuple) else ids
        return self.head(self.table(ids.view(-1, ids.shape[-1])))


def _fast_path_with_index(rank, world, bad, nested=False):
    """The fast path's local run of `_Embedder` on ids whose last one (on the last rank) is
    `bad`, after a checked call on good ids: the path and the loss. `nested`: the ids are
    passed in a tuple."""
    import sbp.nn

    P = _all(world)
    torch.manual_seed(0)
    model = _Embedder().to_global(P, sbp.broadcast)
    sbp.nn.data_parallel(model)
    ids = torch.arange(4 * world).remainder(5).reshape(2 * world, 2)

    def call(ids):
        g = sbp.tensor(ids, placement=P, sbp=sbp.split(0))
        return model((g,) if nested else g)

    call(ids).sum().backward()  # the check
    ids[-1, -1] = bad
    out = call(ids)
    out.sum().backward()
    return sbp.nn.fast_path.state(model).last_path, out.sum().item()


@pytest.mark.parametrize("bad", [5, -1], ids=["size", "negative"])
@pytest.mark.parametrize("nested", [False, True], ids=["argument", "in-a-tuple"])
def test_index_out_of_range_on_the_fast_path_raises_on_every_rank(pool, bad, nested):
    """The checking pass notes which inputs an op checked as index tensors (`ids`, through
    a view, or inside a tuple argument); each local run checks their known range as the op
    would."""
    for path, _ in _expect_values(pool, _fast_path_with_index, 4, nested):
        assert path == "fast"
    _expect_error(
        pool,
        _fast_path_with_index,
        sbp.IndexRangeError,
        bad,
        nested,
        match=f"embedding: indices holds index {bad}, outside [0, 5)",
    )


# ---------------------------------------------------------------- resources


def test_decision_cache_is_least_recently_used(monkeypatch):
    from sbp.ops import registry

    monkeypatch.setattr(registry, "CACHE_SIZE", 2)
    monkeypatch.setattr(registry, "_cache", registry.OrderedDict())
    g = sbp.to_global(torch.ones(3), sbp.placement("cpu", [0]), sbp.broadcast)
    g.neg()
    g.exp()
    g.neg()  # a hit: neg is now the most recently used
    g.sin()  # evicts exp, not neg
    ops = [key[0].overloadpacket for key in registry._cache]
    assert ops == [torch.ops.aten.neg, torch.ops.aten.sin]


def test_staging_buffers_above_the_cap_are_not_kept():
    from sbp.kernels import reference

    sbp.boxing.empty_cache()
    like = torch.ones(1, dtype=torch.float32)
    small = reference.staging(1024, like, "recv")
    big = reference.staging(reference.STAGING_LIMIT // 4 + 1, like, "send")
    kept = {key[0]: buf.numel() for key, buf in reference._staging.items()}
    assert small.numel() == 1024 and big.numel() == reference.STAGING_LIMIT // 4 + 1
    assert kept == {"recv": 1024}
    sbp.boxing.empty_cache()
    assert reference._staging == {}


def _conversions_over_orders(orders, rounds):
    import itertools
    import os
    import resource

    from sbp.comm import groups

    def usage():
        with open("/proc/self/status") as f:
            threads = next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
        fds = len(os.listdir("/proc/self/fd"))
        return fds, threads, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    world = sbp.env.get_world_size()
    logical = torch.arange(24.0).reshape(6, 4)
    before = usage()
    groups_before = groups.count()  # earlier tests in this pool made groups of their own
    for i, ranks in zip(range(rounds), itertools.cycle(orders)):
        P = sbp.placement("cpu", list(ranks))
        me = sbp.env.get_rank()
        local = logical if me in P else torch.empty(0, 4)
        g = sbp.to_global(local, P, sbp.broadcast, check_meta=False, shape=(6, 4))
        h = g.to_global(sbp=sbp.split(i % 2))
        full = h.full_tensor()
        assert me not in P or torch.equal(full, logical)
    after = usage()
    sets = {frozenset(r) for r in orders}
    return before, after, groups.count() - groups_before, len(sets), world


def _rank_orders(world, n):
    import itertools

    orders = []
    for k in range(world, 1, -1):
        for subset in itertools.combinations(range(world), k):
            orders += list(itertools.permutations(subset))
    return orders[:n]


def test_process_groups_are_one_per_rank_set(pool4):
    orders = _rank_orders(4, 30)  # 24 orders of all 4 ranks, then 6 of {0, 1, 2}
    for before, after, n_groups, n_sets, _ in pool4.run(_conversions_over_orders, orders, 30):
        assert n_groups <= n_sets  # one new group per rank set at most
        assert after[0] <= before[0] + 4 * n_sets  # fds: a few per new group at most


@pytest.mark.slow
def test_soak_1000_conversions_over_60_rank_orders(pool4):
    orders = _rank_orders(4, 60)
    assert len(orders) == 60
    for before, after, n_groups, n_sets, _ in pool4.run(
        _conversions_over_orders, orders, 1000, timeout=600
    ):
        fds, threads, rss = (a - b for a, b in zip(after, before, strict=True))
        print(f"groups {n_groups}, fds {before[0]}->{after[0]}, threads {before[1]}->{after[1]}")
        print(f"max RSS {before[2] // 1024}->{after[2] // 1024} MiB")
        assert n_groups <= n_sets
        assert fds <= 4 * n_sets
        assert threads <= 4 * n_sets
        assert rss < 200 * 1024  # KiB


def _embedding(rank, world, sparse):
    w = torch.nn.Parameter(sbp.to_global(torch.ones(6, 2), _all(world), sbp.broadcast))
    ids = sbp.to_global(torch.tensor([[0, 2], [5, 3]]), _all(world), sbp.broadcast)
    torch.nn.functional.embedding(ids, w, sparse=sparse).sum().backward()
    return w.grad.full_tensor().tolist()


def test_sparse_embedding_names_its_argument(pool):
    """(Before: torch's 'unsupported memory format option Contiguous' in backward, from
    sbp's gradient hook making the sparse gradient contiguous.) The dense one first: a
    worker's first embedding takes a second (imports), which is not the error's time."""
    for got in _expect_values(pool, _embedding, False):
        assert got == [[1.0, 1.0], [0.0, 0.0], [1.0, 1.0], [1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]
    _expect_error(pool, _embedding, sbp.InputValueError, True, match="sparse=True")
