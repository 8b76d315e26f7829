"""How a call the data-parallel check takes whole (`families.attention`,
`recurrent`, `embedding_bag`) lays its results out as the batch: the batch's layout moved to the
dim a tensor holds its samples on, and this rank's rows of a result as a global tensor."""

from __future__ import annotations

import torch

from sbp.layout import GlobalSpec
from sbp.placement import placement as Placement
from sbp.signature import split
from sbp.tensor import GlobalTensor


def moved_to(data_nd: tuple, dim: int) -> tuple:
    """The batch's layout with its splits moved to `dim`."""
    return tuple(split(dim) if s.is_split else s for s in data_nd)


def rows_as_global(
    local: torch.Tensor, placement: Placement, nd: tuple, dim: int, n: int
) -> GlobalTensor:
    """`local`, this rank's rows of a result whose batch of `n` samples lies on `dim`, laid
    out as `nd`, as a global tensor (no communication)."""
    shape = (*local.shape[:dim], n, *local.shape[dim + 1 :])
    return GlobalTensor(local, GlobalSpec(placement, nd, shape, local.dtype))
