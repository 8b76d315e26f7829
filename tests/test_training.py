"""Real models train on global tensors with results equal to single-process training.

float64 is used so that the comparison tests the semantics (logical BatchNorm
statistics, loss means over the logical batch, gradient reductions) rather
than float32 rounding: a split batch sums in another order, and mobilenet's
BatchNorm chain amplifies that rounding (see the note on the issue).
"""

import pytest
import torch
import torch.nn.functional as F

import sbp

S0, S1, B = sbp.split(0), sbp.split(1), sbp.broadcast
STEPS, BATCH = 3, 10


def _optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def _mobilenet():
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.mobilenet_v2(num_classes=10, dropout=0.0).double()


def _batches():
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(BATCH, 3, 32, 32, generator=g, dtype=torch.float64),
            torch.randint(0, 10, (BATCH,), generator=g),
        )
        for _ in range(STEPS)
    ]


def _train_global(world, opt_name, layout=B):
    me = sbp.env.get_rank()
    P = sbp.placement("cpu", list(range(world)))
    model = _mobilenet().to_global(P, layout)
    opt = _optimizer(opt_name, model.parameters())
    losses = []
    for x, y in _batches():
        local = sbp.local_slices(x.shape, P, S0, P.coord(me)) if me in P else (slice(0, 0),)
        loss = F.cross_entropy(
            model(sbp.to_global(x[local], P, S0)), sbp.to_global(y[local[:1]], P, S0)
        )
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        opt.step()
        losses.append(loss.item() if me in P else None)
    params = [p.full_tensor() for p in model.parameters()]
    buffers = [b.full_tensor() for b in model.buffers()]
    if me != 0:
        return None
    grad_sbps = {tuple(p.grad.sbp) for p in model.parameters()}
    return losses, params, buffers, grad_sbps, sbp.nn.fast_path.state(model).last_path


def train_one_process(model, opt, batches, loss_fn, max_norm):
    """The single-process reference: the same steps on the logical (whole) batches."""
    losses = []
    for x, y in batches:
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach() for p in model.parameters()], list(model.buffers())


def _train_reference(opt_name):
    model = _mobilenet()
    opt = _optimizer(opt_name, model.parameters())
    return train_one_process(model, opt, _batches(), F.cross_entropy, 5.0)


def _relative(a, b):
    a = torch.cat([t.double().flatten() for t in a])
    b = torch.cat([t.double().flatten() for t in b])
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize(
    ("world", "opt_name", "layout"),
    [(2, "adamw", B), (4, "sgd", B), (2, "sgd", S0), (4, "adamw", S0)],
)
def test_mobilenet_v2_data_parallel_equals_one_process(pool4, world, opt_name, layout):
    """Each world and each optimizer once per layout (the other pairs took 6 s and run no
    new path): parameters broadcast, and sharded (`split(0)`: ZeRO-3, each of the 19
    feature blocks a unit; BatchNorm statistics over the logical batch, buffers broadcast)."""
    losses, params, buffers, grad_sbps, path = pool4.run(
        _train_global, world, opt_name, layout, timeout=600
    )[0]
    ref_losses, ref_params, ref_buffers = _train_reference(opt_name)
    assert path == ("fast" if layout == B else "sharded")
    assert grad_sbps == {(layout,)}  # partial gradients reduced (all-reduce / reduce-scatter)
    for got, want in zip(losses, ref_losses, strict=True):
        assert abs(got - want) <= 1e-4 * abs(want)
    assert _relative(params, ref_params) < 1e-4
    assert _relative(buffers, ref_buffers) < 1e-4  # BatchNorm running statistics


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _mlp_batches():
    g = torch.Generator().manual_seed(2)
    return [
        (
            torch.randn(7, 8, generator=g, dtype=torch.float64),
            torch.randn(7, 4, generator=g, dtype=torch.float64),
        )
        for _ in range(STEPS)
    ]


