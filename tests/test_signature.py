"""Pure tests of `sbp.signature`: SBP values and nd_sbp normalisation."""

from __future__ import annotations

import copy
import pickle

import pytest
from hypothesis import find, given
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument, NoSuchExample

import sbp
from sbp.signature import (
    SBP,
    Partial,
    Split,
    format_nd_sbp,
    is_all_broadcast,
    normalize_nd_sbp,
)
from sbp.testing.strategies import nd_sbps, sbps

ALL_KINDS = [sbp.split(0), sbp.split(2), sbp.broadcast, sbp.partial_sum, sbp.partial_max]
ALL_KINDS += [sbp.partial_min]

# --- SBP values -----------------------------------------------------------------


def test_reprs():
    assert repr(sbp.split(0)) == "sbp.split(dim=0)"
    assert repr(sbp.split(3)) == "sbp.split(dim=3)"
    assert repr(sbp.split(-1)) == "sbp.split(dim=-1)"
    assert repr(sbp.broadcast) == "sbp.broadcast"
    assert repr(sbp.partial_sum) == "sbp.partial_sum"
    assert repr(sbp.partial_max) == "sbp.partial_max"
    assert repr(sbp.partial_min) == "sbp.partial_min"
    assert str(sbp.split(1)) == "sbp.split(dim=1)"


def test_split_dim_keyword():
    assert sbp.split(dim=1) == sbp.split(1)
    assert sbp.split(1).dim == 1


def test_kind_flags():
    s, b, p = sbp.split(0), sbp.broadcast, sbp.partial_sum
    assert (s.is_split, s.is_broadcast, s.is_partial) == (True, False, False)
    assert (b.is_split, b.is_broadcast, b.is_partial) == (False, True, False)
    for q in (sbp.partial_sum, sbp.partial_max, sbp.partial_min):
        assert (q.is_split, q.is_broadcast, q.is_partial) == (False, False, True)
    assert [q.op for q in (sbp.partial_sum, sbp.partial_max, sbp.partial_min)] == [
        "sum",
        "max",
        "min",
    ]
    assert p.op == "sum"


def test_equality_and_hash():
    assert sbp.split(0) == sbp.split(0)
    assert hash(sbp.split(1)) == hash(sbp.split(1))
    assert sbp.split(0) != sbp.split(1)
    assert sbp.split(-1) != sbp.split(1)  # only normalisation with a tensor ndim relates them
    for i, a in enumerate(ALL_KINDS):
        for j, b in enumerate(ALL_KINDS):
            assert (a == b) == (i == j), (a, b)
    assert len(set(ALL_KINDS)) == len(ALL_KINDS)
    assert sbp.broadcast != "B"
    assert sbp.partial_sum != "sum"
    assert sbp.split(0) != 0


@pytest.mark.parametrize("s", ALL_KINDS)
def test_pickle_and_copy_round_trip(s):
    for t in (pickle.loads(pickle.dumps(s)), copy.deepcopy(s), copy.copy(s)):
        assert t == s
        assert hash(t) == hash(s)
        assert repr(t) == repr(s)
        assert isinstance(t, SBP)


def test_nd_sbp_tuples_are_hashable_values():
    a = (sbp.split(0), sbp.broadcast)
    b = pickle.loads(pickle.dumps(a))
    assert a == b
    assert {a: 1}[b] == 1


@pytest.mark.parametrize("dim", [1.0, "0", None, True, False, [0]])
def test_split_dim_must_be_int(dim):
    with pytest.raises(sbp.SbpSignatureError, match="dim"):
        sbp.split(dim)


def test_partial_op_is_checked():
    with pytest.raises(sbp.SbpSignatureError, match="partial op"):
        Partial("mean")


def test_short_format():
    nd = (sbp.split(1), sbp.broadcast, sbp.partial_sum, sbp.partial_max, sbp.partial_min)
    assert format_nd_sbp(nd) == "(S(1), B, P, P(max), P(min))"


def test_is_all_broadcast():
    assert is_all_broadcast((sbp.broadcast,))
    assert is_all_broadcast((sbp.broadcast, sbp.broadcast))
    assert not is_all_broadcast((sbp.broadcast, sbp.split(0)))
    assert not is_all_broadcast((sbp.partial_sum,))


# --- normalize_nd_sbp -----------------------------------------------------------


