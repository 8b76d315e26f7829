"""Shape and slice arithmetic of global tensors: which part of the logical tensor each rank holds.

Uneven splits are balanced: `d` over `n` parts gives `d // n + 1` to the first
`d % n` parts and `d // n` to the rest. For an n-D placement the tensor is split
by the first hierarchy dim, then each part by the next, in order.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence
from typing import Any, NamedTuple

from sbp.errors import InputTypeError, InputValueError, PlacementError, SbpSignatureError
from sbp.placement import index_of_coord
from sbp.placement import placement as Placement
from sbp.signature import NdSbp, Split, StridedSplit, normalize_nd_sbp


def elements_per_index(shape: Sequence[int], dim: int) -> int:
    """How many elements one index of `dim` spans: the product of the other sizes."""
    return math.prod(shape[:dim]) * math.prod(shape[dim + 1 :])


def balanced_sizes(size: int, parts: int) -> list[int]:
    """Sizes of `parts` balanced shards of `size` (larger ones first)."""
    base, extra = divmod(size, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


def balanced_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of shard `index` of `size` split in `parts` balanced shards."""
    base, extra = divmod(size, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def _coord(placement: Placement, coord: Any) -> tuple[int, ...]:
    if not isinstance(coord, (tuple, list)):
        coord = (coord,)
    try:
        coord = tuple(operator.index(c) for c in coord)
    except TypeError:
        raise PlacementError(f"coord must be ints, got {coord!r}") from None
    if len(coord) != placement.ndim or any(
        not 0 <= c < n for c, n in zip(coord, placement.hierarchy, strict=True)
    ):
        raise PlacementError(f"coord {coord} is outside hierarchy {placement.hierarchy}")
    return coord


def local_ranges(
    shape: Sequence[int], hierarchy: Sequence[int], nd_sbp: NdSbp, coord: Sequence[int]
) -> list[tuple[int, int]]:
    """[start, stop) per tensor dim held at `coord` (nd_sbp already normalised)."""
    ranges = [(0, int(d)) for d in shape]
    for h, s in enumerate(nd_sbp):
        if s.is_strided:
            raise SbpSignatureError(
                f"a tensor laid out as {nd_sbp} (a split dim flattened behind whole ones) "
                "holds no range of the logical tensor here; convert it first: "
                "x.to_global(sbp=...) with split, broadcast or partial"
            )
        if s.is_split:
            start, stop = ranges[s.dim]
            a, b = balanced_range(stop - start, hierarchy[h], coord[h])
            ranges[s.dim] = (start + a, start + b)
    return ranges


def check_shape(shape: Any) -> tuple[int, ...]:
    """A logical shape as a tuple of non-negative ints, else an `InputTypeError` (not ints)
    or `InputValueError` (a negative size) naming `shape`."""
    try:
        out = tuple(operator.index(d) for d in shape)
    except TypeError:
        raise InputTypeError(f"shape must be a sequence of ints, got {shape!r}") from None
    if any(d < 0 for d in out):
        raise InputValueError(f"shape must not have negative sizes, got {tuple(shape)!r}")
    return out


def local_slices(
    shape: Sequence[int], placement: Placement, nd_sbp: Any, coord: Any
) -> tuple[slice, ...]:
    """The slice of the logical tensor held at hierarchy `coord` (a tuple, or an int for 1-D)."""
    if not isinstance(placement, Placement):
        raise PlacementError(f"placement must be an sbp.placement, got {placement!r}")
    shape = check_shape(shape)
    nd = normalize_nd_sbp(nd_sbp, placement.ndim, len(shape))
    ranges = local_ranges(shape, placement.hierarchy, nd, _coord(placement, coord))
    return tuple(slice(a, b) for a, b in ranges)


def local_shape(
    shape: Sequence[int], placement: Placement, nd_sbp: Any, coord: Any
) -> tuple[int, ...]:
    """Shape of the local tensor held at hierarchy `coord`."""
    return tuple(s.stop - s.start for s in local_slices(shape, placement, nd_sbp, coord))


def rank_slices(
    shape: Sequence[int], placement: Placement, nd_sbp: NdSbp, rank: int
) -> tuple[slice, ...]:
    """`local_slices` addressed by rank instead of coordinate."""
    return local_slices(shape, placement, nd_sbp, placement.coord(rank))


def logical_size_along(
    local_sizes: Sequence[int], hierarchy: Sequence[int], nd_sbp: NdSbp, dim: int
) -> int:
    """Logical size of `dim` from every coordinate's local size of that dim (row-major order).

    Summing the locals of the coordinates whose split-on-`dim` hierarchy coords vary
    and whose others are 0 gives the logical size.
    """
    split_dims = [h for h, s in enumerate(nd_sbp) if s.is_split and s.dim == dim]
    if not split_dims:
        return int(local_sizes[0])
    total = 0
    for combo in itertools.product(*[range(hierarchy[h]) for h in split_dims]):
        coord = [0] * len(hierarchy)
        for h, c in zip(split_dims, combo, strict=True):
            coord[h] = c
        total += int(local_sizes[index_of_coord(coord, hierarchy)])
    return total


class GlobalSpec(NamedTuple):
    """Everything a plan depends on: placement, normalised nd_sbp, logical shape, dtype."""

    placement: Placement
    nd_sbp: NdSbp
    shape: tuple[int, ...]
    dtype: Any

    def __deepcopy__(self, memo: dict) -> GlobalSpec:
        """Immutable: a copy is the spec itself. Dynamo deep-copies each traced tensor's
        spec for its guards; comparing with the same object is then an identity check."""
        return self

    def ranges(self, rank: int) -> list[tuple[int, int]]:
        """[start, stop) per tensor dim held by `rank` (which must be in the placement)."""
        return local_ranges(
            self.shape, self.placement.hierarchy, self.nd_sbp, self.placement.coord(rank)
        )

    def local_shape(self, rank: int) -> tuple[int, ...]:
        if rank not in self.placement:
            return (0,)
        strided = strided_of(self.nd_sbp)
        if strided is not None:
            d = strided.dim
            shape = unflattened(self).local_shape(rank)
            return (*shape[:d], shape[d] * shape[d + 1], *shape[d + 2 :])
        return tuple(b - a for a, b in self.ranges(rank))


def strided_of(nd_sbp: NdSbp) -> StridedSplit | None:
    """The strided split of a signature, if it holds one (each holds at most one kind)."""
    for s in nd_sbp:
        if s.is_strided:
            return s
    return None


def unflattened(spec: GlobalSpec, strided: StridedSplit | None = None) -> GlobalSpec:
    """`spec` with the dim of its strided split (or of `strided`) seen as (blocks, inner):
    the strided split becomes a split of the inner dim, a split of that dim one of the
    blocks. This is what a strided split means, and how it is converted (`sbp.boxing`)."""
    st = strided or strided_of(spec.nd_sbp)
    d, k = st.dim, st.inner
    shape = (*spec.shape[:d], spec.shape[d] // k, k, *spec.shape[d + 1 :])
    nd = []
    for s in spec.nd_sbp:
        if s.is_strided:
            nd.append(Split(d + 1))
        elif s.is_split and s.dim > d:
            nd.append(Split(s.dim + 1))
        else:
            nd.append(s)
    return GlobalSpec(spec.placement, tuple(nd), shape, spec.dtype)
