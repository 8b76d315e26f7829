"""Bytes each rank sends per collective: one model shared by the planner and the counters.

Ring algorithms: all-gather sends (n-1) shards, reduce-scatter (n-1)/n of its
input, all-reduce twice that; all-to-all sends every chunk not kept; a
broadcast or send moves the buffer once.
"""

from __future__ import annotations

from collections.abc import Sequence


def all_gather_bytes(n: int, shard_bytes: int) -> int:
    return (n - 1) * shard_bytes if n > 1 else 0


def reduce_scatter_bytes(n: int, input_bytes: int) -> int:
    return (n - 1) * input_bytes // n if n > 1 else 0


def all_reduce_bytes(n: int, nbytes: int) -> int:
    return 2 * (n - 1) * nbytes // n if n > 1 else 0


def all_to_all_bytes(send_bytes: Sequence[int], me: int) -> int:
    return sum(b for i, b in enumerate(send_bytes) if i != me)


def broadcast_bytes(n: int, nbytes: int) -> int:
    return nbytes if n > 1 else 0
