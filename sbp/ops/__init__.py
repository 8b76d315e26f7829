"""SBP propagation: which signature each torch op's output gets, and what inputs must move.

`dispatch` is called by `GlobalTensor.__torch_dispatch__`. An op with a rule in
the registry runs by it; any other op falls back to boxing every global input
to broadcast, running locally, and returning broadcast results (warned once).
"""

from sbp.ops import (  # noqa: F401 - register rules
    attention,
    basic,
    batch_norm,
    conversions,
    decomposed,
    init,
    inplace_views,
    linalg,
    nn,
    optim,
    out_variants,
    pointwise,
    reductions,
    setitem,
    shard_batch_norm,
    traced,
    views,
    writes,
)
from sbp.ops.registry import dispatch, register

__all__ = ["dispatch", "register"]