@pytest.mark.parametrize("s", ALL_KINDS)
def test_single_sbp_is_a_1_tuple_for_1d(s):
    assert normalize_nd_sbp(s, 1) == (s,)
    assert normalize_nd_sbp(s, 1, 3) == (s,)


def test_list_and_tuple_are_accepted():
    nd = (sbp.split(0), sbp.partial_sum)
    assert normalize_nd_sbp(list(nd), 2) == nd
    assert normalize_nd_sbp(nd, 2) == nd
    assert isinstance(normalize_nd_sbp(list(nd), 2), tuple)


@pytest.mark.parametrize(
    ("dim", "ndim", "expected"),
    [(-1, 1, 0), (-1, 3, 2), (-3, 3, 0), (-2, 4, 2), (0, 1, 0), (2, 3, 2)],
)
def test_negative_split_dims_are_normalised(dim, ndim, expected):
    assert normalize_nd_sbp(sbp.split(dim), 1, ndim) == (sbp.split(expected),)
    nd = normalize_nd_sbp((sbp.broadcast, sbp.split(dim)), 2, ndim)
    assert nd == (sbp.broadcast, sbp.split(expected))


def test_without_tensor_ndim_split_dims_are_kept():
    assert normalize_nd_sbp(sbp.split(-1), 1) == (sbp.split(-1),)
    assert normalize_nd_sbp(sbp.split(9), 1) == (sbp.split(9),)


@pytest.mark.parametrize(("dim", "ndim"), [(1, 1), (3, 3), (-2, 1), (-4, 3), (0, 0), (-1, 0)])
def test_split_dim_out_of_range(dim, ndim):
    with pytest.raises(sbp.SbpSignatureError, match=rf"sbp split dim {dim} .*{ndim} dims"):
        normalize_nd_sbp(sbp.split(dim), 1, ndim)
    with pytest.raises(sbp.SbpSignatureError, match="dim"):
        normalize_nd_sbp((sbp.broadcast, sbp.split(dim)), 2, ndim)


@pytest.mark.parametrize(
    ("value", "hierarchy_ndim"),
    [
        ((), 1),
        ((sbp.broadcast,), 2),
        (sbp.broadcast, 2),
        ((sbp.split(0), sbp.broadcast), 1),
        ([sbp.broadcast] * 3, 2),
    ],
)
def test_wrong_nd_sbp_length(value, hierarchy_ndim):
    with pytest.raises(sbp.SbpSignatureError, match=rf"sbp has .*{hierarchy_ndim} dims"):
        normalize_nd_sbp(value, hierarchy_ndim)


@pytest.mark.parametrize(
    "value",
    [(sbp.broadcast, "S(0)"), (0, sbp.broadcast), (None, None), ((sbp.broadcast,), sbp.broadcast)],
)
def test_non_sbp_entries(value):
    with pytest.raises(sbp.SbpSignatureError, match="sbp entries"):
        normalize_nd_sbp(value, 2)


@pytest.mark.parametrize("value", ["B", "S(0)", 0, None, {sbp.broadcast}, Split])
def test_non_sbp_argument(value):
    with pytest.raises(sbp.SbpSignatureError, match="sbp must be"):
        normalize_nd_sbp(value, 1)


def test_signature_errors_are_sbp_errors():
    with pytest.raises(sbp.SbpError):
        normalize_nd_sbp(sbp.split(5), 1, 2)
    with pytest.raises(ValueError):
        normalize_nd_sbp("B", 1)


def test_local_shape_checks_the_signature():
    p1 = sbp.placement("cpu", [0, 1])
    p2 = sbp.placement("cpu", [[0, 1], [2, 3]])
    with pytest.raises(sbp.SbpSignatureError, match="split dim 2"):
        sbp.local_shape((4, 4), p1, sbp.split(2), 0)
    with pytest.raises(sbp.SbpSignatureError, match="split dim -3"):
        sbp.local_slices((4, 4), p1, sbp.split(-3), 0)
    with pytest.raises(sbp.SbpSignatureError, match="split dim 0"):
        sbp.local_shape((), p1, sbp.split(0), 0)
    with pytest.raises(sbp.SbpSignatureError, match="sbp has 1 entries"):
        sbp.local_shape((4, 4), p2, sbp.split(0), (0, 0))
    with pytest.raises(sbp.SbpSignatureError, match="sbp has 3 entries"):
        sbp.local_shape((4, 4), p2, (sbp.broadcast,) * 3, (0, 0))
    with pytest.raises(sbp.SbpSignatureError, match="sbp entries"):
        sbp.local_shape((4, 4), p2, (sbp.broadcast, 1), (0, 0))


