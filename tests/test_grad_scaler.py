"""torch.amp.GradScaler on global parameters, against one process.

GradScaler multiplies the loss by its scale (a local 0-dim tensor), unscales the
gradients with `_amp_foreach_non_finite_check_and_unscale_`, which also notes any inf or
NaN in a local `found_inf`, and skips the step where it found one. With global tensors the
scale meets global ones, so `scale(...).backward()` runs inside `sbp.implicit_replication()`;
and `found_inf` must say the same on every rank, also where each rank checks only its
shard of a split gradient.
"""

from __future__ import annotations

import pytest
import torch

import sbp

S0, B = sbp.split(0), sbp.broadcast


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 6)
        self.b = torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _train(model, batches, place=None, tensor_parallel=False):
    """Three scaled SGD steps; the second one's loss weights an output by inf, so its
    gradients overflow and the step is skipped. Returns (scale, params) after each step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    seen = []
    for i, (x, y) in enumerate(batches):
        weight = torch.ones(3, dtype=torch.float64)
        if i == 1:  # only output 2 overflows: in a tensor-parallel `b`, one rank's rows
            weight[2] = float("inf")
        if place is not None:
            x, y = sbp.to_global((x, y), place, B if tensor_parallel else S0)
            weight = sbp.to_global(weight, place, B)
        opt.zero_grad()
        out = model(x)
        loss = (torch.nn.functional.mse_loss(out, y, reduction="none") * weight).mean()
        with sbp.implicit_replication():
            scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        params = [p.full_tensor() if place is not None else p for p in model.parameters()]
        seen.append((scaler.get_scale(), [p.detach().clone() for p in params]))
    return seen


def _batches():
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(4, 4, generator=g, dtype=torch.float64),
            torch.randn(4, 3, generator=g, dtype=torch.float64),
        )
        for _ in range(3)
    ]


def _scaled_training(tensor_parallel: bool):
    torch.manual_seed(0)
    ref = Net().double()
    model = Net().double()
    model.load_state_dict(ref.state_dict())
    if tensor_parallel:  # (`a` learning would carry the inf into broadcast gradients)
        ref.a.requires_grad_(False)
        model.a.requires_grad_(False)
    P = sbp.placement.all("cpu")
    model.to_global(P, B)
    if tensor_parallel:  # b's rows (outputs) split: the inf of step 2 is in one rank's shard
        model.b.weight = torch.nn.Parameter(model.b.weight.to_global(P, S0))
        model.b.bias = torch.nn.Parameter(model.b.bias.to_global(P, S0))
    want = _train(ref, _batches())
    got = _train(model, _batches(), P, tensor_parallel)
    errors = []
    for step, ((s, ps), (ref_s, ref_ps)) in enumerate(zip(got, want, strict=True)):
        if s != ref_s:
            errors.append(f"step {step}: scale {s} != {ref_s}")
        for p, q in zip(ps, ref_ps, strict=True):
            if not torch.allclose(p, q, rtol=1e-12, atol=1e-12):
                errors.append(f"step {step}: a parameter differs by {(p - q).abs().max():.3g}")
    return errors


def test_grad_scaler_data_parallel(pool2):
    """Broadcast parameters, split batch: scales and parameters equal one process's, the
    overflowing step skipped on both ranks."""
    for errors in pool2.run(_scaled_training, False):
        assert errors == []


def test_grad_scaler_tensor_parallel(pool2):
    """A split weight whose gradient overflows on one rank's shard only: both ranks skip
    the step, as one process does."""
    for errors in pool2.run(_scaled_training, True):
        assert errors == []


def test_a_local_gradient_is_a_named_error():
    """Under implicit_replication a local gradient reaches the unscale rule itself."""
    P = sbp.placement("cpu", [0])
    grads = [sbp.to_global(torch.ones(3), P, B), torch.ones(3)]
    with sbp.implicit_replication(), pytest.raises(sbp.PlacementError, match="local tensor"):
        torch._amp_foreach_non_finite_check_and_unscale_(grads, torch.zeros(()), torch.ones(()))
