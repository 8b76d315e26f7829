"""What each rank holds of a global tensor, for the protocols that read or write it by
parts: DCP's checkpointable protocol (its chunk and write item, `GlobalTensor.__create_*__`),
`copy_` of a plain logical value (`model.load_state_dict` of plain tensors) and pickling
(`__reduce_ex__`: this rank's part).

Below `sbp.tensor`, which calls them: they read a global tensor's spec and local tensor
only. Pickling is `sbp.checkpoint`'s, registered here at its import (`pickle_with`): its
unpickler builds a GlobalTensor, so it sits above `sbp.tensor`, and saved files name it
there (`sbp.checkpoint.rebuild_global_tensor`). `sbp/__init__.py` imports `sbp.checkpoint`,
so every use of sbp has it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from sbp import env
from sbp.errors import MetaMismatchError, SbpSignatureError
from sbp.layout import strided_of, unflattened
from sbp.signature import Partial, format_nd_sbp

if TYPE_CHECKING:
    from sbp.tensor import GlobalTensor


def chunk_list(g: GlobalTensor) -> list:
    """The chunk of the logical tensor this rank holds (none outside the placement)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    me = env.get_rank()
    if me not in g.placement:
        return []
    if any(s.is_partial for s in g.sbp):
        raise SbpSignatureError(
            f"a GlobalTensor with sbp {format_nd_sbp(g.sbp)} holds partial values, which DCP "
            "cannot write or read: use sbp.checkpoint.save/load (they reduce partials), or "
            "convert it first with .to_global(sbp=...)"
        )
    ranges = g._spec.ranges(me)
    return [
        ChunkStorageMetadata(
            offsets=torch.Size(a for a, _ in ranges), sizes=torch.Size(b - a for a, b in ranges)
        )
    ]


def write_items(g: GlobalTensor, fqn: str) -> list:
    """One SHARD write item for this rank's chunk; DCP keeps one of equal chunks (replicas)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    properties = TensorProperties.create_from_tensor(g._local)
    return [
        WriteItem(
            index=MetadataIndex(fqn, chunk.offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=g.size()),
        )
        for chunk in chunk_list(g)
    ]


def copy_plain_value(g: GlobalTensor, src: torch.Tensor, non_blocking: bool) -> GlobalTensor:
    """Distribute `src`, the logical value held whole on every rank, by `g`'s sbp.

    Each rank copies the slice it holds; along a partial_sum dim the first rank holds the
    value and the others zeros. No communication, so every rank must pass the same value.
    """
    me = env.get_rank()
    if tuple(src.shape) != tuple(g.shape):
        raise MetaMismatchError(
            f"copy_: a plain source of shape {tuple(src.shape)} is taken as the logical value "
            f"and must have the global tensor's shape {tuple(g.shape)}"
        )
    if me not in g.placement:
        return g
    coord = g.placement.coord(me)
    if any(s == Partial("sum") and c != 0 for s, c in zip(g.sbp, coord, strict=True)):
        g._local.zero_()
    else:
        spec = g._spec
        if strided_of(spec.nd_sbp) is not None:  # (its part of the unflattened value)
            spec, src = unflattened(spec), src.reshape(unflattened(spec).shape)
        part = src[tuple(slice(a, b) for a, b in spec.ranges(me))]
        g._local.copy_(part.reshape(g._local.shape), non_blocking=non_blocking)
    return g


_PICKLERS: list[Callable] = []  # `sbp.checkpoint.reduce_global_tensor`, once imported


def pickle_with(reduce: Callable) -> None:
    """`reduce(g)` is how `GlobalTensor.__reduce_ex__` pickles `g` (`sbp.checkpoint`)."""
    _PICKLERS[:] = [reduce]


def pickled(g: GlobalTensor) -> tuple:
    """`g.__reduce_ex__(protocol)`: the registered reduction of `g`."""
    if not _PICKLERS:
        raise RuntimeError("pickling a GlobalTensor needs sbp.checkpoint: import sbp first")
    return _PICKLERS[0](g)
