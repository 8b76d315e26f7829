"""See and forbid implicit communication: `sbp.comm_stats(trace=True)` names the op,
conversion, module and phase of every collective; `sbp.strict()` raises at the first
conversion an op needs that the program did not ask for, on every rank, before it runs."""

from __future__ import annotations

import pytest
import torch

import sbp

S0, S1, B, PS = sbp.split(0), sbp.split(1), sbp.broadcast, sbp.partial_sum


class _Block(torch.nn.Module):
    """A Megatron MLP block: fc1 column-parallel, fc2 row-parallel."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16, dtype=torch.float64)
        self.fc2 = torch.nn.Linear(16, 8, dtype=torch.float64)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _megatron(P) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Block(), _Block())
    plain = [p.detach().clone() for p in model.parameters()]
    layouts = {"fc1.weight": S0, "fc1.bias": S0, "fc2.weight": S1, "fc2.bias": B}
    for block in model:
        for name, p in list(block.named_parameters()):
            owner, attr = name.split(".")
            g = sbp.tensor(p.detach(), placement=P, sbp=layouts[name], requires_grad=True)
            setattr(getattr(block, owner), attr, torch.nn.Parameter(g))
    return model, plain


def _traced_step() -> tuple[int, list, str]:
    P = sbp.placement.all("cpu")
    model, _ = _megatron(P)
    x = torch.arange(24.0, dtype=torch.float64).reshape(3, 8).to_global(P, B)
    with sbp.comm_stats(trace=True, model=model) as st:
        model(x).sum().backward()
    events = [(e.phase, e.module, e.op, e.conversion, e.kind) for e in st.events]
    return st.calls, events, st.table()


def test_every_collective_is_named_with_its_cause(pool2):
    """Two Megatron blocks, forward and backward: block 0's partial output made whole for
    block 1's fc1 (forward), the gradient at block 0's output made whole for fc2's input
    gradient (backward); block 0's fc2 bias gradient is summed from that whole gradient
    (the value reduced once, `sbp.ops.converted.at_hand`), so nothing is left to reduce at
    the leaves (before: a third all-reduce, of the bias gradients' partial sums)."""
    want = [
        ("forward", "1.fc1", "aten.addmm.default", "(P) -> (B)", "all_reduce"),
        ("backward", "", "aten.mm.default", "(P) -> (B)", "all_reduce"),
    ]
    for calls, events, table in pool2.run(_traced_step):
        assert calls == len(events) == 2
        assert events == want
        assert table.splitlines()[0].split() == [
            "phase",
            "module",
            "op",
            "conversion",
            "collective",
            "calls",
            "bytes",
        ]
        assert "aten.addmm.default  (P) -> (B)  all_reduce  1      192" in table


def _strict_run(explicit: bool) -> tuple[str, str, bool]:
    P = sbp.placement.all("cpu")
    model, _ = _megatron(P)
    x = torch.arange(24.0, dtype=torch.float64).reshape(3, 8).to_global(P, B)
    with sbp.strict(model):
        try:
            h = model[0](x)
            if explicit:  # the conversions asked for (Megatron's g, and f's backward)
                h = h.to_global(sbp=B, grad_sbp=B)
            out = model[1](h)
            out.sum().backward()
        except sbp.ImplicitCommunicationError as e:
            return "raised", str(e), model[0].fc1.weight.grad is None
    return "ran", str(out.full_tensor().sum().item()), model[0].fc1.weight.grad is None


def test_strict_mode_raises_on_every_rank_at_an_implicit_conversion(pool2):
    for outcome, message, no_grad in pool2.run(_strict_run, False):
        assert outcome == "raised"
        assert "aten.addmm.default in 1.fc1" in message and "(P) -> (B)" in message
        assert "all_reduce" in message and no_grad


def test_strict_mode_lets_the_conversions_asked_for_run(pool2):
    torch.manual_seed(0)
    plain = torch.nn.Sequential(_Block(), _Block())
    x = torch.arange(24.0, dtype=torch.float64).reshape(3, 8)
    want = plain(x).sum().item()
    for outcome, value, _ in pool2.run(_strict_run, True):
        assert outcome == "ran", value
        assert abs(float(value) - want) < 1e-9


def test_trace_and_strict_check_their_arguments():
    with pytest.raises(sbp.InputTypeError, match="trace must be a bool"):
        sbp.comm_stats(trace="yes")
    with pytest.raises(sbp.InputTypeError, match="model must be a torch.nn.Module"):
        with sbp.strict(model="m"):
            pass
