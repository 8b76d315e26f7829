"""Strided splits (`sbp.signature.StridedSplit`, `sbp.ops.strided`): torch's `matmul`
flattens `(batch, heads)` for `bmm`; with the heads split that is no contiguous split, so
it is kept strided and the products stay local. Every result is compared with one
process on the logical tensors (float64); collectives are counted exactly. A strided
tensor that reaches any other op, or a re-box, is converted on the unflattened tensor:
tested against the logical values for every kind of target.
"""

from __future__ import annotations

import math

import pytest
import torch

import sbp
from sbp.boxing import box, plan_specs
from sbp.layout import GlobalSpec
from sbp.signature import StridedSplit

S0, S1, B, P = sbp.split(0), sbp.split(1), sbp.broadcast, sbp.partial_sum
TOL = {"rtol": 1e-12, "atol": 1e-12}


def _placement(two_d: bool):
    return sbp.placement("cpu", [[0, 1], [2, 3]] if two_d else [0, 1])


def _attention(q, k, v):
    """Causal attention written out, as nanoGPT's and Hugging Face's eager paths do."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    mask = torch.ones_like(scores, dtype=torch.bool).triu(1)
    return scores.masked_fill(mask, float("-inf")).softmax(-1) @ v


def _qkvg(b: int, h: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(b, h, 5, 3, generator=g, dtype=torch.float64) for _ in range(4)]


def _global_attention(two_d: bool, b: int, h: int) -> tuple:
    Pl = _placement(two_d)
    nd = (S0, S1) if two_d else (S1,)
    q, k, v, g = (sbp.tensor(t, placement=Pl, sbp=nd) for t in _qkvg(b, h))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with sbp.comm_stats() as fwd:
        out = _attention(q, k, v)
    with sbp.comm_stats() as bwd:
        out.backward(g)
    if sbp.env.get_rank() not in Pl:  # (made by every rank, held by the placement's)
        return None
    grads = [t.grad.full_tensor() for t in (q, k, v)]
    return out.sbp, out.full_tensor(), grads, fwd.calls, bwd.calls


@pytest.mark.parametrize(
    "two_d, b, h, calls",
    [
        (False, 2, 4, 0),
        (True, 4, 4, 0),  # batch split over hierarchy dim 0, heads over dim 1
        (False, 1, 4, 0),  # (nothing flattened behind the heads: a plain split)
        (False, 2, 3, None),  # 3 heads on 2 ranks: not even, converted instead
    ],
)
def test_attention_written_out_with_the_heads_split(pool4, two_d, b, h, calls):
    """Forward and backward of softmax(q @ k^T) @ v equal one process; with the heads
    even over the ranks no collective runs, forward or backward."""
    q, k, v, g = (t.clone().requires_grad_() for t in _qkvg(b, h))
    want = _attention(q, k, v)
    want.backward(g)
    for res in pool4.run(_global_attention, two_d, b, h):
        if res is None:
            continue
        nd, out, grads, fwd_calls, bwd_calls = res
        torch.testing.assert_close(out, want.detach(), **TOL)
        for got, ref in zip(grads, (q, k, v), strict=True):
            torch.testing.assert_close(got, ref.grad, **TOL)
        if calls is not None:  # (uneven: laid out as propagation finds cheapest)
            assert nd == ((S0, S1) if two_d else (S1,))
            assert (fwd_calls, bwd_calls) == (calls, calls)


def _flattened(two_d: bool) -> tuple:
    """x (4, 4, 3) split along dim 1 (and dim 0 on 2-D), viewed as (16, 3): strided."""
    Pl = _placement(two_d)
    x = torch.arange(48, dtype=torch.float64).view(4, 4, 3)
    g = sbp.tensor(x, placement=Pl, sbp=(S0, S1) if two_d else (S1,))
    return Pl, x, g.reshape(16, 3)


def _converted(two_d: bool) -> list:
    Pl, x, y = _flattened(two_d)
    out = [y.sbp, tuple(y.to_local().shape)]
    n = Pl.ndim
    targets = [(B,) * n, (S0,) * n, (S1,) * n, (P,) * n, (B,) * (n - 1) + (S0,)]
    with sbp.comm_stats() as st:
        out += [y.to_global(sbp=t).full_tensor() for t in targets]
    out.append(st.calls > 0)
    # ops with no strided rule take it converted
    out += [(y * 2 + 1).full_tensor(), y.sum(0).full_tensor(), y.t().contiguous().full_tensor()]
    # another placement (its ranks reversed)
    other = sbp.placement("cpu", [[3, 2], [1, 0]] if two_d else [1, 0])
    out.append(y.to_global(placement=other).full_tensor())
    return out


@pytest.mark.parametrize("two_d", [False, True])
def test_a_strided_tensor_converts_to_any_layout(pool4, two_d):
    """Re-boxed to broadcast, splits of either dim, a partial sum, another placement, or
    taken by ops with no strided rule: the logical value every time."""
    x = torch.arange(48, dtype=torch.float64).view(16, 3)
    results = pool4.run(_converted, two_d)
    for res in results if two_d else results[:2]:
        nd, local_shape, *values, moved, mul, summed, transposed, moved_placement = res
        assert nd == ((S0, StridedSplit(0, 4)) if two_d else (StridedSplit(0, 4),))
        assert local_shape == ((4, 3) if two_d else (8, 3))
        for v in values:
            torch.testing.assert_close(v, x, **TOL)
        assert moved
        torch.testing.assert_close(mul, x * 2 + 1, **TOL)
        torch.testing.assert_close(summed, x.sum(0), **TOL)
        torch.testing.assert_close(transposed, x.t(), **TOL)
        torch.testing.assert_close(moved_placement, x, **TOL)


def _boxed_into_strided(two_d: bool) -> list:
    """A plan into a strided layout (from broadcast, and from a split of the blocks that
    is not whole blocks) gives each rank its local view."""
    Pl = _placement(two_d)
    x = torch.arange(60, dtype=torch.float64).view(6, 10)  # (blocks 3 x inner 2) x 10
    strided = (S0, StridedSplit(0, 2)) if two_d else (StridedSplit(0, 2),)
    dst = GlobalSpec(Pl, strided, (6, 10), torch.float64)
    out = []
    for src_nd in [(B,) * Pl.ndim, (S0,) * Pl.ndim, (S1,) * Pl.ndim]:
        src = GlobalSpec(Pl, src_nd, (6, 10), torch.float64)
        me = sbp.env.get_rank()
        local = x[sbp.layout.rank_slices((6, 10), Pl, src_nd, me)] if me in Pl else x[:0]
        out.append((str(plan_specs(src, dst)), box(local.contiguous(), src, dst)))
    return out


def test_boxing_into_a_strided_layout(pool4):
    """Each rank's local tensor equals its part of the unflattened (3, 2, 10) tensor."""
    x = torch.arange(60, dtype=torch.float64).view(3, 2, 10)
    for two_d in (False, True):
        Pl = _placement(two_d)
        results = pool4.run(_boxed_into_strided, two_d)
        for rank, res in enumerate(results[: Pl.size]):
            coord = Pl.coord(rank)
            # the inner dim (2) is split over the last hierarchy dim; on 2-D the blocks (3)
            # over the first: balanced, 2 + 1
            blocks = slice(None) if not two_d else [slice(0, 2), slice(2, 3)][coord[0]]
            want = x[blocks, coord[-1] : coord[-1] + 1].reshape(-1, 10)
            for text, got in res:
                assert "view" in text
                torch.testing.assert_close(got, want, **TOL)


