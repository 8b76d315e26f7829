"""sbp.testing's SPMD pool: what a shipped function returns comes back as its values."""

import pytest
import torch

import sbp
from sbp.testing import SpmdError


def _views_of_one_bucket():
    bucket = torch.arange(20_000, dtype=torch.float64)  # as gradients viewing one flat bucket
    return [bucket[i * 10 : i * 10 + 10].view(2, 5) for i in range(300)]


def test_views_of_a_large_storage_come_back_as_their_own_values(pool2):
    """pickle writes a view's whole storage, once per view: the pool copies views first (a
    compiled mobilenet_v2 test returning its gradients once needed >12 GB per rank)."""
    for views in pool2.run(_views_of_one_bucket):
        assert [v.untyped_storage().nbytes() for v in views] == [80] * 300
        assert torch.equal(views[7], torch.arange(70, 80, dtype=torch.float64).view(2, 5))


def _rank_two_fails():
    if sbp.env.get_rank() == 2:
        raise ValueError("rank two is unhappy")
    return sbp.env.get_rank()


def _exit_on_rank_one():
    import os

    if sbp.env.get_rank() == 1:
        os._exit(7)
    return sbp.env.get_rank()


def _rank_and_world():
    return sbp.env.get_rank(), sbp.env.get_world_size()


def test_pool_runs_reports_and_survives(pool4):
    assert pool4.run(_rank_and_world) == [(r, 4) for r in range(4)]
    with pytest.raises(SpmdError, match="rank 2 raised") as info:
        pool4.run(_rank_two_fails)
    assert "rank two is unhappy" in info.value.errors[2]
    assert isinstance(info.value.exceptions[2], ValueError)
    with pytest.raises(SpmdError, match=r"rank 1 died \(exit code 7\)"):
        pool4.run(_exit_on_rank_one)
    assert pool4.run(_rank_and_world) == [(r, 4) for r in range(4)]


def _rank_one_hangs():
    import time

    if sbp.env.get_rank() == 1:
        time.sleep(600)
    return sbp.env.get_rank()


def test_pool_reports_a_hung_worker_with_its_stack_and_recovers(pool4):
    with pytest.raises(SpmdError, match=r"ranks \[1\] did not finish in time") as info:
        pool4.run(_rank_one_hangs, timeout=3)
    assert "_rank_one_hangs" in str(info.value)  # faulthandler's dump of the stuck rank
    assert pool4.run(_rank_and_world) == [(r, 4) for r in range(4)]
