"""`sbp.nn`: modules on global tensors: the data-parallel fast path of `module.to_global`
(`fast_path`, from `sbp.data_parallel`), torch DDP with sbp's environment (`parallel`)
and tensor-parallel layouts at module boundaries (`parallelize`)."""

from sbp.data_parallel.memory import memory_report
from sbp.nn import fast_path, parallel
from sbp.nn.fast_path import data_parallel, no_sync
from sbp.nn.module import module_to_global
from sbp.nn.parallelize import ColwiseParallel, RowwiseParallel, parallelize

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
