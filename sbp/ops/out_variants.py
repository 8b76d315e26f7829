"""`out=` variants (`torch.add(a, b, out=c)`): the op's functional form, written into `out`.

Run as any other op, `out` would be boxed to what the op's rule wants, a copy where its
layout differs, and the result written into that copy: lost. Instead the functional form
runs by its rule, and `out` takes the result: copied in, in `out`'s own layout, or where
the shapes differ (torch resizes `out` then) `out` becomes the result.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from sbp.errors import InputTypeError
from sbp.ops.inplace_views import become
from sbp.ops.registry import register_when


@functools.cache
def _out_names(func) -> tuple[str, ...]:
    """The arguments `func` writes its results into."""
    return tuple(a.name for a in func._schema.arguments if a.is_out)


@register_when(lambda func: bool(_out_names(func)), first=True)
def out_variant(func, args: tuple, kwargs: dict) -> Any:
    names = _out_names(func)
    outs = [kwargs[name] for name in names]
    rest = {k: v for k, v in kwargs.items() if k not in names}
    if _made_from_nothing(func, args):  # (a factory: `torch.randn(n, out=x)` draws in x's dtype)
        rest.setdefault("dtype", outs[0].dtype)
    results = func.overloadpacket(*args, **rest)
    if isinstance(results, torch.Tensor):
        results = (results,)
    for name, out, result in zip(names, outs, results, strict=True):
        if not torch.can_cast(result.dtype, out.dtype):
            raise InputTypeError(
                f"{func}: the result type {result.dtype} can't be cast to {name}'s type "
                f"{out.dtype}, as torch's out= would not"
            )
        if tuple(out.shape) == tuple(result.shape):
            out.copy_(result)
        else:
            become(out, result.to(out.dtype))
    return outs[0] if len(outs) == 1 else tuple(outs)


def _made_from_nothing(func, args: tuple) -> bool:
    """Is `func` a factory (no tensor among its arguments) whose functional form takes a
    dtype? Its default dtype would differ from `out`'s."""
    return not any(isinstance(a, torch.Tensor) for a in args) and _takes_dtype(func.overloadpacket)


@functools.cache
def _takes_dtype(packet) -> bool:
    return any(
        a.name == "dtype"
        for name in packet.overloads()
        for a in getattr(packet, name)._schema.arguments
    )
