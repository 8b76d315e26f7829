"""Tensors that stand in for global tensors in autograd graphs: who makes them registers.

The data-parallel fast path (`sbp.data_parallel.call.DataParallel`) runs a module on local
leaves that share their parameters' storage: a parameter itself is in no graph, its local
leaf is. A `backward(inputs=...)` (`GlobalTensor.backward`) or `torch.autograd.grad` naming
the parameter asks the owners registered here for the tensor autograd knows instead.
Neutral on purpose: `sbp.tensor` calls it without knowing who registers.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch

# The owners alive: each provides `local_leaves(tensors) -> list` (the tensors with its
# stand-ins in place) and `leaf_grad_spec(t)` (the layout of a gradient taken at `t`'s
# stand-in, or None where it has none).
OWNERS: weakref.WeakSet = weakref.WeakSet()


def replace(inputs: torch.Tensor | Iterable[torch.Tensor]) -> list:
    """`inputs` of a `backward(inputs=...)` with each tensor that has a stand-in replaced
    by it (the stand-in's graph is the one that reaches the loss)."""
    tensors = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
    for owner in list(OWNERS):
        tensors = owner.local_leaves(tensors)
    return tensors


def grad_spec(t: torch.Tensor) -> Any:
    """The layout of a gradient taken at `t`'s stand-in (by `torch.autograd.grad`): for
    the fast path's, this rank's share of the logical gradient, a partial sum over the
    ranks splitting the batch; None where `t` has no stand-in."""
    for owner in list(OWNERS):
        spec = owner.leaf_grad_spec(t)
        if spec is not None:
            return spec
    return None
