"""In-place writes: the written tensor keeps its layout, and a view sbp had to copy passes
the write on to the tensor it views.

torch users rely on two promises of an in-place op: the tensor keeps being the same tensor
(its layout, here), and a write into a view is a write into its base (`h[:, :4].add_(x)`,
`q, k, v = qkv.chunk(3, -1); q.mul_(s)`). A global view is a view of its base's local tensor
only where the op needs no data moved; where its input had to be re-boxed (a slice across a
split dim, say) it is a copy. Such a copy remembers which part of its base it shows, and a
write into it is written into that part of the base (in logical coordinates, as
`g[index] = value` is), whatever the layouts. The other way too: a copy read after its
base was written is taken again first (`fresh`), as a torch view shows its base's values.
"""

from __future__ import annotations

from typing import Any

import torch

from sbp import env
from sbp.boxing import box
from sbp.comm.functional import tracing
from sbp.errors import SbpSignatureError
from sbp.layout import strided_of
from sbp.ranges import COPIED_VIEWS, forget_range, global_writes
from sbp.signature import broadcast
from sbp.tensor import GlobalTensor
from sbp.tensor_parts import copy_plain_value

aten = torch.ops.aten

# What part of its base a copied view shows: a list of one int or slice per base dim, RESHAPED
# (its elements in the base's order), or None (no way back), where the op re-boxed its input
# (the same on every rank); LOCAL where this rank's local view had to be a contiguous copy
# (`sbp.ops.local_views.local_view`); ALIASED for a true view of a base that is itself a copy, so
# that a write into it still reaches the base's base.
RESHAPED, LOCAL, ALIASED = "reshaped", "local", "aliased"


class CopyOf:
    """What a copied view (`g._copy_of`) remembers of its base: the base as it was shown
    (`as_shown`; None inside compiled code, which never sees the base), the part it shows,
    the base's versions when the view last matched it, and how to take the view again
    (`func(base, *args, **kwargs)`, output `index`). Shared by everything that shows the
    view's local memory (`as_shown`, `x.set_(view)`), so one refresh serves them all.

    Two counts tell a write into the base's local memory: the writes through global
    tensors on its storage (`sbp.ranges.forget_range`, counted by every rank for every
    in-place op: SPMD), and the local tensor's own version, which moves where it is
    written outside sbp's dispatcher (an optimizer's step on the locals,
    `x.to_local().add_(1)`; inside the dispatcher writes into local tensors move no
    version). So every rank takes a view again alike."""

    __slots__ = ("base", "part", "version", "func", "args", "kwargs", "index")

    def __init__(self, shown, part, func=None, args=(), kwargs=None, index=None) -> None:
        self.base, self.part = shown, part
        self.func, self.args, self.kwargs, self.index = func, args, kwargs or {}, index
        self.version = None
        if shown is not None:
            COPIED_VIEWS[0] = True  # (from now on every write is counted)
            self.version = self.versions()

    def versions(self) -> tuple:
        """The base's counts of writes now."""

        local = self.base._local
        return global_writes(local), None if local.is_inference() else local._version

    def remake(self):
        """The view taken again from its base (every rank takes it: SPMD)."""
        out = self.func(self.base, *self.args, **self.kwargs)
        return out if self.index is None else out[self.index]


_SLICES = {aten.slice.Tensor, aten.narrow.default}
_SPLITS = {
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.chunk.default,
    aten.unbind.int,
}
_RESHAPES = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.unsqueeze.default,
}


_inplace: dict = {}
_views: dict = {}


def is_inplace(func) -> bool:
    """Does `func` write values into its first argument and return it (`add_`, `copy_`,
    ...)? Not the in-place view ops (`t_`, `set_`), which change what it shows
    (`sbp.ops.inplace_views`)."""
    found = _inplace.get(func)
    if found is None:
        args = func._schema.arguments
        alias = args[0].alias_info if args else None
        found = _inplace[func] = bool(
            alias is not None
            and alias.is_write
            and not args[0].kwarg_only
            and torch.Tag.inplace_view not in func.tags
        )
    return found


def is_view(func) -> bool:
    """Does `func` return a view of its first argument (`slice`, `view`, `chunk`, ...)?"""
    found = _views.get(func)
    if found is None:
        returns = func._schema.returns
        alias = returns[0].alias_info if returns else None
        found = _views[func] = alias is not None and not alias.is_write
    return found


def _dim(args: tuple, kwargs: dict, pos: int, ndim: int) -> int:
    d = args[pos] if len(args) > pos else kwargs.get("dim", 0)
    return d + ndim if d < 0 else d


