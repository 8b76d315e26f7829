"""Names of `torch.nn.functional` replaced for a call (a loss, attention, dropout looked up
by name), and module forwards replaced for a call."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from sbp.data_parallel.names_replaced import NamesReplaced

BATCH_NORMS = torch.nn.modules.batchnorm._BatchNorm
SPECIAL_MODULES = (BATCH_NORMS, torch.nn.modules.dropout._DropoutNd)


@contextlib.contextmanager
def _forwards_replaced(modules: list[torch.nn.Module], replacement) -> Iterator[None]:
    """For the call, each module's forward is `replacement(module, its forward)`."""
    own = [m.__dict__.get("forward") for m in modules]
    for m in modules:  # (the instance dict: nn.Module.__setattr__ is slow)
        m.__dict__["forward"] = replacement(m, m.forward)
    try:
        yield
    finally:
        for m, f in zip(modules, own, strict=True):
            if f is None:
                del m.__dict__["forward"]
            else:
                m.__dict__["forward"] = f


@contextlib.contextmanager
def _by_name_replaced(handler: Callable) -> Iterator[None]:
    """For the call, in this thread, `torch.nn.functional.cross_entropy(...)`,
    `nll_loss(...)` and `scaled_dot_product_attention(...)` are `handler(the function,
    ...)`: a model's loss (transformers' `nn.functional.cross_entropy`,
    `nn.CrossEntropyLoss`) and attention (transformers' `sdpa_attention_forward`) look them
    up as they are called. The names stay replaced while any thread's call is on; each
    thread's calls go to its innermost handler, or to torch's function where it has none."""
    handlers = _HANDLERS.__dict__.setdefault("stack", [])
    with _NAMES.held():
        handlers.append(handler)
        try:
            yield
        finally:
            handlers.pop()


def _route_names() -> list:
    saved = []
    for f in _BY_NAME:
        name = f.__name__
        current = getattr(F, name)
        route = _ROUTES.get(current)
        if route is None:  # (made once per function: installs come at every local run)
            route = _ROUTES[current] = _routed(current)
            _ROUTED[route] = current
        setattr(F, name, route)
        saved.append((F, name, current))
    return saved


# torch's functions, taken before any replacement (a mode is handed the replacement where a
# Python function of torch.nn.functional passes itself by its module's name)
_LOSSES = (F.cross_entropy, F.nll_loss)
_ATTENTION = F.scaled_dot_product_attention
_DROPOUT = F.dropout  # (by name only inside torch's multi-head attention: `_LocalOps`)
_BY_NAME = (*_LOSSES, _ATTENTION, _DROPOUT)
_ROUTES: dict = {}  # a function the names held: the replacement routing to it
_ROUTED: dict = {}  # a replacement: the function it routes to
_HANDLERS = threading.local()  # .stack: this thread's handlers, innermost last
_NAMES = NamesReplaced(_route_names)


def _unrouted(func: Any) -> Any:
    """`func`, or the function a name's replacement routes to (one lookup: the modes ask
    it of every torch call)."""
    return _ROUTED.get(func, func)


def _routed(original: Callable) -> Callable:
    @functools.wraps(original)
    def call(*args, **kwargs):
        handlers = getattr(_HANDLERS, "stack", None)
        if not handlers:
            return original(*args, **kwargs)
        return handlers[-1](original, *args, **kwargs)

    return call


def _within(context, forward):
    def inside(*args, **kwargs):
        with context:
            return forward(*args, **kwargs)

    return inside
