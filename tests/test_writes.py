"""In-place writes (sbp.ops.writes): the written tensor keeps its layout, and a write into a
view reaches its base even where sbp had to copy the view (a slice across a split dim, a
chunk of a split dim, a view that loses a split). Each case runs on single-process torch
tensors and on global ones (worlds of 2 and 4, uneven shapes), in float64; the logical
results must match and every written tensor must keep its sbp."""

from __future__ import annotations

import pytest
import torch

import sbp

S0, S1, B, P = sbp.split(0), sbp.split(1), sbp.broadcast, sbp.partial_sum
SHAPE = (5, 7)  # uneven over 2 and 4 ranks on both dims


def _logical(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _slice_of_broadcast_gets_split(make):
    h, x = make(_logical(SHAPE, 0), B), make(_logical((5, 4), 1), S0)
    h[:, :4].add_(x)
    return [h]


def _slice_across_split(make):
    h, x = make(_logical(SHAPE, 0), S1), make(_logical((5, 4), 1), B)
    h[:, 1:5].add_(x)
    return [h]


def _augmented_slice_assignment(make):
    h, x = make(_logical(SHAPE, 0), S1), make(_logical((5, 3), 1), S0)
    h[:, 2:5] += x
    return [h]


def _select_across_split(make):
    h = make(_logical(SHAPE, 0), S0)
    h[3].mul_(-2)
    h.select(1, 6).fill_(0.5)
    return [h]


def _chunks_of_split_dim(make):
    qkv = make(_logical((5, 9), 0), S1)
    q, k, v = qkv.chunk(3, dim=-1)
    q.mul_(0.25)
    v.zero_()
    return [qkv, k]


def _tensor_split_of_split_dim(make):
    t = make(_logical(SHAPE, 0), S1)
    a, b = torch.tensor_split(t, [3], dim=1)
    c, d, e = t.tensor_split(3, dim=0)
    b.mul_(-1.0)
    d.fill_(0.5)
    t.add_(1.0)
    return [t, a * 1.0, e]


def _unbind_split_dim(make):
    t = make(_logical((5, 3), 0), S1)
    a, b, c = t.unbind(1)
    b.add_(a)
    return [t]


def _view_losing_its_split(make):
    x = make(_logical((4, 6), 0), S1)
    x.view(24).add_(1)
    x.view(2, 12).mul_(3)
    return [x]


def _view_of_a_copied_view(make):
    h = make(_logical(SHAPE, 0), S1)
    h[:, :4][1].fill_(7.0)  # a select (a true view) of a slice across the split (a copy)
    h[:, 3:].t()[0].sub_(1)
    return [h]


def _write_back_partial(make):
    p = make(_logical(SHAPE, 0), P)
    p.exp_()  # no partial candidate: computed reduced, made partial again
    q = make(_logical(SHAPE, 1), P)
    q.fill_(3.0)
    return [p, q]


def _partial_plus_broadcast(make):
    p, b = make(_logical(SHAPE, 0), P), make(_logical(SHAPE, 1), B)
    p.add_(b)
    b.mul_(p)
    return [p, b]


def _index_put_keeps_split(make):
    x = make(_logical(SHAPE, 0), S0)
    x[torch.tensor([0, 4, 2])] = make(_logical((3, 7), 1), B)
    x[x < 0] = 0.0
    return [x]


def _copy_into_copied_views(make):
    h = make(_logical(SHAPE, 0), S0)
    h[3].copy_(h[0] * 10.0)  # (a select across the split: a copy, in the source's layout)
    torch.mul(h[1], 10.0, out=h[2])
    return [h]


def _index_put_of_a_partial_sum_into_broadcast(make):
    """`y[idx] = v` with `v` a partial sum (a column sum of a split tensor; a slice of a split
    one, made partial at no cost): the write boxes `y` to partial, which hands the first
    rank its own local tensor back; it skipped the all-reduce the others ran (a wrong row
    there, a hang elsewhere)."""
    y, a = make(_logical(SHAPE, 0), B), make(_logical(SHAPE, 1), S0)
    z, w = make(_logical(SHAPE, 2), B), make(_logical(SHAPE, 3), S0)
    y[torch.tensor([1])] = a.sum(0)
    z[torch.tensor([4, 0, 2])] = w[:3]
    return [y, z]


def _copied_views_see_later_writes_into_their_base(make):
    """The other way: a copied view read after its base was written shows the new values,
    as a torch view does: written in place, through a true view of it, through another
    copied view of it, by `g[i] = v`; and a view of the copy too."""
    h = make(_logical(SHAPE, 0), S1)
    v = h[:, 1:5]  # (across the split: a copy)
    w = v[1:3]  # (a view of the copy)
    h.mul_(10.0)
    a = v * 1.0
    h[:, :2].add_(1.0)  # (a true view of the base)
    b = w + 0.0
    qkv = make(_logical((5, 9), 1), S1)
    q, k, _ = qkv.chunk(3, dim=-1)
    across = qkv[:, 2:5]  # (overlaps q and k)
    q.mul_(-2.0)  # (a copy written: the write reaches qkv, and so `across`)
    c = across * 1.0
    h[2] = 3.0
    return [a, b, c, v, w, k.sum(0), across]


def _views_that_lose_a_split_see_later_writes(make):
    x = make(_logical((4, 6), 0), S1)
    flat, rows = x.view(24), x.unbind(0)
    x.add_(1.0)
    e = x[1:2].expand(3, 6)  # (a slice across nothing split, then expanded)
    z = make(torch.complex(_logical((4, 3), 1), _logical((4, 3), 2)), S0)
    zc = z.conj()  # (resolved at once in sbp: a copy)
    z.mul_(3.0)
    s = make(_logical((4, 6), 3), S0)
    e2 = s[:1].expand(3, 6)  # (across the split, then expanded)
    s.mul_(-1.0)
    return [flat * 1.0, rows[2], e, zc.abs(), zc * 1.0, e2 + 0.0]


def _foreach_ops_on_copied_views(make):
    """List ops (optimizers, clip_grad_norm_) read copied views fresh and write through them
    (a `_foreach_add_` into one left its base unwritten)."""
    h, w = make(_logical((4, 6), 0), S1), make(_logical(SHAPE, 1), S1)
    torch._foreach_add_([h.view(-1), w[:, 1:5]], [1.0, 2.0])
    v = w[:, 2:6]
    w.mul_(3.0)
    return [h, w, torch._foreach_mul([v], 0.5)[0]]


def _broadcast_copied_view_read_whole(make):
    """`full_tensor()` of a copied view already broadcast (unfold has no rule: it runs on
    broadcast inputs) re-boxes nothing, so it reads the local tensor: taken again first."""
    h = make(_logical((4, 8), 0), S1)
    u = h.unfold(1, 3, 1)
    h.mul_(10.0)
    return [u]


def _plain_value_copied_into_a_copied_view(make):
    """`v.copy_(plain)` takes a plain source as the logical value (no dispatch): into a
    copied view it must still reach the base (it did not: the base kept its values)."""
    h = make(_logical(SHAPE, 0), S1)
    h[:, 1:5].copy_(_logical((5, 4), 1))
    h[3].copy_(_logical((7,), 2))
    return [h]


CASES = [
    (_copied_views_see_later_writes_into_their_base, [None] * 7),
    (_views_that_lose_a_split_see_later_writes, [None] * 6),
    (_plain_value_copied_into_a_copied_view, [S1]),
    (_foreach_ops_on_copied_views, [S1, S1, None]),
    (_broadcast_copied_view_read_whole, [B]),
    (_index_put_of_a_partial_sum_into_broadcast, [B, B]),
    (_slice_of_broadcast_gets_split, [B]),
    (_slice_across_split, [S1]),
    (_augmented_slice_assignment, [S1]),
    (_select_across_split, [S0]),
    (_chunks_of_split_dim, [S1, None]),
    (_tensor_split_of_split_dim, [S1, None, None]),
    (_unbind_split_dim, [S1]),
    (_view_losing_its_split, [S1]),
    (_view_of_a_copied_view, [S1]),
    (_write_back_partial, [P, P]),
    (_partial_plus_broadcast, [P, B]),
    (_index_put_keeps_split, [S0]),
    (_copy_into_copied_views, [S0]),
]


def _run_global(case):
    placement = sbp.placement("cpu", list(range(sbp.env.get_world_size())))
    made = []

    def make(t, layout):
        g = sbp.tensor(t, placement=placement, sbp=layout)
        made.append(g)
        return g

    outs = case(make)
    return [(o.full_tensor(), o.sbp) for o in outs]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case, layouts", CASES, ids=[c.__name__.strip("_") for c, _ in CASES])
def test_write_equals_one_process_and_keeps_layout(case, layouts, world, pool2, pool4):
    want = case(lambda t, layout: t.clone())
    pool = pool2 if world == 2 else pool4
    for outs in pool.run(_run_global, case):
        for (got, layout), w, keep in zip(outs, want, layouts, strict=True):
            torch.testing.assert_close(got, w, rtol=1e-12, atol=1e-12)
            if keep is not None:
                assert layout == (keep,)


def _slice_write_under_autograd():
    placement = sbp.placement("cpu", [0, 1])
    w = sbp.tensor(_logical(SHAPE, 0), placement=placement, sbp=S1).requires_grad_()
    y = w * 1.0
    y[:, 1:5].mul_(3.0)  # recorded by autograd (CopySlices), written through by sbp
    (y * y).sum().backward()
    return y.full_tensor().detach(), w.grad.full_tensor()


def test_write_into_copied_view_under_autograd(pool2):
    w = _logical(SHAPE, 0).requires_grad_()
    y = w * 1.0
    y[:, 1:5].mul_(3.0)
    (y * y).sum().backward()
    for got_y, got_grad in pool2.run(_slice_write_under_autograd):
        torch.testing.assert_close(got_y, y.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got_grad, w.grad, rtol=1e-12, atol=1e-12)


def _write_with_no_way_back(view):
    placement = sbp.placement("cpu", [0, 1])
    x = sbp.tensor(_logical((4, 4), 0), placement=placement, sbp=S0)
    if view == "conj":  # (a conjugated view is resolved at once: a copy)
        x = sbp.tensor(torch.complex(_logical((4, 4), 0), _logical((4, 4), 1)), placement, S0)
    before = x.full_tensor()
    try:
        if view == "diagonal":
            x.diagonal().mul_(2.0)  # (the diagonal of a split matrix is gathered: a copy)
        else:
            x.conj().mul_(2.0)
    except sbp.SbpError as e:
        return type(e).__name__, str(e), x.full_tensor(), before
    return None, "", x.full_tensor(), before


@pytest.mark.parametrize("view", ["diagonal", "conj"])
def test_write_into_a_copy_with_no_way_back_is_refused_on_every_rank(pool2, view):
    for name, message, x, before in pool2.run(_write_with_no_way_back, view):
        assert name == "SbpSignatureError"
        assert "cannot reach the base" in message
        torch.testing.assert_close(x, before, rtol=0, atol=0)


def _writes_on_a_2x2_placement(case_name):
    placement = sbp.placement("cpu", [[0, 1], [2, 3]])
    h = sbp.tensor(_logical(SHAPE, 0), placement=placement, sbp=(P, S1))
    x = sbp.tensor(_logical((5, 4), 1), placement=placement, sbp=(S0, B))
    if case_name == "slice":
        h[:, 1:5].add_(x)
    elif case_name == "setitem":
        h[1:4, 2] = 7.0
        h[0] = sbp.tensor(_logical((7,), 2), placement=placement, sbp=(B, B))
    else:
        h.exp_()
        h.view(-1).mul_(0.5)
    return h.full_tensor(), h.sbp


@pytest.mark.parametrize("case_name", ["slice", "setitem", "write_back"])
def test_writes_on_a_2x2_placement_keep_partial_and_split(pool4, case_name):
    h, x = _logical(SHAPE, 0), _logical((5, 4), 1)
    if case_name == "slice":
        h[:, 1:5].add_(x)
    elif case_name == "setitem":
        h[1:4, 2] = 7.0
        h[0] = _logical((7,), 2)
    else:
        h.exp_()
        h.view(-1).mul_(0.5)
    for got, layout in pool4.run(_writes_on_a_2x2_placement, case_name):
        torch.testing.assert_close(got, h, rtol=1e-12, atol=1e-12)
        assert layout == (P, S1)


def _copied_view_of_a_parameter(how):
    placement = sbp.placement("cpu", [0, 1])
    w = sbp.tensor(_logical(SHAPE, 0), placement=placement, sbp=S1).requires_grad_()
    with torch.no_grad():
        v = w.view(-1)  # (the split dim is not the first: a copy)
    first = v * 1.0
    if how == "sgd":
        (w * w).sum().backward()
        torch.optim.SGD([w], lr=0.25).step()
    else:  # every rank writes its own shard, outside the dispatcher
        w.to_local().mul_(3.0)
    with torch.no_grad():  # (torch refuses a view made so read with grad after the step)
        return first.full_tensor(), (v * 1.0).full_tensor()


@pytest.mark.parametrize("how", ["sgd", "to_local"])
def test_a_copied_view_sees_an_optimizer_step_and_local_writes_into_its_base(pool2, how):
    w = _logical(SHAPE, 0).requires_grad_()
    with torch.no_grad():
        v = w.view(-1)
    first = v * 1.0
    if how == "sgd":
        (w * w).sum().backward()
        torch.optim.SGD([w], lr=0.25).step()
    else:
        w.detach().mul_(3.0)
    with torch.no_grad():
        second = v * 1.0
    for got_first, got_second in pool2.run(_copied_view_of_a_parameter, how):
        torch.testing.assert_close(got_first, first, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got_second, second, rtol=1e-12, atol=1e-12)


def _copied_view_read_after_its_base_is_written_under_autograd():
    placement = sbp.placement("cpu", [0, 1])
    w = sbp.tensor(_logical(SHAPE, 0), placement=placement, sbp=S1).requires_grad_()
    y = w * 1.0
    v = y[:, 1:5]
    y.mul_(3.0)  # autograd takes v as a view of the new y; sbp takes its values again
    (v * v).sum().backward()
    return v.full_tensor().detach(), w.grad.full_tensor()


def test_a_copied_view_read_after_its_base_is_written_under_autograd(pool2):
    w = _logical(SHAPE, 0).requires_grad_()
    y = w * 1.0
    v = y[:, 1:5]
    y.mul_(3.0)
    (v * v).sum().backward()
    for got_v, got_grad in pool2.run(_copied_view_read_after_its_base_is_written_under_autograd):
        torch.testing.assert_close(got_v, v.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got_grad, w.grad, rtol=1e-12, atol=1e-12)
