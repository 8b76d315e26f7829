"""Pure tests of `sbp.layout`: which part of the logical tensor each coordinate holds.

Results are compared against references written here (numpy `array_split`,
`torch.tensor_split`, and the API's `d // n + 1` formula), never against
`sbp.layout` internals.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict

import numpy as np
import pytest
import torch
from hypothesis import find, given
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

import sbp
from sbp.layout import balanced_range, balanced_sizes, logical_size_along, rank_slices
from sbp.placement import coord_of_index
from sbp.signature import normalize_nd_sbp
from sbp.testing.strategies import GlobalLayout, global_layouts, nd_sbps, shapes

S, B, PS = sbp.split, sbp.broadcast, sbp.partial_sum

# --- references -----------------------------------------------------------------


def api_sizes(d: int, n: int) -> list[int]:
    """The API's rule: `d // n + 1` for the first `d % n` parts, `d // n` for the rest."""
    return [d // n + 1 if i < d % n else d // n for i in range(n)]


def ref_indices(shape, hierarchy, nd_sbp, coord) -> list[np.ndarray]:
    """Indices of the logical tensor held at `coord`, per tensor dim, via `np.array_split`."""
    idx = [np.arange(d) for d in shape]
    for h, s in enumerate(nd_sbp):
        if s.is_split:
            idx[s.dim] = np.array_split(idx[s.dim], hierarchy[h])[coord[h]]
    return idx


def ref_local_value(logical: torch.Tensor, hierarchy, nd_sbp, coord) -> torch.Tensor:
    """The local value held at `coord`, via `torch.tensor_split`, level by level."""
    out = logical
    for h, s in enumerate(nd_sbp):
        if s.is_split:
            out = torch.tensor_split(out, hierarchy[h], dim=s.dim)[coord[h]]
    return out


def all_coords(p) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(n) for n in p.hierarchy)))


@st.composite
def wide_layouts(draw) -> GlobalLayout:
    """Layouts beyond the public strategy: hierarchies of 1 to 3 dims, sides 1 to 3."""
    hierarchy = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    flat = draw(st.permutations(range(math.prod(hierarchy))))
    ranks: list = list(flat)
    for n in reversed(hierarchy[1:]):
        ranks = [ranks[i : i + n] for i in range(0, len(ranks), n)]
    p = sbp.placement("cpu", ranks)
    assert p.hierarchy == tuple(hierarchy)
    shape = draw(shapes(max_side=9))
    return GlobalLayout(shape, p, draw(nd_sbps(p.ndim, len(shape))))


layouts = st.one_of(global_layouts(), wide_layouts())


# --- examples -------------------------------------------------------------------


def _ranges(slices):
    return [(s.start, s.stop) for s in slices]


def test_uneven_1d_examples():
    p = sbp.placement("cpu", [0, 1])
    assert sbp.local_shape((5,), p, S(0), 0) == (3,)
    assert sbp.local_shape((5,), p, S(0), 1) == (2,)
    assert sbp.local_slices((5,), p, S(0), 1) == (slice(3, 5),)
    p4 = sbp.placement("cpu", [3, 2, 1, 0])
    assert [sbp.local_shape((2,), p4, S(0), i) for i in range(4)] == [(1,), (1,), (0,), (0,)]
    assert [_ranges(sbp.local_slices((2,), p4, S(0), i)) for i in range(4)] == [
        [(0, 1)],
        [(1, 2)],
        [(2, 2)],
        [(2, 2)],
    ]
    assert [sbp.local_shape((10, 3), p4, S(0), i) for i in range(4)] == [
        (3, 3),
        (3, 3),
        (2, 3),
        (2, 3),
    ]


def test_nested_split_example():
    p = sbp.placement("cpu", [[0, 1], [2, 3]])
    got = {c: _ranges(sbp.local_slices((7,), p, (S(0), S(0)), c)) for c in all_coords(p)}
    # first by hierarchy dim 0 (4 + 3), then each part by dim 1 (2 + 2, 2 + 1)
    assert got == {
        (0, 0): [(0, 2)],
        (0, 1): [(2, 4)],
        (1, 0): [(4, 6)],
        (1, 1): [(6, 7)],
    }


