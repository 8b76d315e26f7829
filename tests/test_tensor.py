"""The GlobalTensor surface users touch: metadata, logical values, repr, containers, modules."""

import numpy as np
import pytest
import torch

import sbp

S0, S1, B, P = sbp.split(0), sbp.split(1), sbp.broadcast, sbp.partial_sum


def test_import_adds_methods_and_plain_tensors_are_not_global():
    assert hasattr(torch.Tensor, "to_global") and hasattr(torch.nn.Module, "to_global")
    assert torch.zeros(1).is_global is False


def _raises_placement_error(fn):
    try:
        fn()
    except sbp.PlacementError as e:
        return str(e)
    return "no error"


def _surface():
    me = sbp.env.get_rank()
    Pl = sbp.placement("cpu", [0, 1, 2])
    value = torch.arange(10.0).reshape(5, 2)
    g = sbp.tensor(value, Pl, S0)
    with sbp.comm_stats() as st:
        text = repr(g)
        str(g)
    out = {
        "meta": (tuple(g.shape), g.dtype, g.placement, g.sbp, g.is_global, g.device.type),
        "repr_calls": st.calls,
        "repr": text,
        "tolist": g.tolist(),
        "numpy": g.numpy(),
        "item": g.sum().item() if me in Pl else _raises_placement_error(g.sum().item),
        "format": format(g.sum(), ".2f") if me in Pl else None,
        "local": g.to_local().tolist(),
        "nested": None,
    }
    batch = {"x": torch.ones(2, 3) * me, "pair": (torch.zeros(1), [torch.ones(4)]), "n": 3}
    nested = sbp.to_global(batch, Pl, B)
    out["nested"] = (
        type(nested["pair"]).__name__,
        type(nested["pair"][1]).__name__,
        nested["n"],
        nested["x"].is_global,
        nested["pair"][1][0].sbp,
        nested["x"].to_local().tolist(),  # broadcast synced from the placement's first rank
    )
    return out


def test_global_tensor_surface(pool4):
    value = torch.arange(10.0).reshape(5, 2)
    for rank, r in enumerate(pool4.run(_surface)):
        shape, dtype, placement, sbp_, is_global, device = r["meta"]
        assert shape == (5, 2) and dtype == torch.float32 and is_global and device == "cpu"
        assert placement == sbp.placement("cpu", [0, 1, 2]) and sbp_ == (S0,)
        assert r["repr_calls"] == 0  # repr never communicates
        assert "sbp=(S(0))" in r["repr"] and "placement=" in r["repr"]
        assert r["nested"][:5] == ("tuple", "list", 3, True, (B,))
        if rank == 3:  # outside the placement: metadata only
            assert "rank 3 is outside" in r["item"] and r["tolist"] == []
            continue
        assert r["tolist"] == value.tolist()
        assert np.array_equal(r["numpy"], value.numpy())
        assert r["item"] == 45.0 and r["format"] == "45.00"
        assert r["local"] == value[sbp.local_slices((5, 2), placement, S0, rank)].tolist()
        assert r["nested"][5] == [[0.0] * 3] * 2


def _to_local_autograd():
    Pl = sbp.placement("cpu", [0, 1])
    w = sbp.tensor(torch.arange(6.0).reshape(3, 2), Pl, S1, requires_grad=True)
    (w.to_local() * 3).sum().backward()
    return w.grad.sbp, w.grad.full_tensor().tolist()


def test_to_local_is_differentiable_and_grad_has_leaf_sbp(pool4):
    for rank, (grad_sbp, grad) in enumerate(pool4.run(_to_local_autograd)):
        assert grad_sbp == (S1,)
        if rank < 2:
            assert grad == [[3.0, 3.0]] * 3


def _module_to_global():
    Pl = sbp.placement("cpu", [0, 1])
    torch.manual_seed(sbp.env.get_rank())  # ranks initialise differently on purpose
    lin = torch.nn.Linear(3, 3)
    model = torch.nn.Sequential(lin, torch.nn.ReLU(), lin, torch.nn.BatchNorm1d(3))
    out = model.to_global(Pl, B)
    params = list(model.parameters())
    return (
        out is model,
        len(params),
        model[0].weight is model[2].weight,
        all(isinstance(p, torch.nn.Parameter) and p.is_global for p in params),
        model[3].running_mean.is_global,
        model[0].weight.to_local(),
    )


def test_module_to_global_syncs_shares_and_converts_buffers(pool4):
    results = pool4.run(_module_to_global)
    for same, n, shared, params_global, buffers_global, _ in results:
        assert same and n == 4 and shared and params_global and buffers_global
    assert torch.equal(results[0][5], results[1][5])  # rank 1 took rank 0's initialisation


SIZES = (5, 5, 4, 4)