def _part(func, args: tuple, kwargs: dict, k: int, outs: list) -> Any:
    """Which part of the base output `k` of view op `func` shows (see RESHAPED)."""
    if func in _RESHAPES:
        return RESHAPED
    base = args[0]
    ndim = base.dim()
    if func is aten.select.int:
        dim = _dim(args, kwargs, 1, ndim)
        index = args[2] if len(args) > 2 else kwargs["index"]
        return _at(ndim, dim, index)
    if func in _SLICES:
        dim = _dim(args, kwargs, 1, ndim)
        if func is aten.narrow.default:
            start, length = args[2], args[3]
            return _at(ndim, dim, slice(start, start + length))
        start = args[2] if len(args) > 2 else kwargs.get("start")
        end = args[3] if len(args) > 3 else kwargs.get("end")
        step = args[4] if len(args) > 4 else kwargs.get("step", 1)
        return _at(ndim, dim, slice(start, end, step))
    if func in _SPLITS:
        dim = _dim(args, kwargs, 1 if func is aten.unbind.int else 2, ndim)
        if func is aten.unbind.int:
            return _at(ndim, dim, k)
        start = sum(o.shape[dim] for o in outs[:k])
        return _at(ndim, dim, slice(start, start + outs[k].shape[dim]))
    return None


def _at(ndim: int, dim: int, item: Any) -> list:
    return [slice(None)] * dim + [item] + [slice(None)] * (ndim - dim - 1)


def mark_view(func, args: tuple, kwargs: dict, outs: list, boxed: bool, copied: bool) -> None:
    """After view op `func` ran on `args[0]`: where its input was re-boxed (`boxed`, the same
    on every rank) its outputs are copies; where this rank copied the local view (`copied`),
    or the base is itself a copy, they pass writes on too. Each remembers its part."""
    base = args[0]
    if boxed:
        parts = [_part(func, args, kwargs, k, outs) for k in range(len(outs))]
    elif copied:
        parts = [LOCAL] * len(outs)
    elif base._copy_of is not None:
        parts = [ALIASED] * len(outs)
    else:
        return
    shown = as_shown(base)
    many = len(outs) > 1 or str(func._schema.returns[0].type).startswith("List")
    for k, (out, part) in enumerate(zip(outs, parts, strict=True)):
        if out is not None:
            out._copy_of = CopyOf(shown, part, func, args[1:], kwargs, k if many else None)


def as_shown(x) -> Any:
    """A global tensor holding what `x` shows now (its local tensor, spec, and base). A copied
    view remembers it, not `x`: `x` may later show other data (`x.t_()`, `x.set_(y)`), while
    the view goes on showing its part of the old, as a torch view keeps its storage."""

    shown = GlobalTensor(x._local, x._spec)
    shown._copy_of = x._copy_of
    return shown


def written(g) -> Any:
    """Call after every in-place write into `g`; returns `g`. A copied view passes the new
    values on to its base (and so on up, where the base is a copied view too)."""
    record = g._copy_of
    if record is None:
        return g

    base, part = record.base, record.part
    if base is None:
        raise SbpSignatureError(
            f"an in-place write into a view of sbp {g.sbp} that sbp had to copy from its base "
            "(a slice across a split dim, say), passed into or returned by compiled code, which "
            "cannot reach the base; take the view where its base is (inside the compiled "
            "function, or outside it from the base it returns), or write view.clone()"
        )
    if part is None:
        raise SbpSignatureError(
            f"an in-place write into a view of sbp {g.sbp} that had to be copied from its base "
            f"(of sbp {base.sbp}) cannot reach the base; use the out-of-place op, or convert "
            "the base with .to_global(sbp=...) before taking the view"
        )
    with torch.no_grad():
        if part is LOCAL:
            base._local.copy_(g._local.reshape(base._local.shape))
        elif part is RESHAPED:
            value = g.reshape(base.shape)
            assign(base, value._local, value._spec)
        elif part is not ALIASED:
            write_part(base, part, g)
    forget_range(base)  # (written on every rank: the base's other copied views are stale)
    record.version = record.versions()  # (this one is not: the base holds what it shows)
    return written(base)


def fresh(g) -> None:
    """Copied view `g` taken again where its base was written since `g` last matched it
    (a torch view shows its base's values now). Called before `g` is read: by the
    dispatcher for every copied input, and by the reads that bypass it (`to_global`,
    `g[i] = v`, a compiled call's inputs; not `to_local` or `repr`, which never
    communicate). Writes are told by the counts `CopyOf.versions` reads, alike on every
    rank."""
    record = g._copy_of
    base = record.base
    if base is None or record.func is None:
        return  # (inside compiled code; or resolved once, as a conjugate)
    if base._copy_of is not None:
        fresh(base)
    version = record.versions()
    if version == record.version:
        return
    if record.part is not ALIASED:  # (an alias shares its base's memory: nothing to copy)
        with torch.no_grad():
            new = record.remake()
            value = new._local if new._spec == g._spec else box(new._local, new._spec, g._spec)
            if not _write_over(g._local, value):
                g._local = value  # (overlapping itself, as unfold's windows: replaced)
        forget_range(g)
    record.version = version


