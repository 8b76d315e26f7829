"""Communication: process groups per rank set, collectives, metadata exchange, counters."""

from sbp.comm.collectives import (
    Pending,
    all_gather,
    all_gather_async,
    all_reduce,
    all_reduce_async,
    all_to_all,
    barrier,
    broadcast,
    broadcast_async,
    exchange_p2p,
    reduce_scatter,
    reduce_scatter_async,
)
from sbp.comm.groups import get_group
from sbp.comm.meta import exchange
from sbp.comm.stats import CommStats, comm_stats

__all__ = [
    "CommStats",
    "all_gather",
    "Pending",
    "all_reduce",
    "all_gather_async",
    "all_reduce_async",
    "all_to_all",
    "barrier",
    "broadcast",
    "broadcast_async",
    "comm_stats",
    "exchange",
    "exchange_p2p",
    "get_group",
    "reduce_scatter",
    "reduce_scatter_async",
]
