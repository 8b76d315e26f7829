"""Shared by the data-parallel tests (tests/test_data_parallel*.py): logical tensors laid
out on a placement, a small MLP and its data, training one model three ways (on local
shards, op by op, in one process)."""

import torch
import torch.nn.functional as F

import sbp

S0, B = sbp.split(0), sbp.broadcast


def _shard(t, P, nd):
    """This rank's part of the logical tensor `t` laid out as `nd` on `P`."""
    me = sbp.env.get_rank()
    if me not in P:
        return t[:0]
    return t[sbp.local_slices(t.shape, P, nd, P.coord(me))]


def _global(t, P, nd=S0):
    """The global tensor whose logical value is `t`, laid out as `nd` on `P`."""
    return sbp.to_global(_shard(t, P, nd), P, nd)


def _loss(model, x, y, P):
    return F.cross_entropy(model(_global(x, P)), _global(y, P))


def _gather(model):
    return [p.full_tensor() for p in model.parameters()]


def _rel(a, b):
    a = torch.cat([t.flatten() for t in a])
    b = torch.cat([t.flatten() for t in b])
    return ((a - b).norm() / b.norm()).item()


class MLP(torch.nn.Module):
    def __init__(self, width=16, depth=4):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(8 if i == 0 else width, width) for i in range(depth)
        )
        self.head = torch.nn.Linear(width, 3)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def _data(n=10, steps=3, shape=(8,), classes=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(n, *shape, generator=g, dtype=torch.float64),
            torch.randint(0, classes, (n,), generator=g),
        )
        for _ in range(steps)
    ]


def _train(
    make_model,
    placement,
    nd,
    fast,
    data,
    opt="sgd",
    batch_norm="global",
    compiled=False,
    compile_local=None,
):
    """`fast`: the fast path on or off; `compiled`: the model under torch.compile (aot_eager,
    fullgraph; or with `compiled` as the backend, graph breaks allowed); `compile_local`:
    torch.compile options for the fast path's local forward."""
    import sbp.nn

    torch.manual_seed(0)
    sbp.manual_seed(0)  # dropout masks: the same draws for every run in this process
    model = make_model().double()
    if placement is not None:
        model.to_global(placement, (B,) * placement.ndim)
        sbp.nn.data_parallel(model, fast=fast, batch_norm=batch_norm, compile=compile_local)
    params = list(model.parameters())
    optim = (
        torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4)
        if opt == "sgd"
        else torch.optim.AdamW(params, lr=1e-2)
    )
    if compiled is True:
        run = torch.compile(model, backend="aot_eager", fullgraph=True)
    else:
        run = torch.compile(model, backend=compiled) if compiled else model
    losses, paths = [], []
    for x, y in data:
        if placement is not None:
            x, y = _global(x, placement, nd), _global(y, placement, nd)
        loss = F.cross_entropy(run(x), y)
        if placement is not None:
            paths.append(sbp.nn.fast_path.state(model).last_path)
        optim.zero_grad()
        loss.backward()
        optim.step()
        inside = placement is None or sbp.env.get_rank() in placement
        losses.append(loss.item() if inside else None)
    params = _gather(model) if placement is not None else [p.detach() for p in params]
    buffers = [b.full_tensor() if placement else b for b in model.buffers()]
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    grad_sbps = {tuple(g.sbp) for g in grads} if placement else None
    return losses, params, buffers, paths, grad_sbps


def _mobilenet():
    import torchvision

    return torchvision.models.mobilenet_v2(num_classes=4, dropout=0.2)


def _fast_and_per_op(make_model, world, nd, data, **kw):
    P = sbp.placement("cpu", list(range(world)))
    fast = _train(make_model, P, nd, True, data, **kw)
    per_op = _train(make_model, P, nd, False, data, **kw)
    return fast, per_op


class ConvBN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 6, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(6)
        self.fc = torch.nn.Linear(6, 4)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(x)))
        return self.fc(x.mean((2, 3)))


def _conv_bn_cumulative():
    """BatchNorm with momentum=None (as torch.optim.swa_utils.update_bn sets it): the running
    statistics are a cumulative average, which reads num_batches_tracked as a number."""
    model = ConvBN()
    model.bn.momentum = None
    return model


def _train_recording(make_model, fast, data):
    """`_train` on every rank, with each checked layout's `in_modules`."""
    from sbp.nn import fast_path

    checked = []
    check = fast_path.DataParallel._check

    def recording(self, *args):
        checked.append(check(self, *args))
        return checked[-1]

    fast_path.DataParallel._check = recording
    try:
        out = _train(make_model, sbp.placement.all("cpu"), (S0,), fast, data)
    finally:
        fast_path.DataParallel._check = check
    return out, [layout.in_modules for layout in checked]