def _nested_batch():
    """A batch of inputs and labels, uneven along dim 0, made global in one call."""
    me = sbp.env.get_rank()
    Pl = sbp.placement.all("cpu")
    n = SIZES[me]  # uneven, as split(0) balances 18 samples
    x = torch.arange(n * 2, dtype=torch.float64).reshape(n, 2) + 100 * me
    y = torch.arange(n) + 10 * me
    with sbp.comm_stats() as st:
        gx, (gy, label) = sbp.to_global((x, (y, "labels")), Pl, S0)
    try:  # the second tensor's ndim does not fit split(1): named on every rank
        sbp.to_global([x, y], Pl, S1)
        error = None
    except sbp.SbpError as e:
        error = (type(e).__name__, str(e))
    return {
        "calls": st.calls,
        "x": (tuple(gx.shape), gx.dtype, gx.full_tensor().tolist()),
        "y": (tuple(gy.shape), gy.dtype, gy.full_tensor().tolist()),
        "label": label,
        "error": error,
    }


def test_nested_to_global_exchanges_metadata_once(pool4):
    xs = [
        torch.arange(n * 2, dtype=torch.float64).reshape(n, 2) + 100 * r
        for r, n in enumerate(SIZES)
    ]
    ys = [torch.arange(n) + 10 * r for r, n in enumerate(SIZES)]
    for r in pool4.run(_nested_batch):
        assert r["calls"] == 1  # one metadata exchange for both tensors
        assert r["x"] == ((18, 2), torch.float64, torch.cat(xs).tolist())
        assert r["y"] == ((18,), torch.int64, torch.cat(ys).tolist())
        assert r["label"] == "labels"
        assert r["error"] == (
            "SbpSignatureError",
            "sbp split dim 1 is out of range for a tensor with 1 dims",
        )


def test_copy_between_global_tensors_laid_out_alike():
    """Local to local without dispatch, yet a write like any other: the range learnt by
    to_global is forgotten, autograd sees the new version, a leaf that requires grad refuses."""
    from sbp.tensor import known_range

    Pl = sbp.placement.all("cpu")
    y = sbp.to_global(torch.tensor([3, 1, 4]), Pl, B)
    y.copy_(sbp.to_global(torch.tensor([7, 8, 9]), Pl, B))
    assert y.to_local().tolist() == [7, 8, 9] and known_range(y) is None
    w = sbp.to_global(torch.ones(3, dtype=torch.float64), Pl, B).requires_grad_()
    saved = sbp.to_global(torch.full((3,), 2.0, dtype=torch.float64), Pl, B)
    out = (w * saved).sum()
    saved.copy_(sbp.to_global(torch.zeros(3, dtype=torch.float64), Pl, B))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        w.copy_(sbp.to_global(torch.zeros(3, dtype=torch.float64), Pl, B))


@pytest.mark.parametrize("alias", ["detach", "data", "view"])
def test_a_write_through_an_alias_forgets_the_range(alias):
    """`y.detach()`, `y.data` and views share y's storage: a write through them forgets y's
    range too, or the loss would trust a range its labels no longer have (it skipped the
    count of ignored labels and divided by 3, not by the labels left)."""
    import torch.nn.functional as F

    from sbp.tensor import known_range

    Pl = sbp.placement.all("cpu")
    logits = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = sbp.to_global(torch.tensor([3, 1, 2]), Pl, B)
    assert known_range(y) == (1, 3)
    other = {"detach": y.detach, "data": lambda: y.data, "view": lambda: y[1:]}[alias]()
    other.fill_(-100)  # ignore_index
    assert known_range(y) is None
    want = F.cross_entropy(logits, y.to_local())
    got = F.cross_entropy(sbp.to_global(logits, Pl, B), y)
    assert torch.allclose(got.to_local(), want, equal_nan=True)


def test_a_write_forgets_the_range_learnt_by_to_global():
    """Labels' range from to_global lets a loss skip a collective; any write through the
    global tensor, list ops included, forgets it (on every rank alike)."""
    from sbp.tensor import known_range

    Pl = sbp.placement.all("cpu")
    y = sbp.to_global(torch.tensor([3, 1, 4]), Pl, B)
    assert known_range(y) == (1, 4)
    torch._foreach_add_([y], 1)
    assert known_range(y) is None and y.to_local().tolist() == [4, 2, 5]
    y = sbp.to_global(torch.tensor([3, 1, 4]), Pl, B)
    y.add_(1)
    assert known_range(y) is None


def test_to_global_in_a_world_of_one_checks_without_an_exchange():
    """With one rank there is nothing to exchange; the local tensor is the logical one, and
    a bad shape= or sbp still raises its named error."""
    from sbp.tensor import known_range

    assert sbp.env.get_world_size() == 1
    Pl = sbp.placement("cpu", [0])
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.tensor([2, 0, 1, 2])
    with sbp.comm_stats() as st:
        gx, gy = sbp.to_global((x, y), Pl, S0)
    assert st.calls == 0
    assert torch.equal(gx.full_tensor(), x) and gx.shape == (4, 3) and gx.sbp == (S0,)
    assert known_range(gy) == (0, 2)
    assert sbp.to_global(x, Pl, B, shape=(4, 3)).shape == (4, 3)
    with pytest.raises(sbp.MetaMismatchError, match="does not match shape="):
        sbp.to_global(x, Pl, S0, shape=(5, 3))
    with pytest.raises(sbp.SbpSignatureError, match="out of range"):
        sbp.to_global(x, Pl, sbp.split(2))


