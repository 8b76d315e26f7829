"""Elementwise optimizers step split parameters on their locals (`optim_step.ELEMENTWISE`).

Megatron's layouts on 2 ranks (fc1 weight and bias split(0), fc2 weight split(1), its
bias broadcast), trained with each elementwise optimizer of torch: after the first
step (on the global tensors, which makes the state) every step runs on the locals, and
parameters and state equal one process's in float64. A subclass, and a parameter whose
state is laid out otherwise, step on the global tensors, and equal it too.
"""

from __future__ import annotations

import pytest
import torch

import sbp
from sbp.data_parallel import optim_step

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "adadelta": lambda ps: torch.optim.Adadelta(ps, lr=0.5),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-2),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5, centered=True),
    "rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-2, foreach=True),
    "asgd": lambda ps: torch.optim.ASGD(ps, lr=1e-2, t0=1, foreach=True),
}
STEPS = 4


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 8, dtype=torch.float64)
        self.fc2 = torch.nn.Linear(8, 6, dtype=torch.float64)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class _AdamWOfItsOwn(torch.optim.AdamW):
    """A subclass may compute otherwise: stepped on the global tensors."""


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(5, 6, generator=g, dtype=torch.float64) for _ in range(STEPS)]


def _train(model, opt, batches, to=lambda x: x):
    for x in batches:
        opt.zero_grad()
        model(to(x)).square().mean().backward()
        opt.step()


def _megatron(model: torch.nn.Module, P) -> torch.nn.Module:
    model.to_global(P, sbp.broadcast)
    for name, p in model.named_parameters():
        s = {"fc1.weight": sbp.split(0), "fc1.bias": sbp.split(0), "fc2.weight": sbp.split(1)}
        p.data = p.to_global(P, s.get(name, sbp.broadcast))
    return model


def _global_training(name: str) -> tuple:
    P = sbp.placement("cpu", [0, 1])
    torch.manual_seed(0)
    model = _megatron(Block(), P)
    make = OPTIMIZERS.get(name) or (lambda ps: _AdamWOfItsOwn(ps, lr=1e-2))
    opt = make(model.parameters())
    swaps, real = [], optim_step._Swap.make
    optim_step._Swap.make = staticmethod(lambda o: _counted(real, o, swaps))
    try:
        _train(model, opt, _batches(), lambda x: x.to_global(P, sbp.broadcast))
    finally:
        optim_step._Swap.make = staticmethod(real)
    params = [p.full_tensor() for p in model.parameters()]
    state = [
        {
            k: v.full_tensor() if isinstance(v, sbp.GlobalTensor) else v
            for k, v in opt.state[p].items()
        }
        for p in model.parameters()
    ]
    return swaps, params, state


def _counted(real, optimizer, swaps):
    swap = real(optimizer)
    swaps.append(swap is not None)
    return swap


@pytest.mark.parametrize("name", [*OPTIMIZERS, "subclass"])
def test_split_parameters_step_on_their_locals(pool2, name):
    torch.manual_seed(0)
    plain = Block()
    opt = (
        OPTIMIZERS[name](plain.parameters())
        if name in OPTIMIZERS
        else _AdamWOfItsOwn(plain.parameters(), lr=1e-2)
    )
    _train(plain, opt, _batches())
    for swaps, params, state in pool2.run(_global_training, name):
        # (the first step runs on the global tensors: it makes the state)
        assert swaps == ([True] * (STEPS - 1) if name in OPTIMIZERS else [False] * (STEPS - 1))
        for got, p in zip(params, plain.parameters(), strict=True):
            torch.testing.assert_close(got, p.detach(), rtol=1e-12, atol=1e-12)
        for got, p in zip(state, plain.parameters(), strict=True):
            want = opt.state[p]
            assert set(got) == set(want)
            for k, v in want.items():
                if isinstance(v, torch.Tensor):
                    torch.testing.assert_close(got[k], v, rtol=1e-12, atol=1e-12)
                else:
                    assert got[k] == v
