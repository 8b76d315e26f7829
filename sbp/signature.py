"""SBP values (split / broadcast / partial) and nd_sbp signatures.

An SBP says how one hierarchy dim of a placement relates each rank's local
tensor to the logical one. A signature (`nd_sbp`) is a tuple with one SBP per
hierarchy dim. These are pure, hashable values.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from sbp.errors import SbpSignatureError


class SBP:
    """Base class of the three kinds of SBP."""

    __slots__ = ()

    is_split = False
    is_broadcast = False
    is_partial = False
    is_strided = False


class Split(SBP):
    """Local tensor is a balanced slice of the logical tensor along `dim`."""

    __slots__ = ("dim", "_hash")
    is_split = True

    def __init__(self, dim: int) -> None:
        if isinstance(dim, bool):
            raise SbpSignatureError(f"split dim must be an int, got {dim!r}")
        try:
            self.dim = operator.index(dim)
        except TypeError:
            raise SbpSignatureError(f"split dim must be an int, got {dim!r}") from None
        self._hash = hash(("S", self.dim))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Split) and other.dim == self.dim

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"sbp.split(dim={self.dim})"

    def __reduce__(self):
        return (Split, (self.dim,))


class StridedSplit(SBP):
    """Dim `dim`, seen as blocks of `inner` elements (`(size // inner, inner)`), with each
    block split alike: what flattening `(batch, heads)` gives where the heads are split
    (DTensor's `_StridedShard`). Made by views (`sbp.ops.views`) and read by the few ops
    that keep it (batched products, transposes, the view back); anything else converts it
    first. Within its signature a `Split(dim)` splits the blocks, and the layout is the one
    of the unflattened tensor (`sbp.layout.unflattened`)."""

    __slots__ = ("dim", "inner", "_hash")
    is_strided = True

    def __init__(self, dim: int, inner: int) -> None:
        self.dim, self.inner = operator.index(dim), operator.index(inner)
        self._hash = hash(("SS", self.dim, self.inner))

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, StridedSplit) and other.dim == self.dim and other.inner == self.inner
        )

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"sbp.strided_split(dim={self.dim}, inner={self.inner})"

    def __reduce__(self):
        return (StridedSplit, (self.dim, self.inner))


class Broadcast(SBP):
    """Local tensor is the whole logical tensor, equal on every rank."""

    __slots__ = ()
    is_broadcast = True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Broadcast)

    _HASH = hash("B")

    def __hash__(self) -> int:
        return self._HASH

    def __repr__(self) -> str:
        return "sbp.broadcast"

    def __reduce__(self):
        return (Broadcast, ())


class Partial(SBP):
    """Logical tensor is the reduction (`sum`, `max` or `min`) of the local tensors."""

    __slots__ = ("op", "_hash")
    is_partial = True
    OPS = ("sum", "max", "min")

    def __init__(self, op: str) -> None:
        if op not in self.OPS:
            raise SbpSignatureError(f"partial op must be one of {self.OPS}, got {op!r}")
        self.op = op
        self._hash = hash(("P", op))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Partial) and other.op == self.op

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"sbp.partial_{self.op}"

    def __reduce__(self):
        return (Partial, (self.op,))


def split(dim: int) -> Split:
    """`sbp.split(dim)`: each rank holds a balanced slice along `dim`."""
    return Split(dim)


broadcast = Broadcast()
partial_sum = Partial("sum")
partial_max = Partial("max")
partial_min = Partial("min")

NdSbp = tuple[SBP, ...]


def normalize_nd_sbp(sbp: Any, hierarchy_ndim: int, tensor_ndim: int | None = None) -> NdSbp:
    """Turn a user's `sbp=` argument into a checked tuple of one SBP per hierarchy dim.

    A single SBP is accepted for a 1-D hierarchy. With `tensor_ndim` given, split
    dims are range-checked and negative ones normalised.
    """
    if isinstance(sbp, SBP):
        items: Sequence[Any] = (sbp,)
    elif isinstance(sbp, (tuple, list)):
        items = sbp
    else:
        raise SbpSignatureError(f"sbp must be an SBP or a tuple of SBPs, got {sbp!r}")
    if len(items) != hierarchy_ndim:
        raise SbpSignatureError(
            f"sbp has {len(items)} entries but the placement hierarchy has {hierarchy_ndim} "
            f"dims: {tuple(items)!r}"
        )
    out = []
    for s in items:
        if not isinstance(s, SBP):
            raise SbpSignatureError(f"sbp entries must be SBPs, got {s!r} in {tuple(items)!r}")
        if s.is_strided:
            raise SbpSignatureError(
                f"sbp: {s!r} is made by views (a flatten of a split dim), not asked for; "
                "use split, broadcast or partial"
            )
        if s.is_split and tensor_ndim is not None:
            d = s.dim
            if not -tensor_ndim <= d < max(tensor_ndim, 0) or tensor_ndim == 0:
                raise SbpSignatureError(
                    f"sbp split dim {d} is out of range for a tensor with {tensor_ndim} dims"
                )
            if d < 0:
                s = Split(d + tensor_ndim)
        out.append(s)
    nd = tuple(out)
    return _interned.setdefault(nd, nd)


# One tuple object per distinct signature: a model's tensors then share their nd_sbp, and
# checks over hundreds of them (an optimizer step's lists) can compare by identity
_interned: dict[NdSbp, NdSbp] = {}


def partials_to_broadcast(nd_sbp: NdSbp) -> NdSbp:
    """`nd_sbp` with every partial dim made broadcast (what a reduced value looks like)."""
    if not any(s.is_partial for s in nd_sbp):
        return nd_sbp
    return tuple(broadcast if s.is_partial else s for s in nd_sbp)


def splits_to_partials(nd_sbp: NdSbp) -> NdSbp:
    """`nd_sbp` with every split dim a partial sum, every other dim broadcast: how a sum over
    the parts of a split tensor (its local sums, say) is laid out before it is reduced."""
    return tuple(partial_sum if s.is_split else broadcast for s in nd_sbp)


def is_all_broadcast(nd_sbp: NdSbp) -> bool:
    return all(s.is_broadcast for s in nd_sbp)


def format_nd_sbp(nd_sbp: NdSbp) -> str:
    """Short form for plans and messages: S(0), B, P(sum)."""
    return "(" + ", ".join(short(s) for s in nd_sbp) + ")"


def short(s: SBP) -> str:
    if isinstance(s, Split):
        return f"S({s.dim})"
    if isinstance(s, Partial):
        return "P" if s.op == "sum" else f"P({s.op})"
    if isinstance(s, StridedSplit):
        return f"S({s.dim}/{s.inner})"
    return "B"
