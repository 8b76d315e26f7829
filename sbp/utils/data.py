"""`sbp.utils.data.DistributedSampler`: torch's sampler, ranks from `sbp.env`.

torch's sampler asks `torch.distributed` for the world size and rank when they are
not given, and fails before `init_process_group`. Here the defaults come from
`sbp.env`, which reads the launcher's variables (and is a world of 1 without one).
"""

from __future__ import annotations

from typing import Any

import torch.utils.data

from sbp import env
from sbp.errors import InputTypeError, InputValueError

__all__ = ["DistributedSampler"]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_arguments(num_replicas: Any, rank: Any, shuffle: Any, seed: Any, drop_last: Any) -> None:
    """Named errors for what torch's sampler takes silently (`shuffle="no"` is true, a float
    seed fails at the first epoch) or reports as a bare ValueError."""
    for name, value in (("shuffle", shuffle), ("drop_last", drop_last)):
        if not isinstance(value, bool):
            raise InputTypeError(f"DistributedSampler: {name} must be True or False, got {value!r}")
    for name, value in (("num_replicas", num_replicas), ("rank", rank), ("seed", seed)):
        if not _is_int(value):
            raise InputTypeError(f"DistributedSampler: {name} must be an int, got {value!r}")
    if num_replicas < 1:
        raise InputValueError(
            f"DistributedSampler: num_replicas must be at least 1, got {num_replicas}; leave it "
            "None for the world size"
        )
    if not 0 <= rank < num_replicas:
        raise InputValueError(
            f"DistributedSampler: rank must be in [0, {num_replicas}) (num_replicas="
            f"{num_replicas}), got {rank}; leave it None for this process's rank"
        )


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
        _check_arguments(num_replicas, rank, shuffle, seed, drop_last)
        super().__init__(
            dataset, num_replicas, rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