def _write_over(local: torch.Tensor, value: torch.Tensor) -> bool:
    """Copy `value` into `local`, whose repeated elements (an expanded view's) take it
    once; False where `local` overlaps itself otherwise."""
    if any(s == 0 for s in local.stride()):
        keep = tuple(slice(0, 1) if s == 0 else slice(None) for s in local.stride())
        local, value = local[keep], value[keep]
    if torch._debug_has_internal_overlap(local) == 1:  # (2: too hard to tell; copy_ too)
        return False
    local.copy_(value)
    return True


def assign(g, local: torch.Tensor, spec) -> None:
    """Make `local` (laid out as `spec`) `g`'s value in `g`'s own layout and local tensor."""

    if spec != g._spec:  # (decided from the specs, alike on every rank: the boxing to
        # `spec` may have handed one rank `g`'s own local tensor back, broadcast to partial)
        g._local.copy_(box(local, spec, g._spec))
    elif local is not g._local:
        g._local.copy_(local)


# ---------------------------------------------------------------- logical slices


def _local_part(item: Any, size: int, lo: int, hi: int) -> tuple[Any, Any] | None:
    """(local index, index into the value) of the logical `item` on a shard [lo, hi), or None."""
    if isinstance(item, int):
        i = item + size if item < 0 else item
        return (i - lo, None) if lo <= i < hi else None
    start, stop, step = item.indices(size)
    first = max(lo, start)
    k0 = -(-(first - start) // step)
    i0 = start + k0 * step
    end = min(hi, stop)
    if i0 >= end:
        return None
    count = len(range(i0, end, step))
    return slice(i0 - lo, i0 - lo + (count - 1) * step + 1, step), slice(k0, k0 + count)


def write_part(g, items: list, value: Any) -> None:
    """Write `value` (a global tensor on `g`'s placement, or a number) into the logical part
    `items` (one int or slice per dim) of `g`: each rank writes what falls in its shard, in
    `g`'s layout, with no communication of `g`'s. Along a partial sum only the first rank
    of the group writes the value and the others zeros; a partial max or min is written
    the value everywhere."""
    if isinstance(value, torch.Tensor) and hasattr(value, "_spec"):
        value = value.full_tensor()
    me = env.get_rank()
    if me not in g.placement:
        return
    if strided_of(g._spec.nd_sbp) is not None:
        _write_strided(g, items, value)
        return
    coord = g.placement.coord(me)
    summed = [c for c, s in zip(coord, g.sbp, strict=True) if s.is_partial and s.op == "sum"]
    _write_local_part(g, items, value if not any(summed) else 0)


def _write_strided(g, items: list, value: Any) -> None:
    """A strided split holds no range of the logical tensor (`sbp.layout.unflattened`): its
    logical value is gathered, written, and each rank takes its part back (rare: such a
    layout lives between a flattening view and the product that reads it)."""
    if any(s.is_partial for s in g._spec.nd_sbp):
        raise SbpSignatureError(
            f"writing into a tensor laid out as {g._spec.nd_sbp}: convert it first "
            "(x.to_global(sbp=...) with split or broadcast)"
        )
    spec = g._spec
    whole = box(g._local, spec, spec._replace(nd_sbp=(broadcast,) * len(spec.nd_sbp))).clone()
    whole[tuple(items)] = torch.as_tensor(value, dtype=g.dtype, device=whole.device)
    copy_plain_value(g, whole, non_blocking=False)


def _write_nothing(local: torch.Tensor, value: torch.Tensor) -> None:
    """Write an empty part of `value` into `local`. Traced, a rank that writes nothing would
    leave unused the collective that gathered `value`, and the graph would drop it on this
    rank alone (the other ranks would wait for it); written so, it stays."""
    hole = local[(slice(0, 0),) * local.dim()]
    nothing = value[(slice(0, 0),) * value.dim()] if value.dim() else value.reshape(1)[:0]
    hole.copy_(nothing.reshape(hole.shape))


def _write_local_part(g, items: list, value: Any) -> None:
    sizes = [
        len(range(*i.indices(n)))
        for i, n in zip(items, g.shape, strict=True)
        if isinstance(i, slice)
    ]
    value = torch.as_tensor(value, dtype=g.dtype, device=g._local.device).expand(sizes)
    local_index, value_index = [], []
    for item, size, (lo, hi) in zip(items, g.shape, g._spec.ranges(env.get_rank()), strict=True):
        part = _local_part(item, size, lo, hi)
        if part is None:  # nothing of the slice lives on this rank
            if tracing(g._local):
                _write_nothing(g._local, value)
            return
        local_index.append(part[0])
        if part[1] is not None:
            value_index.append(part[1])
    g._local[tuple(local_index)] = value[tuple(value_index)]