def test_2d_example_with_permuted_ranks():
    p = sbp.placement("cpu", [[0, 3], [1, 2]])
    nd = (S(0), S(1))
    assert sbp.local_slices((5, 6), p, nd, (1, 1)) == (slice(3, 5), slice(3, 6))
    # rank 3 sits at coord (0, 1)
    assert rank_slices((5, 6), p, nd, 3) == (slice(0, 3), slice(3, 6))
    assert rank_slices((5, 6), p, (S(1), S(0)), 3) == (slice(3, 5), slice(0, 3))
    assert sbp.local_shape((5, 6), p, (S(1), B), (1, 0)) == (5, 3)
    assert sbp.local_shape((5, 6), p, (PS, S(-1)), (1, 0)) == (5, 3)


def test_broadcast_and_partial_hold_everything():
    p = sbp.placement("cpu", [[0, 1], [2, 3]])
    for nd in [(B, B), (PS, B), (sbp.partial_max, sbp.partial_min)]:
        for c in all_coords(p):
            assert sbp.local_slices((3, 5), p, nd, c) == (slice(0, 3), slice(0, 5))
            assert sbp.local_shape((3, 5), p, nd, c) == (3, 5)


def test_scalar_tensor():
    p = sbp.placement("cpu", [0, 1, 2])
    assert sbp.local_slices((), p, B, 2) == ()
    assert sbp.local_shape((), p, PS, 1) == ()


def test_int_coord_equals_1_tuple_coord():
    p = sbp.placement("cpu", [2, 0, 1])
    for i in range(3):
        assert sbp.local_slices((8, 2), p, S(0), i) == sbp.local_slices((8, 2), p, S(0), (i,))


def test_list_shape_and_list_nd_sbp_are_accepted():
    p = sbp.placement("cpu", [[0, 1], [2, 3]])
    assert sbp.local_shape([5, 4], p, [S(0), S(1)], [1, 0]) == (2, 2)
    assert sbp.local_shape(torch.Size([5, 4]), p, (S(0), S(1)), (1, 0)) == (2, 2)


@pytest.mark.parametrize("coord", [2, -1, (0, 0), (3,)])
def test_bad_coord_1d(coord):
    p = sbp.placement("cpu", [0, 1])
    with pytest.raises(sbp.PlacementError, match="coord"):
        sbp.local_slices((4,), p, S(0), coord)


@pytest.mark.parametrize("coord", [0, (0,), (2, 0), (0, -1), (0, 0, 0)])
def test_bad_coord_2d(coord):
    p = sbp.placement("cpu", [[0, 1], [2, 3]])
    with pytest.raises(sbp.PlacementError, match="coord"):
        sbp.local_shape((4,), p, (S(0), B), coord)


def test_rank_not_in_placement():
    p = sbp.placement("cpu", [0, 1])
    with pytest.raises(sbp.PlacementError, match="rank 5"):
        rank_slices((4,), p, (S(0),), 5)


# --- properties against independent references -----------------------------------


@given(layouts)
def test_local_slices_match_array_split_reference(layout):
    shape, p, nd = layout
    for c in all_coords(p):
        slices = sbp.local_slices(shape, p, nd, c)
        assert isinstance(slices, tuple)
        assert len(slices) == len(shape)
        ref = ref_indices(shape, p.hierarchy, nd, c)
        for d, (sl, idx) in enumerate(zip(slices, ref, strict=True)):
            assert sl.step is None
            assert 0 <= sl.start <= sl.stop <= shape[d]
            assert list(range(sl.start, sl.stop)) == idx.tolist()


@given(layouts)
def test_local_values_match_tensor_split_reference(layout):
    shape, p, nd = layout
    logical = torch.arange(math.prod(shape)).reshape(shape)
    for c in all_coords(p):
        local = logical[sbp.local_slices(shape, p, nd, c)]
        ref = ref_local_value(logical, p.hierarchy, nd, c)
        assert local.shape == ref.shape
        assert torch.equal(local, ref)


