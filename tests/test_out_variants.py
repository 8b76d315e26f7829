"""`out=` variants on global tensors (sbp.ops.out_variants): the result is written into
`out` in its own layout, or `out` becomes the result where torch would resize it. Each case
runs on single-process torch tensors and on global ones (worlds of 2 and 4, uneven shapes),
in float64 where the inputs allow. (Before, `out` was boxed to the op's layout and the
result written into that copy: `out` silently kept its old values.)"""

from __future__ import annotations

import pytest
import torch

import sbp

S0, S1, B = sbp.split(0), sbp.split(1), sbp.broadcast
SHAPE = (5, 7)
F64 = torch.float64


def _logical(shape, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def _pointwise_into_a_split_out(make):
    a, b, c = (
        make(_logical(SHAPE, 0), S0),
        make(_logical(SHAPE, 1), S0),
        make(torch.zeros(SHAPE, dtype=F64), S0),
    )
    got = torch.add(a, b, alpha=2.0, out=c)
    assert got is c
    return [c]


def _out_in_another_layout(make):
    a, c = make(_logical(SHAPE, 0), S0), make(torch.zeros(SHAPE, dtype=F64), S1)
    torch.mul(a, a, out=c)
    return [c]


def _out_of_another_shape_is_resized(make):
    a, c = make(_logical(SHAPE, 0), S1), make(torch.zeros(0, dtype=F64), B)
    torch.exp(a, out=c)  # (an empty out is resized without a warning)
    return [c]


def _two_outs(make):
    x = make(_logical(SHAPE, 0), S0)
    values, indices = (
        make(torch.zeros(5, dtype=F64), S0),
        make(torch.zeros(5, dtype=torch.int64), S0),
    )
    torch.max(x, 1, out=(values, indices))
    return [values, indices]


def _cat_and_a_wider_dtype(make):
    a, b = make(_logical(SHAPE, 0, torch.float32), S0), make(_logical(SHAPE, 1, torch.float32), S0)
    c = make(torch.zeros(10, 7, dtype=torch.float32), B)
    torch.cat([a, b], out=c)
    d = make(torch.zeros(SHAPE, dtype=F64), S1)
    torch.add(a, b, out=d)  # (float32 results written into float64)
    return [c, d]


def _sum_over_a_split_dim(make):
    x, c = make(_logical(SHAPE, 0), S0), make(torch.zeros(7, dtype=F64), B)
    torch.sum(x, 0, out=c)
    return [c]


def _factory_in_the_out_s_dtype(make):
    c = make(torch.zeros(10, dtype=F64), S0)
    torch.arange(0, 1, 0.1, out=c)  # (drawn as float32 first, it was 1e-8 off)
    return [c]


CASES = [
    (_pointwise_into_a_split_out, [S0]),
    (_out_in_another_layout, [S1]),
    (_out_of_another_shape_is_resized, [None]),
    (_two_outs, [S0, S0]),
    (_cat_and_a_wider_dtype, [B, S1]),
    (_sum_over_a_split_dim, [B]),
    (_factory_in_the_out_s_dtype, [S0]),
]


def _run_global(case):
    placement = sbp.placement("cpu", list(range(sbp.env.get_world_size())))
    outs = case(lambda t, layout: sbp.tensor(t, placement=placement, sbp=layout))
    return [(o.full_tensor(), o.dtype, o.sbp) for o in outs]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case, layouts", CASES, ids=[c.__name__.strip("_") for c, _ in CASES])
def test_out_variant_equals_one_process(case, layouts, world, request):
    want = case(lambda t, layout: t.clone())
    for outs in request.getfixturevalue(f"pool{world}").run(_run_global, case):
        for (got, dtype, layout), w, keep in zip(outs, want, layouts, strict=True):
            assert dtype == w.dtype
            torch.testing.assert_close(
                got, w, rtol=1e-6 if w.dtype == torch.float32 else 1e-12, atol=1e-12
            )
            if keep is not None:
                assert layout == (keep,)


def _cast_refused():
    placement = sbp.placement("cpu", [0, 1])
    a = sbp.tensor(torch.arange(6).reshape(3, 2), placement=placement, sbp=S0)
    c = sbp.tensor(torch.zeros(3, 2, dtype=torch.long), placement=placement, sbp=S0)
    try:
        torch.div(a, 7, out=c)  # (a float result into an integer out: torch refuses)
    except sbp.SbpError as e:
        return type(e).__name__, str(e), c.full_tensor()
    return None, "", c.full_tensor()


def test_an_out_of_a_type_the_result_cannot_be_cast_to_is_refused_on_every_rank(pool2):
    for name, message, c in pool2.run(_cast_refused):
        assert name == "InputTypeError"
        assert "can't be cast to out's type torch.int64" in message
        assert not c.any()
