"""How global tensors meet the rest of torch (issue 9): ops with no meta kernel, comm stats,
leaf gradients, no-op conversions, module re-boxing, in-place init, allocation ops, ranks
outside a placement, and the first op not importing torch._dynamo. Expected values come from
single-process torch on the logical tensors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sbp

S0, S1, B, P = sbp.split(0), sbp.split(1), sbp.broadcast, sbp.partial_sum
ROOT = Path(__file__).resolve().parent.parent


def _logical(shape, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype)


# ---------------------------------------------------------------- item 11: first op


def test_first_op_does_not_import_dynamo():
    """Meta kernels wrapped in torch._disable_dynamo used to import torch._dynamo (~4 s)."""
    code = (
        "import sys, torch, sbp\n"
        "P = sbp.placement.all('cpu')\n"
        "x = sbp.to_global(torch.ones(4, 3), P, sbp.split(0))\n"
        "y = (x + 1) * x - x.sum(0) / 2\n"
        "z = (x @ x.t()).softmax(-1).mean()\n"
        "print(round(z.item(), 6), 'torch._dynamo' in sys.modules)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    value, dynamo = out.stdout.split()
    x = torch.ones(4, 3)
    assert float(value) == round((x @ x.t()).softmax(-1).mean().item(), 6)
    assert dynamo == "False"


# ---------------------------------------------------------------- item 3: no meta kernel


def _no_meta_ops():
    Pl = sbp.placement("cpu", [0, 1, 2])  # rank 3 is outside
    a = _logical((5, 4))
    b = a.clone()
    b[4, 3] += 1
    ga, gb = sbp.tensor(a, Pl, S0), sbp.tensor(b, Pl, S1)
    ga2 = sbp.tensor(a, Pl, B)
    nz = torch.nonzero(ga > 0.5)
    ms = torch.masked_select(ga, ga > 0)
    return (
        ga.equal(ga2),
        torch.equal(ga, gb),
        (tuple(nz.shape), nz.sbp, nz.tolist()),
        (tuple(ms.shape), ms.dtype, ms.tolist()),
    )


def test_ops_without_meta_kernel_give_the_logical_answer(pool4):
    a = _logical((5, 4))
    b = a.clone()
    b[4, 3] += 1
    nz, ms = torch.nonzero(a > 0.5), torch.masked_select(a, a > 0)
    for rank, (same, differ, got_nz, got_ms) in enumerate(pool4.run(_no_meta_ops)):
        assert got_nz[:2] == (tuple(nz.shape), (B,))  # every rank knows the shape
        assert got_ms[:2] == (tuple(ms.shape), torch.float64)
        if rank == 3:
            continue
        assert same is True and differ is False
        assert got_nz[2] == nz.tolist() and got_ms[2] == ms.tolist()


# ---------------------------------------------------------------- item 7: comm stats


def _stats_of_fallback():
    Pl = sbp.placement("cpu", [0, 1])
    x = sbp.tensor(torch.arange(6.0).reshape(2, 3), Pl, B)
    with sbp.comm_stats() as st:
        y = torch.renorm(x, 2, 0, 5.0)  # no rule, broadcast input: no collective at all
    return st.calls, st.bytes, dict(st.fallbacks), y.tolist()


def test_comm_stats_calls_count_collectives_only(pool4):
    ref = torch.renorm(torch.arange(6.0).reshape(2, 3), 2, 0, 5.0).tolist()
    for rank, (calls, nbytes, fallbacks, y) in enumerate(pool4.run(_stats_of_fallback)):
        if rank < 2:
            assert calls == 0 and nbytes == 0 and y == ref
            assert fallbacks == {"aten.renorm.default": 1}


# ---------------------------------------------------------------- item 4: leaf grads


def _partial_leaf_grads():
    P2 = sbp.placement("cpu", [[0, 1], [2, 3]])
    w = _logical((4, 3), seed=1)
    out = {}
    for name, nd in {"PB": (P, B), "BP": (B, P), "PS1": (P, S1), "PP": (P, P)}.items():
        leaf = sbp.tensor(w, P2, nd, requires_grad=True)
        x = sbp.tensor(_logical((4, 3), seed=2), P2, (B, B))
        with sbp.comm_stats() as st:
            (leaf * x).sin().sum().backward()
        out[name] = (leaf.grad.sbp, leaf.grad.full_tensor(), st.calls)
    # a gradient that arrives partial on every hierarchy dim (a split batch, say)
    g = _logical((4, 3), seed=3)
    for name, nd in {"PB_from_PP": (P, B), "BP_from_PP": (B, P)}.items():
        leaf = sbp.tensor(w, P2, nd, requires_grad=True)
        (leaf * 1.0).backward(sbp.tensor(g, P2, (P, P)))
        out[name] = (leaf.grad.sbp, leaf.grad.full_tensor(), None)
    return out


def test_leaf_grad_takes_the_leaf_sbp_partial_ones_included(pool4):
    w = _logical((4, 3), seed=1).requires_grad_()
    x = _logical((4, 3), seed=2)
    (w * x).sin().sum().backward()
    for r in pool4.run(_partial_leaf_grads):
        for name, nd in {"PB": (P, B), "BP": (B, P), "PS1": (P, S1), "PP": (P, P)}.items():
            got_sbp, got, _ = r[name]
            assert got_sbp == nd, name
            torch.testing.assert_close(got, w.grad)
        for name, nd in {"PB_from_PP": (P, B), "BP_from_PP": (B, P)}.items():
            got_sbp, got, _ = r[name]
            assert got_sbp == nd, name
            torch.testing.assert_close(got, _logical((4, 3), seed=3))


# ---------------------------------------------------------------- item 6: no-op conversions


def _no_op_conversions():
    Pl = sbp.placement("cpu", [0, 1, 2, 3])
    leaf = sbp.tensor(_logical((4, 3)), Pl, P, requires_grad=True)
    with sbp.comm_stats() as st:
        same = leaf.to_global(sbp=P)
        (same * 2.0).backward(sbp.tensor(torch.ones(4, 3, dtype=torch.float64), Pl, P))
    noop = (same is leaf, st.calls, leaf.grad.sbp, leaf.grad.full_tensor())

    weight = _logical((10, 8), seed=4).requires_grad_()
    idx = torch.tensor([[1, 2, 9], [0, 0, 5]])
    w = sbp.tensor(weight.detach(), Pl, S1, requires_grad=True)
    i = sbp.tensor(idx, Pl, B)
    with sbp.comm_stats() as st:
        out = torch.nn.functional.embedding(i, w)
    forward_calls = st.calls
    (out * out).sum().backward()
    return noop, forward_calls, out.sbp, out.full_tensor(), w.grad.sbp, w.grad.full_tensor()


def test_no_op_conversions_and_column_split_embedding_cost_nothing(pool4):
    weight = _logical((10, 8), seed=4).requires_grad_()
    idx = torch.tensor([[1, 2, 9], [0, 0, 5]])
    out = torch.nn.functional.embedding(idx, weight)
    (out * out).sum().backward()
    for noop, calls, out_sbp, got, grad_sbp, grad in pool4.run(_no_op_conversions):
        same, noop_calls, leaf_grad_sbp, leaf_grad = noop
        assert same and noop_calls == 0 and leaf_grad_sbp == (P,)
        torch.testing.assert_close(leaf_grad, torch.full((4, 3), 2.0, dtype=torch.float64))
        assert calls == 0 and out_sbp == (sbp.split(2),) and grad_sbp == (S1,)
        torch.testing.assert_close(got, out.detach())
        torch.testing.assert_close(grad, weight.grad)


# ---------------------------------------------------------------- item 9: allocation ops


def _allocation_ops():
    Pl = sbp.placement("cpu", [0, 1, 2])
    x = sbp.tensor(_logical((5, 4)), Pl, S1)
    p = sbp.tensor(_logical((5, 4)), Pl, P)
    with sbp.comm_stats() as st:
        made = {
            "empty_strided": x.new_empty_strided((5, 4), (4, 1)),
            "empty": x.new_empty((5, 4)),
            "zeros": x.new_zeros((5, 4)),
            "ones_other_shape": x.new_ones((2, 3)),
            "full": x.new_full((5, 4), 7.0),
            "partial": p.new_zeros((5, 4)),
        }
    kept = [made["empty_strided"].sbp, made["empty"].sbp]
    out = {k: (t.sbp, t.full_tensor()) for k, t in made.items() if "empty" not in k}
    calls_for_allocation = st.calls
    # a split leaf whose gradient the caller still holds: autograd copies it into a new buffer
    w = sbp.tensor(_logical((5, 4)), Pl, S1, requires_grad=True)
    g = sbp.tensor(torch.full((5, 4), 3.0, dtype=torch.float64), Pl, S1)
    with sbp.comm_stats() as st:
        w.backward(g)
    calls_for_allocation += st.calls
    return out, kept, calls_for_allocation, w.grad.sbp, w.grad.full_tensor()


def test_allocation_ops_keep_the_layout(pool4):
    for rank, (out, kept, calls, grad_sbp, grad) in enumerate(pool4.run(_allocation_ops)):
        assert kept == [(S1,), (S1,)] and out["partial"][0] == (P,)  # (zeros: a partial sum)
        assert out["zeros"][0] == (S1,) and out["ones_other_shape"][0] == (B,)
        assert grad_sbp == (S1,) and calls == 0
        if rank == 3:
            continue
        assert torch.equal(out["zeros"][1], torch.zeros(5, 4, dtype=torch.float64))
        assert torch.equal(out["ones_other_shape"][1], torch.ones(2, 3, dtype=torch.float64))
        assert torch.equal(out["full"][1], torch.full((5, 4), 7.0, dtype=torch.float64))
        assert torch.equal(out["partial"][1], torch.zeros(5, 4, dtype=torch.float64))
        torch.testing.assert_close(grad, torch.full((5, 4), 3.0, dtype=torch.float64))


# ---------------------------------------------------------------- item 10: outside ranks


def _outside_ranks():
    me = sbp.env.get_rank()
    Pl = sbp.placement("cpu", [0, 1, 2])
    value = _logical((6, 2))
    local = (
        value[tuple(sbp.local_slices((6, 2), Pl, S0, me))]
        if me in Pl
        else torch.zeros(9, dtype=torch.int8)
    )
    out = {}
    for check in (True, False):
        g = sbp.to_global(local, Pl, S0, check_meta=check)
        b = sbp.to_global(
            value if me in Pl else torch.ones(3, dtype=torch.int32), Pl, B, check_meta=check
        )
        out[check] = (tuple(g.shape), g.dtype, tuple(b.shape), b.dtype, g.tolist(), b.tolist())
    return out


def test_ranks_outside_the_placement_take_the_logical_dtype_and_shape(pool4):
    value = _logical((6, 2))
    for rank, out in enumerate(pool4.run(_outside_ranks)):
        for check in (True, False):
            shape, dtype, bshape, bdtype, g, b = out[check]
            assert (shape, dtype, bshape, bdtype) == ((6, 2), torch.float64, (6, 2), torch.float64)
            if rank < 3:
                assert g == value.tolist() and b == value.tolist()


# ---------------------------------------------------------------- item 5: module re-box


def _rebox_module():
    Pl = sbp.placement("cpu", [0, 1])
    P4 = sbp.placement("cpu", [[0, 1], [2, 3]])
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 6).double()
    model = torch.nn.Sequential(lin, torch.nn.BatchNorm1d(6).double(), lin)
    model.to_global(Pl, B)
    out = model.to_global(P4, (B, B))  # another placement: parameters and buffers move
    params = list(model.parameters())
    moved = (
        out is model,
        model[0].weight is model[2].weight,
        all(isinstance(p, torch.nn.Parameter) and p.placement == P4 for p in params),
        model[1].running_var.placement == P4 and model[1].num_batches_tracked.placement == P4,
    )
    torch.manual_seed(0)
    single = torch.nn.Linear(4, 6).double().to_global(Pl, B)
    single.to_global(Pl, S0)  # another sbp: re-split
    x = sbp.tensor(_logical((3, 4)), Pl, B)
    single(x).sum().backward()
    w = single.weight
    return moved, (w.sbp, single.bias.sbp), w.full_tensor(), w.grad.sbp, w.grad.full_tensor()


def test_module_to_global_on_a_global_module_reboxes(pool4):
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 6).double()
    lin(_logical((3, 4))).sum().backward()
    for rank, (moved, sbps, w, grad_sbp, grad) in enumerate(pool4.run(_rebox_module)):
        assert moved == (True, True, True, True)
        assert sbps == ((S0,), (S0,)) and grad_sbp == (S0,)
        if rank < 2:
            torch.testing.assert_close(w, lin.weight.detach())
            torch.testing.assert_close(grad, lin.weight.grad)


def _plain_module_to_global(layout):
    """A plain module made global keeps its logical shape and values whatever the sbp."""
    places = {1: sbp.placement("cpu", [0, 1, 2]), 2: sbp.placement("cpu", [[0, 1], [2, 3]])}
    nd = {
        "S0": (S0,),
        "P": (P,),
        "B,S0": (B, S0),
        "S0,S0": (S0, S0),
        "P,S0": (P, S0),
    }[layout]
    torch.manual_seed(sbp.env.get_rank())  # ranks start different: rank 0's values win
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    model.double().to_global(places[len(nd)], nd)
    x = sbp.tensor(_logical((4, 5)), places[len(nd)], (B,) * len(nd))
    model(x).square().sum().backward()
    return [
        (tuple(p.shape), p.sbp, p.full_tensor(), p.grad.full_tensor()) for p in model.parameters()
    ]


@pytest.mark.parametrize("layout", ["S0", "P", "B,S0", "S0,S0", "P,S0"])
def test_a_plain_module_made_global_keeps_its_model(pool4, layout):
    """`plain_module.to_global(P, split(0))` shards the user's model: each rank's whole
    weight is the logical one (before: each rank's copy was taken as its shard, and
    `Linear(5, 7)` became a (21, 5) weight on 3 ranks)."""
    torch.manual_seed(0)
    want = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    want.double()(_logical((4, 5))).square().sum().backward()
    two_d = "," in layout
    for rank, got in enumerate(pool4.run(_plain_module_to_global, layout)):
        for (shape, nd, value, grad), p in zip(got, want.parameters(), strict=True):
            assert shape == tuple(p.shape)
            assert len(nd) == (2 if two_d else 1)
            if rank == 3 and not two_d:
                continue  # outside the 1-D placement: metadata only
            torch.testing.assert_close(value, p.detach(), rtol=0, atol=0)
            torch.testing.assert_close(grad, p.grad, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- item 2: in-place init


INITS = {
    "normal_": lambda t: torch.nn.init.normal_(t, 0.5, 2.0),
    "uniform_": lambda t: torch.nn.init.uniform_(t, -3.0, 1.0),
    "kaiming_uniform_": lambda t: torch.nn.init.kaiming_uniform_(t, a=5**0.5),
    "trunc_normal_": lambda t: torch.nn.init.trunc_normal_(t, std=0.7, a=-1.0, b=1.0),
}
LAYOUTS = {"S1": ("1d", (S1,)), "B": ("1d", (B,)), "BS0": ("2d", (B, S0)), "PS1": ("2d", (P, S1))}


def _inplace_init():
    # every rank in the placement: trunc_normal_ loops on `mask.any()`, a logical value
    places = {
        "1d": sbp.placement("cpu", [0, 1, 2, 3]),
        "2d": sbp.placement("cpu", [[0, 1], [2, 3]]),
    }
    out = {}
    for name, init in INITS.items():
        for layout, (kind, nd) in LAYOUTS.items():
            sbp.manual_seed(7)
            t = sbp.zeros(40, 30, placement=places[kind], sbp=nd, dtype=torch.float64)
            local_shape = tuple(t.to_local().shape)
            with sbp.comm_stats() as st:
                init(t)
            kept = (t.sbp, tuple(t.to_local().shape) == local_shape, st.calls)
            out[name, layout] = (kept, t.full_tensor())
    return out


def test_inplace_random_init_keeps_the_layout_and_the_value(pool4):
    results = pool4.run(_inplace_init)
    for name, init in INITS.items():
        ref = torch.empty(40, 30, dtype=torch.float64)
        init(ref)  # single-process torch: the distribution and its bounds
        first = results[0][name, "S1"][1]
        for r in results:
            for layout, (_, nd) in LAYOUTS.items():
                (got_sbp, same_local_shape, calls), value = r[name, layout]
                assert got_sbp == nd and same_local_shape, (name, layout)  # (P stays P)
                # trunc_normal_'s rejection loop all-reduces one flag per round, nothing else
                assert calls == 0 or (name == "trunc_normal_" and calls <= 20), (name, calls)
                assert torch.equal(value, first), (name, layout)  # independent of the layout
        lo, hi = ref.min().item(), ref.max().item()
        if name in ("uniform_", "kaiming_uniform_", "trunc_normal_"):  # bounds by torch's formula
            bound = {"uniform_": (-3.0, 1.0), "trunc_normal_": (-1.0, 1.0)}.get(name)
            bound = bound or (-((1 / 30) ** 0.5), (1 / 30) ** 0.5)
            assert bound[0] <= first.min() and first.max() <= bound[1], name
            assert first.min() < lo + 0.1 * (hi - lo) and first.max() > hi - 0.1 * (hi - lo)
        torch.testing.assert_close(first.mean(), ref.mean(), atol=0.15, rtol=0)
        torch.testing.assert_close(first.std(), ref.std(), atol=0.1 * ref.std().item(), rtol=0)


# ---------------------------------------------------------------- item 12: slice assignment

SETITEMS = [
    ((slice(1, 4), 2), 7.0),
    ((slice(None), slice(1, 6, 2)), [1.0, 2.0, 3.0]),
    ((Ellipsis, 0), -1.0),
    ((-1,), [float(v) for v in range(6)]),
    ((slice(0, 5, 3), slice(4, None)), 9.0),
]


def _setitem():
    P2 = sbp.placement("cpu", [[0, 1], [2, 3]])
    out = {}
    for nd in [(S0, S1), (S1, S0), (B, S0), (P, S1), (B, B)]:
        g = sbp.tensor(torch.arange(30.0).reshape(5, 6), P2, nd)
        with sbp.comm_stats() as st:
            for index, value in SETITEMS:
                g[index] = (
                    sbp.tensor(torch.tensor(value), P2, (B, B))
                    if isinstance(value, list)
                    else value
                )
        out[nd] = (g.full_tensor(), g.sbp, st.calls)
    return out


def test_slice_assignment_writes_the_logical_slice(pool4):
    ref = torch.arange(30.0).reshape(5, 6)
    for index, value in SETITEMS:
        ref[index] = torch.tensor(value)
    for out in pool4.run(_setitem):
        for nd, (got, got_sbp, calls) in out.items():
            assert torch.equal(got, ref), nd
            assert got_sbp == nd  # in-place writes keep the layout, a partial one's too
            assert calls == 0, nd  # (along a partial sum, one rank writes, the others 0)


def _masked_number_writes():
    """`x[mask] = number` (torch's path, not the logical slice above) on split, broadcast and
    partial tensors of both number kinds: the number goes as a broadcast constant."""
    P_ = sbp.placement.all("cpu")
    out = []
    for base in (torch.arange(-6, 6).reshape(3, 4), torch.linspace(-1, 1, 12).reshape(3, 4)):
        for nd in (S0, S1, B, P):
            g = sbp.tensor(base, P_, nd)
            g[g < 0] = 0
            g[(g > 0.5) & (g < 4)] = 2.5  # (2 in an integer tensor, as torch truncates)
            g[sbp.tensor(torch.tensor([True, False, True]), P_, B)] = True
            out.append((g.full_tensor(), nd))
    return out


def test_masked_number_assignment(pool2):
    want = []
    for base in (torch.arange(-6, 6).reshape(3, 4), torch.linspace(-1, 1, 12).reshape(3, 4)):
        x = base.clone()
        x[x < 0] = 0
        x[(x > 0.5) & (x < 4)] = 2.5
        x[torch.tensor([True, False, True])] = True
        want += [x] * 4
    for out in pool2.run(_masked_number_writes):
        for (got, nd), x in zip(out, want, strict=True):
            assert torch.equal(got, x), nd


# ---------------------------------------------------------------- rounding of partial sums


def _rounded_partial_sums():
    """Ops that round (or order) a partial sum's value, on a world of 4: each must see the
    sum, not round each rank's part (before: `div(s, 2, rounding_mode='floor')` gave
    [1, 4] where torch gives [1, 5]; `m.sum(dtype=torch.long)` 2 where torch gives 6)."""
    Pl = sbp.placement("cpu", [0, 1, 2, 3])
    x = torch.tensor([[1, 3], [1, 2], [1, 1], [0, 4], [2, 1], [1, 1], [0, 1], [3, 0]])
    s = sbp.tensor(x, Pl, S0).sum(0)  # a partial sum
    a, b = _logical((2, 8), 1), _logical((8, 2), 2) / 3
    m = sbp.tensor(a, Pl, S1) @ sbp.tensor(b, Pl, S0)  # a float partial sum
    ints = sbp.tensor(torch.zeros(2, 2, dtype=torch.long), Pl, S0).sum(0, keepdim=True)
    ints = ints.expand(2, 2).contiguous()
    r = _logical((4, 2), 3)
    pmax = sbp.to_global(r[sbp.env.get_rank()], Pl, sbp.partial_max)
    out = {
        "floor": torch.div(s, 2, rounding_mode="floor"),
        "trunc": torch.div(-s, 4, rounding_mode="trunc"),
        "floordiv": s // 3,
        "float floor": torch.div(
            m * 7, sbp.tensor(torch.tensor([2.0, 3.0]), Pl, B), rounding_mode="floor"
        ),
        "sum long": m.sum(dtype=torch.long),
        "sum0 long": m.sum(0, dtype=torch.long),
        "cumsum long": m.cumsum(0, dtype=torch.long),
        "bool": m.bool(),
        "copy into long": ints.copy_(m * 3),
        "complex of max": torch.view_as_complex(pmax) * 2,
        "to complex": pmax.to(torch.complex128).sum(),
    }
    return {k: (v.full_tensor(), tuple(v.sbp)) for k, v in out.items()}


def test_rounding_a_partial_sum_rounds_the_sum(pool4):
    x = torch.tensor([[1, 3], [1, 2], [1, 1], [0, 4], [2, 1], [1, 1], [0, 1], [3, 0]])
    s = x.sum(0)
    m = _logical((2, 8), 1) @ (_logical((8, 2), 2) / 3)
    pmax = _logical((4, 2), 3).amax(0)
    want = {
        "floor": torch.div(s, 2, rounding_mode="floor"),
        "trunc": torch.div(-s, 4, rounding_mode="trunc"),
        "floordiv": s // 3,
        "float floor": torch.div(m * 7, torch.tensor([2.0, 3.0]), rounding_mode="floor"),
        "sum long": m.sum(dtype=torch.long),
        "sum0 long": m.sum(0, dtype=torch.long),
        "cumsum long": m.cumsum(0, dtype=torch.long),
        "bool": m.bool(),
        "copy into long": (m * 3).long(),
        "complex of max": torch.view_as_complex(pmax) * 2,
        "to complex": pmax.to(torch.complex128).sum(),
    }
    for got in pool4.run(_rounded_partial_sums):
        assert set(got) == set(want)
        for k, (value, _) in got.items():
            assert torch.equal(value, want[k]), (k, value, want[k])


# ---------------------------------------------------------------- indexing, aliasing


def _write_by_index_backward(how):
    """`y[idx] = v` (or `y[mask] *= 3`) on a split y, then backward: the gradients."""
    Pl = sbp.placement("cpu", [0, 1])
    x, v = _logical((4, 3), 4), _logical((2, 3), 5)
    gx = sbp.tensor(x, Pl, S0).requires_grad_()
    gv = sbp.tensor(v, Pl, B).requires_grad_()
    y = gx * 1
    if how == "index":
        y[sbp.tensor(torch.tensor([0, 2]), Pl, B)] = gv * 2
    else:
        y[y > 0] *= 3
    (y * y).sum().backward()
    return gx.grad.full_tensor(), None if gv.grad is None else gv.grad.full_tensor()


def test_backward_through_a_write_by_index(pool2):
    """torch's backward of index_put writes zeros it makes of the values' logical shape (a
    local tensor): taken as a broadcast value (before: PlacementError in backward)."""
    for how in ("index", "mask"):
        x = _logical((4, 3), 4).requires_grad_()
        v = _logical((2, 3), 5).requires_grad_()
        y = x * 1
        if how == "index":
            y[torch.tensor([0, 2])] = v * 2
        else:
            y[y > 0] *= 3
        (y * y).sum().backward()
        for gx, gv in pool2.run(_write_by_index_backward, how):
            torch.testing.assert_close(gx, x.grad, rtol=1e-14, atol=0)
            if how == "index":
                torch.testing.assert_close(gv, v.grad, rtol=1e-14, atol=0)


def _mask_of_another_shape(length):
    Pl = sbp.placement("cpu", [0, 1])
    g = sbp.tensor(torch.arange(12.0).reshape(4, 3), Pl, S0)
    mask = sbp.tensor(torch.arange(length) % 2 == 0, Pl, B)
    try:
        g[mask]
    except sbp.IndexRangeError as e:
        return str(e)
    return "no error"


def test_a_mask_of_another_shape_raises_on_every_rank(pool2):
    """torch raises IndexError for a mask whose shape is not the indexed dims' (before: sbp
    indexed rows by the shorter mask's positions, silently)."""
    x = torch.arange(12.0).reshape(4, 3)
    for length in (3, 5):
        try:
            x[torch.arange(length) % 2 == 0]
        except IndexError:
            pass
        else:
            raise AssertionError("torch took the mask")
        for message in pool2.run(_mask_of_another_shape, length):
            assert f"shape of the mask [{length}] at index 0 does not match" in message


