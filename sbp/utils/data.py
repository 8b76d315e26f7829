"""`sbp.utils.data.DistributedSampler`: torch's sampler, ranks from `sbp.env`.

torch's sampler asks `torch.distributed` for the world size and rank when they are
not given, and fails before `init_process_group`. Here the defaults come from
`sbp.env`, which reads the launcher's variables (and is a world of 1 without one).
"""

from __future__ import annotations

from typing import Any

import torch.utils.data

from sbp import env

__all__ = ["DistributedSampler"]


class DistributedSampler(torch.utils.data.DistributedSampler):
    """torch's `DistributedSampler`; `num_replicas` and `rank` default to `sbp.env`'s."""

    def __init__(
        self,
        dataset: Any,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if num_replicas is None:
            num_replicas = env.get_world_size()
        if rank is None:
            rank = env.get_rank()
        super().__init__(
            dataset, num_replicas, rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
