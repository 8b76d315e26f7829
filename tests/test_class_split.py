"""Softmax and cross-entropy over a split class dim (vocabulary parallel, `sbp.ops.class_split`):
the logical answer, and one number per row moved instead of the rows gathered."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import sbp

S0, S1, B = sbp.split(0), sbp.split(1), sbp.broadcast


def _case(seed=0, n=6, classes=10, extra=()):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, classes, *extra, generator=g, dtype=torch.float64) * 3
    target = torch.randint(0, classes, (n, *extra), generator=g)
    weight = torch.rand(classes, generator=g, dtype=torch.float64) + 0.5
    return logits, target, weight


def _loss(logits, target, weight, kwargs):
    w = None if not kwargs.get("weight") else weight
    rest = {k: v for k, v in kwargs.items() if k != "weight"}
    return F.cross_entropy(logits, target, weight=w, **rest)


def _split_loss(ranks, nd, target_nd, classes, kwargs, n=6, extra=()):
    P = sbp.placement("cpu", ranks)
    logits, target, weight = _case(n=n, classes=classes, extra=extra)
    lg = sbp.tensor(logits, P, nd).requires_grad_()
    tg = sbp.tensor(target, P, target_nd)
    w = sbp.tensor(weight, P, (B,) * len(nd))
    with sbp.comm_stats() as fwd:
        loss = _loss(lg, tg, w, kwargs)
    grad = torch.ones(loss.shape, dtype=loss.dtype)
    with sbp.comm_stats() as bwd:
        loss.backward(sbp.tensor(grad, P, (B,) * len(nd)) if loss.dim() else None)
    kinds = lambda st: sorted((k, n) for k, n in st.by_kind.items() if n)  # noqa: E731
    return loss.full_tensor(), lg.grad.full_tensor(), kinds(fwd), kinds(bwd)


KWARGS = {
    "mean": {},
    "sum": {"reduction": "sum"},
    "none": {"reduction": "none"},
    "weighted mean": {"weight": True},
    "ignored": {"ignore_index": 3},
    "weighted ignored": {"weight": True, "ignore_index": 3},
    "smoothed": {"label_smoothing": 0.1},
}


@pytest.mark.parametrize("name", sorted(KWARGS))
@pytest.mark.parametrize("classes", [10, 2])
def test_cross_entropy_of_logits_split_along_the_classes(pool4, name, classes):
    """3 ranks hold 4/3/3 classes (or 1/1/0 of 2): the loss and the logits' gradient equal
    one process's; forward moves two numbers per row (max, sum of exponentials), backward
    one, and nothing gathers the logits."""
    logits, target, weight = _case(classes=classes)
    want_logits = logits.clone().requires_grad_()
    want = _loss(want_logits, target, weight, KWARGS[name])
    want.backward(torch.ones_like(want))
    results = pool4.run(_split_loss, [0, 1, 2], (S1,), (B,), classes, KWARGS[name])
    for loss, grad, fwd, bwd in results[:3]:
        torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, want_logits.grad, rtol=1e-12, atol=1e-12)
        # label smoothing also sums the log-probabilities over the classes: a partial sum,
        # reduced before its masked_fill_ of the ignored rows (one number per row again)
        assert fwd == [("all_reduce", 3 if name == "smoothed" else 2)]
        assert bwd == [("all_reduce", 1)]


def test_cross_entropy_with_batch_and_classes_split_on_2d(pool4):
    """DP x TP on [[0, 1], [2, 3]]: the rows split over hierarchy dim 0, the classes over
    dim 1; the loss is the logical mean."""
    logits, target, weight = _case(n=8, classes=11)
    want_logits = logits.clone().requires_grad_()
    want = _loss(want_logits, target, weight, {"weight": True})
    want.backward()
    for loss, grad, fwd, bwd in pool4.run(
        _split_loss, [[0, 1], [2, 3]], (S0, S1), (S0, B), 11, {"weight": True}, 8
    ):
        torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, want_logits.grad, rtol=1e-12, atol=1e-12)
        # max and sum of exponentials over the classes, the total weight over the rows
        assert fwd == [("all_reduce", 3)]
        assert bwd == [("all_reduce", 1)]


def test_cross_entropy_of_per_position_scores_split_along_the_classes(pool2):
    """(N, C, L) scores (nll_loss2d's path) split along C."""
    logits, target, weight = _case(n=3, classes=7, extra=(5,))
    want_logits = logits.clone().requires_grad_()
    want = _loss(want_logits, target, weight, {"weight": True, "ignore_index": 2})
    want.backward()
    kwargs = {"weight": True, "ignore_index": 2}
    for loss, grad, fwd, bwd in pool2.run(_split_loss, [0, 1], (S1,), (B,), 7, kwargs, 3, (5,)):
        torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, want_logits.grad, rtol=1e-12, atol=1e-12)
        assert fwd == [("all_reduce", 2)] and bwd == [("all_reduce", 1)]