def _asked_for(_: int) -> str:
    try:
        torch.zeros(4, 2).to_global(_placement(False), StridedSplit(0, 2))
    except sbp.SbpSignatureError as e:
        return str(e)
    return "no error"


def test_a_strided_split_is_not_asked_for(pool2):
    """Views make it; an sbp argument naming one is refused, on every rank."""
    for msg in pool2.run(_asked_for, 0):
        assert "made by views" in msg


def _two_splits_flattened() -> tuple:
    """(2, 4, 4, 3) split along dims 1 and 2 (hierarchy dims 0 and 1), flattened to
    (32, 3): two strided splits of one dim would be two blocks sizes, which no single
    unflattened tensor means; one is converted instead."""
    Pl = _placement(True)
    x = torch.arange(96, dtype=torch.float64).view(2, 4, 4, 3)
    g = sbp.tensor(x, placement=Pl, sbp=(sbp.split(1), sbp.split(2)))
    y = g.reshape(32, 3)
    return y.sbp, y.full_tensor()


def test_two_split_dims_flattened_together(pool4):
    x = torch.arange(96, dtype=torch.float64).view(32, 3)
    for nd, value in pool4.run(_two_splits_flattened):
        assert len({s for s in nd if s.is_strided}) <= 1
        torch.testing.assert_close(value, x, **TOL)


