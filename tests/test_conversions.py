"""dtype and device conversions and `.contiguous()` on global tensors and global modules, against
single-process torch on the logical tensors (issue 9, items 1 and 8)."""

from __future__ import annotations

import pytest
import torch

import sbp

S0, S1, B, P = sbp.split(0), sbp.split(1), sbp.broadcast, sbp.partial_sum


def _module_dtype_conversions(weight_sbp):
    """Linear made global, then .double() / .half() / .to(dtype): the local tensors, the specs and
    the logical dtype all change, the next forward and backward work and equal torch's."""
    P_ = sbp.placement.all("cpu")
    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 6)
    m = torch.nn.Linear(4, 6)
    m.weight = torch.nn.Parameter(sbp.tensor(ref.weight.detach(), P_, weight_sbp))
    m.bias = torch.nn.Parameter(sbp.tensor(ref.bias.detach(), P_, B))
    x = torch.randn(5, 4)
    m(x.to_global(P_, B)).sum().backward()  # a float32 .grad exists and must convert too
    ref(x).sum().backward()
    errors = []
    for convert in (lambda t: t.double(), lambda t: t.half(), lambda t: t.to(torch.float64)):
        convert(m), convert(ref)
        for name, p in m.named_parameters():
            want = getattr(ref, name).dtype
            got = (p.dtype, p._local.dtype, p._spec.dtype, p.grad.dtype, p.grad._local.dtype)
            if set(got) != {want}:
                errors.append(f"{name}: dtypes {got}, want {want}")
    ref.zero_grad(), m.zero_grad()
    xd = x.double()
    out = m(sbp.tensor(xd, P_, S0))
    expected = ref(xd)
    (out * 2).sum().backward()
    (expected * 2).sum().backward()
    if not torch.allclose(out.full_tensor(), expected, rtol=1e-12, atol=1e-12):
        errors.append("forward after .to(float64) differs from torch")
    for name, p in m.named_parameters():
        if not torch.allclose(p.grad.full_tensor(), getattr(ref, name).grad, rtol=1e-12):
            errors.append(f"{name}: grad differs from torch")
        if p.grad.sbp != p.sbp:
            errors.append(f"{name}: grad sbp {p.grad.sbp} != {p.sbp}")
    return errors


@pytest.mark.parametrize("weight_sbp", [B, S0, S1])
def test_module_dtype_conversion_reaches_local_tensor_and_spec(pool2, weight_sbp):
    for rank, errors in enumerate(pool2.run(_module_dtype_conversions, weight_sbp)):
        assert not errors, f"rank {rank}: {errors}"


def test_module_dtype_conversion_with_swap_tensors(pool2):
    """The same with torch's swap_tensors path of Module._apply switched on."""

    def run():
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            return _module_dtype_conversions(S0)
        finally:
            torch.__future__.set_swap_module_params_on_conversion(False)

    for rank, errors in enumerate(pool2.run(run)):
        assert not errors, f"rank {rank}: {errors}"


def _to_device_and_dtype():
    P_ = sbp.placement.all("cpu")
    x = torch.arange(24.0).reshape(4, 6) / 7
    out = {}
    for sig in (S0, S1, B):
        g = sbp.tensor(x, P_, sig).requires_grad_()
        y = g.to(device="cpu", dtype=torch.float64)
        (y * torch.arange(6.0, dtype=torch.float64).to_global(P_, B)).sum().backward()
        out[repr(sig)] = (
            y.dtype,
            y._local.dtype,
            y.sbp == g.sbp,
            torch.equal(y.full_tensor(), x.double()),
            torch.equal(g.grad.full_tensor(), torch.arange(6.0).expand(4, 6)),
        )
    # A cast to an integer dtype is not linear: partial sums are reduced first.
    half = sbp.env.get_world_size()
    part = (torch.full((3,), 1.5) / half).to_global(P_, P)
    out["partial->int"] = part.to(torch.int64).full_tensor().tolist()
    out["partial->float64"] = part.to(dtype=torch.float64).sbp == (P,)
    try:
        g.to("meta")
        out["meta"] = "no error"
    except sbp.DeviceMismatchError as e:
        out["meta"] = str(e)
    return out


def _check_to(results):
    for out in results:
        for sig in ("sbp.split(dim=0)", "sbp.split(dim=1)", "sbp.broadcast"):
            assert out[sig] == (torch.float64, torch.float64, True, True, True), (sig, out[sig])
        assert out["partial->int"] == [1, 1, 1]  # int(1.5), not a sum of int(0.75)
        assert out["partial->float64"]
        assert "meta" in out["meta"] and "placement" in out["meta"]


def test_to_device_and_dtype_on_global_tensors(pool2):
    _check_to(pool2.run(_to_device_and_dtype))


def test_to_device_and_dtype_in_a_world_of_1():
    """No process group: the conversion must not need meta tensors or communication."""
    _check_to([_to_device_and_dtype()])


def _contiguous():
    P_ = sbp.placement.all("cpu")
    torch.manual_seed(1)
    x = torch.randn(4, 3, 5, 2, dtype=torch.float64)
    results = []
    for sig in (S0, S1, B):
        g = sbp.tensor(x, P_, sig).requires_grad_()
        ref = x.clone().requires_grad_()
        t = g.transpose(1, 2).contiguous()
        y = t.reshape(4, 5, 6)
        ry = ref.transpose(1, 2).contiguous().reshape(4, 5, 6)
        w = torch.randn(4, 5, 6, dtype=torch.float64)
        (y * w.to_global(P_, B)).sum().backward()
        (ry * w).sum().backward()
        results.append(
            (
                t._local.is_contiguous(),
                torch.equal(y.full_tensor(), ry.detach()),
                torch.equal(g.grad.full_tensor(), ref.grad),
            )
        )
    g = sbp.tensor(x, P_, S0)
    results.append(g.contiguous() is g)  # already contiguous: no copy
    return results


def test_contiguous_makes_the_local_tensor_contiguous(pool2):
    for results in pool2.run(_contiguous):
        assert results[:-1] == [(True, True, True)] * 3
        assert results[-1] is True