def _contiguous_then_write(sbp_):
    Pl = sbp.placement("cpu", [0, 1, 2, 3])
    g = sbp.tensor(torch.arange(15.0).reshape(5, 3), Pl, sbp_)
    g.t().contiguous().add_(100)
    g[:, 1:2].contiguous().mul_(-1)
    c = g.contiguous()
    return g.full_tensor(), c is g


def test_contiguous_copies_alike_on_every_rank(pool4):
    """`contiguous()` of a transpose is a copy in torch; it was one on ranks whose shard is
    not contiguous by torch's test only (a 1-row or 1-column shard passes it), so a write
    into it reached the base on some ranks. A contiguous tensor is returned as it is."""
    x = torch.arange(15.0).reshape(5, 3)
    for layout in (S0, S1, B):
        for value, same in pool4.run(_contiguous_then_write, layout):
            assert torch.equal(value, x), layout
            assert same


def _overlapping_in_place(layout):
    Pl = sbp.placement("cpu", [0, 1, 2, 3])
    g = sbp.tensor(torch.arange(15.0).reshape(5, 3), Pl, layout)
    y = g.t()
    y[1:].mul_(y[:-1])
    g[1:].add_(g[:-1])
    return g.full_tensor()


def test_an_in_place_op_reading_what_it_writes(pool4):
    """Sources overlapping the written tensor are read as before the write, alike on every
    rank (before: torch's overlap check, run on each rank's local views, raised on the
    ranks whose shard passed as contiguous, and the others went on: a desync)."""
    x = torch.arange(15.0).reshape(5, 3)
    y = x.t()
    y[1:].mul_(y[:-1].clone())
    x[1:].add_(x[:-1].clone())
    for layout in (S0, S1, B):
        for value in pool4.run(_overlapping_in_place, layout):
            assert torch.equal(value, x), layout


