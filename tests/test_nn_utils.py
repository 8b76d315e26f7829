"""sbp.nn.parallel.DistributedDataParallel and sbp.utils.data.DistributedSampler."""

import os
import subprocess
import sys
from pathlib import Path

import torch

import sbp
from sbp.nn.parallel import DistributedDataParallel
from sbp.utils.data import DistributedSampler


def _sampler_and_ddp(xs: torch.Tensor, ys: torch.Tensor):
    rank, world = sbp.env.get_rank(), sbp.env.get_world_size()
    mine = list(DistributedSampler(range(10), shuffle=True, seed=3))
    torchs = list(torch.utils.data.DistributedSampler(range(10), world, rank, seed=3))
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(3, 2).double())
    loss = ((model(xs[rank]) - ys[rank]) ** 2).mean()
    loss.backward()
    return mine, torchs, model.weight.grad.clone(), model.bias.grad.clone()


def test_sampler_defaults_and_ddp_average_gradients_on_two_ranks(pool2):
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(2, 4, 3, generator=g, dtype=torch.float64)
    ys = torch.randn(2, 4, 2, generator=g, dtype=torch.float64)
    results = pool2.run(_sampler_and_ddp, xs, ys)

    for mine, torchs, _, _ in results:
        assert mine == torchs  # ranks from sbp.env, as torch's with explicit ones
        assert len(mine) == 5
    assert sorted(results[0][0] + results[1][0]) == list(range(10))

    # One process: the mean of the two ranks' losses (each a mean over its 4 rows).
    torch.manual_seed(0)
    ref = torch.nn.Linear(3, 2).double()
    loss = sum(((ref(xs[r]) - ys[r]) ** 2).mean() for r in (0, 1)) / 2
    loss.backward()
    for _, _, w_grad, b_grad in results:
        torch.testing.assert_close(w_grad, ref.weight.grad)
        torch.testing.assert_close(b_grad, ref.bias.grad)


ONE_PROCESS = """
import torch

import sbp
from sbp.nn.parallel import DistributedDataParallel
from sbp.utils.data import DistributedSampler

assert list(DistributedSampler(range(4), shuffle=False)) == [0, 1, 2, 3]
model = DistributedDataParallel(torch.nn.Linear(2, 1))
assert model.weight is model.module.weight  # attributes of the wrapped module
model(torch.ones(3, 2)).sum().backward()
torch.testing.assert_close(model.weight.grad, torch.full((1, 2), 3.0))
print("ok", sbp.env.get_world_size())
"""


def test_one_process_without_launcher():
    # No launcher variables: a world of 1; DDP makes its own one-process group. In a
    # subprocess, so the test session's own process keeps no process group.
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    res = subprocess.run(
        [sys.executable, "-c", ONE_PROCESS], env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["ok", "1"]
