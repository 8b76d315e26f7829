"""The data-parallel fast path and the overlapped gradient reducer (sbp.data_parallel).

Each test trains or differentiates the same model three ways where it can: on local
shards (the fast path), op by op (`sbp.nn.data_parallel(model, fast=False)`), and in
one process on the logical batch; float64 so that 1e-12 separates semantics from
rounding.
"""

import copy
import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from data_parallel_helpers import (
    MLP,
    S0,
    B,
    ConvBN,
    _data,
    _fast_and_per_op,
    _gather,
    _global,
    _loss,
    _mobilenet,
    _rel,
    _train,
)

import sbp


@pytest.mark.parametrize("world", [1, 2, 4])
def test_mobilenet_fast_path_equals_per_op(pool4, world):
    """Logical BatchNorm, dropout 0.2 (the same masks both ways), uneven shards on 4 ranks;
    on one rank the BatchNorm modules run their own forward."""
    data = _data(n=6, steps=2, shape=(3, 32, 32), classes=4)
    fast, per_op = pool4.run(_fast_and_per_op, _mobilenet, world, S0, data, timeout=600)[0]
    assert fast[3] == ["fast", "fast"] and per_op[3] == ["per-op", "per-op"]
    for a, b in zip(fast[0], per_op[0], strict=True):
        assert abs(a - b) <= 1e-12 * abs(b)
    assert _rel(fast[1], per_op[1]) < 1e-12
    assert _rel(fast[2], per_op[2]) < 1e-12  # running statistics
    assert fast[4] == {(B,)}


@pytest.mark.parametrize("nd", [(S0, S0), (S0, B)])
@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_mlp_on_2x2_equals_one_process(pool4, nd, opt):
    data = _data()

    def run(nd, opt):
        P = sbp.placement("cpu", [[0, 1], [2, 3]])
        fast = _train(MLP, P, nd, True, data, opt=opt)
        per_op = _train(MLP, P, nd, False, data, opt=opt)
        return fast, per_op

    fast, per_op = pool4.run(run, nd, opt)[0]
    ref = _train(MLP, None, None, None, data, opt=opt)
    assert fast[3] == ["fast"] * 3
    for got in (fast, per_op):
        for a, b in zip(got[0], ref[0], strict=True):
            assert abs(a - b) <= 1e-12 * abs(b)
        assert _rel(got[1], ref[1]) < 1e-12
        assert got[4] == {(B, B)}


def test_world_of_one():
    """In this (test) process: no launcher variables, so a world of one with no process group."""
    data = _data()
    got = _train(MLP, sbp.placement("cpu", [0]), S0, True, data)
    ref = _train(MLP, None, None, None, data)
    assert got[3] == ["fast"] * 3
    assert _rel(got[1], ref[1]) < 1e-12


def _waiting_type(p):
    """The type of the gradient the fast path left waiting, plain, on `p` or (one rank) in
    its local leaf, when torch's own `.grad` of `p` is still empty; else None's."""
    if torch._C.TensorBase.grad.__get__(p) is not None:
        return type(None)
    pending = p._pending
    waiting = None if pending is None else pending.grad
    claim = None if pending is None else pending.claim
    return type(waiting if waiting is not None or claim is None else claim[1].grad)


def _grad_rules(global_model, x, y, P):
    """What users do to `.grad` between backwards, on `global_model` (P given) or, with P
    None, on the same model in one process: backward twice unread, clear one gradient
    and replace another, zero in place, drop (the optimizer's zero_grad and the
    module's). Returns the gradients after each, and the parameters after steps."""
    params = list(global_model.parameters())
    full = (lambda g: g.full_tensor().clone()) if P is not None else (lambda g: g.clone())
    opt = torch.optim.SGD(params, lr=0.1)

    def loss():
        if P is None:
            return F.cross_entropy(global_model(x), y)
        return _loss(global_model, x, y, P)

    seen = []
    loss().backward()
    plain = []
    if P is not None:  # waiting plain: no global gradient made until one is read
        plain = [_waiting_type(p) for p in params]
    loss().backward()  # accumulates onto the unread gradients
    seen.append([full(p.grad) for p in params])
    params[0].grad = None
    params[1].grad = torch.ones_like(params[1])
    loss().backward()
    seen.append([full(p.grad) for p in params])
    opt.zero_grad(set_to_none=False)
    seen.append([bool((full(p.grad) == 0).all()) for p in params])
    loss().backward()
    opt.step()  # (the optimizer takes the gradients as they are)
    opt.zero_grad()
    seen.append([p.grad is None for p in params])
    loss().backward()
    opt.step()
    seen.append([full(p.detach()) for p in params])
    global_model.zero_grad()
    loss().backward()
    global_model.zero_grad()
    seen.append([p.grad is None for p in params])
    loss().backward()
    seen.append([full(p.grad) for p in params])
    return seen, plain


@pytest.mark.parametrize("world", [1, 2])
def test_gradients_wait_plain_and_behave_as_torch_grads(pool2, world):
    """The fast path leaves each summed gradient plain on its parameter until `.grad` is
    read; reading, accumulating, replacing, zeroing and stepping give torch's numbers."""
    ((x, y),) = _data(steps=1)

    def run(world):
        P = sbp.placement("cpu", list(range(world)))
        torch.manual_seed(0)
        model = MLP().double().to_global(P, B)
        out = _grad_rules(model, x, y, P)
        return out, sbp.nn.fast_path.state(model).last_path

    (seen, plain), path = pool2.run(run, world)[0]
    torch.manual_seed(0)
    want, _ = _grad_rules(MLP().double(), x, y, None)
    assert path == "fast"
    assert plain == [torch.Tensor] * len(plain) and plain
    for got, ref in zip(seen, want, strict=True):
        if isinstance(ref[0], bool):
            assert got == ref
        else:
            assert _rel(got, ref) < 1e-12


