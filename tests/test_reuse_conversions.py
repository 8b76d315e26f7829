"""Each logical value is moved at most once (`sbp.ops.converted`): a converted input is
kept, so other consumers of the same value, and views of it, take it instead of
communicating again; a write into the value, or into a view of it, drops what was kept.

Every result is compared with one process on the logical tensors (float64), and every
count of collectives is asserted exactly, with the count without reuse beside it
(`converted.set_enabled(False)` runs the code as it was before reuse).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import sbp
from sbp.ops import converted

S0, S1, B, P = sbp.split(0), sbp.split(1), sbp.broadcast, sbp.partial_sum
TOL = {"rtol": 1e-12, "atol": 1e-12}


def _reuse(enabled: bool):
    """Run the rest of a worker function with reuse on or off; returns the undo."""
    previous = converted.set_enabled(enabled)
    return lambda: converted.set_enabled(previous)


# ---------------------------------------------------------------- Megatron MLP blocks

BLOCKS, HIDDEN, FFN, BATCH, STEPS = 4, 8, 16, 6, 3


def _mlp_params() -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)

    def r(*shape, scale):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    return [
        [
            r(FFN, HIDDEN, scale=0.4),
            r(FFN, scale=0.1),
            r(HIDDEN, FFN, scale=0.3),
            r(HIDDEN, scale=0.1),
        ]
        for _ in range(BLOCKS)
    ]


def _mlp_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, HIDDEN, generator=g, dtype=torch.float64)
    return x, torch.randn(BATCH, HIDDEN, generator=g, dtype=torch.float64)


def _mlp(x, params):
    for w1, b1, w2, b2 in params:  # Megatron: fc1 column-parallel, fc2 row-parallel
        x = F.linear(F.relu(F.linear(x, w1, b1)), w2, b2)
    return x


def _train_mlp(reuse: bool):
    undo = _reuse(reuse)
    try:
        Pl = sbp.placement("cpu", [0, 1])
        params = [
            [
                sbp.tensor(t, Pl, s).requires_grad_()
                for t, s in zip(block, (S0, S0, S1, B), strict=True)
            ]
            for block in _mlp_params()
        ]
        flat = [p for block in params for p in block]
        opt = torch.optim.AdamW(flat, lr=1e-2, weight_decay=0.01)
        x, y = _mlp_data()
        counts, losses = [], []
        for _ in range(STEPS):
            with sbp.comm_stats() as fwd:
                loss = F.mse_loss(_mlp(sbp.tensor(x, Pl, B), params), sbp.tensor(y, Pl, B))
            opt.zero_grad()
            with sbp.comm_stats() as bwd:
                loss.backward()
            opt.step()
            counts.append((dict(fwd.by_kind), dict(bwd.by_kind)))
            losses.append(loss.full_tensor())
        return counts, losses, [p.full_tensor() for p in flat]
    finally:
        undo()


def test_megatron_mlp_trains_as_one_process_moving_each_value_once(pool2):
    """4 Megatron MLP blocks (fc1 weight and bias split(0), fc2 weight split(1), fc2 bias
    and the input broadcast, ReLU between), MSE loss, AdamW, 2 ranks: equal to one process,
    with these collectives per step, measured without reuse (as before it) and with it:

    - forward, both: 4 all-reduces (blocks 2-4 take their input, a partial sum, whole;
      mse_loss takes the last output whole, `sbp.ops.decomposed`);
    - backward, without reuse: 11 all-reduces. The gradient at each block's output, a
      partial sum, is all-reduced for `grad @ W2` and again for fc2's weight gradient
      (but the last block's, which mse_loss's backward computes from the output forward
      reduced); each inner block's input, all-reduced in forward, again for fc1's weight
      gradient;
    - backward, with reuse: 3 all-reduces, one per inner block's output gradient (the
      fc2 bias gradients are summed from those whole gradients, and mse_loss's backward
      takes the output forward reduced): 16 collectives per step -> 7, Megatron's floor
      (4 forward, 3 backward).
    """
    before, after = pool2.run(_train_mlp, False), pool2.run(_train_mlp, True)
    ref = [[t.clone().requires_grad_() for t in block] for block in _mlp_params()]
    flat = [p for block in ref for p in block]
    opt = torch.optim.AdamW(flat, lr=1e-2, weight_decay=0.01)
    x, y = _mlp_data()
    want_losses = []
    for _ in range(STEPS):
        loss = F.mse_loss(_mlp(x, ref), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        want_losses.append(loss.detach())
    for _, losses, params in before + after:
        for got, want in zip(losses, want_losses, strict=True):
            torch.testing.assert_close(got, want, **TOL)
        for got, want in zip(params, flat, strict=True):
            torch.testing.assert_close(got, want.detach(), **TOL)
    for counts, _, _ in before:
        assert counts == [({"all_reduce": 4}, {"all_reduce": 11})] * STEPS
    for counts, _, _ in after:
        assert counts == [({"all_reduce": 4}, {"all_reduce": 3})] * STEPS


# ---------------------------------------------------------------- one partial value, many uses


def _data(*shapes, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes]


X_SHAPE = (6, 4)  # the partial value; its consumers need it whole (gathering the weight,
# split on its long dim, would send more than reducing it)


def _partial(x, Pl):
    return sbp.tensor(x, Pl, B).to_global(sbp=P)  # (local: rank 0 holds x, rank 1 zeros)


def _consumers(order: str, reuse: bool):
    undo = _reuse(reuse)
    try:
        Pl = sbp.placement("cpu", [0, 1])
        x, w2, w3, h = _data(X_SHAPE, (4, 40), (4, 40), (6, 40))
        p = _partial(x, Pl)
        gw2, gw3, gh = (sbp.tensor(t, Pl, S1) for t in (w2, w3, h))
        uses = {"a": lambda: p @ gw2, "b": lambda: p @ gw3, "t": lambda: p.t() @ gh}
        with sbp.comm_stats() as st:
            out = {k: uses[k]() for k in order}
        return {k: v.full_tensor() for k, v in out.items()}, dict(st.by_kind), converted.count()
    finally:
        undo()


@pytest.mark.parametrize("order", ["abt", "tab", "atb"])
def test_two_consumers_and_a_transpose_all_reduce_once(pool2, order):
    """`p @ w2`, `p @ w3` and `p.t() @ h` of one partial `p` (each needs `p` whole): one
    all-reduce in all, where there were three. The transpose first converts `p` itself
    (it shows all of it) and keeps that; after `p`, it takes a view of what was kept."""
    x, w2, w3, h = _data(X_SHAPE, (4, 40), (4, 40), (6, 40))
    want = {"a": x @ w2, "b": x @ w3, "t": x.t() @ h}
    for reuse, calls in ((False, 3), (True, 1)):
        for out, kinds, _ in pool2.run(_consumers, order, reuse):
            assert kinds == {"all_reduce": calls}, (reuse, kinds)
            for k in order:
                torch.testing.assert_close(out[k], want[k], **TOL)


def _on_2x2():
    Pl = sbp.placement("cpu", [[0, 1], [2, 3]])
    x, w, h = _data((8, 4), (4, 40), (8, 40))
    p = sbp.tensor(x, Pl, (S0, B)).to_global(sbp=(S0, P))  # partial on hierarchy dim 1
    gw, gh = sbp.tensor(w, Pl, (B, S1)), sbp.tensor(h, Pl, (S0, S1))
    with sbp.comm_stats() as st:
        a, t, b = p @ gw, p.t() @ gh, p @ gw
    return [v.full_tensor() for v in (a, t, b)], dict(st.by_kind)


def test_a_partial_dim_of_a_2d_placement_is_reduced_once(pool4):
    """(S0, P) on [[0, 1], [2, 3]]: `p @ w` and `p.t() @ h` need hierarchy dim 1 whole;
    the transpose is split on its other dim, and takes a view of what `p` kept."""
    x, w, h = _data((8, 4), (4, 40), (8, 40))
    want = [x @ w, x.t() @ h, x @ w]
    for outs, kinds in pool4.run(_on_2x2):
        assert kinds == {"all_reduce": 1}, kinds  # (each rank's pair along dim 1)
        for got, ref in zip(outs, want, strict=True):
            torch.testing.assert_close(got, ref, **TOL)


# ---------------------------------------------------------------- writes drop what was kept

WRITES = {
    "mul_": lambda p: p.mul_(2.0),
    "through a view": lambda p: p.t().mul_(2.0),
    "through .data": lambda p: p.data.mul_(2.0),
    "into to_local()": lambda p: p.to_local().mul_(2.0),  # (every rank: both parts doubled)
    "copy_": lambda p: p.copy_(p * 2.0),
}


def _write_between_uses(write: str):
    Pl = sbp.placement("cpu", [0, 1])
    x, w = _data(X_SHAPE, (4, 40))
    p, gw = _partial(x, Pl), sbp.tensor(w, Pl, S1)
    with sbp.comm_stats() as st:
        first = p @ gw
        WRITES[write](p)
        second = p @ gw
        third = p @ gw  # (the written value, converted again, is kept again)
    return first.full_tensor(), second.full_tensor(), third.full_tensor(), dict(st.by_kind)


@pytest.mark.parametrize("write", sorted(WRITES))
def test_a_write_between_two_uses_drops_the_kept_conversion(pool2, write):
    """`p @ w`, a write doubling `p`, `p @ w` again: the second use sees the written value
    (kept, it would see the first), and it is all-reduced again, once."""
    x, w = _data(X_SHAPE, (4, 40))
    for first, second, third, kinds in pool2.run(_write_between_uses, write):
        torch.testing.assert_close(first, x @ w, **TOL)
        torch.testing.assert_close(second, (2 * x) @ w, **TOL)
        torch.testing.assert_close(third, (2 * x) @ w, **TOL)
        assert kinds == {"all_reduce": 2}, kinds


def _view_before_write(view_first: bool):
    Pl = sbp.placement("cpu", [0, 1])
    x, w, h = _data(X_SHAPE, (4, 40), (6, 40))
    p, gw, gh = _partial(x, Pl), sbp.tensor(w, Pl, S1), sbp.tensor(h, Pl, S1)
    v = p.t()  # taken before the write: it shows p's storage, written below
    with sbp.comm_stats() as st:
        first = v @ gh if view_first else p @ gw
        p.mul_(2.0)
        after_view = v @ gh
        after_base = p @ gw
    outs = (first, after_view, after_base)
    return [o.full_tensor() for o in outs], dict(st.by_kind)


@pytest.mark.parametrize("view_first", [False, True], ids=["base first", "view first"])
def test_a_view_taken_before_a_write_sees_it(pool2, view_first):
    """`v = p.t()`, then a use of `p` (or of `v`) keeps `p` converted; `p.mul_(2)`; then
    `v @ h` and `p @ w` see the written value: one all-reduce before the write, and one
    after it for both uses."""
    x, w, h = _data(X_SHAPE, (4, 40), (6, 40))
    y = 2.0 * x
    want = [x.t() @ h if view_first else x @ w, y.t() @ h, y @ w]
    for outs, kinds in pool2.run(_view_before_write, view_first):
        for got, ref in zip(outs, want, strict=True):
            torch.testing.assert_close(got, ref, **TOL)
        assert kinds == {"all_reduce": 2}, kinds


def _train_with_converted_weight(reuse: bool):
    undo = _reuse(reuse)
    try:
        Pl = sbp.placement("cpu", [0, 1])
        x, w0 = _data((5, 6), (6, 4), seed=7)
        w = sbp.tensor(w0, Pl, S0).requires_grad_()
        opt = torch.optim.AdamW([w], lr=0.05)
        gx = sbp.tensor(x, Pl, B)
        counts = []
        for _ in range(3):
            with sbp.comm_stats() as st:
                loss = (gx @ w.sort(0).values).pow(2).sum() + w.sort(0).values.exp().sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            counts.append(dict(st.by_kind))
        return counts, w.full_tensor()
    finally:
        undo()


def test_an_optimizer_step_drops_its_parameters_kept_conversions(pool2):
    """A weight split(0) that two sorts along dim 0 need converted:
    converted once per step with reuse (twice without), and again after each AdamW step
    (which writes the locals outside the dispatcher): equal to one process."""
    x, w0 = _data((5, 6), (6, 4), seed=7)
    w = w0.clone().requires_grad_()
    opt = torch.optim.AdamW([w], lr=0.05)
    for _ in range(3):
        loss = (x @ w.sort(0).values).pow(2).sum() + w.sort(0).values.exp().sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    runs = {reuse: pool2.run(_train_with_converted_weight, reuse) for reuse in (False, True)}
    for results in runs.values():
        for _, got in results:
            torch.testing.assert_close(got, w.detach(), **TOL)
    off, on = runs[False][0][0], runs[True][0][0]
    assert (on, off) == ([{"all_gather": 1}] * 3, [{"all_gather": 2}] * 3), (on, off)


# ---------------------------------------------------------------- nothing kept


def _kept_when(case: str):
    Pl = sbp.placement("cpu", [0, 1])
    x, w = _data(X_SHAPE, (4, 40))
    converted.clear()
    p, gw = _partial(x, Pl), sbp.tensor(w, Pl, S1)
    if case == "off":
        undo = _reuse(False)
        try:
            out = p @ gw
            kept = converted.count()
        finally:
            undo()
    else:
        out = p @ gw
        kept = converted.count()
        del p
    return out.full_tensor(), kept, converted.count()


def test_what_is_kept_is_freed_with_its_source_and_the_switch_turns_it_off(pool2):
    x, w = _data(X_SHAPE, (4, 40))
    for out, kept, left in pool2.run(_kept_when, "on"):
        torch.testing.assert_close(out, x @ w, **TOL)
        assert (kept, left) == (1, 0)  # kept while p lives, freed with it
    for out, kept, left in pool2.run(_kept_when, "off"):
        torch.testing.assert_close(out, x @ w, **TOL)
        assert (kept, left) == (0, 0)


def _compiled():
    Pl = sbp.placement("cpu", [0, 1])
    x, w, h = _data(X_SHAPE, (4, 40), (6, 40))
    converted.clear()
    p, gw, gh = _partial(x, Pl), sbp.tensor(w, Pl, S1), sbp.tensor(h, Pl, S1)
    f = torch.compile(lambda p, w, h: (p @ w, p.t() @ h), backend="aot_eager", fullgraph=True)
    keep, traced = converted._keep, []

    def spy(g, kept):  # (every keep: was it of a traced tensor?)
        traced.append(sbp.comm.functional.tracing(kept.out))
        keep(g, kept)

    converted._keep = spy
    try:
        outs = [o.full_tensor() for run in range(2) for o in f(p, gw, gh)]
    finally:
        converted._keep = keep
    return outs, traced


def test_nothing_is_kept_while_compiled_code_is_traced(pool2):
    """Traced, the conversions are graph nodes on fake tensors: none is kept (a fake result
    kept would outlive the trace, or be taken by a later eager use)."""
    x, w, h = _data(X_SHAPE, (4, 40), (6, 40))
    for outs, traced in pool2.run(_compiled):
        assert True not in traced, traced
        for got, ref in zip(outs, [x @ w, x.t() @ h] * 2, strict=True):
            torch.testing.assert_close(got, ref, **TOL)
