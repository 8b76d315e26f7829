"""How global tensors meet the rest of torch (issue 9): ops with no meta kernel, comm stats,
leaf gradients, no-op conversions, module re-boxing, in-place init, allocation ops, ranks
outside a placement, and the first op not importing torch._dynamo. Expected values come from
single-process torch on the logical tensors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
        y = torch.cumsum(x, 1)  # no rule, broadcast input: no collective at all
    return st.calls, st.bytes, dict(st.fallbacks), y.tolist()


def test_comm_stats_calls_count_collectives_only(pool4):
    ref = torch.cumsum(torch.arange(6.0).reshape(2, 3), 1).tolist()
    for rank, (calls, nbytes, fallbacks, y) in enumerate(pool4.run(_stats_of_fallback)):
        if rank < 2:
            assert calls == 0 and nbytes == 0 and y == ref
            assert fallbacks == {"aten.cumsum.default": 1}


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
