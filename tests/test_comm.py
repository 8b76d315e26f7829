"""Collective wrappers, process groups per rank set, counters and metadata exchange on 4 ranks."""

import os

import pytest
import torch

import sbp
from sbp import comm
from sbp.comm import cost
from sbp.comm.meta import MAX_INTS
from sbp.testing import SpmdPool


def _gather_in_placement_order(ranks):
    me = sbp.env.get_rank()
    if me not in ranks:
        return None
    out = torch.empty(len(ranks), 2)
    with sbp.comm_stats() as st:
        comm.all_gather(out, torch.full((1, 2), float(me)), tuple(ranks))
    return out[:, 0].tolist(), st.calls, st.bytes


@pytest.mark.parametrize("ranks", [[0, 1, 2, 3], [3, 1], [2, 0, 3], [1]])
def test_all_gather_follows_placement_order(pool4, ranks):
    results = pool4.run(_gather_in_placement_order, ranks)
    for rank, res in enumerate(results):
        if rank not in ranks:
            assert res is None
            continue
        values, calls, nbytes = res
        assert values == [float(r) for r in ranks]
        n = len(ranks)
        assert calls == (1 if n > 1 else 0)
        assert nbytes == cost.all_gather_bytes(n, 2 * 4)


def _reductions():
    me = sbp.env.get_rank()
    ranks = (0, 1, 2, 3)
    out = {}
    for op in ("sum", "max", "min"):
        t = torch.tensor([me, -me, me * me], dtype=torch.float32)
        out[op] = comm.all_reduce(t, op, ranks).tolist()
    rs = torch.empty(2)
    comm.reduce_scatter(rs, torch.arange(8, dtype=torch.float32) * (me + 1), "sum", ranks)
    out["reduce_scatter"] = rs.tolist()
    b = torch.full((3,), float(me))
    comm.broadcast(b, 2, (3, 2, 1)) if me in (1, 2, 3) else None
    out["broadcast"] = b.tolist()
    return out


def test_reductions_and_broadcast(pool4):
    results = pool4.run(_reductions)
    for rank, res in enumerate(results):
        assert res["sum"] == [6.0, -6.0, 14.0]
        assert res["max"] == [3.0, 0.0, 9.0]
        assert res["min"] == [0.0, -3.0, 0.0]
        expected = (torch.arange(8, dtype=torch.float32) * 10)[2 * rank : 2 * rank + 2]
        assert res["reduce_scatter"] == expected.tolist()
        assert res["broadcast"] == ([2.0] * 3 if rank else [0.0] * 3)


def _uneven_all_to_all():
    me = sbp.env.get_rank()
    ranks = (0, 1, 2, 3)
    # rank r sends (j + 1) rows to rank j, each row holding (r, j)
    send = torch.cat([torch.tensor([[me, j]] * (j + 1), dtype=torch.float32) for j in range(4)])
    recv = torch.empty(4 * (me + 1), 2)
    with sbp.comm_stats() as st:
        comm.all_to_all(recv, send, [me + 1] * 4, [j + 1 for j in range(4)], ranks)
    return recv.tolist(), st.by_kind["all_to_all"], st.bytes


def test_uneven_all_to_all(pool4):
    for rank, (recv, calls, nbytes) in enumerate(pool4.run(_uneven_all_to_all)):
        assert recv == [[r, rank] for r in range(4) for _ in range(rank + 1)]
        assert calls == 1
        assert nbytes == sum((j + 1) * 8 for j in range(4) if j != rank)


def _p2p_ring():
    me = sbp.env.get_rank()
    out = torch.empty(3)
    comm.exchange_p2p([(torch.full((3,), float(me)), (me + 1) % 4)], [(out, (me - 1) % 4)])
    return out.tolist()


def test_p2p_ring(pool4):
    for rank, got in enumerate(pool4.run(_p2p_ring)):
        assert got == [float((rank - 1) % 4)] * 3


def _meta(dtype_on_rank2):
    me = sbp.env.get_rank()
    desc = {"dtype": str(dtype_on_rank2 if me == 2 else torch.float32), "sbp": "S(0)"}
    try:
        return comm.exchange(desc, (0, 1, 2, 3), ints=[me, 5, me * 2], what="x")
    except sbp.MetaMismatchError as e:
        return str(e)


def test_meta_exchange_returns_every_ranks_ints(pool4):
    for got in pool4.run(_meta, torch.float32):
        assert got == [(r, 5, 2 * r) for r in range(4)]


def test_meta_mismatch_raises_on_every_rank(pool4):
    for got in pool4.run(_meta, torch.float64):
        assert isinstance(got, str)
        assert "dtype differs" in got and "rank 2: 'torch.float64'" in got
        assert "sbp" not in got.split("dtype differs")[1]


def _arrivals():
    """Every rank arrives; rank 0 gives up before the others come; two ranks alone; all
    again (the calls stay numbered alike after a give-up)."""
    import time

    from sbp.comm import arrival

    me, world = sbp.env.get_rank(), (0, 1, 2, 3)
    verdicts = [arrival.arrived_together(world, 30.0)]
    if me == 0:
        verdicts.append(arrival.arrived_together(world, 0.2, "rank 0 raised ValueError"))
    else:
        time.sleep(0.8)
        verdicts.append(arrival.arrived_together(world, 30.0, f"rank {me} gave up"))
    if me in (1, 3):
        verdicts.append(arrival.arrived_together((3, 1), 30.0))
    verdicts.append(arrival.arrived_together(world, 30.0))
    return verdicts