def _shared_use_steps(model, opt, data, P):
    """Steps whose loss uses the head's weight twice: inside the model (on the fast path, its
    gradient reduced in buckets) and op by op outside it (an L2 term on the global weight,
    its gradient accumulated through autograd); every parameter's gradient and value after
    each step, as logical tensors (copies: a broadcast tensor's full_tensor() is its local)."""

    def logical(t):
        return (t.full_tensor() if P is not None else t.detach()).clone()

    seen = []
    for x, y in data:
        opt.zero_grad()
        out = model(_global(x, P) if P is not None else x)
        loss = F.cross_entropy(out, _global(y, P) if P is not None else y)
        loss = loss + 0.1 * (model.head.weight**2).sum()
        loss.backward()
        grads = [logical(p.grad) for p in model.parameters()]
        opt.step()
        seen.append((grads, [logical(p) for p in model.parameters()]))
    return seen


@pytest.mark.parametrize("world", [1, 2])
def test_a_parameter_used_inside_and_outside_the_model(pool2, world):
    """A parameter used by the data-parallel model and op by op beside it gets the sum of
    both gradients, as in one process: the model's part reduced over the ranks once, the
    outside part's partial sum flushed once, neither counted twice."""
    data = _data(steps=3)

    def run(world):
        P = sbp.placement("cpu", list(range(world)))
        torch.manual_seed(0)
        model = MLP().double().to_global(P, B)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        seen = _shared_use_steps(model, opt, data, P)
        return seen, sbp.nn.fast_path.state(model).last_path

    got, path = pool2.run(run, world)[0]
    torch.manual_seed(0)
    ref = MLP().double()
    want = _shared_use_steps(
        ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), data, None
    )
    assert path == "fast"
    for (grads, params), (ref_grads, ref_params) in zip(got, want, strict=True):
        assert _rel(grads, ref_grads) < 1e-12
        assert _rel(params, ref_params) < 1e-12


# (the step pre-hook that installs the step on locals reads its caller's frame: Dynamo
# leaves the graph there, and says so)
@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace the builtin")
def test_a_compiled_optimizer_step_reads_waiting_gradients():
    """torch.compile(optimizer.step) traces the step on the global tensors, reading each
    `.grad` through the property that wraps a waiting gradient: equal to one process."""
    P = sbp.placement("cpu", [0])
    torch.manual_seed(0)
    ref = MLP().double()
    model = copy.deepcopy(ref).to_global(P, B)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    torch._dynamo.reset()
    step = torch.compile(opt.step, backend="aot_eager")
    waiting = []
    for x, y in _data(steps=3):
        opt.zero_grad()
        _loss(model, x, y, P).backward()
        waiting.append(_waiting_type(model.head.weight))
        step()
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
    torch._dynamo.reset()
    assert waiting == [torch.Tensor] * 3
    assert _rel(_gather(model), [p.detach() for p in ref.parameters()]) < 1e-12


class _FailOnce(torch.autograd.Function):
    """The identity, whose backward raises while `fail` is set."""

    fail = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if _FailOnce.fail:
            raise RuntimeError("backward failed")
        return grad


class FailingMLP(MLP):
    def forward(self, x):
        x = _FailOnce.apply(torch.relu(self.layers[0](x)))
        for layer in self.layers[1:]:
            x = torch.relu(layer(x))
        return self.head(x)


def test_a_failed_backward_leaves_nothing_behind():
    """A backward that raised (after some leaves got gradients) never ran its end-of-backward
    hand-over; the next step's gradients are still exactly that step's (world of one)."""
    x, y = _data(steps=1)[0]
    P = sbp.placement("cpu", [0])
    torch.manual_seed(0)
    model = FailingMLP().double()
    ref = copy.deepcopy(model)
    model.to_global(P, B)
    _FailOnce.fail = True
    try:
        with pytest.raises(RuntimeError, match="backward failed"):
            _loss(model, x, y, P).backward()
    finally:
        _FailOnce.fail = False
    assert all(p.grad is None for p in model.parameters())
    _loss(model, x, y, P).backward()
    F.cross_entropy(ref(x), y).backward()
    assert sbp.nn.fast_path.state(model).last_path == "fast"
    assert (
        _rel([p.grad.full_tensor() for p in model.parameters()], [q.grad for q in ref.parameters()])
        < 1e-12
    )