def _written_through_a_strided_view(two_d: bool) -> tuple:
    """y = x.view(16, 3) is strided; y.mul_(2) and y[0] = 7 write x."""
    Pl, x, _ = _flattened(two_d)
    g = sbp.tensor(x, placement=Pl, sbp=(S0, S1) if two_d else (S1,))
    y = g.view(16, 3)
    y.mul_(2)
    y[0] = 7.0
    return y.full_tensor(), g.full_tensor()


@pytest.mark.parametrize("two_d", [False, True])
def test_writes_through_a_strided_view_reach_its_base(pool4, two_d):
    x = torch.arange(48, dtype=torch.float64).view(4, 4, 3)
    want = x * 2
    want.view(16, 3)[0] = 7.0
    results = pool4.run(_written_through_a_strided_view, two_d)
    for y, base in results if two_d else results[:2]:
        torch.testing.assert_close(y, want.view(16, 3), **TOL)
        torch.testing.assert_close(base, want, **TOL)


def _filled_through_a_strided_view() -> tuple:
    """copy_ of a plain (logical) value, and normal_ (placement-independent values: equal
    to a broadcast tensor's under the same seed)."""
    Pl, x, _ = _flattened(False)
    y = sbp.tensor(x, placement=Pl, sbp=S1).reshape(16, 3)
    y.copy_(torch.arange(48, dtype=torch.float64).view(16, 3) * 3)
    copied = y.full_tensor()
    sbp.manual_seed(5)
    torch.nn.init.normal_(y)
    sbp.manual_seed(5)
    z = torch.nn.init.normal_(sbp.zeros(16, 3, dtype=torch.float64, placement=Pl, sbp=B))
    return y.sbp, copied, y.full_tensor(), z.full_tensor()


def test_filling_a_strided_view(pool2):
    x = torch.arange(48, dtype=torch.float64).view(16, 3)
    for nd, copied, drawn, broadcast_drawn in pool2.run(_filled_through_a_strided_view):
        assert nd == (StridedSplit(0, 4),)
        torch.testing.assert_close(copied, x * 3, **TOL)
        torch.testing.assert_close(drawn, broadcast_drawn, **TOL)


def _dropped_out() -> tuple:
    """Dropout (and bernoulli_) on a strided tensor: each rank's heads draw their own mask."""
    Pl = _placement(False)
    g = sbp.tensor(torch.ones(2, 4, 3, dtype=torch.float64), placement=Pl, sbp=S1)
    y = g.reshape(8, 3)
    dropped = torch.nn.functional.dropout(y, 0.5).full_tensor().view(2, 4, 3)
    drawn = y.clone().bernoulli_(0.5).full_tensor().view(2, 4, 3)
    return y.sbp, dropped, drawn


def test_dropout_on_a_strided_tensor_draws_per_shard(pool2):
    """Before, a strided hierarchy dim seeded as broadcast: both ranks' heads drew the
    same mask."""
    for nd, dropped, drawn in pool2.run(_dropped_out):
        assert nd == (StridedSplit(0, 4),)
        assert set(dropped.unique().tolist()) <= {0.0, 2.0}
        assert not torch.equal(dropped[:, :2], dropped[:, 2:])
        assert not torch.equal(drawn[:, :2], drawn[:, 2:])
