"""See and forbid implicit communication.

`sbp.comm_stats(trace=True, model=m)` keeps, for every collective, the op that caused
it, the conversion (source -> target sbp), the module path running it in forward
(names from `m.named_modules()`, else class names) and the phase; `st.table()` sums them.
`sbp.strict()` raises `ImplicitCommunicationError` at the first conversion an op needs
that the program did not ask for with `to_global`: on every rank alike, since every rank
plans the same conversions. The gradient reductions a broadcast or split parameter's
layout implies, and the collectives that are an op's own (BatchNorm's sums over the
batch, a loss's mean), are not conversions: strict mode lets them run. `SBP_STRICT=1`
makes the whole program strict.

Module paths come from forward pre/post hooks on every module, installed while a traced
`comm_stats` or a strict block is open (torch's global module hooks).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterator

import torch

from sbp.comm import stats
from sbp.errors import ImplicitCommunicationError, InputTypeError

_names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_hooks: list = []
_strict = [0]


def comm_stats(trace: bool = False, model: torch.nn.Module | None = None):
    """Count the collectives run inside the block (`st.calls`, `st.bytes`, `st.by_kind`);
    with `trace=True` keep each one's cause in `st.events` (`st.table()`)."""
    if not isinstance(trace, bool):
        raise InputTypeError(f"sbp.comm_stats: trace must be a bool, got {trace!r}")
    return _traced(trace, model)


@contextlib.contextmanager
def _traced(trace: bool, model: torch.nn.Module | None) -> Iterator[stats.CommStats]:
    with _module_paths(model) if trace else contextlib.nullcontext():
        with stats.comm_stats(trace) as st:
            yield st


@contextlib.contextmanager
def strict(model: torch.nn.Module | None = None) -> Iterator[None]:
    """Raise `ImplicitCommunicationError` at the first conversion an op needs inside."""
    _strict[0] += 1
    try:
        with _module_paths(model), stats.watch():
            yield
    finally:
        _strict[0] -= 1


def is_strict() -> bool:
    return _strict[0] > 0


def check_conversion(src_text: str, dst_text: str, collectives: list[str]) -> None:
    """Called by `box` (while watched) before a conversion runs its collectives."""
    cause = stats.current_cause()
    if not collectives or not is_strict() or cause is None or not cause[1]:
        return
    backward = torch._C._current_autograd_node() is not None
    where = stats.modules[-1] if stats.modules and not backward else ""
    raise ImplicitCommunicationError(
        f"sbp.strict: {cause[0]}{f' in {where}' if where else ''} needs an input converted "
        f"{src_text} -> {dst_text} ({', '.join(collectives)}), which the program did not ask "
        "for: convert it where you mean to (x.to_global(sbp=...)) or lay out its producer "
        "so, or run this outside sbp.strict()"
    )


@contextlib.contextmanager
def _module_paths(model: torch.nn.Module | None) -> Iterator[None]:
    if model is not None:
        if not isinstance(model, torch.nn.Module):
            raise InputTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        for name, m in model.named_modules():
            _names[m] = name or type(m).__name__
    if not _hooks:
        from torch.nn.modules.module import (
            register_module_forward_hook,
            register_module_forward_pre_hook,
        )

        _hooks.append(register_module_forward_pre_hook(_enter))
        _hooks.append(register_module_forward_hook(_leave))
    _hooks.append(None)  # (one per open block: the hooks go when the last one closes)
    try:
        yield
    finally:
        _hooks.remove(None)
        if all(h is not None for h in _hooks):
            for h in _hooks:
                h.remove()
            _hooks.clear()
            stats.modules.clear()  # (a forward that raised left its modules on the stack)


def _enter(module: torch.nn.Module, args) -> None:
    """Push the module's path: its name in the model given, else the class names down."""
    if stats.watching():
        name = _names.get(module)
        if name is None:
            outer = stats.modules[-1] + "/" if stats.modules else ""
            name = outer + type(module).__name__
        stats.modules.append(name)


def _leave(module: torch.nn.Module, args, out) -> None:
    if stats.watching() and stats.modules:
        stats.modules.pop()


if os.environ.get("SBP_STRICT") == "1":
    _strict[0] += 1
    stats._watchers[0] += 1