def test_ranks_learn_through_the_store_whether_all_arrived(pool4):
    from sbp.comm.arrival import ALL

    for rank, got in enumerate(pool4.run(_arrivals)):
        gave_up = "rank 0 raised ValueError"
        assert got == ([ALL, gave_up, ALL, ALL] if rank in (1, 3) else [ALL, gave_up, ALL])


def _long_ints(n):
    me = sbp.env.get_rank()
    return comm.exchange({"k": 1}, (0, 1, 2, 3), ints=list(range(me, me + n)))


@pytest.mark.parametrize("n", [20, MAX_INTS, MAX_INTS + 5])  # beyond a row: gathered as objects
def test_meta_exchange_many_ints(pool4, n):
    for got in pool4.run(_long_ints, n):
        assert got == [tuple(range(r, r + n)) for r in range(4)]


def _missing_partner():
    """Rank 0 all-reduces alone; the shared segment's setup (its first call) times out."""
    import glob

    me = sbp.env.get_rank()
    if me == 0:
        before = set(glob.glob("/dev/shm/sbp-*"))
        try:
            comm.all_reduce(torch.ones(2), "sum", (0, 1))
        except sbp.CommTimeoutError as e:
            left = sorted(set(glob.glob("/dev/shm/sbp-*")) - before)
            return "timeout: " + str(e)[:80], left
    return "skipped", []


def test_collective_timeout_becomes_comm_timeout_error():
    pool = SpmdPool(2, timeout=60, comm_timeout=2.0)
    try:
        results = pool.run(_missing_partner)
        assert results[0][0].startswith("timeout: all_reduce over ranks [0, 1]")
        assert results[0][1] == []  # the segment's file is removed though no peer came
        assert results[1][0] == "skipped"
    finally:
        pool.close()


def _small_all_reduces(ranks):
    """Sums, maxima and minima (NaN kept) of small tensors; which path ran."""
    from sbp.comm import shm

    me = sbp.env.get_rank()
    if me not in ranks:
        return None
    known = shm._segments.get(tuple(sorted(ranks)))  # (earlier tests may have used it)
    before = known[1].calls if known is not None and known[1] is not None else 0
    out = {}
    for dtype in (torch.float64, torch.float32, torch.int64):
        t = (torch.arange(6, dtype=torch.float64) * (me + 1) - me).to(dtype)
        out[f"sum {dtype}"] = comm.all_reduce(t, "sum", ranks)
    nan = torch.tensor([1.0, 2.0, 3.0]) * me
    nan[1] = float("nan") if me == ranks[-1] else nan[1]
    out["max"] = comm.all_reduce(nan.clone(), "max", ranks)
    out["min"] = comm.all_reduce(nan.clone(), "min", ranks)
    segment = shm._segments[tuple(sorted(ranks))][1]
    shared = segment is not None and segment.calls - before == 5
    out["path"] = "shared memory" if shared else "gloo"
    return out


@pytest.mark.parametrize("ranks", [(0, 1, 2, 3), (3, 1)])
def test_small_all_reduce_through_shared_memory(pool4, ranks):
    from sbp.comm import shm

    results = [r for r in pool4.run(_small_all_reduces, ranks) if r is not None]
    for dtype in (torch.float64, torch.float32, torch.int64):
        parts = [(torch.arange(6, dtype=torch.float64) * (r + 1) - r).to(dtype) for r in ranks]
        expected = torch.stack(parts).sum(0).to(dtype)
        for r in results:
            assert torch.equal(r[f"sum {dtype}"], expected)
    nans = []
    for rank in ranks:
        t = torch.tensor([1.0, 2.0, 3.0]) * rank
        t[1] = float("nan") if rank == ranks[-1] else t[1]
        nans.append(t)
    for r in results:
        for op, expected in (
            ("max", torch.stack(nans).amax(0)),
            ("min", torch.stack(nans).amin(0)),
        ):
            assert r[op][1].isnan()  # NaN kept, as torch's max and min keep it
            assert torch.equal(r[op].nan_to_num(), expected.nan_to_num())
        shared = shm.usable(torch.ones(1)) and os.access("/dev/shm", os.W_OK)
        assert r["path"] == ("shared memory" if shared else "gloo")
    first = results[0]
    for r in results[1:]:  # the same bits on every rank
        for k, v in first.items():
            if k != "path":
                assert torch.equal(v.nan_to_num(), r[k].nan_to_num())


def _groups_made_by_their_members_only():
    """Ranks 0 and 1 make a group that ranks 2 and 3 never see; then ranks 1 and 2 make
    one, each having made a different number of groups before. torch salts a member-only
    group's name with such a count: without sbp's naming by rank set, the two would wait
    for each other under different names until the timeout."""
    from datetime import timedelta

    import torch.distributed as dist

    from sbp.comm import groups

    me = sbp.env.get_rank()
    kwargs = {"use_local_synchronization": True, "timeout": timedelta(seconds=20)}
    sums = []
    for ranks in ([0, 1], [1, 2], [0, 2, 3], [1, 2]):
        if me in ranks:
            group = groups._new_member_only_group(ranks, kwargs)
            x = torch.tensor([float(me + 1)])
            dist.all_reduce(x, group=group)
            sums.append(x.item())
    return sums


def test_member_only_groups_agree_on_their_names(pool4):
    expected = {0: [3.0, 8.0], 1: [3.0, 5.0, 5.0], 2: [5.0, 8.0, 5.0], 3: [8.0]}
    for rank, sums in enumerate(pool4.run(_groups_made_by_their_members_only)):
        assert sums == expected[rank]