# (max.dim's backward scatters through the fallback that runs on broadcast inputs: whole here)
@pytest.mark.filterwarnings("ignore:sbp. no SBP rule for aten.scatter")
def test_a_local_scatter_buffer_is_trusted_only_inside_backward():
    """torch 2.11's max.dim backward scatters into a local zeros buffer, which sbp takes as
    broadcast inside torch's backward only; a user's local buffer is still an error."""
    Pl = sbp.placement("cpu", [0])
    index = sbp.to_global(torch.tensor([[0], [2]]), Pl, B)
    src = sbp.to_global(torch.ones(2, 1, dtype=torch.float64), Pl, B)
    with pytest.raises(sbp.PlacementError, match="mixes global tensors with a local"):
        torch.zeros(2, 3, dtype=torch.float64).scatter(1, index, src)
    x = torch.randn(2, 3, dtype=torch.float64)
    g = sbp.to_global(x.clone(), Pl, B).requires_grad_()
    g.max(dim=1).values.sum().backward()
    want = torch.zeros_like(x).scatter(1, x.argmax(dim=1, keepdim=True), 1.0)
    assert torch.equal(g.grad.full_tensor(), want)


def _rebind_counts():
    from sbp.counters import COUNTS
    from sbp.tensor import watch

    Pl = sbp.placement("cpu", [0])
    a, b = (sbp.tensor(torch.full((2,), v), Pl, B) for v in (1.0, 2.0))
    counts = []

    def counted(change):
        before = COUNTS.rebinds
        change()
        counts.append(COUNTS.rebinds - before)

    counted(lambda: setattr(a, "_spec", a._spec))  # unwatched: not counted
    watch([a, torch.zeros(1)])  # (plain tensors are passed over)
    counted(lambda: setattr(a, "_spec", a._spec))
    counted(lambda: setattr(a, "_local", a._local))
    counted(lambda: setattr(a, "data", b.detach()))
    counted(lambda: setattr(a, "__class__", sbp.GlobalTensor))
    # not rebindings: requires_grad (the fast path reads it every call), other attributes
    counted(lambda: a.requires_grad_())
    counted(lambda: setattr(a, "foo", 1))
    torch.utils.swap_tensors(a, b)  # (swaps every slot, `_watched` too)
    return counts, a._watched


def test_a_rebinding_counts_for_watched_global_tensors_only(pool1):
    """What the fast path's and the optimizer's caches rely on (`sbp.counters.COUNTS.rebinds`): a
    watched global tensor's local, spec, data or class set moves the count, an unwatched
    one's does not, and a tensor stays watched through swap_tensors."""
    counts, a_watched = pool1.run(_rebind_counts)[0]
    assert counts[0] == 0
    assert all(c >= 1 for c in counts[1:5])
    assert counts[5:] == [0, 0]
    assert a_watched


def _copy_across_placements(dst_ranks, dst_nd, src_ranks, src_nd):
    """x.copy_(y) with y on another placement (OneFlow's test_global_tensor.test_copy:
    a PlacementError before), a cast, and the gradient back to y."""
    value = torch.arange(30.0, dtype=torch.float64).reshape(5, 6)
    x = sbp.zeros(5, 6, placement=sbp.placement("cpu", dst_ranks), sbp=dst_nd, dtype=torch.float32)
    y = sbp.tensor(value, sbp.placement("cpu", src_ranks), src_nd, requires_grad=True)
    x.copy_(y * 2)
    (
        x * torch.linspace(0, 1, 6, dtype=torch.float32).to_global(x.placement, (B,) * len(x.sbp))
    ).sum().backward()
    me = sbp.env.get_rank()
    full = x.full_tensor() if me in x.placement else None
    grad = y.grad.full_tensor() if me in y.placement else None
    return tuple(x.sbp), x.placement.ranks, x.dtype, full, grad


@pytest.mark.parametrize(
    "dst_ranks, dst_nd, src_ranks, src_nd",
    [
        ([0, 1], (B,), [0], (B,)),
        ([0, 1], (S0,), [2, 3], (S1,)),
        ([3, 1, 2], (S1,), [0, 1, 2, 3], (P,)),
        ([[0, 1], [2, 3]], (S0, B), [1, 3], (S0,)),
    ],
)
def test_copy_from_another_placement(pool4, dst_ranks, dst_nd, src_ranks, src_nd):
    value = torch.arange(30.0, dtype=torch.float64).reshape(5, 6)
    want_grad = (2 * torch.linspace(0, 1, 6, dtype=torch.float32)).double().expand(5, 6)
    for nd, ranks, dtype, full, grad in pool4.run(
        _copy_across_placements, dst_ranks, dst_nd, src_ranks, src_nd
    ):
        assert nd == dst_nd and ranks == dst_ranks and dtype == torch.float32
        if full is not None:  # (ranks of the placement hold it)
            torch.testing.assert_close(full, (value * 2).float(), rtol=0, atol=0)
        if grad is not None:
            torch.testing.assert_close(grad, want_grad, rtol=1e-6, atol=1e-7)
