"""Conversions kept for reuse: each logical value is moved at most once.

When an op's input has to be boxed to another layout (`registry.run_strategy`), the
converted local tensor is kept with the global tensor it came from, so that later uses of
the same value in the same target layout take it instead of communicating again: other
consumers (backward's `grad @ W` and `grad.t() @ h` both need the gradient whole), the
backward of an op whose forward converted its input (pow's saved input), and views.

- **Same tensor.** A kept conversion is found by the global tensor object (two consumers
  are handed the same one), its source and target specs, and its local tensor.
- **Views.** A conversion that only reduces partial dims to broadcast (an all-reduce)
  keeps each element where it is in the local tensor. For a view of a base whose such
  conversion is kept (autograd's `view._base`, as `.t()`, `.view()`, `.transpose()`,
  `.detach()` make), the view's converted value is the same view (`as_strided` with the
  view's local size, stride and offset) of the base's: taken where the base's local
  tensor and the kept result are both contiguous from offset 0 and the view's local
  tensor shows the base's storage. A view converted before its base that covers all of
  it (a transpose in backward, reduced before the gradient it shows) converts its base
  instead, and keeps that.
- **Writes.** A kept value holds while its source's local storage is not written: the
  writes through global tensors on it (counted per storage by every rank, in
  `GlobalTensor.__torch_dispatch__`: `sbp.ranges.global_writes`) and the local tensor's
  own version (writes outside the dispatcher: an optimizer's step on the locals,
  `x.to_local().add_(1)`) must be what they were; so must the kept result's, should a
  later op write through a tensor that shows it. A write into `to_local()` of a view
  (its own local version) is not seen.
- **Memory.** A kept result lives as long as the global tensor it was converted from (a
  weak reference on it: when that tensor is freed, so is what was kept; a view keeps its
  base alive, and so the base's kept result). A partial activation all-reduced in forward
  and saved for backward thus holds its broadcast copy, as large as itself, until
  backward frees it; a split one gathered, its gathered copy, `n` times its own size.
  `clear()` frees everything kept now.
- **Switch.** `set_enabled(False)` (returns the previous setting), or the environment
  variable `SBP_REUSE_CONVERSIONS=0` read at import, turns it off; every rank must set it
  alike, since it changes which collectives run.

Nothing is kept while a graph is traced (`torch.compile`), for ranks outside the
placement (they move nothing), for conversions between placements or without a
collective, for ops that write an argument or return views, and while the data-parallel
fast path watches the ops of its checking pass (so it behaves as before). What is kept
is dropped on every rank where a rank set is found out of step. Whether a use is found
depends only on what every rank of the collective's group does alike (the same tensor
objects, the same writes, the same local shapes), so the ranks skip the collective
together.
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from sbp import env
from sbp.boxing import plan_specs
from sbp.comm import functional, shm
from sbp.layout import GlobalSpec
from sbp.ranges import COPIED_VIEWS, global_writes

_ENABLED = [os.environ.get("SBP_REUSE_CONVERSIONS", "1") != "0"]


def set_enabled(enabled: bool) -> bool:
    """Turn reuse of converted inputs on or off (on every rank alike); returns the previous
    setting. Turning it off also frees what was kept."""
    previous = _ENABLED[0]
    _ENABLED[0] = bool(enabled)
    if not enabled:
        clear()
    return previous


def enabled() -> bool:
    """Is reuse of converted inputs on?"""
    return _ENABLED[0]


@dataclass
class _Kept:
    """One conversion of a global tensor's local tensor `local` from `src` to `dst`."""

    src: GlobalSpec
    dst: GlobalSpec
    local: torch.Tensor  # (the source's local tensor then: `set_` may give it another)
    out: torch.Tensor
    versions: tuple  # of `local` and of `out` when kept (see `_versions`)
    dense: bool  # local and out contiguous from offset 0: a view's result is a view of out


# id(global tensor) -> (weak reference to it, its kept conversions)
_kept: dict[int, tuple[Any, list[_Kept]]] = {}


def clear(*_: Any) -> None:
    """Free every kept conversion."""
    _kept.clear()


shm.on_out_of_step(clear)  # (ranks may have kept different things: drop them alike)


def count() -> int:
    """How many conversions are kept now."""
    return sum(len(entries) for _, entries in _kept.values())


def _forget(key: int, _ref: Any = None) -> None:
    _kept.pop(key, None)


def _versions(t: torch.Tensor) -> tuple:
    return global_writes(t), None if t.is_inference() else t._version


@functools.lru_cache(maxsize=4096)
def _worth_keeping(src: GlobalSpec, dst: GlobalSpec) -> bool:
    """Does the conversion run a collective on one placement?"""

    return src.placement == dst.placement and bool(plan_specs(src, dst).collectives)


@functools.lru_cache(maxsize=4096)
def _reduces_only(src: GlobalSpec, dst: GlobalSpec) -> bool:
    """Does the conversion only reduce partial dims to broadcast (elementwise on the local
    tensor: a view's result is the same view of its base's)?"""
    return any(a != b for a, b in zip(src.nd_sbp, dst.nd_sbp, strict=True)) and all(
        a == b or (a.is_partial and b.is_broadcast)
        for a, b in zip(src.nd_sbp, dst.nd_sbp, strict=True)
    )