def _mlp_model():
    torch.manual_seed(4)
    return MLP().double()


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.5),
    "sgd-foreach": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.5, foreach=True),
    "sgd-fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.5, fused=True),
    "adam-foreach": lambda p: torch.optim.Adam(p, lr=0.01, foreach=True),
    "adam-fused": lambda p: torch.optim.Adam(p, lr=0.01, fused=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
    "adamw-foreach": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, foreach=True),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, fused=True),
}


def _train_mlp_2d(opt_name):
    me = sbp.env.get_rank()
    P = sbp.placement("cpu", [[0, 1], [2, 3]])
    model = _mlp_model()
    model.to_global(P, (B, B))  # on a global module this re-boxes, so it comes first
    for layer in (model.fc1, model.fc2):
        layer.weight = torch.nn.Parameter(layer.weight.detach().to_global(sbp=(B, S1)))
    opt = OPTIMIZERS[opt_name](model.parameters())
    losses = []
    for x, y in _mlp_batches():
        x_local = x[sbp.local_slices(x.shape, P, (S0, B), P.coord(me))]
        y_local = y[sbp.local_slices(y.shape, P, (S0, B), P.coord(me))]
        loss = F.mse_loss(
            model(sbp.to_global(x_local, P, (S0, B))), sbp.to_global(y_local, P, (S0, B))
        )
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        losses.append(loss.item())
    sbps = [tuple(p.sbp) for p in model.parameters()]
    grads = [tuple(p.grad.sbp) for p in model.parameters()]
    return losses, [p.full_tensor() for p in model.parameters()], sbps, grads


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_2d_placement_mlp_with_split_weights_equals_one_process(pool4, opt_name):
    """Single-tensor, foreach and fused optimizer paths, with clip_grad_norm_, on split weights."""
    model = _mlp_model()
    opt = OPTIMIZERS[opt_name](model.parameters())
    ref_losses, ref_params, _ = train_one_process(model, opt, _mlp_batches(), F.mse_loss, 0.5)
    for losses, params, sbps, grads in pool4.run(_train_mlp_2d, opt_name):
        assert sbps == [(B, S1), (B, B), (B, S1), (B, B)]
        assert grads == sbps  # each leaf's gradient arrives in the leaf's sbp
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)) < 1e-9
        assert _relative(params, ref_params) < 1e-9


def _clipped(make, foreach):
    """Gradients of split and broadcast parameters (one expanded: `.sum()`'s), clipped."""
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(*s, generator=g, dtype=torch.float64) for s in ((4, 6), (6,), (3,))]
    ps = [make(v, layout).requires_grad_() for v, layout in zip(values, (S0, B, B), strict=True)]
    ((ps[0] * ps[1]).pow(2).sum() + 3.0 * ps[2].sum()).backward()
    norm = torch.nn.utils.clip_grad_norm_(ps, 0.5, foreach=foreach)
    return [norm] + [p.grad for p in ps]


def _clipped_global(foreach):
    P = sbp.placement("cpu", [0, 1])
    got = _clipped(lambda t, layout: sbp.tensor(t, placement=P, sbp=layout), foreach)
    return [t.full_tensor() for t in got]