class MixesSamples(torch.nn.Module):
    """Not batch-separable: centres the features over the batch."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.fc(x - x.mean(0, keepdim=True))


def test_declines_a_module_that_mixes_samples(pool2):
    data = _data(steps=2)

    def run():
        with pytest.warns(UserWarning, match="runs op by op"):
            return _train(MixesSamples, sbp.placement("cpu", [0, 1]), S0, True, data)

    got = pool2.run(run)[0]
    ref = _train(MixesSamples, None, None, None, data)
    assert got[3] == ["per-op", "per-op"]
    assert _rel(got[1], ref[1]) < 1e-12


def _new_head_steps(world, classes):
    """Two SGD steps of an MLP (three classes), then a new head of `classes` classes
    (fine-tuning on other labels: `model.head = Linear(...)`), two steps more. Global when `world`:
    the fast path ran before the head changed. The losses, the last step's paths and
    parameters (logical values)."""
    import sbp.nn

    torch.manual_seed(0)
    model = MLP().double()
    head = torch.nn.Linear(16, classes).double()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 4, 8, dtype=torch.float64, generator=g)
    y = [torch.randint(0, 3 if i < 2 else classes, (4,), generator=g) for i in range(4)]
    P = None if world is None else sbp.placement("cpu", list(range(world)))
    if P is not None:
        model.to_global(P, B)
        sbp.nn.data_parallel(model)
    losses, paths = [], []
    for i in range(4):
        if i == 2:
            model.head = head if P is None else copy.deepcopy(head).to_global(P, B)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = F.cross_entropy(model(x[i]), y[i]) if P is None else _loss(model, x[i], y[i], P)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if P is not None:
            paths.append(sbp.nn.fast_path.state(model).last_path)
    params = [p.detach() for p in model.parameters()] if P is None else _gather(model)
    return losses, paths, params


@pytest.mark.parametrize("classes", [5, 3])
@pytest.mark.parametrize("world", [1, 2])
def test_a_new_head_after_the_fast_path_ran(request, world, classes):
    """The local run puts local tensors in the tables it found: a new submodule's are new
    ones (before: the old head's got them, and the new head's global weight met a local
    input: PlacementError). The layouts checked with the old parameters expected three
    classes; new parameters of other shapes are checked again."""
    ref = _new_head_steps(None, classes)
    pool = request.getfixturevalue(f"pool{world}")
    for losses, paths, params in pool.run(_new_head_steps, world, classes):
        assert paths == ["fast"] * 4
        assert losses == pytest.approx(ref[0], rel=1e-12)
        assert _rel(params, ref[2]) < 1e-12


def _hooked_steps(world):
    """Three SGD steps of an MLP whose parameters halve their gradients in a hook and count
    their accumulations (optimizer-in-backward's hook), the hooks removed before the third.
    Global when `world`. The paths, the counts, the parameters (logical values)."""
    import sbp.nn

    torch.manual_seed(0)
    model = MLP().double()
    P = None if world is None else sbp.placement("cpu", list(range(world)))
    if P is not None:
        model.to_global(P, B)
    params = list(model.parameters())
    counts = [0]
    handles = [p.register_hook(lambda g: g * 0.5) for p in params]
    handles += [
        p.register_post_accumulate_grad_hook(lambda p: counts.__setitem__(0, counts[0] + 1))
        for p in params
    ]
    opt = torch.optim.SGD(params, lr=0.1)
    data = _data(n=8, steps=3)
    paths = []
    for i in range(3):
        if i == 2:
            for h in handles:
                h.remove()
        opt.zero_grad()
        x, y = data[i]
        loss = F.cross_entropy(model(x), y) if P is None else _loss(model, x, y, P)
        loss.backward()
        opt.step()
        if P is not None:
            paths.append(sbp.nn.fast_path.state(model).last_path)
    return paths, counts[0], params if P is None else _gather(model)


@pytest.mark.filterwarnings("ignore:sbp. MLP runs op by op while a parameter has a gradient")
@pytest.mark.parametrize("world", [1, 2])
def test_gradient_hooks_on_parameters(request, world):
    """A parameter's hooks see and change its logical gradient, as in one process: the fast
    path's local gradients would pass them by (before: never called, gradients unscaled,
    silently), so the model runs op by op while a parameter holds one."""
    _, want_count, want = _hooked_steps(None)
    pool = request.getfixturevalue(f"pool{world}")
    for paths, count, params in pool.run(_hooked_steps, world):
        assert paths == ["per-op", "per-op", "fast"]
        assert count == want_count == 2 * len(want)
        assert _rel(params, want) < 1e-12


def test_a_split_weight_among_broadcast_ones_runs_sharded(pool2):
    """A weight split along dim 0 beside broadcast ones (a mixed layout, or a column-parallel
    weight with the batch split as well) runs on the sharded path: the logical model is
    the same, its gradient stays split(0)."""
    data = _data(steps=2)

    def run():
        import sbp.nn

        P = sbp.placement("cpu", [0, 1])
        torch.manual_seed(0)
        model = MLP().double().to_global(P, B)
        w = model.layers[1].weight
        model.layers[1].weight = torch.nn.Parameter(w.detach().to_global(sbp=sbp.split(0)))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
        paths = []
        for x, y in data:
            loss = _loss(model, x, y, P)
            paths.append(sbp.nn.fast_path.state(model).last_path)
            opt.zero_grad()
            loss.backward()
            opt.step()
        return paths, _gather(model), tuple(model.layers[1].weight.grad.sbp)

    paths, params, grad_sbp = pool2.run(run)[0]
    torch.manual_seed(0)
    ref = _train(MLP, None, None, None, data[:2])
    assert paths == ["sharded", "sharded"]
    assert grad_sbp == (sbp.split(0),)
    assert _rel(params, ref[1]) < 1e-12


def test_buckets_run_during_backward(pool2):
    """With one parameter per bucket, a bucket starts before the last gradient is ready."""
    x, y = _data(steps=1)[0]

    def run():
        import sbp.nn

        P = sbp.placement("cpu", [0, 1])
        torch.manual_seed(0)
        model = MLP(width=64, depth=6).double().to_global(P, B)
        sbp.nn.data_parallel(model, bucket_mb=64 * 64 * 8 / 2**20)
        state = sbp.nn.fast_path.state(model)
        state.trace = []
        loss = _loss(model, x, y, P)
        loss.backward()
        return state.trace, [p.grad.full_tensor() for p in model.parameters()]

    trace, grads = pool2.run(run)[0]
    torch.manual_seed(0)
    model = MLP(width=64, depth=6).double()
    F.cross_entropy(model(x), y).backward()
    ref = [p.grad for p in model.parameters()]
    assert _rel(grads, ref) < 1e-12
    last_ready = max(i for i, e in enumerate(trace) if e[0] == "ready")
    first_launch = min(i for i, e in enumerate(trace) if e[0] == "launch")
    assert first_launch < last_ready
    launches = [e[1] for e in trace if e[0] == "launch"]
    assert launches == sorted(launches) and len(launches) > 4  # in bucket order on every rank


def test_bucket_buffers_reused_only_when_released(pool2):
    """Gradients are views of the reducer's bucket buffers. A buffer is reused by the next
    backward once `zero_grad()` released every gradient in it; a gradient the user kept, or
    one accumulated into (set_to_none=False), keeps its own numbers."""
    data = _data(steps=4)

    def run():
        P = sbp.placement("cpu", [0, 1])
        torch.manual_seed(0)
        model = MLP().double().to_global(P, B)
        params = list(model.parameters())
        storage = []
        kept, kept_copy = None, None
        for i, (x, y) in enumerate(data):
            for p in params:
                p.grad = None if i != 3 else p.grad  # step 3 accumulates onto step 2's
            _loss(model, x, y, P).backward()
            storage.append(params[0].grad.to_local().untyped_storage().data_ptr())
            if i == 1:
                kept = params[0].grad  # held across the next backward
                kept_copy = kept.full_tensor().clone()
        return storage, kept.full_tensor(), kept_copy, [p.grad.full_tensor() for p in params]

    storage, kept, kept_copy, grads = pool2.run(run)[0]
    torch.manual_seed(0)
    model = MLP().double()
    for i, (x, y) in enumerate(data):
        if i != 3:
            model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if i == 1:
            ref_kept = model.layers[0].weight.grad.clone()
    assert storage[1] == storage[0]  # released by the loop: the buffer is reused
    assert storage[2] != storage[1]  # step 1's gradient is still held: a new buffer
    assert torch.equal(kept, kept_copy)
    assert _rel([kept], [ref_kept]) < 1e-12
    assert _rel(grads, [p.grad for p in model.parameters()]) < 1e-12


@pytest.mark.parametrize("world", [1, 2])
def test_no_sync_accumulates_micro_batches(pool2, world):
    """On one rank the gradients are handed over once after backward, not by a hook per leaf;
    a partial sum over one rank is whole once a synchronised backward follows."""
    data = _data(steps=3)

    def run(world):
        import sbp.nn

        P = sbp.placement("cpu", list(range(world)))
        torch.manual_seed(0)
        model = MLP().double().to_global(P, B)
        inside = []
        for i, (x, y) in enumerate(data):
            loss = _loss(model, x, y, P)
            if i < 2:
                with sbp.nn.no_sync(model):
                    loss.backward()
                inside.append({tuple(p.grad.sbp) for p in model.parameters()})
            else:
                loss.backward()
        after = {tuple(p.grad.sbp) for p in model.parameters()}
        path = sbp.nn.fast_path.state(model).last_path
        return inside, after, path, [p.grad.full_tensor() for p in model.parameters()]

    inside, after, path, grads = pool2.run(run, world)[0]
    torch.manual_seed(0)
    model = MLP().double()
    for x, y in data:
        F.cross_entropy(model(x), y).backward()
    assert path == "fast"
    assert inside == [{(sbp.partial_sum,)}] * 2
    assert after == {(B,)}
    assert _rel(grads, [p.grad for p in model.parameters()]) < 1e-12


def _held_grads(world, kind, loss):
    """References to every `.grad` kept after a backward, then the next (after
    `zero_grad(set_to_none=False)`; after one under `no_sync`; or a synchronised one, then
    one under no_sync, then the next): the held tensors' values, read before any `.grad`
    is, whether `.grad` is still each, and then the `.grad` values."""
    import sbp.nn

    P = sbp.placement("cpu", list(range(world)))
    torch.manual_seed(0)
    model = MLP().double().to_global(P, B)
    batches = _data(steps=3)
    if kind == "no_sync":
        with sbp.nn.no_sync(model):
            loss(model, *batches[0], P).backward()
    else:
        loss(model, *batches[0], P).backward()
    held = [p.grad for p in model.parameters()]
    if kind == "zero_grad(set_to_none=False)":
        model.zero_grad(set_to_none=False)
    if kind in ("synchronised, no_sync", "no_sync, a parameter frozen"):
        with sbp.nn.no_sync(model):
            loss(model, *batches[2], P).backward()
    if kind == "no_sync, a parameter frozen":  # (a new reducer takes the partial sums)
        model.layers[0].bias.requires_grad_(False)
    loss(model, *batches[1], P).backward()
    values = [g.full_tensor().clone() for g in held]  # (a broadcast one's is its local)
    same = all(p.grad is g for p, g in zip(model.parameters(), held, strict=True))
    values += [p.grad.full_tensor() for p in model.parameters()]  # (read: nothing added twice)
    return values, same, sbp.nn.fast_path.state(model).last_path


def _squares(model, x, y, P):
    """A loss taken op by op on the global output (`_loss`: on the fast path's twin)."""
    return model(_global(x, P)).square().mean()


@pytest.mark.parametrize("loss", [_loss, _squares], ids=["cross_entropy", "squares"])
@pytest.mark.parametrize(
    "kind",
    [
        "zero_grad(set_to_none=False)",
        "no_sync",
        "synchronised, no_sync",
        "no_sync, a parameter frozen",
    ],
)
@pytest.mark.parametrize("world", [1, 2])
def test_a_held_grad_gets_the_next_backward_as_in_torch(pool2, world, kind, loss):
    """Torch accumulates into the `.grad` tensor a parameter holds: a reference kept to it
    sees the next backward's gradient (before: it stayed stale until `.grad` was read,
    as the reducer left the sum waiting beside it; around no_sync `.grad` became another
    tensor)."""
    batches = _data(steps=3)
    torch.manual_seed(0)
    model = MLP().double()
    plain = F.cross_entropy if loss is _loss else lambda out, y: out.square().mean()
    plain(model(batches[0][0]), batches[0][1]).backward()
    if kind == "zero_grad(set_to_none=False)":
        model.zero_grad(set_to_none=False)
    if kind in ("synchronised, no_sync", "no_sync, a parameter frozen"):
        plain(model(batches[2][0]), batches[2][1]).backward()
    if kind == "no_sync, a parameter frozen":
        model.layers[0].bias.requires_grad_(False)
    plain(model(batches[1][0]), batches[1][1]).backward()
    for values, same, path in pool2.run(_held_grads, world, kind, loss)[:world]:
        assert path == "fast" and same
        assert _rel(values, [p.grad for p in model.parameters()] * 2) < 1e-12


class Branches(torch.nn.Module):
    """`unused` takes part in no forward; `aux` is returned broadcast, from parameters alone."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 3)
        self.unused = torch.nn.Linear(8, 3)
        self.scale = torch.nn.Parameter(torch.tensor([0.5, 2.0, 1.5]))

    def forward(self, x):
        return self.fc(x) * self.scale, (self.scale**2).sum()


@pytest.mark.parametrize("counts_on_host", [False, True])
def test_unused_parameters_broadcast_outputs_and_input_grads(pool2, counts_on_host):
    """The "used" counts ride in the buckets (CPU) or are summed apart on the host (what a
    GPU run does, so that reading them does not wait for the GPU): the same gradients."""
    x, y = _data(steps=1)[0]

    def run(counts_on_host):
        P = sbp.placement("cpu", [0, 1])
        torch.manual_seed(0)
        model = Branches().double().to_global(P, B)
        xg = _global(x, P).requires_grad_()
        out, aux = model(xg)
        state = sbp.nn.fast_path.state(model)
        assert state._reducer.counts_on_host is False  # (chosen by the device: CPU)
        state._reducer.counts_on_host = counts_on_host
        loss = F.cross_entropy(out, _global(y, P)) + aux
        loss.backward()
        grads = {
            n: None if p.grad is None else p.grad.full_tensor() for n, p in model.named_parameters()
        }
        return state.last_path, grads, xg.grad.full_tensor(), tuple(aux.sbp)

    path, grads, xgrad, aux_sbp = pool2.run(run, counts_on_host)[0]
    torch.manual_seed(0)
    model = Branches().double()
    xr = x.clone().requires_grad_()
    out, aux = model(xr)
    (F.cross_entropy(out, y) + aux).backward()
    assert path == "fast" and aux_sbp == (B,)
    for name, p in model.named_parameters():
        if p.grad is None:
            assert grads[name] is None, name
        else:
            assert torch.allclose(grads[name], p.grad, rtol=1e-12, atol=1e-14), name
    assert grads["unused.weight"] is None
    assert torch.allclose(xgrad, xr.grad, rtol=1e-12, atol=1e-14)


def test_bucket_size_is_checked():
    """A bucket size that is not a positive number of megabytes names `bucket_mb` (before:
    int() of "25" * 10**6 raised ValueError, inf OverflowError, and 0 and -1 passed)."""
    import sbp.nn

    model = MLP().double().to_global(sbp.placement("cpu", [0]), B)
    for bad in ("25", float("nan"), float("inf"), 0, -1, True):
        with pytest.raises(sbp.SbpError, match="bucket_mb"):
            sbp.nn.data_parallel(model, bucket_mb=bad)
    sbp.nn.data_parallel(model, bucket_mb=0.001)  # (about one kilobyte: a bucket per layer)
    assert sbp.nn.fast_path.state(model).bucket_bytes == int(0.001 * 2**20)
    x, y = _data(steps=1)[0]
    _loss(model, x, y, sbp.placement("cpu", [0])).backward()
    plain = MLP().double()
    plain.load_state_dict({k: v.full_tensor() for k, v in model.state_dict().items()})
    F.cross_entropy(plain(x), y).backward()
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-12, atol=1e-14)


def test_compile_option_is_checked():
    import sbp.nn

    model = MLP().to_global(sbp.placement("cpu", [0]), B)
    with pytest.raises(sbp.SbpError, match="compile"):
        sbp.nn.data_parallel(model, compile="max-autotune")
    sbp.nn.data_parallel(model, compile={"mode": "default"})
    assert sbp.nn.fast_path.state(model).compile_options == {"mode": "default"}
    sbp.nn.data_parallel(model, compile=False)
    assert sbp.nn.fast_path.state(model).compile_options is None


def _adapting_batch_norm(x, compile_local, batch_norm):
    """A model in eval mode whose BatchNorm is in train mode (test-time adaptation of its
    statistics), one forward without grad."""
    import warnings

    import sbp.nn

    P = sbp.placement("cpu", [0, 1])
    torch.manual_seed(0)
    model = ConvBN().double().to_global(P, B)
    options = {"backend": "aot_eager"} if compile_local else None
    sbp.nn.data_parallel(model, batch_norm=batch_norm, compile=options)
    model.eval()
    model.bn.train()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        out = model(_global(x, P))
    state = sbp.nn.fast_path.state(model)
    return state.last_path, out.full_tensor(), model.bn.running_mean.to_local()


@pytest.mark.parametrize("compile_local", [False, True])
def test_batch_norm_in_train_mode_inside_a_model_in_eval_mode(pool2, compile_local):
    """What the checking pass recorded decides, not the model's own mode: logical BatchNorm
    equals one process (compiled too: the modules' logical forward), and per-shard running
    statistics are the first rank's on both ranks."""
    x, _ = _data(n=8, steps=1, shape=(3, 5, 5), classes=4)[0]
    torch.manual_seed(0)
    ref = ConvBN().double()
    ref.eval()
    ref.bn.train()
    shard = copy.deepcopy(ref)
    with torch.no_grad():
        want, _ = ref(x), shard(x[:4])
    logical = pool2.run(_adapting_batch_norm, x, compile_local, "global")
    for path, out, running_mean in logical:
        assert path == "fast"
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(running_mean, ref.bn.running_mean, rtol=1e-12, atol=1e-12)
    for _, _, running_mean in pool2.run(_adapting_batch_norm, x, compile_local, "local"):
        torch.testing.assert_close(running_mean, shard.bn.running_mean, rtol=1e-12, atol=1e-12)


class _Twin(torch.nn.Module):
    """MLP's hidden layers (the same modules) under a head of its own."""

    def __init__(self, mlp):
        super().__init__()
        self.layers = mlp.layers
        self.head = torch.nn.Linear(16, 3)

    forward = MLP.forward


def _twin_steps(a, b, data, P):
    """SGD steps on two models sharing their hidden layers: both in one loss, then each
    alone; every parameter after each step, as logical tensors."""
    params = list({id(p): p for p in [*a.parameters(), *b.parameters()]}.values())
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)

    def loss(model, x, y):
        if P is None:
            return F.cross_entropy(model(x), y)
        return _loss(model, x, y, P)

    seen = []
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        models = [(a, b), (b,), (a,), (a, b)][i % 4]
        sum(loss(m, x, y) for m in models).backward()
        opt.step()
        seen.append([(p.full_tensor() if P is not None else p.detach()).clone() for p in params])
    return seen


@pytest.mark.parametrize("world", [1, 2])
def test_two_models_sharing_parameters(pool2, world):
    """Two data-parallel models sharing layers, used together and apart: each shared
    parameter gets both models' gradients, once each, as in one process (on one rank, the
    gradients of both models' local leaves are summed when the optimizer reads them)."""
    data = _data(steps=6)

    def run(world):
        P = sbp.placement("cpu", list(range(world)))
        torch.manual_seed(0)
        a = MLP().double()
        b = _Twin(a).double()
        a.to_global(P, B)
        b.to_global(P, B)
        seen = _twin_steps(a, b, data, P)
        paths = {sbp.nn.fast_path.state(m).last_path for m in (a, b)}
        return seen, paths

    got, paths = pool2.run(run, world)[0]
    torch.manual_seed(0)
    a = MLP().double()
    want = _twin_steps(a, _Twin(a).double(), data, None)
    assert paths == {"fast"}
    for g, w in zip(got, want, strict=True):
        assert _rel(g, w) < 1e-12


def test_gradients_after_zero_grad_and_a_new_reducer():
    """zero_grad, then a reducer made anew over the same leaves (a new bucket size): the
    next backward's gradients are that backward's alone (world of one)."""
    data = _data(steps=2)
    P = sbp.placement("cpu", [0])
    torch.manual_seed(0)
    model = MLP().double()
    ref = copy.deepcopy(model)
    model.to_global(P, B)
    (x0, y0), (x1, y1) = data
    _loss(model, x0, y0, P).backward()
    model.zero_grad()  # (sbp's: the leaves' gradients are marked dropped)
    sbp.nn.data_parallel(model, bucket_mb=1)
    _loss(model, x1, y1, P).backward()
    F.cross_entropy(ref(x1), y1).backward()
    assert sbp.nn.fast_path.state(model).last_path == "fast"
    got = [p.grad.full_tensor() for p in model.parameters()]
    assert _rel(got, [q.grad for q in ref.parameters()]) < 1e-12


def _accumulate_op_by_op():
    """Three backward passes onto the same `.grad`s op by op: the collectives of each."""
    import sbp.nn

    P = sbp.placement("cpu", [0, 1])
    torch.manual_seed(0)
    model = MLP().double().to_global(P, B)
    sbp.nn.data_parallel(model, fast=False)
    calls = []
    for x, y in _data(steps=3):
        with sbp.comm_stats() as st:
            _loss(model, x, y, P).backward()
        calls.append(dict(st.by_kind))
    grads = [(p.grad.full_tensor(), tuple(p.grad.sbp)) for p in model.parameters()]
    return calls, grads


def test_gradient_accumulation_op_by_op_stays_bucketed(pool2):
    """An in-place op keeps its tensor's layout, so accumulating a partial gradient into the
    broadcast `.grad` of an earlier backward would reduce each gradient on its own; the old
    gradient is relabelled partial first, so every backward ends in one flat all-reduce,
    and the sums equal one process."""
    torch.manual_seed(0)
    model = MLP().double()
    for x, y in _data(steps=3):
        F.cross_entropy(model(x), y).backward()
    for calls, grads in pool2.run(_accumulate_op_by_op):
        assert [c.get("all_reduce") for c in calls] == [1, 1, 1], calls
        for (got, layout), p in zip(grads, model.parameters(), strict=True):
            assert layout == (B,)
            torch.testing.assert_close(got, p.grad, rtol=1e-12, atol=1e-12)


def _rebinding_steps(model, data, P, compiled):
    """Train, rebinding parameters between steps as torch's own paths do: requires_grad
    set or turned off and on again, `.data` replaced, `detach_`, `torch.utils.swap_tensors`
    (the same objects, holding other tensors), requires_grad turned off by torch's C++
    (`torch.detach_`, the unbound method), `set_` to another tensor. Returns the losses and
    parameters."""
    import sbp.nn

    as_model = (lambda t: t) if P is None else (lambda t: sbp.to_global(t, P, B))
    if P is not None:
        model.to_global(P, B)
        sbp.nn.data_parallel(model)
    run = torch.compile(model, backend="aot_eager") if compiled else model
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    losses = []
    for i, (x, y) in enumerate(data):
        if i == 1:
            params[0].requires_grad_(False)
        elif i == 2:
            params[0].requires_grad = True
            params[1].requires_grad = False
        elif i == 3:
            params[1].requires_grad_()
            params[2].data = as_model(torch.full(tuple(params[2].shape), 0.03).double())
        elif i == 4:
            params[3].detach_()
        elif i == 5:
            new = as_model(torch.full(tuple(params[4].shape), -0.02).double())
            torch.utils.swap_tensors(params[4], new.requires_grad_())
        elif i == 6:  # (the swapped parameter is still watched)
            params[4].requires_grad_(False)
            params[2].data = as_model(torch.full(tuple(params[2].shape), 0.01).double())
        elif i == 7:  # (torch's C++ turns requires_grad off: no Python write to see)
            torch.Tensor.requires_grad_(params[5], False)
        elif i == 8:
            torch.detach_(params[6])
        elif i == 9:  # (the local tensor object stays, its storage changes)
            with torch.no_grad():
                params[2].set_(as_model(torch.full(tuple(params[2].shape), 0.02).double()))
        if P is not None:
            x, y = _global(x, P), _global(y, P)
        loss = F.cross_entropy(run(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item() if P is None or sbp.env.get_rank() in P else None)
    got = [p.full_tensor() if P is not None else p.detach() for p in params]
    return losses, got, None if P is None else sbp.nn.fast_path.state(model).last_path


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("compiled", [False, True])
def test_parameters_rebound_between_steps(request, world, compiled):
    """The fast path and the optimizer keep what they found in the parameters from step to
    step, and look again only when a global tensor was rebound (`sbp.counters.COUNTS.rebinds`):
    every way torch rebinds a parameter between steps is seen, and training equals one
    process's (a frozen parameter's leaf remade in a world of two raised in backward: the
    kept leaves' hooks returned False for the old reducer). (A world of
    one on its own pool: traced on a rank outside the placement, the parameters get the
    weak references torch's tracing keeps, and torch.utils.swap_tensors refuses them.)"""
    data = _data(steps=11)

    def run():
        torch.manual_seed(0)
        P = sbp.placement("cpu", list(range(world)))
        return _rebinding_steps(MLP().double(), data, P, compiled)

    for losses, params, path in request.getfixturevalue(f"pool{world}").run(run):
        torch.manual_seed(0)
        want_losses, want, _ = _rebinding_steps(MLP().double(), data, None, compiled)
        assert path == "fast"
        assert max(abs(a - b) for a, b in zip(losses, want_losses, strict=True)) < 1e-12
        assert _rel(params, want) < 1e-12


def _switching_steps(data, P):
    """Two steps op by op, then two on the fast path, then one op by op: the optimizer's
    kept swap, made when no reducer held the gradients, must see the reducer that holds
    them from the third step (on one rank, in its local leaves)."""
    import sbp.nn

    torch.manual_seed(0)
    model = MLP().double()
    if P is not None:
        model.to_global(P, B)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    for i, (x, y) in enumerate(data):
        if P is not None:
            sbp.nn.data_parallel(model, fast=i in (2, 3))
            x, y = _global(x, P), _global(y, P)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.full_tensor() if P is not None else p.detach() for p in params]


@pytest.mark.parametrize("world", [1, 2])
def test_the_fast_path_switched_on_between_steps(request, world):
    """Training that switches the fast path on and off between steps equals one process
    (in a world of one, the step would find no gradient if the reducer's claim on the
    parameters went uncounted: `sbp.counters.COUNTS.rebinds`)."""
    data = _data(steps=5)

    def run():
        return _switching_steps(data, sbp.placement("cpu", list(range(world))))

    want = _switching_steps(data, None)
    for got in request.getfixturevalue(f"pool{world}").run(run):
        assert _rel(got, want) < 1e-12


class _NormedMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.BatchNorm1d(6))
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def _inference_mode_outputs(x, P, modes):
    """The model's outputs in eval mode under each of `modes` in turn, and (global) the
    paths taken and the warnings that a call runs op by op."""
    torch.manual_seed(0)
    model = _NormedMLP().double().eval()
    if P is not None:
        model.to_global(P, B)
    outs, paths = [], []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for mode in modes:
            with {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode]():
                out = model(_global(x, P) if P is not None else x)  # (the input made inside)
                outs.append(out.full_tensor() if P is not None else out)
            if P is not None:
                paths.append(sbp.nn.fast_path.state(model).last_path)
    said = [str(w.message) for w in seen if "runs op by op" in str(w.message)]
    return outs, paths, said


