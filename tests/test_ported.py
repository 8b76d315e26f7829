"""Test cases of the peer projects, ported to sbp's API and run on 4 ranks.

Each case names its source file. Expected values are the peer test's own literals or the
single-process torch result on the logical tensors, never sbp's. Mapping: OneFlow's
`flow.placement(..., ranks)` / `to_global` / `sbp.*` are ours by name; DTensor's
`distribute_tensor(t, mesh, [Shard(d)])` is `sbp.tensor(t, P, split(d))`, `Replicate` is
`broadcast`, `Partial` is `partial_sum`, `redistribute` is `to_global(sbp=...)`,
`CommDebugMode` is `sbp.comm_stats()`.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import sbp

S0, S1, S2, B, P = sbp.split(0), sbp.split(1), sbp.split(2), sbp.broadcast, sbp.partial_sum
WORLD = 4


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ================================================================ OneFlow
# Oneflow-Inc/oneflow python/oneflow/test/modules/test_eager_boxing.py: every rank holds its own
# 4x4 array; a tensor on ranks [0, 1] (or [0, 1, 3]) moves to ranks [2, 3].

ONEFLOW_ARRAYS = [
    [[4, 6, 5, 20], [6, 8, 9, 0], [3, 7, 5, 0], [6, 8, 9, 0]],
    [[2, 10, 10, 7], [3, 9, 10, 5], [4, 6, 6, 9], [6, 8, 6, 4]],
    [[9, 6, 5, 8], [4, 9, 7, 0], [2, 5, 7, 9], [6, 8, 10, 0]],
    [[9, 4, 5, 8], [7, 2, 9, 5], [6, 3, 9, 2], [3, 7, 5, 8]],
]
R0_R1 = ONEFLOW_ARRAYS[0] + ONEFLOW_ARRAYS[1]  # rows of ranks 0 and 1, split(0) logical
# (name, source ranks, first sbp, optional intermediate sbp, target sbp, rank 2 local, rank 3 local)
EAGER_BOXING = {
    "non_overlapping_p_to_s1": (
        [0, 1],
        P,
        None,
        S1,
        [[6, 16], [9, 17], [7, 13], [12, 16]],
        [[15, 27], [19, 5], [11, 9], [15, 4]],
    ),
    "non_overlapping_b_to_s1": (
        [0, 1],
        B,
        None,
        S1,
        [[4, 6], [6, 8], [3, 7], [6, 8]],
        [[5, 20], [9, 0], [5, 0], [9, 0]],
    ),
    "non_overlapping_s0_to_s1": (
        [0, 1],
        S0,
        None,
        S1,
        [[4, 6], [6, 8], [3, 7], [6, 8], [2, 10], [3, 9], [4, 6], [6, 8]],
        [[5, 20], [9, 0], [5, 0], [9, 0], [10, 7], [10, 5], [6, 9], [6, 4]],
    ),
    "non_overlapping_s1_to_s1": (
        [0, 1],
        S0,
        S1,
        S1,
        [[4, 6], [6, 8], [3, 7], [6, 8], [2, 10], [3, 9], [4, 6], [6, 8]],
        [[5, 20], [9, 0], [5, 0], [9, 0], [10, 7], [10, 5], [6, 9], [6, 4]],
    ),
    "non_overlapping_s1_to_s0": (
        [0, 1],
        S0,
        S1,
        S0,
        ONEFLOW_ARRAYS[0],
        ONEFLOW_ARRAYS[1],
    ),
    "non_overlapping_s1_to_b": ([0, 1], S0, S1, B, R0_R1, R0_R1),
    "overlapping_p_to_s1": (
        [0, 1, 3],
        P,
        None,
        S1,
        [[15, 20], [16, 19], [13, 16], [15, 23]],
        [[20, 35], [28, 10], [20, 11], [20, 12]],
    ),
    "overlapping_b_to_s1": (
        [0, 1, 3],
        B,
        None,
        S1,
        [[4, 6], [6, 8], [3, 7], [6, 8]],
        [[5, 20], [9, 0], [5, 0], [9, 0]],
    ),
}


def _eager_boxing(name):
    src_ranks, first, middle, target, _, _ = EAGER_BOXING[name]
    me = sbp.env.get_rank()
    x = torch.tensor(ONEFLOW_ARRAYS[me], dtype=torch.float32)
    placement = sbp.placement("cpu", src_ranks)
    g = x.to_global(placement, first)
    if middle is not None:
        g = g.to_global(placement, middle)
    new_placement = sbp.placement("cpu", [2, 3])
    y = g.to_global(new_placement, target)
    return y.placement == new_placement, y.to_local().numpy()


@pytest.mark.parametrize("name", list(EAGER_BOXING))
def test_oneflow_eager_boxing(pool4, name):
    *_, rank2, rank3 = EAGER_BOXING[name]
    results = pool4.run(_eager_boxing, name)
    assert all(placed for placed, _ in results)
    assert np.array_equal(results[2][1], np.array(rank2, dtype=np.float32))
    assert np.array_equal(results[3][1], np.array(rank3, dtype=np.float32))


def _eager_boxing_s1_to_p():
    # test_eager_boxing.py, _test_eager_boxing_with_non_overlapping_placement_s1_to_p
    me = sbp.env.get_rank()
    x = torch.tensor(ONEFLOW_ARRAYS[me], dtype=torch.float32)
    placement = sbp.placement("cpu", [0, 1])
    y = x.to_global(placement, S0).to_global(placement, S1)
    z = y.to_global(sbp.placement("cpu", [2, 3]), P)
    return z.to_local().numpy(), z.full_tensor().numpy()


def test_oneflow_eager_boxing_s1_to_p(pool4):
    results = pool4.run(_eager_boxing_s1_to_p)
    assert np.array_equal(results[2][0], np.array(R0_R1, dtype=np.float32))
    assert np.array_equal(results[3][0], np.zeros((8, 4), dtype=np.float32))
    assert np.array_equal(results[2][1], np.array(R0_R1, dtype=np.float32))


# Oneflow-Inc/oneflow python/oneflow/test/modules/test_module_to_global_or_local.py


def _module_to_global_shared():
    me = sbp.env.get_rank()
    placement = sbp.placement("cpu", [0, 1])

    class ReuseVarModule(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear1 = torch.nn.Linear(3, 4)
            self.linear2 = torch.nn.Linear(3, 4)
            self.linear2.weight = self.linear1.weight

    m = ReuseVarModule()
    before = (m.linear1.weight is m.linear2.weight, m.linear1.bias is not m.linear2.bias)
    m.to_global(placement=placement, sbp=B)
    after = (
        m.linear1.weight is m.linear2.weight,
        m.linear1.weight.placement == placement and m.linear1.weight.sbp[0] == B,
        m.linear1.bias is not m.linear2.bias,
        m.linear1.bias.placement == placement and m.linear1.bias.sbp[0] == B,
    )
    return before, after, me


def test_oneflow_module_to_global(pool4):
    for before, after, _ in pool4.run(_module_to_global_shared):
        assert before == (True, True) and after == (True, True, True, True)


def _module_to_global_resplit():
    placement = sbp.placement("cpu", [0, 1])
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 4, False)
    torch.nn.init.uniform_(m.weight)
    m.to_global(placement=placement, sbp=B)
    origin = m.weight.numpy()
    m.to_global(placement=placement, sbp=S0)  # re-box a global module
    return origin, m.weight.sbp, m.weight.numpy(), m.weight.to_local().detach().numpy()


def test_oneflow_module_to_global_resplits_a_global_module(pool4):
    results = pool4.run(_module_to_global_resplit)
    origin = results[0][0]
    for rank, (orig, sbp_, value, local) in enumerate(results[:2]):
        assert np.array_equal(orig, origin) and sbp_ == (S0,)
        assert np.array_equal(value, origin)
        assert np.array_equal(local, origin[:2] if rank == 0 else origin[2:])


# Oneflow-Inc/oneflow python/oneflow/test/modules/test_global_stateful_kernel_with_cache.py


def _stateful_slice(nd):
    x = torch.arange(64).reshape(8, 8).to_global(sbp.placement.all("cpu"), B)
    x = x.to_global(sbp.placement("cpu", [[0, 1], [2, 3]]), nd)
    y = x[0:3, 0:1]
    z = x.to_global(sbp.placement.all("cpu"), S1)[0:3, 0:1]
    return y.numpy(), z.numpy()


@pytest.mark.parametrize("nd", [(B, B), (S0, S1), (S1, S0), (P, S0), (S1, S1)])
def test_oneflow_global_slice_with_any_layout(pool4, nd):
    for y, z in pool4.run(_stateful_slice, nd):
        assert np.array_equal(y, np.array([[0], [8], [16]]))
        assert np.array_equal(z, np.array([[0], [8], [16]]))


# Oneflow-Inc/oneflow python/oneflow/test/modules/test_stateful_local_opkernel.py


def _slice_assign():
    rank = sbp.env.get_rank()
    placement = sbp.placement("cpu", [0, 1])
    x = torch.tensor([1, 2]) * (rank + 1)
    x = x.to_global(placement, S0)
    y = torch.tensor([3, 4, 5]).to_global(placement, B)
    x[:3] = y
    x = x.to_global(sbp=B)
    return x.to_local().numpy()


def test_oneflow_slice_assign_on_a_split_tensor(pool4):
    for rank, local in enumerate(pool4.run(_slice_assign)):
        if rank < 2:
            assert np.array_equal(local, np.array([3, 4, 5, 4]))


# ================================================================ DTensor
# pytorch/pytorch test/distributed/tensor/test_redistribute.py (world size 4)

SHARD_SIZES = [
    ((WORLD * 3, 3), 0),
    ((WORLD * 3 + 1, 3), 0),
    ((WORLD * 3 + 2, 3), 0),
    ((3, WORLD * 3), 1),
    ((3, WORLD * 3 + 1), 1),
    ((3, WORLD * 3 + 2), 1),
]


def _shard_to_replicate():
    mesh = sbp.placement.all("cpu")
    out = []
    for i, (size, dim) in enumerate(SHARD_SIZES):
        expected = _randn(*size, seed=i)
        dt = sbp.tensor(expected, mesh, sbp.split(dim), requires_grad=True)
        with sbp.comm_stats() as fwd:
            reshard = dt.to_global(sbp=B)
        with sbp.comm_stats() as bwd:
            reshard.backward(torch.ones_like(reshard))
        out.append(
            (
                tuple(reshard.shape),
                reshard.to_local(),
                fwd.by_kind["all_gather"],
                dt.grad.sbp,
                dt.grad.to_local(),
                tuple(dt.to_local().shape),
                bwd.calls,
            )
        )
    return out


def test_dtensor_shard_to_replicate_forward_backward(pool4):
    for r in pool4.run(_shard_to_replicate):
        for i, (size, dim) in enumerate(SHARD_SIZES):
            shape, local, gathers, grad_sbp, grad, local_shape, bwd_calls = r[i]
            assert shape == size and gathers == 1
            assert torch.equal(local, _randn(*size, seed=i))
            assert grad_sbp == (sbp.split(dim),) and bwd_calls == 0
            assert torch.equal(grad, torch.ones(local_shape, dtype=torch.float64))


def _replicate_and_partial_round_trips():
    mesh = sbp.placement.all("cpu")
    local_tensor = _randn(12, 3)
    out = {}
    # replicate -> replicate: no communication either way
    rep = sbp.tensor(local_tensor, mesh, B, requires_grad=True)
    with sbp.comm_stats() as st:
        again = rep.to_global(mesh, B)
        again.backward(torch.ones_like(again))
    out["r2r"] = (again.to_local(), rep.grad.sbp, rep.grad.to_local(), st.calls)
    # partial -> partial: a no-op forward and backward
    partial_local = torch.ones(12, 3, dtype=torch.float64)
    part = partial_local.to_global(mesh, P).detach().requires_grad_()
    grad_output = torch.ones(12, 3, dtype=torch.float64).to_global(mesh, P)
    with sbp.comm_stats() as st:
        again = part.to_global(mesh, P)
        again.backward(grad_output)
    out["p2p"] = (again.to_local(), part.grad.sbp, part.grad.to_local(), st.calls)
    # replicate -> shard: forward slices, backward all-gathers the gradient
    fwd_bwd = []
    for i, (size, dim) in enumerate(SHARD_SIZES):
        replica = sbp.tensor(_randn(*size, seed=i), mesh, B, requires_grad=True)
        with sbp.comm_stats() as fwd:
            reshard = replica.to_global(mesh, sbp.split(dim))
        with sbp.comm_stats() as bwd:
            reshard.backward(torch.ones_like(reshard))
        fwd_bwd.append(
            (reshard.sbp, reshard.to_local(), fwd.calls, replica.grad.sbp, replica.grad.to_local())
            + (bwd.calls,)
        )
    out["r2s"] = fwd_bwd
    # partial -> replicate: all-reduce; the local tensor's gradient is the replicated one
    partial_local = torch.ones(12, 3, dtype=torch.float64, requires_grad=True)
    with sbp.comm_stats() as fwd:
        whole = partial_local.to_global(mesh, P).to_global(mesh, B)
    with sbp.comm_stats() as bwd:
        whole.backward(torch.ones_like(whole))
    out["p2r"] = (whole.to_local(), fwd.by_kind["all_reduce"], partial_local.grad, bwd.calls)
    return out


def test_dtensor_replicate_and_partial_redistribute(pool4):
    for rank, out in enumerate(pool4.run(_replicate_and_partial_round_trips)):
        value, grad_sbp, grad, calls = out["r2r"]
        assert torch.equal(value, _randn(12, 3)) and grad_sbp == (B,) and calls == 0
        assert torch.equal(grad, torch.ones(12, 3, dtype=torch.float64))
        value, grad_sbp, grad, calls = out["p2p"]
        assert torch.equal(value, torch.ones(12, 3, dtype=torch.float64))
        assert grad_sbp == (P,) and calls == 0
        assert torch.equal(grad, torch.ones(12, 3, dtype=torch.float64))
        for i, (size, dim) in enumerate(SHARD_SIZES):
            out_sbp, local, fwd_calls, grad_sbp, grad, bwd_calls = out["r2s"][i]
            shard = _randn(*size, seed=i)[
                tuple(
                    sbp.local_slices(
                        size, sbp.placement("cpu", list(range(WORLD))), sbp.split(dim), rank
                    )
                )
            ]
            assert out_sbp == (sbp.split(dim),) and torch.equal(local, shard) and fwd_calls == 0
            assert grad_sbp == (B,) and torch.equal(grad, torch.ones(size, dtype=torch.float64))
            assert bwd_calls == 1
        value, reduces, grad, bwd_calls = out["p2r"]
        assert torch.equal(value, torch.ones(12, 3, dtype=torch.float64) * WORLD)
        assert reduces == 1 and bwd_calls == 0
        assert torch.equal(grad, torch.ones(12, 3, dtype=torch.float64))


# pytorch/pytorch test/distributed/tensor/test_matrix_ops.py

SPECS = {"S0": S0, "S1": S1, "R": B}


def _addmm_and_mm():
    mesh = sbp.placement.all("cpu")
    out = {}
    mat1, mat2, bias = _randn(12, 8, seed=1), _randn(8, 4, seed=2), _randn(4, seed=3)
    dist_res = torch.addmm(
        sbp.tensor(bias, mesh, B), sbp.tensor(mat1, mesh, S0), sbp.tensor(mat2, mesh, B)
    )
    out["addmm"] = dist_res.to_global(sbp=B).to_local()
    # test_addmm_auto_redistribute: mat1 split(1), mat2 split(0): the product is partial
    m1 = sbp.tensor(mat1, mesh, S1, requires_grad=True)
    m2 = sbp.tensor(mat2, mesh, S0, requires_grad=True)
    res = torch.addmm(sbp.tensor(bias, mesh, B), m1, m2)
    replica = res.to_global(sbp=B).to_local()
    replica.sum().backward()
    out["addmm_auto"] = (res.sbp, replica, m2.grad.full_tensor())
    t1, t2 = _randn(12, 8, seed=4), _randn(8, 16, seed=5)
    for (n1, s1), (n2, s2) in itertools.product(SPECS.items(), SPECS.items()):
        d1 = sbp.tensor(t1, mesh, s1, requires_grad=True)
        d2 = sbp.tensor(t2, mesh, s2)
        r = torch.mm(d1, d2).to_global(sbp=B)
        r.backward(torch.ones_like(r))
        out["mm", n1, n2] = (r.to_local(), d1.grad.full_tensor())
    # test_t and test_t_partial
    mat = sbp.tensor(mat1, mesh, S0)
    out["t"] = (tuple(mat.t().shape), mat.t().sbp, tuple(mat.t().t().shape), mat.t().t().sbp)
    a, b = _randn(12, 8, seed=6), _randn(8, 4, seed=7)
    dc = torch.mm(sbp.tensor(a, mesh, S1), sbp.tensor(b, mesh, S0)).t()
    out["t_partial"] = (dc.sbp, dc.to_global(sbp=B).to_local())
    # test_bmm over every pair of placements
    b1, b2 = _randn(4, 8, 4, seed=8).abs(), _randn(4, 4, 8, seed=9).abs()
    bmm_specs = {"S0": S0, "S1": S1, "S2": S2, "R": B}
    for (n1, s1), (n2, s2) in itertools.product(bmm_specs.items(), bmm_specs.items()):
        d1 = sbp.tensor(b1, mesh, s1, requires_grad=True)
        r = torch.bmm(d1, sbp.tensor(b2, mesh, s2)).to_global(sbp=B)
        r.backward(torch.ones_like(r))
        out["bmm", n1, n2] = (r.to_local(), d1.grad.to_global(sbp=B).to_local())
    return out


def test_dtensor_matrix_ops(pool4):
    mat1, mat2, bias = _randn(12, 8, seed=1), _randn(8, 4, seed=2), _randn(4, seed=3)
    m1, m2 = mat1.clone().requires_grad_(), mat2.clone().requires_grad_()
    local_auto = torch.addmm(bias, m1, m2)
    local_auto.sum().backward()
    t1, t2 = _randn(12, 8, seed=4).requires_grad_(), _randn(8, 16, seed=5)
    mm = torch.mm(t1, t2)
    mm.backward(torch.ones_like(mm))
    a, b = _randn(12, 8, seed=6), _randn(8, 4, seed=7)
    b1, b2 = _randn(4, 8, 4, seed=8).abs().requires_grad_(), _randn(4, 4, 8, seed=9).abs()
    bmm = torch.bmm(b1, b2)
    bmm.backward(torch.ones_like(bmm))
    for out in pool4.run(_addmm_and_mm):
        torch.testing.assert_close(out["addmm"], torch.addmm(bias, mat1, mat2))
        res_sbp, value, grad = out["addmm_auto"]
        assert res_sbp == (P,)
        torch.testing.assert_close(value, local_auto.detach())
        torch.testing.assert_close(grad, m2.grad)
        for n1, n2 in itertools.product(SPECS, SPECS):
            value, grad = out["mm", n1, n2]
            torch.testing.assert_close(value, mm.detach())
            torch.testing.assert_close(grad, t1.grad)
        assert out["t"] == ((8, 12), (S1,), (12, 8), (S0,))
        assert out["t_partial"][0] == (P,)
        torch.testing.assert_close(out["t_partial"][1], torch.mm(a, b).t())
        for n1, n2 in itertools.product(["S0", "S1", "S2", "R"], repeat=2):
            value, grad = out["bmm", n1, n2]
            torch.testing.assert_close(value, bmm.detach())
            torch.testing.assert_close(grad, b1.grad)


# pytorch/pytorch test/distributed/tensor/test_embedding_ops.py

EMBEDDING_CASES = [
    (1, [5, 4], 17, 12, {}),
    (1, [6, 7, 6], 21, 11, {}),
    (1, [8, 6, 5, 4], 23, 13, {}),
    (1, [4], 15, 14, {}),
    (1, [34], 15, 14, {"padding_idx": 10}),
    (1, [8, 6, 5, 4], 23, 13, {"padding_idx": 12}),
    (0, [5, 12], 16, 22, {}),  # row-wise: values only (DTensor's _MaskPartial is not ours)
    (0, [6, 7, 6], 13, 22, {}),
]


def _embedding_case(shard_dim, input_size, num_embeddings, embedding_dim, kwargs):
    torch.manual_seed(0)
    local = torch.nn.Embedding(num_embeddings, embedding_dim, **kwargs)
    torch.manual_seed(10)
    inp = torch.randint(0, num_embeddings, tuple(input_size))
    target = torch.empty(*inp.size(), embedding_dim).random_(0, 1)
    return local, inp, target


def _embedding(case):
    shard_dim, input_size, num_embeddings, embedding_dim, kwargs = case
    mesh = sbp.placement.all("cpu")
    local, inp, target = _embedding_case(*case)
    sharded = torch.nn.Embedding(num_embeddings, embedding_dim, **kwargs)
    sharded.weight = torch.nn.Parameter(local.weight.detach().clone())
    sharded.to_global(mesh, B)  # local values are the whole weight: place it, then shard it
    sharded.to_global(mesh, sbp.split(shard_dim))
    dist_inp = sbp.tensor(inp, mesh, B)
    with sbp.comm_stats() as fwd:
        dist_output = sharded(dist_inp)
    output = dist_output.full_tensor()
    loss = torch.nn.CrossEntropyLoss()(output, target)
    with sbp.comm_stats() as bwd:
        loss.backward()
    placed = sharded.weight.sbp == (sbp.split(shard_dim),)
    return placed, fwd.calls, bwd.calls, output, sharded.weight.grad.full_tensor()


@pytest.mark.parametrize("case", EMBEDDING_CASES, ids=lambda c: f"shard{c[0]}-{c[1]}-{c[4]}")
def test_dtensor_sharded_embedding(pool4, case):
    local, inp, target = _embedding_case(*case)
    local_output = local(inp)
    torch.nn.CrossEntropyLoss()(local_output, target).backward()
    for placed, fwd_calls, bwd_calls, output, grad in pool4.run(_embedding, case):
        assert placed
        torch.testing.assert_close(output, local_output.detach())
        torch.testing.assert_close(grad, local.weight.grad)
        if case[0] == 1:  # column-wise: no communication either way
            assert fwd_calls == 0 and bwd_calls == 0


# pytorch/pytorch test/distributed/tensor/test_random_ops.py (init ops on sharded tensors):
# the logical value of an in-place init does not depend on the sharding, and shards differ.


def _init_ops():
    mesh = sbp.placement.all("cpu")
    out = {}
    for name, init in {
        "kaiming_uniform_": torch.nn.init.kaiming_uniform_,
        "normal_": lambda t: torch.nn.init.normal_(t, mean=1.5, std=0.8),
        "uniform_": lambda t: torch.nn.init.uniform_(t, 0, 1),
    }.items():
        values = []
        for nd in (S0, S1, B):
            sbp.manual_seed(42)
            t = sbp.empty(8, 16, placement=mesh, sbp=nd, dtype=torch.float64)
            init(t)
            values.append((t.sbp, t.to_local(), t.full_tensor()))
        out[name] = values
    return out


def test_dtensor_init_ops(pool4):
    results = pool4.run(_init_ops)
    for name in ("kaiming_uniform_", "normal_", "uniform_"):
        ref = torch.empty(8, 16, dtype=torch.float64)
        {"kaiming_uniform_": torch.nn.init.kaiming_uniform_}.get(name, lambda t: t)(ref)
        full = results[0][name][0][2]
        for rank, r in enumerate(results):
            locals_ = []
            for (got_sbp, local, value), nd in zip(r[name], (S0, S1, B), strict=True):
                assert got_sbp == (nd,) and torch.equal(value, full)
                locals_.append(local)
            # shards of different ranks are different draws
            if rank > 0:
                assert not torch.equal(results[0][name][0][1], locals_[0])
        if name == "kaiming_uniform_":  # torch's own bound: gain * sqrt(3 / fan_in)
            bound = ref.abs().max().item()
            assert full.abs().max() <= (3 / 16) ** 0.5 * 2**0.5 and full.abs().max() > 0.5 * bound