@given(layouts)
def test_shards_tile_the_logical_tensor(layout):
    shape, p, nd = layout
    split_h = {h for h, s in enumerate(nd) if s.is_split}
    # every element is held once per coordinate of the non-splitting hierarchy dims
    holders = math.prod(n for h, n in enumerate(p.hierarchy) if h not in split_h)
    cover = np.zeros(shape, dtype=np.int64)
    by_group: dict = defaultdict(lambda: np.zeros(shape, dtype=np.int64))
    for c in all_coords(p):
        sl = sbp.local_slices(shape, p, nd, c)
        for d, s in enumerate(sl):
            assert 0 <= s.start <= s.stop <= shape[d]
        cover[sl] += 1
        by_group[tuple(x for h, x in enumerate(c) if h not in split_h)][sl] += 1
    assert (cover == holders).all()
    # coordinates that agree on every non-splitting hierarchy dim tile it exactly once
    assert len(by_group) == holders
    for group_cover in by_group.values():
        assert (group_cover == 1).all()


@given(layouts)
def test_local_shape_is_the_length_of_local_slices(layout):
    shape, p, nd = layout
    logical = np.empty(shape, dtype=np.int8)
    for c in all_coords(p):
        slices = sbp.local_slices(shape, p, nd, c)
        local = sbp.local_shape(shape, p, nd, c)
        assert isinstance(local, tuple)
        assert local == tuple(s.stop - s.start for s in slices)
        assert local == logical[slices].shape
        for d, size in enumerate(local):
            if not any(s.is_split and s.dim == d for s in nd):
                assert size == shape[d]


@given(layouts)
def test_each_level_of_nesting_is_balanced_larger_first(layout):
    shape, p, nd = layout
    k = p.ndim

    def upto(j):  # the signature with only the first j hierarchy dims applied
        return tuple(nd[:j]) + (B,) * (k - j)

    for h, s in enumerate(nd):
        if not s.is_split:
            continue
        n = p.hierarchy[h]
        for prefix in itertools.product(*(range(m) for m in p.hierarchy[:h])):
            parent = sbp.local_slices(shape, p, upto(h), prefix + (0,) * (k - h))[s.dim]
            children = [
                sbp.local_slices(shape, p, upto(h + 1), prefix + (i,) + (0,) * (k - h - 1))[s.dim]
                for i in range(n)
            ]
            sizes = [ch.stop - ch.start for ch in children]
            assert sizes == api_sizes(parent.stop - parent.start, n)
            assert sizes == sorted(sizes, reverse=True)
            assert max(sizes) - min(sizes) <= 1
            # children are contiguous, in order, and cover the parent
            assert children[0].start == parent.start
            assert children[-1].stop == parent.stop
            for a, b in itertools.pairwise(children):
                assert a.stop == b.start


@given(shapes(min_dims=1, max_side=20), st.integers(1, 8), st.data())
def test_1d_split_follows_the_api_formula(shape, n, data):
    dim = data.draw(st.integers(0, len(shape) - 1))
    p = sbp.placement("cpu", data.draw(st.permutations(range(n))))
    d = shape[dim]
    sizes = []
    for i in range(n):
        expected = list(shape)
        expected[dim] = d // n + 1 if i < d % n else d // n
        got = sbp.local_shape(shape, p, S(dim), i)
        assert got == tuple(expected)
        assert sbp.local_shape(shape, p, S(dim - len(shape)), i) == got
        assert sbp.local_slices(shape, p, (S(dim - len(shape)),), (i,)) == sbp.local_slices(
            shape, p, S(dim), i
        )
        sizes.append(got[dim])
    assert sum(sizes) == d
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)


