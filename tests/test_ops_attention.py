"""Rows for scaled dot-product attention (CPU flash kernel, forward and backward),
constant_pad_nd, and reshapes that merge a split dim, run by test_ops' table machinery: forward values and input gradients on global
tensors equal single-process torch on the logical tensors (float64), for every signature listed
on 4 ranks of a world of 4 (the first also on 2) and on 2x2."""

from __future__ import annotations

import pytest
import test_ops
import torch
import torch.nn.functional as F
from test_ops import Row, _id

import sbp

S0, S1, S2, B, P = sbp.split(0), sbp.split(1), sbp.split(2), sbp.broadcast, sbp.partial_sum
QKV = [(4, 2, 5, 3)] * 3


def _sdpa_masked(q, k, v, m):
    """An additive float mask (0 or -1) of shape (N, 1, L, S), made from an integer input."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m.to(q.dtype) - 1, scale=0.3)


def _sdpa_mask_2d(q, k, v, m):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m.to(q.dtype) * 0.5)


ROWS = {
    "sdpa_causal": Row(
        QKV,
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        [(S0, S0, S0), (S1, S1, S1), (B, B, B), (S0, B, S1), (P, B, B)],
        two_d=[((S0, S1),) * 3, ((S1, B),) * 3],
    ),
    "sdpa_mask_batch": Row(
        [*QKV, ("int", (4, 1, 5, 5), 2)],
        _sdpa_masked,
        [(S0, S0, S0, S0), (S1, S1, S1, B), (S0, S0, S0, B), (B, B, B, B)],
        two_d=[((S0, S1),) * 3 + ((S0, B),)],
    ),
    "sdpa_mask_2d": Row(
        [*QKV, ("int", (5, 5), 2)], _sdpa_mask_2d, [(S0, S0, S0, B), (S1, S1, S1, S0)]
    ),
    "constant_pad_nd": Row(
        [(5, 6)],
        lambda x: (F.pad(x, (1, 2)), F.pad(x, (0, 0, 1, 1), value=2.0), F.pad(x, (1, 1, 2, 0))),
        [(S0,), (S1,), (P,), (B,)],
    ),
    "constant_pad_nd_3d": Row(
        [(3, 4, 5)], lambda x: F.pad(x, (2, 1), value=-1.0), [(S0,), (S1,), (S2,), (P,)]
    ),
    "reshape_merges_split_dim": Row(
        [(4, 3, 2)],
        lambda x: (x.reshape(12, 2), x.reshape(2, 12), x.flatten().view(8, 3)),
        [(S0,), (S1,), (P,)],
    ),
}
test_ops.ROWS.update(ROWS)  # here and in every worker that unpickles _case


def _case(name: str, nd_sbps: list, ranks: list) -> list:
    test_ops.ROWS.update(ROWS)
    return test_ops._run_case(name, nd_sbps, ranks)


CASES = [
    (name, tuple((s,) for s in combo), ranks)
    for name, row in ROWS.items()
    for ranks, combos in (([1, 0], row.sbps[:1]), ([3, 1, 0, 2], row.sbps))
    for combo in combos
] + [(name, nd, [[0, 1], [2, 3]]) for name, row in ROWS.items() for nd in row.two_d]


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_attention_and_pad_match_single_process(pool4, case):
    name, nd, ranks = case
    for rank, errors in enumerate(pool4.run(_case, name, list(nd), ranks)):
        assert not errors, f"rank {rank}: {errors}"


def _runs_without_fallback():
    """The GPT-2 path's attention and padding ops run by their rules: batch and head splits
    need no communication at all."""
    P_ = sbp.placement.all("cpu")
    torch.manual_seed(0)
    q, k, v = (torch.randn(4, 2, 5, 3, dtype=torch.float64) for _ in range(3))
    out = {}
    for sig in (S0, S1):
        g = [sbp.tensor(t, P_, sig).requires_grad_() for t in (q, k, v)]
        with sbp.comm_stats() as st:
            y = F.scaled_dot_product_attention(*g, is_causal=True)
            y.backward(sbp.tensor(torch.ones(4, 2, 5, 3, dtype=torch.float64), P_, sig))
            F.pad(g[0], (0, 1))
            if sig == S0:  # a flatten of the batch dim keeps the split (logits.view(-1, V))
                flat = y.reshape(20, 2, 3).view(-1, 3)
                out["flatten"] = (flat.sbp, tuple(flat._local.shape))
        out[repr(sig)] = (y.sbp, dict(st.by_kind))
    return out


def test_attention_splits_need_no_communication(pool2):
    for out in pool2.run(_runs_without_fallback):
        assert out.pop("flatten") == ((S0,), (20, 3))
        for sig, (ysbp, kinds) in out.items():
            assert repr(ysbp[0]) == sig
            assert kinds == {}, (sig, kinds)