@pytest.mark.parametrize("foreach", [False, True])
def test_clip_grad_norm_of_split_broadcast_and_expanded_gradients(pool2, foreach):
    """clip_grad_norm_ failed on split with broadcast gradients (a decision-cache collision
    gave a norm the wrong shape) and on an expanded one (`p.sum()`'s gradient kept stride 0:
    "more than one element of the written-to tensor refers to a single memory location")."""
    want = _clipped(lambda t, layout: t.clone(), foreach)
    for got in pool2.run(_clipped_global, foreach):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _clipped_pipeline(foreach, error_if_nonfinite):
    """A pipeline's parameters: one on each rank's own placement and one split over both,
    clipped together; everything read back on the whole world."""
    P = sbp.placement("cpu", [0, 1])
    places = (sbp.placement("cpu", [0]), sbp.placement("cpu", [1]), P)

    def make(t, layout):
        where = places[make.i]
        make.i += 1
        return sbp.tensor(t, placement=where, sbp=layout if where is P else B)

    make.i = 0
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(*s, generator=g, dtype=torch.float64) for s in ((4, 6), (6,), (3,))]
    ps = [make(v, layout).requires_grad_() for v, layout in zip(values, (S0, B, B), strict=True)]
    whole = [p.to_global(placement=P, sbp=B) for p in ps]
    ((whole[0] * whole[1]).pow(2).sum() + 3.0 * whole[2].sum()).backward()
    kw = {} if foreach is None else {"foreach": foreach}
    norm = torch.nn.utils.clip_grad_norm_(ps, 0.5, error_if_nonfinite=error_if_nonfinite, **kw)
    return [list(norm.placement.ranks)] + [
        t.to_global(placement=P, sbp=B).full_tensor() for t in (norm, *(p.grad for p in ps))
    ]


@pytest.mark.parametrize("foreach", [None, True])
@pytest.mark.parametrize("error_if_nonfinite", [False, True])
def test_clip_grad_norm_over_a_pipelines_placements(pool2, foreach, error_if_nonfinite):
    """Parameters on several placements (a pipeline's stages) clipped together, as one
    process clips them: each norm goes to the placement of all their ranks (the total is
    read on every stage: error_if_nonfinite), and the scale to each gradient's (before: PlacementError, "inputs
    are on different placements", from _foreach_norm)."""
    want = _clipped(lambda t, layout: t.clone(), True)
    for where, *got in pool2.run(_clipped_pipeline, foreach, error_if_nonfinite):
        assert where == [0, 1]
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _clipped_pipeline_error(foreach):
    try:
        _clipped_pipeline(foreach, False)
    except sbp.PlacementError as e:
        return str(e)
    return None


def test_clip_grad_norm_over_placements_without_foreach_raises_on_every_rank(pool2):
    """torch's loop without foreach stacks norms of several placements itself: the same
    PlacementError on every rank, naming the op."""
    for said in pool2.run(_clipped_pipeline_error, False):
        assert said is not None and "aten.stack" in said and "different placements" in said


def _list_ops_over_placements(values, scalars):
    """`torch._foreach_*` over lists whose entries sit on [0], [1] and [0, 1] (split)."""
    P = sbp.placement("cpu", [0, 1])
    places = (sbp.placement("cpu", [0]), sbp.placement("cpu", [1]), P)
    layouts = (B, B, S0)

    def lists(k):
        return [
            sbp.tensor(v[k], placement=p, sbp=s)
            for v, p, s in zip(values, places, layouts, strict=True)
        ]

    a, b, c = lists(0), lists(1), lists(2)
    torch._foreach_addcdiv_(a, b, c, scalars)  # (a local tensor of numbers, one per entry)
    made = torch._foreach_mul(a, b)  # (a new list)
    return [t.to_global(placement=P, sbp=B).full_tensor() for t in (*a, *made)]


def test_list_ops_over_placements_equal_one_process(pool2):
    """A list op over several placements runs once per placement, each on its entries of
    every list and of a tensor of numbers; results come back in order."""
    g = torch.Generator().manual_seed(1)
    values = [
        [torch.randn(*s, generator=g, dtype=torch.float64) + (2 if k == 2 else 0) for k in range(3)]
        for s in ((3,), (2, 2), (4, 3))
    ]
    scalars = torch.tensor([0.5, -2.0, 3.0], dtype=torch.float64)
    a, b, c = ([v[k].clone() for v in values] for k in range(3))
    torch._foreach_addcdiv_(a, b, c, scalars)
    want = [*a, *torch._foreach_mul(a, b)]
    for got in pool2.run(_list_ops_over_placements, values, scalars):
        for x, y in zip(got, want, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