# --- properties -----------------------------------------------------------------


@st.composite
def _signature_case(draw):
    hierarchy_ndim = draw(st.integers(1, 3))
    tensor_ndim = draw(st.integers(0, 4))
    return hierarchy_ndim, tensor_ndim, draw(nd_sbps(hierarchy_ndim, tensor_ndim))


@given(_signature_case())
def test_valid_signatures_normalise_to_themselves(case):
    hierarchy_ndim, tensor_ndim, nd = case
    assert normalize_nd_sbp(nd, hierarchy_ndim, tensor_ndim) == nd
    assert normalize_nd_sbp(list(nd), hierarchy_ndim) == nd
    if hierarchy_ndim == 1:
        assert normalize_nd_sbp(nd[0], 1, tensor_ndim) == nd


@given(_signature_case(), st.data())
def test_negative_dims_normalise_like_python_indexing(case, data):
    hierarchy_ndim, tensor_ndim, nd = case
    # rewrite some split dims to their negative spelling
    flip = data.draw(st.lists(st.booleans(), min_size=hierarchy_ndim, max_size=hierarchy_ndim))
    negative = tuple(
        sbp.split(s.dim - tensor_ndim) if s.is_split and f else s
        for s, f in zip(nd, flip, strict=True)
    )
    got = normalize_nd_sbp(negative, hierarchy_ndim, tensor_ndim)
    assert got == nd
    assert normalize_nd_sbp(got, hierarchy_ndim, tensor_ndim) == got  # idempotent
    for s in got:
        if s.is_split:
            assert list(range(tensor_ndim))[s.dim] == s.dim


@given(st.integers(0, 4), st.integers(-10, 10))
def test_split_dim_range_matches_python_indexing(tensor_ndim, dim):
    dims = list(range(tensor_ndim))
    try:
        expected = dims[dim]
    except IndexError:
        with pytest.raises(sbp.SbpSignatureError, match="dim"):
            normalize_nd_sbp(sbp.split(dim), 1, tensor_ndim)
    else:
        assert normalize_nd_sbp(sbp.split(dim), 1, tensor_ndim) == (sbp.split(expected),)


# --- the sbps / nd_sbps strategies ---------------------------------------------


@given(st.integers(0, 4), st.data())
def test_sbps_strategy(ndim, data):
    s = data.draw(sbps(ndim))
    assert isinstance(s, SBP)
    if s.is_split:
        assert 0 <= s.dim < ndim
    t = data.draw(sbps(ndim, partial=False))
    assert not t.is_partial


def test_sbps_strategy_values():
    assert find(sbps(0), lambda s: True) == sbp.broadcast
    for ndim in (0, 1, 3):
        for s in [sbp.broadcast, sbp.partial_sum, sbp.partial_max, sbp.partial_min]:
            assert find(sbps(ndim), lambda x, s=s: x == s) == s
        for d in range(ndim):
            assert find(sbps(ndim), lambda x, d=d: x == sbp.split(d)) == sbp.split(d)
    with pytest.raises(NoSuchExample):
        find(sbps(0), lambda x: x.is_split)
    with pytest.raises(NoSuchExample):
        find(sbps(2, partial=False), lambda x: x.is_partial)


@given(st.integers(1, 3), st.integers(0, 3), st.booleans(), st.data())
def test_nd_sbps_strategy(hierarchy_ndim, tensor_ndim, partial, data):
    nd = data.draw(nd_sbps(hierarchy_ndim, tensor_ndim, partial=partial))
    assert isinstance(nd, tuple)
    assert len(nd) == hierarchy_ndim
    assert normalize_nd_sbp(nd, hierarchy_ndim, tensor_ndim) == nd
    if not partial:
        assert not any(s.is_partial for s in nd)


def test_nd_sbps_strategy_allows_nested_splits():
    nd = find(nd_sbps(2, 2), lambda nd: nd[0].is_split and nd[0] == nd[1])
    assert nd == (sbp.split(0), sbp.split(0))


@pytest.mark.parametrize(
    ("strategy", "args"),
    [(sbps, (-1,)), (nd_sbps, (0, 1)), (nd_sbps, (1, -1)), (sbps, (1.5,))],
)
def test_strategies_reject_bad_arguments(strategy, args):
    with pytest.raises(InvalidArgument):
        strategy(*args)
