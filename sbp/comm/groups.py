"""One process group per ordered rank set, created so ranks outside the set never block.

Groups keep the placement's rank order (`sort_ranks=False`), so group rank i is
the i-th rank of the set and gathered chunks come back in placement order.
"""

from __future__ import annotations

import inspect

import torch.distributed as dist

from sbp import env
from sbp.errors import PlacementError

_groups: dict[tuple[int, ...], object] = {}
_HAS_SORT_RANKS = "sort_ranks" in inspect.signature(dist.new_group).parameters


def get_group(ranks: tuple[int, ...]):
    """The process group of `ranks` (in this order); None for a single rank."""
    if len(ranks) <= 1:
        return None
    group = _groups.get(ranks)
    if group is not None:
        return group
    world = env.get_world_size()
    if ranks == tuple(range(world)):
        group = dist.group.WORLD
    else:
        if max(ranks) >= world:
            raise PlacementError(f"ranks {list(ranks)} are outside the world of {world} ranks")
        kwargs = {"use_local_synchronization": True, "timeout": env.get_timeout()}
        if _HAS_SORT_RANKS:
            kwargs["sort_ranks"] = False
        elif list(ranks) != sorted(ranks):
            raise PlacementError(
                f"placement ranks {list(ranks)} are not in ascending order; "
                "this torch cannot keep the order of a process group (needs sort_ranks)"
            )
        group = _new_member_only_group(list(ranks), kwargs)
    _groups[ranks] = group
    return group


def _new_member_only_group(ranks: list[int], kwargs: dict):
    """`new_group` called by the members only.

    torch 2.14 salts the hashed name of a member-only group with a global group
    counter that non-members never advance, so once one group left some ranks
    out, members of the next one derive different names and wait for each
    other forever. The name must depend on the rank set alone; we pin the salt
    while the group is made and give the counter back its own progress after.
    """
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is None or not hasattr(world, "group_count"):
        return dist.new_group(ranks, **kwargs)
    count = world.group_count
    world.group_count = 0
    try:
        return dist.new_group(ranks, **kwargs)
    finally:
        world.group_count = count + 1


def clear() -> None:
    """Forget cached groups (after the world was re-created)."""
    _groups.clear()
