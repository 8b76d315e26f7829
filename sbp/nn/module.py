"""`module.to_global`: parameters and buffers become global; broadcast ones get the fast path."""

from __future__ import annotations

from typing import Any

import torch

from sbp.nn import fast_path, torch_recurrent
from sbp.placement import placement as Placement
from sbp.signature import normalize_nd_sbp
from sbp.tensor import module_to_global as convert_module


def module_to_global(
    module: torch.nn.Module, placement: Placement, sbp: Any, **kwargs: Any
) -> torch.nn.Module:
    """Convert `module` in place (see `sbp.tensor.module_to_global`); a module made broadcast
    everywhere runs data-parallel calls on local shards (`sbp.data_parallel`); recurrent
    layers start from a global zero state (`sbp.nn.torch_recurrent`)."""
    convert_module(module, placement, sbp, **kwargs)
    torch_recurrent.attach(module)
    nd = normalize_nd_sbp(sbp, placement.ndim)
    if all(s.is_broadcast or (s.is_split and s.dim == 0) for s in nd):
        # broadcast, or parameters sharded along dim 0 (sharded data parallelism)
        fast_path.attach(module, placement)
    else:
        fast_path.detach_fast_path(module)
    return module
