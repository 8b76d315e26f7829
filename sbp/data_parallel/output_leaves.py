"""The leaves of a module's output for the data-parallel fast path, KV caches opened.

The fast path wraps each tensor a local run returns as a global tensor laid out as the
checking pass found it. torch's pytree reaches the tensors of tuples, dicts and
transformers' `ModelOutput`s, but a transformers KV cache (`DynamicCache`, returned while
`use_cache` is on, as it is by default in training) is one opaque leaf holding each layer's
keys and values. Here a cache's layers are opened: their `keys` and `values` are leaves
too, and putting leaves back writes them into the same cache object, so the local run's
cache comes back holding global tensors.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

CACHE = "<a transformers cache>"  # where a cache stood among the leaves (a plain value)


def _cache_layers(obj: Any) -> list | None:
    """The layers of a transformers cache, each with `keys` and `values` (tensors or None);
    None for anything else."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    cache_type = getattr(cache_utils, "Cache", None)
    if cache_type is None or not isinstance(obj, cache_type):
        return None
    layers = getattr(obj, "layers", None)
    if not isinstance(layers, list):
        return None
    for layer in layers:
        for name in ("keys", "values"):
            value = getattr(layer, name, None)
            if value is not None and not isinstance(value, torch.Tensor):
                return None
    return layers


def output_leaves(out: Any) -> tuple[list, Callable[[list], Any]]:
    """The leaves of `out` with every transformers cache opened (the marker CACHE, then
    each layer's keys and values), and a function that puts new leaves back."""
    if isinstance(out, torch.Tensor):  # (the usual: one tensor, no tree)
        return [out], _only
    leaves, tree = tree_flatten(out)
    flat: list = []
    caches = []  # (position of the marker, the cache, its layers)
    for leaf in leaves:
        layers = _cache_layers(leaf)
        if layers is None:
            flat.append(leaf)
            continue
        caches.append((len(flat), leaf, layers))
        flat.append(CACHE)
        for layer in layers:
            flat.extend((layer.keys, layer.values))

    def put_back(new: list) -> Any:
        new = list(new)
        opened = set()
        for at, cache, layers in caches:
            for i, layer in enumerate(layers):
                layer.keys, layer.values = new[at + 1 + 2 * i], new[at + 2 + 2 * i]
            new[at] = cache
            opened.update(range(at + 1, at + 1 + 2 * len(layers)))
        return tree_unflatten([x for k, x in enumerate(new) if k not in opened], tree)

    return flat, put_back


def _only(new: list) -> Any:
    return new[0]
