"""Pure tests of `sbp.placement`: construction checks, accessors, value semantics."""

from __future__ import annotations

import copy
import pickle

import pytest
from hypothesis import find, given
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

import sbp
from sbp.placement import coord_of_index, index_of_coord
from sbp.testing.strategies import placements

# --- construction and accessors -------------------------------------------------


def test_1d_accessors():
    p = sbp.placement("cpu", [0, 1])
    assert p.type == "cpu"
    assert p.ranks == [0, 1]
    assert p.hierarchy == (2,)
    assert p.size == 2
    assert p.ndim == 1
    assert p.flat_ranks == (0, 1)


def test_2d_accessors():
    p = sbp.placement("cuda", [[0, 1], [2, 3]])
    assert p.type == "cuda"
    assert p.ranks == [[0, 1], [2, 3]]
    assert p.hierarchy == (2, 2)
    assert p.size == 4
    assert p.ndim == 2


def test_3d_and_non_square_hierarchies():
    p = sbp.placement("cpu", [[[0], [1], [2]], [[3], [4], [5]]])
    assert p.hierarchy == (2, 3, 1)
    assert p.size == 6
    assert p.ranks == [[[0], [1], [2]], [[3], [4], [5]]]
    q = sbp.placement("cpu", [[5, 1, 3]])
    assert q.hierarchy == (1, 3)
    assert q.ranks == [[5, 1, 3]]


def test_ranks_are_as_given_not_sorted():
    p = sbp.placement("cpu", [[3, 0], [2, 1]])
    assert p.ranks == [[3, 0], [2, 1]]
    assert p.flat_ranks == (3, 0, 2, 1)
    assert sbp.placement("cpu", [7, 2, 5]).ranks == [7, 2, 5]


def test_ranks_is_a_fresh_copy():
    p = sbp.placement("cpu", [[0, 1], [2, 3]])
    r = p.ranks
    r[0][0] = 99
    r.append([5, 6])
    assert p.ranks == [[0, 1], [2, 3]]


def test_range_and_tuple_ranks_are_accepted():
    assert sbp.placement("cpu", range(3)) == sbp.placement("cpu", [0, 1, 2])
    assert sbp.placement("cpu", ((0, 1), (2, 3))) == sbp.placement("cpu", [[0, 1], [2, 3]])
    assert sbp.placement("cpu", range(3)).ranks == [0, 1, 2]


def test_contains():
    p = sbp.placement("cpu", [[0, 3], [5, 2]])
    for r in (0, 3, 5, 2):
        assert r in p
    for r in (1, 4, 6, -1, "0", None):
        assert r not in p


def test_contains_unhashable_is_false():
    assert [0] not in sbp.placement("cpu", [0, 1])


def test_numpy_ints_are_ranks_and_bytes_are_not():
    import numpy as np

    p = sbp.placement("cpu", [np.int64(1), np.int64(0)])
    assert p.ranks == [1, 0] and p.rank_at(0) == 1 and p.rank_at(np.int64(1)) == 0
    assert sbp.split(np.int64(1)).dim == 1
    with pytest.raises(sbp.PlacementError, match="ranks"):
        sbp.placement("cpu", b"\x00\x01")
    with pytest.raises(sbp.PlacementError, match="hierarchy dim 1"):
        p.group_ranks(0, 1)


def test_bad_logical_shape_is_named():
    p = sbp.placement("cpu", [0, 1])
    with pytest.raises(sbp.SbpError, match="shape"):
        sbp.local_shape((-3, 2), p, sbp.split(0), 0)
    with pytest.raises(sbp.SbpError, match="shape"):
        sbp.local_shape((3, 2.7), p, sbp.split(0), 0)


def test_equality_and_hash():
    a = sbp.placement("cpu", [[0, 1], [2, 3]])
    b = sbp.placement("cpu", [[0, 1], [2, 3]])
    assert a == b
    assert hash(a) == hash(b)
    assert len({a, b}) == 1
    # rank order matters
    assert a != sbp.placement("cpu", [[0, 3], [1, 2]])
    assert sbp.placement("cpu", [0, 1]) != sbp.placement("cpu", [1, 0])
    # same flat order, different hierarchy
    assert sbp.placement("cpu", [0, 1, 2, 3]) != a
    assert sbp.placement("cpu", [[0], [1], [2], [3]]) != sbp.placement("cpu", [[0, 1, 2, 3]])
    # device type matters
    assert sbp.placement("cuda", [[0, 1], [2, 3]]) != a
    # not equal to other kinds of values
    assert a != [[0, 1], [2, 3]]
    assert a != "cpu"


