"""Replicas that must be equal are compared before a model's state leaves the ranks.

A broadcast tensor's replicas are equal by construction, unless something ran on some
ranks only (an in-place write to `to_local()`, a step with another setting): then
`full_tensor()` returns a different "logical" value on each rank, silently. Before a
checkpoint is written and before `full_state_dict` hands out plain tensors, each rank
hashes the bytes of the part it holds of every tensor with replicas (the re-box check's
`agreement.data_hash`) and the ranks holding the same part compare them: one small
all-gather of names and hashes; a drift is `MetaMismatchError` on every rank naming the
tensors and the ranks that differ.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from sbp import env
from sbp.comm.agreement import data_hash
from sbp.comm.meta import gather_objects
from sbp.errors import MetaMismatchError
from sbp.signature import Broadcast
from sbp.tensor import GlobalTensor


def check(tensors: Mapping[str, torch.Tensor], what: str) -> None:
    """Raise `MetaMismatchError` on every rank where replicas among `tensors` differ."""
    if not env.is_distributed():
        return
    mine = {name: sums for name, t in tensors.items() if (sums := _sum_of_part(t)) is not None}
    every = gather_objects(mine, tuple(range(env.get_world_size())))
    drifted = []
    for name in sorted(mine):
        parts: dict[tuple, dict[int, int]] = {}
        for rank, sums in enumerate(every):
            if sums and name in sums:
                ranges, crc = sums[name]
                parts.setdefault(ranges, {})[rank] = crc
        for by_rank in parts.values():
            if len(set(by_rank.values())) > 1:
                groups: dict[int, list[int]] = {}
                for rank, crc in by_rank.items():
                    groups.setdefault(crc, []).append(rank)
                drifted.append(f"{name!r} (ranks {' vs '.join(map(str, groups.values()))})")
                break
    if drifted:
        raise MetaMismatchError(
            f"{what}: the replicas of {len(drifted)} broadcast tensor(s) differ between "
            f"ranks: {', '.join(drifted[:8])}{' ...' if len(drifted) > 8 else ''}; "
            "something ran on some ranks only (a write into to_local(), an optimizer "
            "setting or step on one rank), so their logical value is not defined"
        )


def _sum_of_part(t: torch.Tensor) -> tuple[tuple, int] | None:
    """(the ranges of this rank's part, its bytes' hash) for a tensor with replicas (a
    broadcast dim, no partial one) that this rank holds; else None."""
    if not isinstance(t, GlobalTensor) or env.get_rank() not in t.placement:
        return None
    if not any(isinstance(s, Broadcast) for s in t.sbp) or any(s.is_partial for s in t.sbp):
        return None
    return tuple(t._spec.ranges(env.get_rank())), data_hash(t._local)
