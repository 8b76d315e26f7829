"""Hypothesis strategies for property-testing code built on `sbp`.

Use them to draw placements, SBPs, signatures, shapes and whole layouts::

    from hypothesis import given
    from sbp.testing.strategies import global_layouts

    @given(global_layouts(world_size=4))
    def test_my_rule(layout):
        shape, placement, nd_sbp = layout
        ...

Everything drawn is a pure value (no tensors, no process groups), so these
strategies are cheap and usable in a single process.
"""

from __future__ import annotations

from typing import NamedTuple

from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

from sbp.placement import placement as Placement
from sbp.signature import (
    SBP,
    NdSbp,
    broadcast,
    partial_max,
    partial_min,
    partial_sum,
    split,
)

__all__ = [
    "GlobalLayout",
    "global_layouts",
    "nd_sbps",
    "placements",
    "sbps",
    "shapes",
]

#: Largest 1-D placement drawn, and the side of the 2-D hierarchy drawn.
MAX_1D_SIZE = 4
HIERARCHY_2D = (2, 2)


class GlobalLayout(NamedTuple):
    """A logical shape, a placement and an nd_sbp that fit together."""

    shape: tuple[int, ...]
    placement: Placement
    nd_sbp: NdSbp


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgument(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


@st.composite
def _permuted_subset(draw: st.DrawFn, world_size: int, size: int) -> list[int]:
    """`size` distinct ranks of `range(world_size)` in a random order."""
    order = draw(st.permutations(range(world_size)))
    return list(order[:size])


def placements(world_size: int = 4, device_type: str = "cpu") -> st.SearchStrategy[Placement]:
    """Placements whose ranks lie in `range(world_size)`.

    1-D placements of 1 to 4 ranks (any subset of the world, in any order), and
    2-D placements with hierarchy (2, 2) over 4 ranks in any order when
    `world_size >= 4`. Shrinks towards `placement(device_type, [0])`.
    """
    _check_int("world_size", world_size, 1)
    if not isinstance(device_type, str):
        raise InvalidArgument(f"device_type must be a str, got {device_type!r}")
    max_1d = min(MAX_1D_SIZE, world_size)
    one_d = st.integers(1, max_1d).flatmap(lambda n: _permuted_subset(world_size, n))
    strategies = [one_d.map(lambda ranks: Placement(device_type, ranks))]
    rows, cols = HIERARCHY_2D
    if world_size >= rows * cols:
        two_d = _permuted_subset(world_size, rows * cols).map(
            lambda flat: Placement(
                device_type, [flat[i * cols : (i + 1) * cols] for i in range(rows)]
            )
        )
        strategies.append(two_d)
    return st.one_of(strategies)


def _sbp_choices(ndim: int, partial: bool) -> list[SBP]:
    choices: list[SBP] = [broadcast]
    choices += [split(d) for d in range(ndim)]
    if partial:
        choices += [partial_sum, partial_max, partial_min]
    return choices


def sbps(ndim: int, *, partial: bool = True) -> st.SearchStrategy[SBP]:
    """One SBP valid for a tensor of `ndim` dims.

    `split(d)` for every `d` in `range(ndim)` (none for a 0-dim tensor),
    `broadcast`, and unless `partial=False` `partial_sum`, `partial_max`,
    `partial_min`. Shrinks towards `broadcast`.
    """
    _check_int("ndim", ndim, 0)
    return st.sampled_from(_sbp_choices(ndim, partial))


def nd_sbps(
    hierarchy_ndim: int, tensor_ndim: int, *, partial: bool = True
) -> st.SearchStrategy[NdSbp]:
    """Signatures: a tuple of `hierarchy_ndim` SBPs, each valid for `tensor_ndim` dims.

    Entries are drawn independently, so one tensor dim may be split by several
    hierarchy dims (nested splits).
    """
    _check_int("hierarchy_ndim", hierarchy_ndim, 1)
    _check_int("tensor_ndim", tensor_ndim, 0)
    one = sbps(tensor_ndim, partial=partial)
    return st.tuples(*([one] * hierarchy_ndim))


def shapes(
    min_dims: int = 0, max_dims: int = 3, max_side: int = 7
) -> st.SearchStrategy[tuple[int, ...]]:
    """Logical tensor shapes with every side in `[0, max_side]`.

    Small sides exercise the awkward cases of balanced splitting: sizes that
    do not divide evenly, sides smaller than the number of ranks, and size-0
    dims. Shrinks towards `()` (or all-zero sides).
    """
    _check_int("min_dims", min_dims, 0)
    _check_int("max_dims", max_dims, min_dims)
    _check_int("max_side", max_side, 0)
    return st.lists(st.integers(0, max_side), min_size=min_dims, max_size=max_dims).map(tuple)


@st.composite
def global_layouts(
    draw: st.DrawFn,
    world_size: int = 4,
    partial: bool = True,
    *,
    device_type: str = "cpu",
    min_dims: int = 0,
    max_dims: int = 3,
    max_side: int = 7,
) -> GlobalLayout:
    """A `GlobalLayout(shape, placement, nd_sbp)` whose parts fit together.

    The placement comes from `placements(world_size, device_type)`, the shape
    from `shapes(min_dims, max_dims, max_side)` and the nd_sbp from
    `nd_sbps(placement.ndim, len(shape), partial=partial)`. It unpacks like a
    3-tuple.
    """
    p = draw(placements(world_size, device_type))
    shape = draw(shapes(min_dims, max_dims, max_side))
    nd_sbp = draw(nd_sbps(p.ndim, len(shape), partial=partial))
    return GlobalLayout(shape, p, nd_sbp)
