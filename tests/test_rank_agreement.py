"""Per-rank settings that change no collective are compared, not left to drift silently:
an optimizer's hyper-parameters before each step, broadcast replicas before a checkpoint
or `full_state_dict` hands the state out.

Before: a learning rate set on one rank only made the replicas of every broadcast
parameter differ, and `full_tensor()` returned another "logical" value on each rank; a
checkpoint saved one rank's replicas as the logical value.
"""

from __future__ import annotations

import time

import pytest
import torch

import sbp
from sbp.comm import collectives

B, S0 = sbp.broadcast, sbp.split(0)


def _model_and_optimizer(name: str):
    torch.manual_seed(0)
    P = sbp.placement.all("cpu")
    model = torch.nn.Linear(4, 3).double().to_global(P, B)
    if name == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return P, model, opt


def _step(P, model, opt) -> None:
    x = torch.arange(8.0, dtype=torch.float64).reshape(2, 4).to_global(P, B)
    loss = model(x).square().sum()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _diverged_optimizer(name: str, change: str) -> tuple[str, float, list]:
    """Steps where rank 1 sets another learning rate (from the start, or after 2 steps):
    the error, its time, and the parameters (which must not have drifted)."""
    P, model, opt = _model_and_optimizer(name)
    one = sbp.env.get_rank() == 1
    if change == "from the start" and one:
        opt.param_groups[0]["lr"] *= 2
    start = time.monotonic()
    try:
        for i in range(4):
            if change == "after 2 steps" and i == 2 and one:
                opt.param_groups[0]["lr"] *= 2
            start = time.monotonic()
            _step(P, model, opt)
    except sbp.MetaMismatchError as e:
        params = [p.to_local().clone() for p in model.parameters()]
        return str(e), time.monotonic() - start, params
    return "no error", 0.0, []


@pytest.mark.parametrize("change", ["from the start", "after 2 steps"])
@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_a_learning_rate_on_one_rank_is_named_before_the_step(name, change, pool2):
    results = pool2.run(_diverged_optimizer, name, change)
    for message, seconds, _ in results:
        assert "param_groups[0]['lr'] differs" in message, message
        lr = 0.1 if name == "sgd" else 0.01
        assert f"rank 0: {lr}" in message and f"rank 1: {2 * lr}" in message
        assert seconds < 5
    for mine, other in zip(results[0][2], results[1][2], strict=True):  # no drift yet
        assert torch.equal(mine, other)


def _drifted_replica(where: str, directory: str) -> str:
    P, model, opt = _model_and_optimizer("sgd")
    _step(P, model, opt)
    if sbp.env.get_rank() == 1:
        model.bias.to_local().add_(1.0)  # (a write into one rank's replica)
    with pytest.raises(sbp.MetaMismatchError) as info:
        if where == "save":
            sbp.checkpoint.save({"model": model, "optim": opt}, directory)
        else:
            sbp.checkpoint.full_state_dict(model)
    in_step = collectives.all_reduce(torch.ones(2), "sum", (0, 1))
    assert torch.equal(in_step, torch.full((2,), 2.0))
    return str(info.value)


@pytest.mark.parametrize("where", ["save", "full_state_dict"])
def test_replicas_that_drifted_apart_are_named(where, pool2, tmp_path):
    for message in pool2.run(_drifted_replica, where, str(tmp_path / "c")):
        assert "'model.bias' (ranks [0] vs [1])" in message or "'bias' (ranks [0] vs [1])" in (
            message
        )
        assert "weight" not in message
    assert not (tmp_path / "c" / "sbp_checkpoint.json").exists()


def _equal_replicas_pass(directory: str) -> list:
    P, model, opt = _model_and_optimizer("adamw")
    for _ in range(2):
        _step(P, model, opt)
    sbp.checkpoint.save({"model": model, "optim": opt}, directory)
    return [t for t in sbp.checkpoint.full_state_dict(model).values()]


def test_equal_replicas_and_settings_pass(pool2, tmp_path):
    """The same training in one process: the checks pass and change no value."""
    rank0, rank1 = pool2.run(_equal_replicas_pass, str(tmp_path / "c"))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(2):
        x = torch.arange(8.0, dtype=torch.float64).reshape(2, 4)
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()
    for got0, got1, want in zip(rank0, rank1, model.state_dict().values(), strict=True):
        torch.testing.assert_close(got0, want, rtol=1e-12, atol=1e-12)
        assert torch.equal(got0, got1)
