"""The fast path's output types where they were documented first (they live in
`sbp.data_parallel.outputs`)."""

from sbp.data_parallel.outputs import FastPathLoss, FastPathOutput

__all__ = ["FastPathLoss", "FastPathOutput"]