def _views_under_inference_mode():
    P2 = sbp.placement("cpu", [0, 1])
    x = torch.arange(24, dtype=torch.float64).view(4, 6)
    got = []
    for nd in (B, S0, S1):
        g = sbp.tensor(x, placement=P2, sbp=nd)
        with torch.inference_mode():
            for op in (lambda t: t[:, 2:5], lambda t: t.view(24), lambda t: t.expand(2, 4, 6)):
                out = op(g)
                got.append(
                    (out.full_tensor().clone(), op(x), out.is_inference(), op(x).is_inference())
                )
            added = g + 1
            got.append((added.full_tensor().clone(), x + 1, added.is_inference(), True))
    # the buffers collectives keep, first made under inference_mode, serve outside it too
    after = sbp.tensor(x, placement=P2, sbp=S1).mul_(2).to_global(sbp=S0).full_tensor()
    got.append((after, x * 2, False, False))
    try:  # (torch's rule for the values made inside: no in-place write outside)
        added.add_(1)
        got.append("written")
    except RuntimeError as e:
        got.append(str(e))
    return got


def test_views_under_inference_mode(pool2):
    """A view of a normal global tensor under torch.inference_mode() (BERT's
    `self.position_ids[:, :n]` in eval) raised torch's "Cannot set version_counter for
    inference tensor": its wrapper was an inference tensor. As in torch, such a view is a
    normal tensor, a new result an inference tensor, which may not be written outside."""
    x = torch.arange(3.0)
    with torch.inference_mode():
        y = x + 1
    with pytest.raises(RuntimeError) as plain:
        y.add_(1)
    for got in pool2.run(_views_under_inference_mode):
        for value, want, inference, want_inference in got[:-1]:
            assert torch.equal(value, want)
            assert inference == want_inference
        assert got[-1] == str(plain.value)


