"""In-place view ops (sbp.ops.inplace_views): `t_`, `transpose_`, `unsqueeze_`, `squeeze_`,
`as_strided_`, `set_` and `resize_` change a global tensor's shape and layout as the
out-of-place view would, and it stays a view of what it showed. Each case runs on
single-process torch tensors and on global ones (worlds of 2 and 4, uneven shapes), in
float64: values, shapes and the older views' values must match, and the layouts are the
view's. (Before, the local tensor was reshaped under an unchanged spec: silently wrong
shapes on a broadcast tensor, a ValueError on a split one.)"""

from __future__ import annotations

import pytest
import torch

import sbp

S0, S1, B, P = sbp.split(0), sbp.split(1), sbp.broadcast, sbp.partial_sum
SHAPE = (5, 7)  # uneven over 2 and 4 ranks on both dims; shards of one row on 4


def _logical(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _transpose_seen_by_an_older_view(make):
    x = make(_logical(SHAPE, 0), S0)
    older = x[:, 1:3]  # (a true view: the split dim is kept whole)
    x.t_()
    x.mul_(2.0)
    return [x, older]


def _transpose_and_swap_back(make):
    x = make(_logical(SHAPE, 0), S1)
    x.transpose_(0, 1).swapdims_(0, 1)
    x[0].fill_(1.5)
    return [x]


def _unsqueeze_and_squeeze(make):
    x = make(_logical(SHAPE, 0), S0)
    x.unsqueeze_(0)
    x.mul_(3.0)
    x.unsqueeze_(-1).squeeze_(0)
    x.squeeze_()
    return [x]


def _squeeze_keeps_one_row_shards(make):
    x = make(_logical(SHAPE, 0), S0)  # (the local squeeze also dropped shards of one row)
    return [x.unsqueeze(1).squeeze(), x.squeeze(0), x.unsqueeze(0).squeeze(0)]


def _view_in_place_of_a_copied_view(make):
    h = make(_logical(SHAPE, 0), S1)
    c = h[:, 1:5]  # a slice across the split: a copy that writes back
    c.t_()
    c[0].fill_(7.0)
    c.mul_(0.5)
    return [h, c]


def _set_to_another_tensor(make):
    x, y = make(_logical(SHAPE, 0), S0), make(_logical((3, 4), 1), B)
    x.set_(y)
    x.add_(1.0)  # (y shows the same data)
    return [x, y]


def _set_to_nothing(make):
    x = make(_logical(SHAPE, 0), S1)
    x.set_()
    return [x]


def _resize_broadcast(make):
    x = make(_logical(SHAPE, 0), B)
    x.resize_(3, 5)  # (the first 15 elements in flat order)
    x.resize_as_(make(torch.zeros(15), B))
    x.resize_(15)  # (the same shape: nothing to do)
    return [x]


def _resize_partial(make):
    x = make(_logical(SHAPE, 0), P)
    x.resize_(35)
    return [x]


def _as_strided_broadcast(make):
    x = make(_logical(SHAPE, 0), B)
    x.as_strided_((3, 3), (7, 1), 2)
    x.mul_(-1.0)
    return [x]


def _copied_view_written_after_its_base_moved(make):
    h = make(_logical(SHAPE, 0), S0)
    c = h[1:3]  # (a slice across the split: a copy that writes back)
    h.t_()
    c.fill_(-1.0)  # (into the rows it showed: columns of h now)
    return [h, c]


def _copied_view_written_after_its_base_was_set(make):
    h, y = make(_logical(SHAPE, 0), S0), make(_logical(SHAPE, 1), S0)
    c = h[1:3]
    h.set_(y)
    c.fill_(-1.0)  # (into h's old data, shown by neither h nor y)
    return [h, y, c]


def _set_to_itself_and_to_a_moved_view(make):
    h = make(_logical(SHAPE, 0), S0)
    c = h[1:4]
    c.set_(c)  # (nothing to do)
    c.add_(1.0)
    x = make(_logical((1, 7), 1), B)
    x.set_(c)  # (x shows h's rows 1..3 ...)
    c.set_(make(_logical((2, 2), 2), B))  # (... also once c shows something else)
    x.mul_(3.0)
    return [h, x, c]


def _set_to_a_copy_of_its_own_part(make):
    x = make(_logical(SHAPE, 0), S0)
    older = x[:, :3]
    x.set_(x[1:3])  # (a slice across the split: a copy, which writes back)
    x.mul_(2.0)
    return [x, older]


CASES = [
    (_transpose_seen_by_an_older_view, [S1, S0]),
    (_transpose_and_swap_back, [S1]),
    (_unsqueeze_and_squeeze, [S0]),
    (_squeeze_keeps_one_row_shards, [S0, S0, S0]),
    (_view_in_place_of_a_copied_view, [S1, None]),
    (_set_to_another_tensor, [B, B]),
    (_set_to_nothing, [B]),
    (_resize_broadcast, [B]),
    (_resize_partial, [P]),
    (_as_strided_broadcast, [B]),
    (_copied_view_written_after_its_base_moved, [S1, None]),
    (_copied_view_written_after_its_base_was_set, [S0, S0, None]),
    (_set_to_itself_and_to_a_moved_view, [S0, None, B]),
    (_set_to_a_copy_of_its_own_part, [None, S0]),
]


def _run_global(case):
    placement = sbp.placement("cpu", list(range(sbp.env.get_world_size())))

    def make(t, layout):
        if layout == P:  # (a partial sum whose shares are not all equal)
            return sbp.tensor(t, placement=placement, sbp=B).to_global(sbp=P)
        return sbp.tensor(t, placement=placement, sbp=layout)

    outs = case(make)
    return [(o.full_tensor(), tuple(o.shape), o.sbp) for o in outs]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case, layouts", CASES, ids=[c.__name__.strip("_") for c, _ in CASES])
def test_view_in_place_equals_one_process(case, layouts, world, request):
    want = case(lambda t, layout: t.clone())
    for outs in request.getfixturevalue(f"pool{world}").run(_run_global, case):
        for (got, shape, layout), w, keep in zip(outs, want, layouts, strict=True):
            assert shape == tuple(w.shape)
            torch.testing.assert_close(got, w, rtol=1e-12, atol=1e-12)
            if keep is not None:
                assert layout == (keep,)


def _loss_through_views_in_place(w):
    h = w * 2.0
    h.t_()
    h.unsqueeze_(0)
    k = w * 3.0
    k.transpose_(0, 1)
    return (h * h).sum() + (k[2:] ** 3).sum()


def _views_in_place_under_autograd(layout):
    placement = sbp.placement("cpu", [0, 1])
    w = sbp.tensor(_logical(SHAPE, 0), placement=placement, sbp=layout).requires_grad_()
    loss = _loss_through_views_in_place(w)
    loss.backward()
    return loss.item(), w.grad.full_tensor()


@pytest.mark.parametrize("layout", [B, S0, S1])
def test_views_in_place_under_autograd(pool2, layout):
    w = _logical(SHAPE, 0).requires_grad_()
    loss = _loss_through_views_in_place(w)
    loss.backward()
    for got_loss, got_grad in pool2.run(_views_in_place_under_autograd, layout):
        assert abs(got_loss - loss.item()) < 1e-10
        torch.testing.assert_close(got_grad, w.grad, rtol=1e-12, atol=1e-12)


def _transpose_on_a_2x2_placement():
    placement = sbp.placement("cpu", [[0, 1], [2, 3]])
    h = sbp.tensor(_logical(SHAPE, 0), placement=placement, sbp=(S0, S1))
    h.t_()
    h.add_(1.0)
    return h.full_tensor(), h.sbp


def test_transpose_in_place_on_a_2x2_placement_moves_the_splits(pool4):
    want = _logical(SHAPE, 0).t_().add_(1.0)
    for got, layout in pool4.run(_transpose_on_a_2x2_placement):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert layout == (S1, S0)


def _refused(what):
    placement = sbp.placement("cpu", [0, 1])
    x = sbp.tensor(_logical((4, 6), 0), placement=placement, sbp=S0)
    try:
        if what == "resize split":
            x.resize_(6, 4)
        elif what == "set local":
            x.set_(torch.zeros(4, 6, dtype=torch.float64))
        elif what == "resize a copy":
            c = x[1:3]
            c.resize_(12)
            return None, "", tuple(c.shape)
        elif what == "set storage":
            x.set_(torch.zeros(24, dtype=torch.float64).untyped_storage())
        else:  # a strided view of a split tensor is gathered: a copy with no way back
            x.as_strided_((2, 2), (1, 2))
            x.add_(1.0)
    except sbp.SbpError as e:
        return type(e).__name__, str(e), tuple(x.shape)
    return None, "", tuple(x.shape)


@pytest.mark.parametrize(
    "what, error, words",
    [
        ("resize split", "SbpSignatureError", "cannot be resized"),
        ("set local", "PlacementError", "make it global first"),
        ("set storage", "PlacementError", "a storage is one rank's memory"),
        ("resize a copy", "SbpSignatureError", "would no longer show a part"),
        ("write strided", "SbpSignatureError", "cannot reach the base"),
    ],
)
def test_bad_views_in_place_are_refused_on_every_rank(pool2, what, error, words):
    for name, message, shape in pool2.run(_refused, what):
        assert name == error
        assert words in message
        assert shape == ((2, 2) if what == "write strided" else (4, 6))