def _softmaxes(fn_name, dim, nd):
    P = sbp.placement("cpu", [0, 1, 2])
    x = torch.randn(4, 9, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    x[1] = -torch.inf  # a row of -inf: softmax gives NaN, _safe_softmax zeros
    x[2, :5] = -torch.inf  # the first ranks' slices all -inf
    g = sbp.tensor(x, P, nd).requires_grad_()
    fn = {"softmax": F.softmax, "log_softmax": F.log_softmax}[fn_name]
    out = fn(g, dim)
    up = torch.arange(36, dtype=torch.float64).reshape(4, 9) / 7
    with sbp.comm_stats() as bwd:
        out.backward(sbp.tensor(up, P, nd))
    return out.full_tensor(), g.grad.full_tensor(), bwd.by_kind.get("all_reduce", 0)


@pytest.mark.parametrize("fn_name", ["softmax", "log_softmax"])
def test_softmax_over_a_split_dim(pool4, fn_name):
    x = torch.randn(4, 9, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    x[1] = -torch.inf
    x[2, :5] = -torch.inf
    x.requires_grad_()
    fn = {"softmax": F.softmax, "log_softmax": F.log_softmax}[fn_name]
    want = fn(x, -1)
    up = torch.arange(36, dtype=torch.float64).reshape(4, 9) / 7
    keep = torch.ones(4, dtype=torch.bool)
    keep[1] = False  # (a row of -inf: NaN in both, compared apart)
    want.backward(up)
    for out, grad, reduced in pool4.run(_softmaxes, fn_name, -1, (S1,))[:3]:
        torch.testing.assert_close(out[keep], want.detach()[keep], rtol=1e-12, atol=1e-12)
        assert torch.isnan(out[1]).all() == torch.isnan(want[1]).all()
        torch.testing.assert_close(grad[keep], x.grad[keep], rtol=1e-12, atol=1e-12)
        assert reduced == 1


def _vocab_split_embedding(ranks, weight_nd, ids_nd, padding_idx):
    P = sbp.placement("cpu", ranks)
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4, padding_idx=padding_idx).double()
    emb.to_global(P, weight_nd)  # the whole table, each rank keeping its rows
    ids = torch.tensor([[1, 7, 3, 9], [9, 0, 5, 2], [4, 4, 8, 6], [0, 2, 2, 3]])
    g = sbp.tensor(ids, P, ids_nd)
    with sbp.comm_stats() as fwd:
        out = emb(g)
    up = sbp.tensor(torch.arange(64.0, dtype=torch.float64).reshape(4, 4, 4), P, ids_nd)
    with sbp.comm_stats() as bwd:
        out.backward(up)
    return out.full_tensor(), emb.weight.grad.full_tensor(), out.sbp, fwd.calls, bwd.calls


@pytest.mark.parametrize("padding_idx", [None, 2])
@pytest.mark.parametrize(
    "ranks, weight_nd, ids_nd, out_nd, reduced",
    [
        ([0, 1, 2], (S0,), (B,), (sbp.partial_sum,), 0),  # 4/3/3 rows
        # DP x TP: the weight's gradient reduced over the batch's ranks, one bucket
        ([[0, 1], [2, 3]], (B, S0), (S0, B), (S0, sbp.partial_sum), 1),
    ],
)
def test_embedding_with_the_vocabulary_split(
    pool4, padding_idx, ranks, weight_nd, ids_nd, out_nd, reduced
):
    """Megatron's VocabParallelEmbedding: each rank looks up the ids in its rows, the
    output is a partial sum, nothing moves forward, nor backward but the data-parallel
    gradient reduction (before: the table was all-gathered). Output and weight gradient
    equal one process's."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4, padding_idx=padding_idx).double()
    ids = torch.tensor([[1, 7, 3, 9], [9, 0, 5, 2], [4, 4, 8, 6], [0, 2, 2, 3]])
    want = emb(ids)
    want.backward(torch.arange(64.0, dtype=torch.float64).reshape(4, 4, 4))
    results = pool4.run(_vocab_split_embedding, ranks, weight_nd, ids_nd, padding_idx)
    for out, grad, nd, fwd, bwd in results[: 3 if len(ranks) == 3 else 4]:
        torch.testing.assert_close(out, want.detach(), rtol=0, atol=0)
        torch.testing.assert_close(grad, emb.weight.grad, rtol=1e-12, atol=1e-12)
        assert nd == out_nd and (fwd, bwd) == (0, reduced)
