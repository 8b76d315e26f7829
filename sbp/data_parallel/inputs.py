"""A call's arguments as the data-parallel path reads them: global inputs (in tuples too),
plain constants, batch sizes."""

from __future__ import annotations

import enum
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

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
    """An argument the fast path cannot take (`DataParallel._layout_key`)."""


def _global_inputs(args: tuple, kwargs: dict) -> Iterator[tuple[tuple, GlobalTensor]]:
    """(path, tensor) of each global input, in tuples too (a recurrent layer's (h, c)
    state): the path is the argument's position or keyword, then the indices inside."""
    stack = [((k,), a) for k, a in reversed([*enumerate(args), *kwargs.items()])]
    while stack:
        path, a = stack.pop()
        if isinstance(a, GlobalTensor):
            yield path, a
        elif type(a) is tuple:
            stack.extend(((*path, i), v) for i, v in reversed(list(enumerate(a))))


def _input_at(args: tuple, kwargs: dict, path: tuple) -> Any:
    value = args[path[0]] if type(path[0]) is int else kwargs[path[0]]
    for i in path[1:]:
        value = value[i]
    return value


def _map_globals(a: Any, fn: Callable) -> Any:
    """`a` with `fn` applied to each global tensor in it (itself, or in tuples)."""
    if isinstance(a, GlobalTensor):
        return fn(a)
    if type(a) is tuple:
        return tuple(_map_globals(v, fn) for v in a)
    return a


def _batch_sizes(args: tuple, kwargs: dict, data_nd: tuple) -> list[int]:
    """The logical leading sizes of the inputs laid out as the batch, in argument order."""
    return [
        leaf.shape[0]
        for leaf in tree_flatten((args, kwargs))[0]
        if isinstance(leaf, GlobalTensor) and tuple(leaf.sbp) == data_nd and leaf.dim()
    ]


def _numbers_blanked(k: Any) -> Any:
    """A layout key's entry (`DataParallel._layout_key`) with each number's value left out,
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