def test_repr_mentions_type_and_ranks():
    r = repr(sbp.placement("cpu", [[0, 3], [1, 2]]))
    assert "cpu" in r
    assert "[[0, 3], [1, 2]]" in r


def test_placement_all_single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    p = sbp.placement.all("cpu")
    assert p.type == "cpu"
    assert p.ranks == [0]
    assert p.hierarchy == (1,)


def test_placement_all_uses_world_size(monkeypatch):
    monkeypatch.setattr(sbp.env, "get_world_size", lambda: 3)
    p = sbp.placement.all("cuda")
    assert p == sbp.placement("cuda", [0, 1, 2])
    with pytest.raises(sbp.PlacementError, match="type"):
        sbp.placement.all("tpu")


@pytest.mark.parametrize(
    "p",
    [
        sbp.placement("cpu", [0]),
        sbp.placement("cpu", [3, 1, 2]),
        sbp.placement("cuda", [[0, 3], [1, 2]]),
        sbp.placement("cpu", [[[0, 1]], [[2, 3]]]),
    ],
)
def test_pickle_and_copy_round_trip(p):
    for q in (pickle.loads(pickle.dumps(p)), copy.deepcopy(p), copy.copy(p)):
        assert q == p
        assert hash(q) == hash(p)
        assert q.ranks == p.ranks
        assert q.hierarchy == p.hierarchy
        assert q.type == p.type


def test_coord_rank_at_group_ranks_example():
    p = sbp.placement("cpu", [[0, 3], [1, 2]])
    assert p.coord(0) == (0, 0)
    assert p.coord(3) == (0, 1)
    assert p.coord(1) == (1, 0)
    assert p.coord(2) == (1, 1)
    assert p.rank_at((1, 0)) == 1
    assert p.index(2) == 3
    # ranks sharing every coordinate but `dim`
    assert p.group_ranks(3, 0) == (3, 2)
    assert p.group_ranks(3, 1) == (0, 3)
    assert p.group_ranks(1, 1) == (1, 2)


def test_coord_of_rank_not_in_placement():
    p = sbp.placement("cpu", [0, 2])
    with pytest.raises(sbp.PlacementError, match="rank 1"):
        p.coord(1)
    with pytest.raises(sbp.PlacementError, match="rank 1"):
        p.index(1)


def test_rank_at_bad_coord():
    p = sbp.placement("cpu", [[0, 1], [2, 3]])
    with pytest.raises(sbp.PlacementError, match="coord"):
        p.rank_at((2, 0))
    with pytest.raises(sbp.PlacementError, match="coord"):
        p.rank_at((0, -1))
    with pytest.raises(sbp.PlacementError, match="coord"):
        p.rank_at((0,))


# --- invalid placements ---------------------------------------------------------


@pytest.mark.parametrize("ranks", [[0, 0], [1, 2, 1], [[0, 1], [1, 2]], [[0, 1], [2, 0]]])
def test_duplicated_ranks(ranks):
    with pytest.raises(sbp.PlacementError, match="ranks.*distinct"):
        sbp.placement("cpu", ranks)


@pytest.mark.parametrize("ranks", [[-1], [0, -2], [[0, 1], [2, -3]]])
def test_negative_ranks(ranks):
    with pytest.raises(sbp.PlacementError, match="ranks.*non-negative"):
        sbp.placement("cpu", ranks)


@pytest.mark.parametrize(
    "ranks",
    [
        [[0, 1], [2]],
        [[0], [1, 2]],
        [[0, 1], 2],
        [0, [1, 2]],
        [[[0, 1]], [2, 3]],
        [[[0, 1], [2, 3]], [[4, 5], [6]]],
    ],
)
def test_ragged_ranks(ranks):
    with pytest.raises(sbp.PlacementError, match="ranks.*ragged"):
        sbp.placement("cpu", ranks)


@pytest.mark.parametrize("ranks", [[], (), range(0), [[]], [[], []], [[[]]]])
def test_empty_ranks(ranks):
    with pytest.raises(sbp.PlacementError, match="ranks.*empty"):
        sbp.placement("cpu", ranks)


