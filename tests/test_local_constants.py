"""Local constants made inside models: `sbp.global_mode` and `sbp.implicit_replication`, against
single-process torch on the logical tensors, and their checking mode."""

from __future__ import annotations

import contextlib

import pytest
import torch

import sbp

S0, S1, B = sbp.split(0), sbp.split(1), sbp.broadcast


class PositionalModel(torch.nn.Module):
    """Single-process model code that makes its own local tensors in forward."""

    def __init__(self):
        super().__init__()
        self.pos = torch.nn.Embedding(6, 4)
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):  # x: (batch, 6, 4)
        positions = torch.arange(x.shape[1]).unsqueeze(0)
        causal = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1)
        h = x + self.pos(positions)
        scores = h @ h.transpose(1, 2) + causal + torch.tensor(0.5)
        return self.proj(torch.softmax(scores, -1) @ h)


def _model_pair():
    torch.manual_seed(0)
    ref = PositionalModel().double()
    m = PositionalModel().double()
    m.load_state_dict(ref.state_dict())
    return ref, m


def _global_mode_training():
    """Two SGD steps of the model under global_mode equal one process; factories give global
    tensors with the mode's placement and sbp; sbp's own collectives stay local inside."""
    P_ = sbp.placement.all("cpu")
    ref, m = _model_pair()
    m.to_global(P_, B)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    torch.manual_seed(1)
    errors = []
    for _ in range(2):
        x = torch.randn(4, 6, 4, dtype=torch.float64)
        with sbp.global_mode(P_, check=True):
            out = m(sbp.tensor(x, P_, S0))
            loss = (out**2).mean()
            full = out.full_tensor()  # a collective inside the mode still works
        loss.backward()
        opt.step(), opt.zero_grad()
        ref_out = ref(x)
        ref_loss = (ref_out**2).mean()
        ref_loss.backward()
        ref_opt.step(), ref_opt.zero_grad()
        if not torch.allclose(full, ref_out.detach(), rtol=1e-10):
            errors.append("full_tensor inside global_mode differs")
        if abs(loss.item() - ref_loss.item()) > 1e-12:
            errors.append(f"loss {loss.item()} != {ref_loss.item()}")
    for name, p in m.named_parameters():
        if not torch.allclose(p.full_tensor(), dict(ref.named_parameters())[name], rtol=1e-10):
            errors.append(f"{name} differs after training")
    with sbp.global_mode(P_, S0):
        z = torch.zeros(4, 3)
        a = torch.arange(6)
    made_before, ones = torch.arange(3.0), sbp.ones(4, 3, placement=P_, sbp=S0)
    with sbp.global_mode(P_):
        t = torch.tensor([[1.0, 2.0]], requires_grad=True)
        u = ones * made_before  # a local tensor made before the mode: replicated
    errors += [] if u.full_tensor().tolist() == [[0.0, 1.0, 2.0]] * 4 else ["mixed local"]
    errors += [] if isinstance(z, sbp.GlobalTensor) and z.sbp == (S0,) else ["zeros not split"]
    errors += [] if a.full_tensor().tolist() == list(range(6)) else ["arange value"]
    errors += [] if t.sbp == (B,) and t.requires_grad and t.is_leaf else ["tensor()"]
    errors += [] if not isinstance(torch.zeros(2), sbp.GlobalTensor) else ["mode leaked"]
    return errors


def test_global_mode_trains_like_one_process(pool2):
    for rank, errors in enumerate(pool2.run(_global_mode_training)):
        assert not errors, f"rank {rank}: {errors}"


def _implicit_replication():
    P_ = sbp.placement.all("cpu")
    torch.manual_seed(2)
    x = torch.randn(5, 3, dtype=torch.float64)
    bias = torch.linspace(-1, 1, 3, dtype=torch.float64)
    g = sbp.tensor(x, P_, S0).requires_grad_()
    with sbp.implicit_replication(check=True):
        y = (g + bias) * torch.arange(3.0, dtype=torch.float64)
        z = torch.cat([g, torch.ones(5, 1, dtype=torch.float64)], 1)
        (y.sum() + z.sum()).backward()  # mul's backward meets the saved local arange again
    ref = x.clone().requires_grad_()
    ry = (ref + bias) * torch.arange(3.0, dtype=torch.float64)
    rz = torch.cat([ref, torch.ones(5, 1, dtype=torch.float64)], 1)
    (ry.sum() + rz.sum()).backward()
    same = (
        torch.equal(y.full_tensor(), ry.detach()),
        torch.equal(z.full_tensor(), rz.detach()),
        torch.equal(g.grad.full_tensor(), ref.grad),
    )
    messages = []
    for f in (
        lambda: g + bias,  # outside the mode: still an error
        lambda: _replicate(g, torch.ones(3, requires_grad=True)),  # its grad would be lost
    ):
        try:
            f()
            messages.append("no error")
        except sbp.PlacementError as e:
            messages.append(str(e))
    return same, messages


