"""The data-parallel fast path's public names, where they were documented first.

The fast path lives in `sbp.data_parallel` (one module per idea, see its docstring);
this module re-exports what users and tests reach through `sbp.nn.fast_path`:
`state(module).last_path`, `data_parallel`, `no_sync`, `attach`, `detach_fast_path`.
"""

from sbp.data_parallel.api import (
    ATTR,
    SETTLE_HOOK,
    attach,
    data_parallel,
    detach_fast_path,
    no_sync,
    state,
)
from sbp.data_parallel.by_name import _by_name_replaced
from sbp.data_parallel.call import DataParallel
from sbp.data_parallel.layout import Layout
from sbp.data_parallel.torch_compile import _COMPILE_BACKENDS

__all__ = [
    "ATTR",
    "SETTLE_HOOK",
    "DataParallel",
    "Layout",
    "_COMPILE_BACKENDS",
    "_by_name_replaced",
    "attach",
    "data_parallel",
    "detach_fast_path",
    "no_sync",
    "state",
]