def _same_reduction(kept: _Kept, src: GlobalSpec, dst: GlobalSpec) -> bool:
    """Does `kept` (of a base) reduce the same hierarchy dims with the same ops as
    `src -> dst` (of a view of it), leaving the others as they are?"""
    if kept.src.placement != src.placement or kept.src.dtype != src.dtype:
        return False
    for ka, kb, a, b in zip(kept.src.nd_sbp, kept.dst.nd_sbp, src.nd_sbp, dst.nd_sbp, strict=True):
        if (a == b) != (ka == kb) or (a != b and ka != a):
            return False
    return True


def _dense(t: torch.Tensor) -> bool:
    return t.storage_offset() == 0 and t.is_contiguous()


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.untyped_storage()._cdata == b.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return False


def _valid(kept: _Kept) -> bool:
    return kept.versions == (_versions(kept.local), _versions(kept.out))


def _entries(g) -> list[_Kept]:
    found = _kept.get(id(g))
    return () if found is None else found[1]


def _keep(g, kept: _Kept) -> None:
    COPIED_VIEWS[0] = True  # (from now on every write through global tensors is counted)
    found = _kept.get(id(g))
    if found is None:
        found = _kept[id(g)] = (weakref.ref(g, functools.partial(_forget, id(g))), [])
    entries = found[1]
    entries[:] = [k for k in entries if k.dst != kept.dst and _valid(k)]  # (stale ones go)
    entries.append(kept)


def _as_view(out: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    return out.as_strided(view.size(), view.stride(), view.storage_offset())


def _view_base(g):
    """`g`'s base global tensor where `g` is an autograd view of one showing its storage."""
    base = g._base
    if base is None or base is g or not hasattr(base, "_spec") or base._copy_of is not None:
        return None
    return base if _same_storage(base._local, g._local) else None


def convert(g: Any, dst: GlobalSpec, box: Callable) -> torch.Tensor:
    """The local tensor of `g` (a GlobalTensor) converted to `dst` by `box(local, src,
    dst)`: a kept result where one holds, else converted now and kept where worth it. (A
    fake or functional local, as tracing makes, is converted and not kept.)"""
    src, local = g._spec, g._local
    if (
        not _ENABLED[0]
        or not _worth_keeping(src, dst)
        or env.get_rank() not in src.placement
        or type(local) is not torch.Tensor
        or functional.tracing(local)
    ):
        return box(local, src, dst)
    for kept in _entries(g):
        if kept.dst == dst and kept.src == src and kept.local is local and _valid(kept):
            return kept.out
    if not _reduces_only(src, dst):
        out = box(local, src, dst)
        _keep(g, _Kept(src, dst, local, out, (_versions(local), _versions(out)), False))
        return out
    base = _view_base(g)
    if base is not None:
        for kept in _entries(base):
            if (
                kept.dense
                and kept.local is base._local
                and _same_reduction(kept, src, dst)
                and _valid(kept)
            ):
                return _as_view(kept.out, local)
        whole = base._local
        if (
            whole.numel() == local.numel()
            and _dense(whole)
            and base._spec.placement == src.placement
        ):
            # the view shows all of its base: convert the base (the same bytes) and keep it
            bsrc = base._spec
            bdst = bsrc._replace(
                nd_sbp=tuple(
                    b if a != b else k
                    for a, b, k in zip(src.nd_sbp, dst.nd_sbp, bsrc.nd_sbp, strict=True)
                )
            )
            if bsrc.dtype == src.dtype and _reduces_only(bsrc, bdst):
                out = box(whole, bsrc, bdst)
                kept = _Kept(
                    bsrc, bdst, whole, out, (_versions(whole), _versions(out)), _dense(out)
                )
                if kept.dense and _same_reduction(kept, src, dst):
                    _keep(base, kept)
                    return _as_view(out, local)
    out = box(local, src, dst)
    dense = _dense(local) and _dense(out)
    _keep(g, _Kept(src, dst, local, out, (_versions(local), _versions(out)), dense))
    return out


def at_hand(flat: list, global_type: type) -> list:
    """`flat` with each partial global tensor that has a kept conversion to a layout without
    partial sums (a partial activation all-reduced by an earlier consumer) replaced by
    that value, as a global tensor in the kept layout: the same logical value, so the
    op's decision starts from what is already at hand instead of resolving the partial
    sum a second way (backward's layer norm would reduce-scatter what forward's
    all-reduced). For ops that neither write an argument nor return views (the caller
    checks); nothing while tracing or with reuse off, as for `convert`."""
    out = None
    for i, a in enumerate(flat):
        if type(a) is not global_type:
            continue
        for kept in _entries(a):
            if (
                kept.src == a._spec
                and kept.local is a._local
                and any(s.is_partial for s in kept.src.nd_sbp)
                and not any(s.is_partial for s in kept.dst.nd_sbp)
                and _valid(kept)
            ):
                if out is None:
                    out = list(flat)
                out[i] = global_type(kept.out, kept.dst)
                break
    return flat if out is None else out


def any_kept() -> bool:
    """Is anything kept now (`at_hand` has anything to find)?"""
    return bool(_kept)
