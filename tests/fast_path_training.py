"""Training a model on the data-parallel fast path and in one process, to compare them
(shared by the tests of torch's row-wise calls: attention, recurrent layers, embedding
bags). A model takes `model(x, second)`; batches are (x, second, labels), float64 unless
`dtype` says."""

import pytest
import torch
import torch.nn.functional as F

import sbp

S0, B = sbp.split(0), sbp.broadcast


def train(make, data, P=None, training=True, fast=True, dtype=torch.float64):
    """Losses and parameters after SGD steps (in eval mode `training=False`: losses under
    no_grad); with `P`, global, on the fast path (or op by op, `fast=False`), with its
    paths."""
    torch.manual_seed(0)
    sbp.manual_seed(0)  # (dropout masks: the same draws for every run in this process)
    model = make().to(dtype).train(training)
    if P is not None:
        model.to_global(P, B)
        sbp.nn.data_parallel(model, fast=fast)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, paths = [], []
    for x, second, y in data:
        if P is not None:
            x, second, y = (sbp.tensor(t, placement=P, sbp=S0) for t in (x, second, y))
        if training:
            loss = F.cross_entropy(model(x, second), y)
            optim.zero_grad()
            loss.backward()
            optim.step()
        else:
            with torch.no_grad():
                loss = F.cross_entropy(model(x, second), y)
        if P is not None:
            paths.append(sbp.nn.fast_path.state(model).last_path)
        losses.append(loss.item())
    params = [p.full_tensor() if P is not None else p.detach() for p in model.parameters()]
    return losses, params, paths


def assert_trains_as_one_process(pool, make, data, fast=True, path="fast", trainer=train, **kw):
    """Every rank of `pool` trains `make()` on `data` as one process does (on `path`);
    `trainer`: `train`, or a function that calls it under some condition."""
    want_losses, want_params, _ = trainer(make, data, **kw)
    P = sbp.placement("cpu", list(range(pool.world_size)))
    single = kw.get("dtype") == torch.float32  # (sums in another order: rounding)
    rtol, atol = (1e-5, 1e-6) if single else (1e-10, 1e-12)
    for losses, params, paths in pool.run(trainer, make, data, P, fast=fast, **kw):
        assert paths == [path] * len(data)
        assert losses == pytest.approx(want_losses, rel=rtol)
        for got, ref in zip(params, want_params, strict=True):
            torch.testing.assert_close(got, ref, rtol=rtol, atol=atol)
