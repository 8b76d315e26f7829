"""Dtypes gloo lacks (int16, uint16, uint32, uint64, float8) move and reduce through
boxing as any other: before, gloo raised "Invalid scalar type" for tensors past the
shared-memory size (and for every size across hosts)."""

from __future__ import annotations

import pytest
import torch

import sbp
from sbp.comm import shm

S0, S1, B, PS = sbp.split(0), sbp.split(1), sbp.broadcast, sbp.partial_sum
DTYPES = [torch.int16, torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn]
REDUCIBLE = {torch.int16}  # (torch 2.14 cannot add the others on CPU: "add_stub")


def _values(rank: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(7 + rank)
    if dtype.is_floating_point:
        return torch.randn(*shape, generator=g).to(dtype)
    return torch.randint(0, 200, shape, generator=g).to(dtype)


def _reboxed(dtype: torch.dtype, rows: int, shared_memory: bool) -> dict:
    """Each conversion's full tensor, through gloo (rows large) or shared memory."""
    saved = shm._ENABLED
    shm._ENABLED = shared_memory
    try:
        P = sbp.placement.all("cpu")
        shape = (rows, 8)
        logical = _values(0, shape, dtype)
        out = {}
        x = logical.to_global(P, B).to_global(sbp=S0)
        for name, nd in (("S0->B", B), ("S0->S1", S1)):
            out[name] = x.to_global(sbp=nd).full_tensor()
        part = sbp.to_global(_values(sbp.env.get_rank(), shape, dtype), P, PS)
        for name, nd in (("P->B", B), ("P->S0", S0)) if dtype in REDUCIBLE else ():
            out[name] = part.to_global(sbp=nd).full_tensor()
        on_one = logical.to_global(sbp.placement("cpu", [0]), B)
        out["[0]->[0,1]"] = on_one.to_global(P, B).to_local()
        # (as bytes: the pool's pickling cannot bring uint16 tensors back)
        return {name: (str(v.dtype), v.contiguous().view(torch.uint8)) for name, v in out.items()}
    finally:
        shm._ENABLED = saved


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, shared_memory", [(2048, True), (6, False)], ids=["gloo", "hosts"])
def test_dtypes_gloo_lacks_move_and_reduce(dtype, rows, shared_memory, pool2):
    shape = (rows, 8)
    logical = _values(0, shape, dtype)
    summed = _values(0, shape, torch.int64) + _values(1, shape, torch.int64)  # (as torch: wraps)
    for got in pool2.run(_reboxed, dtype, rows, shared_memory):
        assert len(got) == (5 if dtype in REDUCIBLE else 3)
        for name, (got_dtype, value) in got.items():
            assert got_dtype == str(dtype), name
            want = summed.to(dtype) if name.startswith("P->") else logical
            assert torch.equal(value, want.view(torch.uint8)), name