def _replicate(g, local):
    with sbp.implicit_replication():
        return g + local


def test_implicit_replication_treats_locals_as_broadcast(pool2):
    for same, (outside, grad) in pool2.run(_implicit_replication):
        assert same == (True, True, True)
        assert "local torch.Tensor" in outside
        assert "requires grad" in grad


def _differing_local_values():
    """A 'constant' that differs between ranks: every rank raises MetaMismatchError."""
    P_ = sbp.placement.all("cpu")
    rank = sbp.env.get_rank()
    g = sbp.ones(4, 2, placement=P_, sbp=S0)
    out = []
    for f in (
        lambda: _replicate_checked(g, torch.full((2,), float(rank == 1))),
        lambda: _global_mode_checked(P_, lambda: torch.tensor([1.0, rank])),
        lambda: _replicate_checked(g, torch.full((2,), 3.0)).full_tensor().tolist(),
    ):
        try:
            out.append(f())
        except sbp.MetaMismatchError as e:
            out.append(f"MetaMismatchError: {e}")
    return out


def _stochastic_depth_checked():
    """torchvision's stochastic depth makes its row mask with `torch.empty(...).bernoulli_`:
    under a checked global_mode the empty tensor's replicas must agree (they held whatever
    memory each rank had: MetaMismatchError), and the mask is then sbp's draw."""
    from torchvision.ops import stochastic_depth

    P_ = sbp.placement.all("cpu")
    x = sbp.tensor(torch.ones(4, 3, dtype=torch.float64), P_, S0)
    with sbp.global_mode(P_, check=True):
        empty = torch.empty(64, 64)
        out = stochastic_depth(x, p=0.5, mode="row", training=True)
    return empty.full_tensor().abs().sum().item(), out.full_tensor()


def test_stochastic_depth_under_a_checked_global_mode(pool2):
    for zeros, out in pool2.run(_stochastic_depth_checked):
        assert zeros == 0.0
        rows = {tuple(r.tolist()) for r in out}
        assert rows <= {(0.0,) * 3, (2.0,) * 3}  # (each row dropped, or kept and scaled by 2)


def _replicate_checked(g, local):
    with sbp.implicit_replication(check=True):
        return g + local


def _global_mode_checked(P_, make):
    with sbp.global_mode(P_, check=True):
        return make()


def test_check_mode_catches_a_local_value_that_differs_between_ranks(pool2):
    for replicated, factory, same in pool2.run(_differing_local_values):
        assert replicated.startswith("MetaMismatchError") and "aten.add" in replicated
        assert factory.startswith("MetaMismatchError") and "tensor" in factory
        assert same == [[4.0, 4.0]] * 4  # equal values pass the check


def test_global_mode_checks_its_arguments():
    for bad in (
        lambda: sbp.global_mode([0, 1]).__enter__(),
        lambda: sbp.global_mode(sbp.placement("cpu", [0]), sbp=(B, B)).__enter__(),
    ):
        try:
            bad()
        except sbp.SbpError as e:
            assert "placement" in str(e) or "sbp" in str(e)
        else:
            raise AssertionError("no error")


def _stochastic_depth():
    """torchvision's stochastic depth (EfficientNet, ConvNeXt, Swin) draws a row mask of the
    logical batch with torch.empty: outside global_mode an error naming it; inside, one
    logical mask that every rank holds its rows of."""
    from torchvision.ops import stochastic_depth

    P_ = sbp.placement("cpu", [0, 1])
    x = torch.randn(8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) + 5
    me = sbp.env.get_rank()
    g = sbp.to_global(x[4 * me : 4 * me + 4], P_, sbp.split(0))
    try:
        stochastic_depth(g, 0.5, "row", True)
        error = ""
    except sbp.PlacementError as e:
        error = str(e)
    sbp.manual_seed(7)
    with sbp.global_mode(P_):
        out = stochastic_depth(g, 0.5, "row", True)
    return error, tuple(out.sbp), out.full_tensor(), x


