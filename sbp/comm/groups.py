"""One process group per rank *set*, created so ranks outside the set never block.

A placement's rank order matters (chunks are gathered in placement order), but
a group per ordering would cost file descriptors and threads for every order a
program ever uses (60 orders of 4 ranks made 48 groups, 311 fds, 145 threads).
So there is one group per set of ranks, with its ranks in ascending order, and
the collectives permute chunks between placement order and group order
(`group_order`) when the two differ: a local copy, no extra communication.
"""

from __future__ import annotations

import hashlib

import torch.distributed as dist

from sbp import env
from sbp.errors import PlacementError

_groups: dict[tuple[int, ...], object] = {}
_made_per_rank_set: dict[tuple[int, ...], int] = {}  # groups made by sbp (names stay unique)


def get_group(ranks: tuple[int, ...]):
    """The process group of the set `ranks` (its group ranks ascend); None for a single rank."""
    if len(ranks) <= 1:
        return None
    key = tuple(sorted(ranks))
    group = _groups.get(key)
    if group is not None:
        return group
    world = env.get_world_size()
    if key == tuple(range(world)):
        group = dist.group.WORLD
    else:
        if key[-1] >= world:
            raise PlacementError(f"ranks {list(ranks)} are outside the world of {world} ranks")
        kwargs = {"use_local_synchronization": True, "timeout": env.get_timeout()}
        group = _new_member_only_group(list(key), kwargs)
    _groups[key] = group
    return group


def group_order(ranks: tuple[int, ...]) -> list[int] | None:
    """Position in the group (ascending ranks) of each rank of `ranks`; None when equal."""
    key = sorted(ranks)
    if list(ranks) == key:
        return None
    return [key.index(r) for r in ranks]


def _new_member_only_group(ranks: list[int], kwargs: dict):
    """`new_group` called by the members only.

    torch salts the hashed name of a member-only group with a count that non-members
    never advance (2.14: a global group counter; 2.11: how many groups the rank knows), so
    once one group left some ranks out, members of the next one derive different names
    and wait for each other forever. The name must depend on what all members know alike:
    the rank set and how many groups of that set sbp made before. We name the group while
    it is made (torch's own naming still runs, for its counters).
    """
    key = tuple(ranks)
    made = _made_per_rank_set[key] = _made_per_rank_set.get(key, 0) + 1
    c10d = dist.distributed_c10d
    torch_name = getattr(c10d, "_process_group_name", None)
    if torch_name is None:
        return dist.new_group(ranks, **kwargs)

    def name_by_rank_set(group_ranks, use_hashed_name):
        name = torch_name(group_ranks, use_hashed_name=use_hashed_name)
        if not use_hashed_name:
            return name
        unique = f"sbp_{'_'.join(map(str, group_ranks))}_{made}"
        return hashlib.sha1(unique.encode(), usedforsecurity=False).hexdigest()

    c10d._process_group_name = name_by_rank_set
    try:
        return dist.new_group(ranks, **kwargs)
    finally:
        c10d._process_group_name = torch_name


def count() -> int:
    """How many process groups sbp made (for tests of resource bounds)."""
    return len(_groups)


def clear() -> None:
    """Forget cached groups (after the world was re-created)."""
    _groups.clear()


env.at_shutdown(clear)
