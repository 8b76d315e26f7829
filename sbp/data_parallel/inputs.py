"""A call's arguments as the data-parallel path reads them (`Inputs`: walked once), and
the values it takes as plain constants."""

from __future__ import annotations

import enum
import types
from collections.abc import Callable
from typing import Any

import torch

from sbp.tensor import GlobalTensor

# output values besides tensors that the local run may return as they are
_PLAIN_VALUES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
# argument values besides tensors that the forward can only read (a flag, a name, a function)
_CONSTANT_TYPES = (*_PLAIN_VALUES, enum.Enum, types.FunctionType, types.BuiltinFunctionType)


def _all_of(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Do contiguous `a` and `b` hold the same elements (one is a whole view of the other)?"""
    return a is b or (
        a.numel() == b.numel()
        and a.storage_offset() == b.storage_offset()
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.is_contiguous()
        and b.is_contiguous()
    )


class _NotDataParallel(Exception):
    """An argument the fast path cannot take (`Inputs`)."""


class Inputs:
    """A call's `(args, kwargs)`, walked once, in argument order, into tuples (a recurrent
    layer's (h, c) state) and nothing else: global inputs on `placement` split or
    broadcast, and plain constants. It serves the layout key's entries, the hierarchy dims
    the inputs are split along, each global input with its path (the argument's position
    or keyword, then the indices inside), the batch sizes, an input by path (the index
    inputs a check found) and the arguments with the globals mapped (the local run's).

    `key` is None where an argument is not one the fast path can take: a global tensor on
    another placement or with a partial sum, a local tensor, an object the forward may
    write into (a KV cache)."""

    __slots__ = ("args", "kwargs", "key", "data", "other", "globals")

    def __init__(self, args: tuple, kwargs: dict, placement: Any):
        self.args, self.kwargs = args, kwargs
        # hierarchy dims along which some input is split on dim 0, and on another dim
        self.data: set[int] = set()
        self.other: set[int] = set()
        self.globals: list[tuple[tuple, GlobalTensor]] = []
        try:
            self.key: tuple | None = tuple(
                self._key_of((k,), a, placement) for k, a in (*enumerate(args), *kwargs.items())
            )
        except _NotDataParallel:
            self.key = None

    def _key_of(self, path: tuple, a: Any, placement: Any) -> Any:
        if isinstance(a, GlobalTensor):
            spec = a._spec
            if spec.placement != placement:
                raise _NotDataParallel
            for h, s in enumerate(spec.nd_sbp):
                if s.is_split:
                    (self.data if s.dim == 0 else self.other).add(h)
                elif not s.is_broadcast:
                    raise _NotDataParallel
            self.globals.append((path, a))
            return spec
        if type(a) is tuple and not _is_constant(a):
            return (tuple, tuple(self._key_of((*path, i), v, placement) for i, v in enumerate(a)))
        if not _is_constant(a):  # (a local tensor, a KV cache the forward writes into)
            raise _NotDataParallel
        return (type(a), a)

    def batch_sizes(self, data_nd: tuple) -> list[int]:
        """The logical leading sizes of the inputs laid out as the batch, in argument order."""
        return [g.shape[0] for _, g in self.globals if tuple(g.sbp) == data_nd and g.dim()]

    def at(self, path: tuple) -> Any:
        """The input at `path` (one of `globals`' paths, in a call of the same layout)."""
        value = self.args[path[0]] if type(path[0]) is int else self.kwargs[path[0]]
        for i in path[1:]:
            value = value[i]
        return value

    def mapped(self, fn: Callable) -> tuple[list, dict]:
        """The arguments with `fn` applied to each global input (`globals`' order)."""
        return (
            [_map_globals(a, fn) for a in self.args],
            {k: _map_globals(v, fn) for k, v in self.kwargs.items()},
        )


def _map_globals(a: Any, fn: Callable) -> Any:
    """`a` with `fn` applied to each global tensor in it (itself, or in tuples)."""
    if isinstance(a, GlobalTensor):
        return fn(a)
    if type(a) is tuple:
        return tuple(_map_globals(v, fn) for v in a)
    return a


def _numbers_blanked(k: Any) -> Any:
    """A layout key's entry (`DataParallel._layout_key`, `Inputs.key`) with each number's value left out,
    in tuples too: `(int, 5)` becomes `int`, a tuple of constants `(tuple, (5, "a"))`
    becomes `(tuple, (int, "a"))`."""
    if type(k) is not tuple or len(k) != 2:
        return k
    kind, value = k
    if kind in (int, float):
        return kind
    if kind is tuple:
        return (
            tuple,
            tuple(type(v) if type(v) in (int, float) else _numbers_blanked(v) for v in value),
        )
    return k


def _is_constant(value: Any) -> bool:
    """Is a plain argument a value the forward can only read (a flag, a number, a name)?
    Any other object (a Hugging Face KV cache) may be written by the forward: the checking
    pass would fill it with global tensors and the local run with local ones."""
    if isinstance(value, tuple):
        return all(_is_constant(v) for v in value)
    return isinstance(value, _CONSTANT_TYPES)