def test_stochastic_depth_runs_under_global_mode(pool2):
    (error, nd, out, x), (_, _, other, _) = pool2.run(_stochastic_depth)
    assert "sbp.global_mode" in error
    assert nd == (sbp.split(0),)
    torch.testing.assert_close(out, other, rtol=0, atol=0)  # one logical mask
    kept = (out != 0).all(1)
    assert ((out == 0).all(1) | kept).all() and kept.any() and not kept.all()  # whole rows
    torch.testing.assert_close(out[kept], x[kept] * 2)  # kept rows scaled by 1 / (1 - p)


def _stochastic_depth_model(world):
    """A torchvision block in a torch container (`nn.Sequential`, as EfficientNet's and
    ConvNeXt's own forwards): no frame of the user's between torch's and the factory. A
    depth of p=1 drops every row, deterministically."""
    from torchvision.ops import StochasticDepth

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 4), StochasticDepth(1.0, "row"), torch.nn.Linear(4, 2)
    ).double()
    x = torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    inside = contextlib.nullcontext()
    if world is not None:
        P_ = sbp.placement("cpu", list(range(world)))
        model.to_global(P_, B)
        x, inside = sbp.tensor(x, placement=P_, sbp=S0), sbp.global_mode(P_)
    with inside:
        out = model(x)
    out.square().sum().backward()  # (outside the mode, where the saved mask must be global)
    values = [out, *(p.grad for p in model.parameters())]
    return [v.full_tensor() if world is not None else v.detach() for v in values]


def test_stochastic_depth_in_a_torch_container_trains_under_global_mode(pool2):
    """The factory's caller decided whether sbp made it (then it stays local), skipping
    frames of modules named torch*: torchvision's too, so the first frame left was the
    fast path's running the model, and the row mask stayed local (a PlacementError in
    backward, where the product's saved mask met global gradients)."""
    want = _stochastic_depth_model(None)
    for got in pool2.run(_stochastic_depth_model, 2):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# torch functions whose C++ makes a local constant on global inputs: (x, y, classes) -> out
_CXX_CONSTANTS = {
    "cosine_similarity": lambda x, y, c: torch.nn.functional.cosine_similarity(x, y),
    "one_hot": lambda x, y, c: torch.nn.functional.one_hot(c, 5).double() * x,
    "interpolate": lambda x, y, c: torch.nn.functional.interpolate(x.unsqueeze(1), scale_factor=2),
    "quantile": lambda x, y, c: torch.quantile(x, 0.3, dim=1),
}


def _cxx_constants_data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 5, dtype=torch.float64, generator=g)
    return (
        x,
        torch.randn(6, 5, dtype=torch.float64, generator=g),
        torch.randint(0, 5, (6,), generator=g),
    )


def _cxx_constants(name, mode, layout):
    P_ = sbp.placement("cpu", [0, 1])
    x, y, c = (sbp.tensor(t, placement=P_, sbp=layout) for t in _cxx_constants_data())
    x.requires_grad_()
    f = _CXX_CONSTANTS[name]
    try:
        f(x, y, c)
        error = None
    except sbp.PlacementError as e:
        error = str(e)
    inside = sbp.implicit_replication() if mode == "implicit" else sbp.global_mode(P_)
    with inside:
        out = f(x, y, c)
        out.sum().backward()
    return error, out.full_tensor(), x.grad.full_tensor()


@pytest.mark.parametrize("layout", [S0, B], ids=["S0", "B"])
@pytest.mark.parametrize("mode", ["implicit", "global_mode"])
@pytest.mark.parametrize("name", sorted(_CXX_CONSTANTS))
def test_functions_making_constants_in_cxx_run_inside_the_modes(pool2, name, mode, layout):
    """Outside the modes, a named error (the constant is local); inside, one process's
    values and gradients (docs/api.md, local constants)."""
    x, y, c = _cxx_constants_data()
    x.requires_grad_()
    want = _CXX_CONSTANTS[name](x, y, c)
    want.sum().backward()
    for error, out, grad in pool2.run(_cxx_constants, name, mode, layout):
        assert error is not None and "global_mode" in error
        torch.testing.assert_close(out, want.detach(), rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(grad, x.grad, rtol=1e-12, atol=1e-14)