@pytest.mark.parametrize("ranks", [0, "01", None, 1.0, [0.0, 1.0], [True, False], [[0, "1"]]])
def test_non_int_ranks(ranks):
    with pytest.raises(sbp.PlacementError, match="ranks"):
        sbp.placement("cpu", ranks)


@pytest.mark.parametrize("device_type", ["tpu", "CPU", "cuda:0", "", None, 0])
def test_unknown_device_type(device_type):
    with pytest.raises(sbp.PlacementError, match="type"):
        sbp.placement(device_type, [0])


def test_placement_errors_are_sbp_errors():
    with pytest.raises(sbp.SbpError):
        sbp.placement("cpu", [0, 0])
    with pytest.raises(ValueError):
        sbp.placement("tpu", [0])


def test_check_in_world():
    p = sbp.placement("cpu", [[0, 5], [2, 3]])
    p.check_in_world(6)
    p.check_in_world(100)
    with pytest.raises(sbp.PlacementError, match=r"ranks \[5\].*world of 4"):
        p.check_in_world(4)
    with pytest.raises(sbp.PlacementError, match="ranks"):
        sbp.placement("cpu", [0]).check_in_world(0)


def test_construction_does_not_check_the_world():
    # a single process can build placements over ranks that do not exist here
    p = sbp.placement("cuda", [[10, 11], [12, 13]])
    assert p.size == 4


# --- properties -----------------------------------------------------------------


@given(placements(world_size=8, device_type="cuda"))
def test_coord_and_rank_at_are_inverse(p):
    assert p.type == "cuda"
    coords = set()
    for i, r in enumerate(p.flat_ranks):
        c = p.coord(r)
        assert len(c) == p.ndim
        assert all(0 <= ci < n for ci, n in zip(c, p.hierarchy, strict=True))
        assert p.rank_at(c) == r
        assert p.index(r) == i
        assert index_of_coord(c, p.hierarchy) == i
        assert coord_of_index(i, p.hierarchy) == c
        coords.add(c)
    assert len(coords) == p.size


@given(placements(world_size=8))
def test_rebuilding_from_ranks_gives_an_equal_placement(p):
    q = sbp.placement(p.type, p.ranks)
    assert q == p
    assert hash(q) == hash(p)
    assert pickle.loads(pickle.dumps(p)) == p


@given(placements(world_size=8), st.integers(0, 1))
def test_group_ranks(p, dim):
    dim = min(dim, p.ndim - 1)
    for r in p.flat_ranks:
        g = p.group_ranks(r, dim)
        assert len(g) == p.hierarchy[dim]
        assert r in g
        assert g.index(r) == p.coord(r)[dim]
        for other in g:
            a, b = p.coord(r), p.coord(other)
            assert all(x == y for k, (x, y) in enumerate(zip(a, b, strict=True)) if k != dim)


# --- the placements strategy ----------------------------------------------------


@given(placements(world_size=4))
def test_placements_strategy_fits_the_world(p):
    p.check_in_world(4)
    assert p.type == "cpu"
    assert p.hierarchy in {(1,), (2,), (3,), (4,), (2, 2)}
    assert sorted(p.flat_ranks) == sorted(set(p.flat_ranks))


@given(placements(world_size=2))
def test_placements_strategy_small_world_is_1d(p):
    p.check_in_world(2)
    assert p.ndim == 1
    assert 1 <= p.size <= 2


@given(placements(world_size=1))
def test_placements_strategy_world_of_one(p):
    assert p == sbp.placement("cpu", [0])


def test_placements_strategy_reaches_interesting_cases():
    assert find(placements(), lambda p: p.ndim == 2).hierarchy == (2, 2)
    assert find(placements(), lambda p: p.ndim == 2 and p.ranks != [[0, 1], [2, 3]])
    assert find(placements(), lambda p: p.size == 4 and p.ndim == 1)
    assert find(placements(world_size=8), lambda p: max(p.flat_ranks) >= 4)
    assert find(placements(), lambda p: list(p.flat_ranks) != sorted(p.flat_ranks))


@pytest.mark.parametrize("kwargs", [{"world_size": 0}, {"world_size": -1}, {"device_type": 1}])
def test_placements_strategy_rejects_bad_arguments(kwargs):
    with pytest.raises(InvalidArgument):
        placements(**kwargs)