@pytest.mark.parametrize(
    "modes", [("inference_mode",) * 2, ("no_grad", "inference_mode")], ids=["alone", "after"]
)
@pytest.mark.parametrize("world", [1, 2])
def test_inference_mode_with_the_input_made_inside(request, world, modes):
    """The fast path's first call keeps each global input's version to undo its writes;
    an inference tensor has none ("Inference tensors do not track version counter"), nor
    has an output of the local run (a layout checked under no_grad and run under
    inference_mode: it crashed). Under inference_mode `F.linear` reaches sbp whole, as
    torch's composite op: the check watches the ops of its definition (it ran op by op)."""
    x = _data(steps=1)[0][0]
    want, _, _ = _inference_mode_outputs(x, None, modes)

    def run():
        return _inference_mode_outputs(x, sbp.placement("cpu", list(range(world))), modes)

    for got, paths, said in request.getfixturevalue(f"pool{world}").run(run)[:world]:
        assert paths == ["fast"] * len(modes) and said == []
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-14)


def test_no_sync_of_a_module_that_is_not_global_is_named():
    """A plain module has no fast path to pause: `PlacementError` (an `SbpError`), not a
    bare ValueError."""
    with pytest.raises(sbp.PlacementError, match="has no data-parallel fast path"):
        with sbp.nn.no_sync(torch.nn.Linear(2, 2)):
            pass


