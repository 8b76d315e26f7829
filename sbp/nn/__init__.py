"""`sbp.nn`: modules on global tensors: the data-parallel fast path of `module.to_global`
(`fast_path`), torch DDP with sbp's environment (`parallel`) and tensor-parallel layouts
at module boundaries (`parallelize`).

`fast_path` and the names from it are loaded on first use: `sbp.data_parallel` imports
helpers of this package (`names_replaced`, `outputs`), and loading the fast path here
would close a circle through it."""

from typing import Any

from sbp.nn import parallel
from sbp.nn.parallelize import ColwiseParallel, RowwiseParallel, parallelize

_LAZY = {
    "fast_path": ("sbp.nn.fast_path", None),
    "data_parallel": ("sbp.nn.fast_path", "data_parallel"),
    "no_sync": ("sbp.nn.fast_path", "no_sync"),
    "module_to_global": ("sbp.nn.module", "module_to_global"),
    "memory_report": ("sbp.data_parallel.memory", "memory_report"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'sbp.nn' has no attribute {name!r}")
    import importlib

    module, attr = _LAZY[name]
    loaded = importlib.import_module(module)
    return loaded if attr is None else getattr(loaded, attr)


__all__ = [
    "ColwiseParallel",
    "RowwiseParallel",
    "data_parallel",
    "fast_path",
    "memory_report",
    "module_to_global",
    "no_sync",
    "parallel",
    "parallelize",
]
