"""sbp.testing's SPMD pool: what a shipped function returns comes back as its values."""

import torch


def _views_of_one_bucket():
    bucket = torch.arange(20_000, dtype=torch.float64)  # as gradients viewing one flat bucket
    return [bucket[i * 10 : i * 10 + 10].view(2, 5) for i in range(300)]


def test_views_of_a_large_storage_come_back_as_their_own_values(pool2):
    """pickle writes a view's whole storage, once per view: the pool copies views first (a
    compiled mobilenet_v2 test returning its gradients once needed >12 GB per rank)."""
    for views in pool2.run(_views_of_one_bucket):
        assert [v.untyped_storage().nbytes() for v in views] == [80] * 300
        assert torch.equal(views[7], torch.arange(70, 80, dtype=torch.float64).view(2, 5))
