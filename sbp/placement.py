"""`sbp.placement`: which ranks hold a global tensor, arranged in a hierarchy.

A placement is a pure value. Construction validates the shape of the rank
list (distinct, non-negative, non-empty, rectangular) so planning code can
build any placement in one process; whether the ranks exist in the running
world is checked when a tensor is placed (`check_in_world`).
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Sequence
from functools import cached_property
from typing import Any

from sbp.errors import PlacementError

DEVICE_TYPES = ("cpu", "cuda")


def _shape_of(ranks: Any, path: str) -> tuple[tuple[int, ...], list[Any]]:
    """Return (hierarchy, flat ranks) of a nested rank list, checking it is rectangular."""
    if isinstance(ranks, range):
        ranks = list(ranks)
    if not isinstance(ranks, Sequence) or isinstance(ranks, (str, bytes)):
        raise PlacementError(f"placement ranks{path} must be a list of ints, got {ranks!r}")
    if len(ranks) == 0:
        raise PlacementError(f"placement ranks{path} must not be empty")
    ints = [_as_int(r) for r in ranks]
    nested = [r is None for r in ints]
    if not any(nested):
        return (len(ranks),), ints
    if not all(nested):
        raise PlacementError(f"placement ranks{path} is ragged: mixes ints and lists: {ranks!r}")
    shapes, flat = [], []
    for i, sub in enumerate(ranks):
        shape, sub_flat = _shape_of(sub, f"{path}[{i}]")
        shapes.append(shape)
        flat.extend(sub_flat)
    if any(s != shapes[0] for s in shapes):
        raise PlacementError(f"placement ranks{path} is ragged (not rectangular): {ranks!r}")
    return (len(ranks), *shapes[0]), flat


def _as_int(value: Any) -> int | None:
    """`value` as an int if it is an integer (numpy ones too, bools not), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _to_nested(flat: tuple[int, ...], hierarchy: tuple[int, ...]) -> list[Any]:
    if len(hierarchy) == 1:
        return list(flat)
    step = len(flat) // hierarchy[0]
    return [_to_nested(flat[i * step : (i + 1) * step], hierarchy[1:]) for i in range(hierarchy[0])]


class placement:  # noqa: N801 - lowercase like OneFlow's and like `torch.device`
    """Device type plus an ordered, possibly n-D, set of ranks."""

    def __init__(self, type: str, ranks: Any) -> None:  # noqa: A002 - public API name
        if type not in DEVICE_TYPES:
            raise PlacementError(f"placement type must be one of {DEVICE_TYPES}, got {type!r}")
        hierarchy, flat = _shape_of(ranks, "")
        for r in flat:
            if r < 0:
                raise PlacementError(f"placement ranks must be non-negative, got {r} in {ranks!r}")
        if len(set(flat)) != len(flat):
            dup = sorted({r for r in flat if flat.count(r) > 1})
            raise PlacementError(f"placement ranks must be distinct, {dup} repeat in {ranks!r}")
        self._type = type
        self._flat = tuple(flat)
        self._hierarchy = hierarchy
        self._hash = hash((type, self._flat, hierarchy))

    @classmethod
    def all(cls, type: str) -> placement:  # noqa: A002, A003
        """Every rank of the running world, 1-D."""
        from sbp import env

        return cls(type, list(range(env.get_world_size())))

    @property
    def type(self) -> str:
        return self._type

    @property
    def ranks(self) -> list[Any]:
        """The ranks as a nested list shaped like the hierarchy (a fresh copy)."""
        return _to_nested(self._flat, self._hierarchy)

    @property
    def flat_ranks(self) -> tuple[int, ...]:
        """Ranks in row-major hierarchy order."""
        return self._flat

    @property
    def hierarchy(self) -> tuple[int, ...]:
        return self._hierarchy

    @property
    def ndim(self) -> int:
        return len(self._hierarchy)

    @property
    def size(self) -> int:
        return len(self._flat)

    @cached_property
    def _index(self) -> dict[int, int]:
        return {r: i for i, r in enumerate(self._flat)}

    def __contains__(self, rank: object) -> bool:
        try:
            return rank in self._index
        except TypeError:  # unhashable: certainly not a rank
            return False

    def index(self, rank: int) -> int:
        """Row-major position of `rank` in this placement."""
        try:
            return self._index[rank]
        except KeyError:
            raise PlacementError(f"rank {rank} is not in {self}") from None

    def coord(self, rank: int) -> tuple[int, ...]:
        """Hierarchy coordinate of `rank`."""
        return coord_of_index(self.index(rank), self._hierarchy)

    def rank_at(self, coord: Sequence[int] | int) -> int:
        """The rank at a hierarchy coordinate (an int for a 1-D placement)."""
        if _as_int(coord) is not None:
            coord = (coord,)
        return self._flat[index_of_coord(coord, self._hierarchy)]

    def group_ranks(self, rank: int, dim: int) -> tuple[int, ...]:
        """Ranks that share `rank`'s coordinate on every hierarchy dim but `dim`, in order."""
        if not 0 <= dim < self.ndim:
            raise PlacementError(f"hierarchy dim {dim} is out of range for {self}")
        c = list(self.coord(rank))
        out = []
        for i in range(self._hierarchy[dim]):
            c[dim] = i
            out.append(self.rank_at(c))
        return tuple(out)

    def ranks_varying(self, rank: int, dims: Collection[int]) -> tuple[int, ...]:
        """Ranks that share `rank`'s coordinate on every hierarchy dim not in `dims`, in
        placement order (`group_ranks` for several dims)."""
        mine = self.coord(rank)
        keep = [h for h in range(self.ndim) if h not in dims]
        return tuple(r for r in self._flat if all(self.coord(r)[h] == mine[h] for h in keep))

    def check_in_world(self, world_size: int) -> None:
        """Raise `PlacementError` if any rank is outside a world of `world_size`."""
        bad = [r for r in self._flat if r >= world_size]
        if bad:
            raise PlacementError(
                f"placement ranks {bad} are outside the world of {world_size} ranks ({self})"
            )

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, placement):
            return NotImplemented
        return self._hash == other._hash and (self._type, self._flat, self._hierarchy) == (
            other._type,
            other._flat,
            other._hierarchy,
        )

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"placement(type={self._type!r}, ranks={self.ranks})"

    def __reduce__(self):
        return (placement, (self._type, self.ranks))


def coord_of_index(index: int, hierarchy: Sequence[int]) -> tuple[int, ...]:
    """Row-major coordinate of a flat index."""
    out = []
    for n in reversed(hierarchy):
        out.append(index % n)
        index //= n
    return tuple(reversed(out))


def index_of_coord(coord: Sequence[int], hierarchy: Sequence[int]) -> int:
    """Flat row-major index of a coordinate."""
    if len(coord) != len(hierarchy):
        raise PlacementError(f"coord {tuple(coord)} does not match hierarchy {tuple(hierarchy)}")
    index = 0
    for c, n in zip(coord, hierarchy, strict=True):
        if not 0 <= c < n:
            raise PlacementError(f"coord {tuple(coord)} is outside hierarchy {tuple(hierarchy)}")
        index = index * n + c
    return index