class _Renormed(torch.nn.Module):
    def forward(self, w):
        return torch.renorm(w, 2, 0, 0.5)


def _parametrized(kind: str) -> torch.nn.Module:
    """A small MLP whose first weight is parametrized: by torch.nn.utils.parametrizations,
    or by `torch.renorm`, an op with no SBP rule."""
    from torch.nn.utils import parametrizations, parametrize

    if kind == "renorm":
        first = torch.nn.Linear(8, 8)
        parametrize.register_parametrization(first, "weight", _Renormed())
    else:
        first = getattr(parametrizations, kind)(torch.nn.Linear(8, 8))
    return torch.nn.Sequential(first, torch.nn.Tanh(), torch.nn.Linear(8, 3))


@pytest.mark.filterwarnings("ignore:sbp. no SBP rule for aten.renorm")
@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm", "orthogonal", "renorm"])
def test_parametrized_weights_take_the_fast_path(pool2, kind):
    """A parametrization computes the weight from broadcast parameters alone (`mv`, `vdot`,
    `tril`, `matrix_exp`, `_weight_norm_interface`, spectral_norm's `normalize(out=_u)`):
    every rank computes the same weight, so the local run is exact, also for an op with no
    rule (before: op by op, for an op with no rule, a norm's own rule or an `out=` write). spectral_norm's power
    iteration updates its buffers `_u` and `_v` on every training call, as in one process."""
    data = _data(n=7)
    make = functools.partial(_parametrized, kind)
    want = _train(make, None, None, None, data)
    for losses, params, buffers, paths, _ in pool2.run(
        _train, make, sbp.placement("cpu", [0, 1]), S0, True, data
    ):
        assert paths == ["fast"] * len(data)
        assert losses == pytest.approx(want[0], rel=1e-12)
        for got, ref in zip([*params, *buffers], [*want[1], *want[2]], strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


def _deep_copied_after_a_step(data, batch_norm):
    import sbp.nn

    P = sbp.placement("cpu", [0, 1])
    torch.manual_seed(0)
    model = ConvBN().double().to_global(P, B)
    sbp.nn.data_parallel(model, batch_norm=batch_norm)
    (x, y), rest = data[0], data[1:]
    _loss(model, x, y, P).backward()
    before = [p.full_tensor().clone() for p in model.parameters()]
    copied = copy.deepcopy(model)
    assert sbp.nn.fast_path.state(copied) is not sbp.nn.fast_path.state(model)
    opt = torch.optim.SGD(copied.parameters(), lr=0.1)
    for x, y in rest:
        opt.zero_grad()
        _loss(copied, x, y, P).backward()
        opt.step()
    grads = [p.grad.full_tensor() for p in copied.parameters()]
    unchanged = all(
        torch.equal(p.full_tensor(), b) for p, b in zip(model.parameters(), before, strict=True)
    )
    return sbp.nn.fast_path.state(copied).last_path, grads, _gather(copied), unchanged


@pytest.mark.parametrize("batch_norm", ["global", "local"])
def test_a_deep_copy_of_a_model_trains_on_its_own(pool2, batch_norm):
    """`copy.deepcopy` of a model with the fast path gets a fresh one (before: the copy's
    backward filled the original's gradients); the copy's training equals one process's
    (per-shard BatchNorm: each half of the batch on its own, as torch DDP)."""
    data = _data(n=6, steps=3, shape=(3, 5, 5), classes=4)
    torch.manual_seed(0)
    ref = ConvBN().double()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in data[1:]:
        opt.zero_grad()
        if batch_norm == "global":
            F.cross_entropy(ref(x), y).backward()
        else:  # two shards of three, each its own statistics; the loss over all six
            loss = sum(
                F.cross_entropy(ref(x[i : i + 3]), y[i : i + 3], reduction="sum") for i in (0, 3)
            )
            (loss / 6).backward()
        opt.step()
    for path, grads, params, unchanged in pool2.run(_deep_copied_after_a_step, data, batch_norm):
        assert path == "fast" and unchanged
        assert _rel(grads, [p.grad for p in ref.parameters()]) < 1e-12
        assert _rel(params, [p.detach() for p in ref.parameters()]) < 1e-12