def _backward_that_raised_then_one_that_did_not() -> list:
    """A backward on a split batch raises in a hook (caught, as a script that skips a batch
    does); the next one runs. Its broadcast leaves' gradients: (sbp, local) per leaf."""
    placement = sbp.placement.all("cpu")
    x = sbp.tensor(torch.arange(12.0, dtype=torch.float64).view(4, 3), placement=placement, sbp=S0)
    ws = [
        sbp.ones(3, dtype=torch.float64, placement=placement, sbp=B).requires_grad_() for _ in "ab"
    ]
    for step in range(2):
        h = x * ws[0]
        if step == 0:

            def boom(grad):
                raise RuntimeError("skip this batch")

            h.register_hook(boom)
        try:
            (h * ws[1]).sum().backward()
        except RuntimeError:
            for w in ws:
                w.grad = None
    return [(tuple(w.grad.sbp), w.grad.to_local()) for w in ws]


def test_a_backward_that_raised_leaves_no_gradient_buckets_behind(pool2):
    """Before: the raised backward's buckets stayed, so no later backward queued its own
    reduction: every later gradient stayed a partial sum (and buckets piled up)."""
    x = torch.arange(12.0, dtype=torch.float64).view(4, 3)
    want = x.sum(0)  # d/dw0 of sum(x * w0 * w1) at w = 1, and d/dw1 alike
    for grads in pool2.run(_backward_that_raised_then_one_that_did_not):
        for nd_sbp, local in grads:
            assert nd_sbp == (B,)
            torch.testing.assert_close(local, want, rtol=0, atol=0)