@given(layouts, st.data())
def test_negative_split_dims_give_the_same_layout(layout, data):
    shape, p, nd = layout
    negative = tuple(
        S(s.dim - len(shape)) if s.is_split and data.draw(st.booleans()) else s for s in nd
    )
    for c in all_coords(p):
        assert sbp.local_slices(shape, p, negative, c) == sbp.local_slices(shape, p, nd, c)


@given(layouts)
def test_rank_slices_address_by_rank(layout):
    shape, p, nd = layout
    for r in p.flat_ranks:
        assert rank_slices(shape, p, nd, r) == sbp.local_slices(shape, p, nd, p.coord(r))


@given(layouts)
def test_logical_size_along_inverts_local_sizes(layout):
    shape, p, nd = layout
    local_shapes = [
        sbp.local_shape(shape, p, nd, coord_of_index(i, p.hierarchy)) for i in range(p.size)
    ]
    for d in range(len(shape)):
        sizes = [ls[d] for ls in local_shapes]
        assert logical_size_along(sizes, p.hierarchy, nd, d) == shape[d]


@given(st.integers(0, 60), st.integers(1, 9))
def test_balanced_helpers_match_array_split(size, parts):
    ref = np.array_split(np.arange(size), parts)
    assert balanced_sizes(size, parts) == [len(r) for r in ref] == api_sizes(size, parts)
    start = 0
    for i, r in enumerate(ref):
        a, b = balanced_range(size, parts, i)
        assert (a, b) == (start, start + len(r))
        assert list(range(a, b)) == r.tolist()
        start = b


# --- the shapes / global_layouts strategies ------------------------------------


@given(shapes())
def test_shapes_strategy_defaults(shape):
    assert isinstance(shape, tuple)
    assert 0 <= len(shape) <= 3
    assert all(isinstance(d, int) and 0 <= d <= 7 for d in shape)


@given(st.integers(0, 3), st.integers(0, 3), st.integers(0, 5), st.data())
def test_shapes_strategy_bounds(lo, extra, side, data):
    shape = data.draw(shapes(min_dims=lo, max_dims=lo + extra, max_side=side))
    assert lo <= len(shape) <= lo + extra
    assert all(0 <= d <= side for d in shape)


def test_shapes_strategy_reaches_awkward_sizes():
    assert 0 in find(shapes(min_dims=1), lambda s: 0 in s)
    assert find(shapes(), lambda s: len(s) == 3 and all(d in (1, 2, 3) for d in s))
    assert find(shapes(), lambda s: any(d > 4 and d % 4 for d in s))
    assert find(shapes(), lambda s: s == ()) == ()


@given(global_layouts())
def test_global_layouts_fit_together(layout):
    shape, p, nd = layout
    assert layout.shape is shape and layout.placement is p and layout.nd_sbp is nd
    p.check_in_world(4)
    assert len(nd) == p.ndim
    assert normalize_nd_sbp(nd, p.ndim, len(shape)) == nd
    assert len(shape) <= 3
    assert all(0 <= d <= 7 for d in shape)


@given(global_layouts(world_size=2, partial=False, device_type="cuda", min_dims=1, max_side=3))
def test_global_layouts_options(layout):
    shape, p, nd = layout
    p.check_in_world(2)
    assert p.type == "cuda"
    assert p.ndim == 1
    assert len(shape) >= 1
    assert all(d <= 3 for d in shape)
    assert not any(s.is_partial for s in nd)


def test_global_layouts_reach_nested_splits():
    layout = find(
        global_layouts(), lambda g: g.placement.ndim == 2 and g.nd_sbp[0] == g.nd_sbp[1] == S(0)
    )
    assert layout.nd_sbp == (S(0), S(0))
    assert find(global_layouts(), lambda g: any(s.is_partial for s in g.nd_sbp))


@pytest.mark.parametrize(
    "kwargs", [{"min_dims": -1}, {"min_dims": 3, "max_dims": 2}, {"max_side": -1}]
)
def test_shapes_strategy_rejects_bad_arguments(kwargs):
    with pytest.raises(InvalidArgument):
        shapes(**kwargs)
