"""The data-parallel fast path and the overlapped gradient reducer (sbp.nn.fast_path).

Each test trains or differentiates the same model three ways where it can: on local
shards (the fast path), op by op (`sbp.nn.data_parallel(model, fast=False)`), and in
one process on the logical batch; float64 so that 1e-12 separates semantics from
rounding.
"""

import contextlib
import copy
import functools
import sys
import types
import warnings

import pytest
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
    waiting, claim = p._waiting_grad, p._waiting_in
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


def test_declines_a_tensor_parallel_weight(pool2):
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
    assert paths == ["per-op", "per-op"]
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


@pytest.mark.parametrize("world", [1, 2])
def test_batch_norm_cumulative_average_on_the_fast_path(pool2, world):
    data = _data(n=6, steps=3, shape=(3, 5, 5), classes=4)
    if world == 1:  # in this process: a world of one (a rank outside has no number to read)
        fast, per_op = _fast_and_per_op(_conv_bn_cumulative, 1, S0, data)
    else:
        fast, per_op = pool2.run(_fast_and_per_op, _conv_bn_cumulative, world, S0, data)[0]
    ref = _train(_conv_bn_cumulative, None, None, None, data)
    assert fast[3] == ["fast"] * 3 and per_op[3] == ["per-op"] * 3
    for got in (fast, per_op):
        for a, b in zip(got[0], ref[0], strict=True):
            assert abs(a - b) <= 1e-12 * abs(b)
        assert _rel(got[1], ref[1]) < 1e-12
        assert _rel(got[2], ref[2]) < 1e-12  # running statistics and num_batches_tracked


@pytest.mark.parametrize("path", ["fast", "per-op", "compiled", "compile-local", "compile-model"])
def test_per_shard_batch_norm_equals_torch_ddp(pool2, path):
    """The fast path, op by op (`sbp::shard_batch_norm`), torch.compile (the same op in
    the graph, one broadcast of the running statistics) and the fast path with its local
    forward compiled (torch's BatchNorm in the graph) all compute what torch DDP does."""
    data = _data(n=8, steps=3, shape=(3, 8, 8), classes=4)

    def run():
        import torch.distributed as dist

        P = sbp.placement("cpu", [0, 1])
        got = _train(
            ConvBN,
            P,
            S0,
            path in ("fast", "compile-local", "compile-model"),
            data,
            batch_norm="local",
            compiled={"compiled": True, "compile-model": "aot_eager"}.get(path, False),
            compile_local={"backend": "aot_eager"} if path == "compile-local" else None,
        )
        torch.manual_seed(0)
        ddp = torch.nn.parallel.DistributedDataParallel(ConvBN().double())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
        for x, y in data:
            loss = F.cross_entropy(ddp(_shard(x, P, S0)), _shard(y, P, S0))
            opt.zero_grad()
            loss.backward()
            opt.step()
        buffers = [b.clone() for b in ddp.module.buffers()]
        for b in buffers:
            dist.broadcast(b, 0)  # torch DDP's buffers are rank 0's (it broadcasts them)
        return got, [p.detach() for p in ddp.module.parameters()], buffers

    expected_path = {"per-op": "per-op", "compiled": "traced"}.get(path, "fast")
    for got, ddp_params, ddp_buffers in pool2.run(run):  # every rank's buffers: rank 0's
        assert got[3] == [expected_path] * 3
        assert _rel(got[1], ddp_params) < 1e-12
        for a, b in zip(got[2], ddp_buffers, strict=True):
            assert torch.allclose(a.double(), b.double(), rtol=1e-12, atol=1e-12)


def test_batch_norm_mode_switches_back(pool2):
    """batch_norm="local" gives the BatchNorm modules the per-shard forward; "global" gives
    them torch's back: op by op, the logical batch's statistics again, as one process."""
    x, _ = _data(n=8, steps=1, shape=(3, 8, 8), classes=4)[0]

    def run():
        import sbp.nn

        P = sbp.placement("cpu", [0, 1])
        torch.manual_seed(0)
        model = ConvBN().double().to_global(P, B)
        sbp.nn.data_parallel(model, fast=False, batch_norm="local")
        installed = "forward" in model.bn.__dict__
        sbp.nn.data_parallel(model, batch_norm="global")
        out = model(_global(x, P))
        still = "forward" in model.bn.__dict__
        return installed, still, out.full_tensor(), model.bn.running_var.to_local()

    torch.manual_seed(0)
    ref = ConvBN().double()
    want = ref(x)
    for installed, still, out, running_var in pool2.run(run):
        assert installed and not still
        assert torch.allclose(out, want, rtol=1e-12, atol=1e-12)
        assert torch.allclose(running_var, ref.bn.running_var, rtol=1e-12, atol=1e-12)


def test_compiled_model_follows_a_change_of_batch_norm_mode(pool2):
    """A compiled model recompiles when its BatchNorm mode changes: per shard, then logical,
    each equal to its reference (torch DDP's per-shard numbers; one process)."""
    x, _ = _data(n=8, steps=1, shape=(3, 8, 8), classes=4)[0]

    def run():
        import sbp.nn

        P = sbp.placement("cpu", [0, 1])
        torch.manual_seed(0)
        model = ConvBN().double().to_global(P, B)
        compiled = torch.compile(model, backend="aot_eager")
        sbp.nn.data_parallel(model, batch_norm="local")
        local = compiled(_global(x, P)).to_local()
        sbp.nn.data_parallel(model, batch_norm="global")
        logical = compiled(_global(x, P)).full_tensor()
        torch._dynamo.reset()
        return local, logical

    torch.manual_seed(0)
    ref = ConvBN().double()
    for rank, (local, logical) in enumerate(pool2.run(run)):
        part = ConvBN().double()
        part.load_state_dict(ref.state_dict())
        assert torch.allclose(local, part(x[4 * rank : 4 * rank + 4]), rtol=1e-12, atol=1e-12)
        assert torch.allclose(logical, ref(x), rtol=1e-12, atol=1e-12)


def _per_shard_with_an_empty_shard(path):
    import sbp.nn

    P = sbp.placement("cpu", [0, 1, 2, 3])
    x, y = _data(n=3, steps=1, shape=(3, 8, 8), classes=4)[0]  # rank 3's part is empty
    torch.manual_seed(0)
    model = ConvBN().double().to_global(P, B)
    sbp.nn.data_parallel(model, fast=path == "fast", batch_norm="local")
    run = torch.compile(model, backend="aot_eager") if path == "compiled" else model
    out = run(_global(x, P))
    F.cross_entropy(out, _global(y, P)).backward()
    grad = model.bn.weight.grad.to_local()
    return out.to_local().detach(), model.bn.running_mean.to_local(), grad


@pytest.mark.parametrize("path", ["fast", "per-op", "compiled"])
def test_per_shard_batch_norm_with_an_empty_shard(pool4, path):
    """An uneven batch leaves a rank nothing: its shard has no statistics and contributes no
    gradient; the others normalise theirs, every rank ends with the first rank's running
    statistics, and the weight gradient is that of the logical loss."""
    x, y = _data(n=3, steps=1, shape=(3, 8, 8), classes=4)[0]
    torch.manual_seed(0)
    ref = ConvBN().double()
    parts, expected_outs = [], []
    for r in range(3):  # one sample each; the loss is the mean over all three
        part = ConvBN().double()
        part.load_state_dict(ref.state_dict())
        out = part(x[r : r + 1])
        (F.cross_entropy(out, y[r : r + 1]) / 3).backward()
        parts.append(part)
        expected_outs.append(out.detach())
    want_grad = sum(p.bn.weight.grad for p in parts)
    results = pool4.run(_per_shard_with_an_empty_shard, path, timeout=300)
    for rank, (out, running_mean, grad) in enumerate(results):
        if rank < 3:
            assert torch.allclose(out, expected_outs[rank], rtol=1e-12, atol=1e-12)
        else:
            assert out.shape[0] == 0
        assert torch.allclose(running_mean, parts[0].bn.running_mean, rtol=1e-12, atol=1e-14)
        assert torch.allclose(grad, want_grad, rtol=1e-10, atol=1e-12)


def _logical_compiled_with_an_empty_shard(backend):
    import sbp.nn

    P = sbp.placement("cpu", [0, 1, 2, 3])
    x, y = _data(n=3, steps=1, shape=(3, 8, 8), classes=4)[0]
    torch.manual_seed(0)
    model = ConvBN().double().to_global(P, B)
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        out = torch.compile(model, backend=backend)(_global(x, P))
        F.cross_entropy(out, _global(y, P)).backward()
    torch._dynamo.reset()
    grads = [p.grad.full_tensor() for p in model.parameters()]
    state = sbp.nn.fast_path.state(model)
    return state.last_path, out.full_tensor().detach(), grads, model.bn.running_var.to_local()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_logical_batch_norm_compiled_with_an_empty_shard(pool4, backend):
    """Three samples over four ranks: the last rank's shard is empty. Inductor's own
    convolution backward fails on an empty batch (plain torch too), on that rank alone,
    and the others waited: a layout that leaves a rank no samples runs its local forward
    eagerly, on every rank alike; equal to one process."""
    x, y = _data(n=3, steps=1, shape=(3, 8, 8), classes=4)[0]
    torch.manual_seed(0)
    ref = ConvBN().double()
    want = ref(x)
    F.cross_entropy(want, y).backward()
    results = pool4.run(_logical_compiled_with_an_empty_shard, backend, timeout=300)
    for path, out, grads, running_var in results:
        assert path == "fast"
        assert torch.allclose(out, want.detach(), rtol=1e-12, atol=1e-12)
        assert _rel(grads, [p.grad for p in ref.parameters()]) < 1e-12
        assert torch.allclose(running_var, ref.bn.running_var, rtol=1e-12, atol=1e-14)


def _per_shard_on_two_of_four(path):
    import sbp.nn

    P = sbp.placement("cpu", [0, 1])
    x, _ = _data(n=8, steps=1, shape=(3, 8, 8), classes=4)[0]
    torch.manual_seed(0)
    model = ConvBN().double().to_global(P, B)
    sbp.nn.data_parallel(model, fast=False, batch_norm="local")
    run = torch.compile(model, backend="aot_eager") if path == "compiled" else model
    out = run(_global(x, P))
    inside = sbp.env.get_rank() in P
    return (out.to_local().detach() if inside else None), model.bn.running_mean.to_local()


@pytest.mark.parametrize("path", ["per-op", "compiled"])
def test_per_shard_batch_norm_with_ranks_outside_the_placement(pool4, path):
    """Ranks 2 and 3 hold nothing of a placement of ranks 0 and 1: they take no part in the
    statistics' broadcast, and nobody waits for them."""
    x, _ = _data(n=8, steps=1, shape=(3, 8, 8), classes=4)[0]
    torch.manual_seed(0)
    ref = ConvBN().double()
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    first = None
    for rank, (out, running_mean) in enumerate(pool4.run(_per_shard_on_two_of_four, path)):
        if rank < 2:
            part = ConvBN().double()
            part.load_state_dict(state)
            assert torch.allclose(out, part(x[4 * rank : 4 * rank + 4]), rtol=1e-12, atol=1e-12)
            first = part.bn.running_mean if rank == 0 else first
            assert torch.allclose(running_mean, first, rtol=1e-12, atol=1e-14)
        else:
            assert out is None and running_mean.numel() == 0


def test_per_shard_statistics_reach_every_rank(pool2):
    """The first rank's running statistics are copied to the others while backward runs:
    every rank holds them after backward, state_dict gives them after a forward alone, and
    a load_state_dict after a forward is not overwritten by the copy still in flight."""
    data = _data(n=8, steps=2, shape=(3, 8, 8), classes=4)

    def run():
        import sbp.nn

        P = sbp.placement("cpu", [0, 1])
        torch.manual_seed(0)
        model = ConvBN().double().to_global(P, B)
        sbp.nn.data_parallel(model, batch_norm="local")
        (x1, y1), (x2, _) = data
        F.cross_entropy(model(_global(x1, P)), _global(y1, P)).backward()
        after_backward = [b.to_local().clone() for b in model.buffers()]
        model(_global(x2, P))  # no backward
        state = {k: v.clone() for k, v in model.state_dict().items()}
        saved = {k: v.to_local().clone() for k, v in state.items()}
        model(_global(x1, P))  # a forward, then a load: the loaded values stay
        model.load_state_dict(state)
        sbp.nn.fast_path.state(model).settle_buffers()
        loaded = [model.bn.running_mean.to_local(), model.bn.running_var.to_local()]
        return after_backward, [saved["bn.running_mean"], saved["bn.running_var"]], loaded

    results = pool2.run(run)
    torch.manual_seed(0)
    ref = ConvBN().double()
    first_rank_part = [x[:4] for x, _ in data]  # rank 0's shard of each batch
    ref(first_rank_part[0])
    ref_after_backward = [b.clone() for b in ref.buffers()]
    ref(first_rank_part[1])
    ref_saved = [ref.bn.running_mean, ref.bn.running_var]
    for after_backward, saved, loaded in results:  # every rank
        assert [a.dtype for a in after_backward] == [b.dtype for b in ref_after_backward]
        assert _rel(after_backward[:2], ref_after_backward[:2]) < 1e-12
        assert torch.equal(after_backward[2], ref_after_backward[2])  # num_batches_tracked
        assert _rel(saved, ref_saved) < 1e-12
        assert _rel(loaded, ref_saved) < 1e-12


def _loss_divisor(labels):
    """Mean cross-entropy of split logits; labels are made global first, then maybe edited."""
    P = sbp.placement.all("cpu")
    logits, y = (
        torch.randn(7, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3)),
        labels,
    )
    gx, gy = sbp.to_global((_shard(logits, P, S0), _shard(y, P, S0)), P, S0)
    out = {}
    with sbp.comm_stats() as st:
        loss = F.cross_entropy(gx, gy)
    out["before"] = (st.calls, loss.full_tensor().item())
    gy[0] = -100  # an ignored label now: the range learnt by to_global no longer holds
    with sbp.comm_stats() as st:
        loss = F.cross_entropy(gx, gy)
    out["after"] = (st.calls, loss.full_tensor().item())
    return out


@pytest.mark.parametrize("hit", [False, True])
def test_cross_entropy_divisor_without_a_collective(pool2, hit):
    """Labels whose range (learnt by to_global) excludes ignore_index: the divisor of the mean
    is their number, no all-reduce; otherwise, or once the labels change, the all-reduce."""
    logits = torch.randn(7, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    y = torch.tensor([1, 4, 0, 2, 3, 3, 1])
    if hit:
        y[5] = -100  # on the second rank only
    edited = y.clone()
    edited[0] = -100
    for r in pool2.run(_loss_divisor, y):
        calls, value = r["before"]
        assert calls == (1 if hit else 0)
        assert value == pytest.approx(F.cross_entropy(logits, y).item(), abs=1e-12)
        calls, value = r["after"]
        assert calls == 1
        assert value == pytest.approx(F.cross_entropy(logits, edited).item(), abs=1e-12)


_CROSS_ENTROPY = F.cross_entropy


class LossInside(torch.nn.Module):
    """Returns its loss of the labels it is given, as transformers' models do with
    `labels=`: the fast path computes it over the logical batch in the local run."""

    def __init__(self, kind="mean"):
        super().__init__()
        self.body, self.kind = MLP(), kind
        self.register_buffer("class_weight", torch.tensor([1.0, 2.0, 0.5]))

    def forward(self, x, y, items=None):
        logits = self.body(x)
        if self.kind == "items":  # transformers' num_items_in_batch: a sum over a count
            loss = F.cross_entropy(logits, y, reduction="sum", ignore_index=0) / items
        elif self.kind == "mixed":  # linear in two losses
            loss = 0.25 * F.cross_entropy(logits, y) + F.nll_loss(F.log_softmax(logits, 1), y) / 2
        elif self.kind == "local size":  # a number read from the batch: the local run's differs
            loss = F.cross_entropy(logits, y, reduction="sum") / x.shape[0]
        elif self.kind == "weight":
            loss = F.cross_entropy(logits, y, weight=self.class_weight)
        elif self.kind == "nll":
            loss = F.nll_loss(F.log_softmax(logits, 1), y, ignore_index=1)
        elif self.kind == "sum":
            loss = F.cross_entropy(logits, y, reduction="sum")
        elif self.kind == "captured":  # not looked up on torch.nn.functional: a mode finds it
            loss = _CROSS_ENTROPY(logits, y, ignore_index=2)
        elif self.kind == "legacy":  # the deprecated flags meaning a mean
            loss = F.cross_entropy(logits, y, size_average=True)
        elif self.kind == "device":  # under another torch function mode, which calls it again
            with torch.device("cpu"):
                loss = F.cross_entropy(logits, y, ignore_index=0)
        else:
            loss = F.cross_entropy(logits, y, ignore_index=0)
        return logits, loss


def _train_loss_inside(kind, world, fast):
    """Steps of `LossInside` trained on its own loss: losses, parameters, paths, and the
    collectives of the last step's forward."""
    import sbp.nn

    torch.manual_seed(0)
    model = LossInside(kind).double()
    P = None if world is None else sbp.placement("cpu", list(range(world)))
    if P is not None:
        model.to_global(P, B)
        sbp.nn.data_parallel(model, fast=fast)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, paths, kinds = [], [], {}
    for x, y in _data(steps=3):
        if P is not None:
            x, y = _global(x, P), _global(y, P)
        items = None
        if kind == "items":  # counted over the logical batch, outside, as a Trainer does
            items = (y != 0).sum()
            items = items.to_global(sbp=B) if P is not None else items
        with sbp.comm_stats() as st:
            logits, loss = model(x, y, items)
        kinds = dict(st.by_kind)
        if P is not None:
            paths.append(sbp.nn.fast_path.state(model).last_path)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = _gather(model) if P is not None else [p.detach() for p in model.parameters()]
    return losses, params, paths, kinds


@pytest.mark.filterwarnings("ignore:size_average and reduce args will be deprecated")
@pytest.mark.parametrize(
    "kind", ["mean", "weight", "nll", "sum", "captured", "legacy", "device", "items", "mixed"]
)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_a_loss_inside_the_forward_runs_on_the_fast_path(pool2, pool4, kind, world):
    """The forward returns a cross-entropy (nll) of its labels: after the check, it runs on
    the local tensors, the mean over the logical batch (ignored labels, class weights, an
    uneven split of 10 rows on 4 ranks) with one small all-reduce for its divisor, and
    training equals one process; so do linear functions of losses (a sum over a broadcast
    count, as transformers' num_items_in_batch, or a weighted sum)."""
    ref_losses, ref_params, _, _ = _train_loss_inside(kind, None, None)
    if world == 1:
        results = [_train_loss_inside(kind, 1, True)]
    else:
        results = (pool2 if world == 2 else pool4).run(_train_loss_inside, kind, world, True)
    for losses, params, paths, kinds in results:
        assert paths == ["fast"] * 3
        assert losses == pytest.approx(ref_losses, rel=1e-12)
        assert _rel(params, ref_params) < 1e-12
        divisors = 0 if world == 1 or kind in ("sum", "items") else 2 if kind == "mixed" else 1
        assert kinds == ({"all_reduce": divisors} if divisors else {}), kinds


def test_a_loss_scaled_by_the_batch_size_runs_op_by_op(pool2):
    """`loss / x.shape[0]`: the check reads the logical size, the local run would read its
    own; the first local run's loss differs, so it is undone and the model runs op by op."""
    ref_losses, ref_params, _, _ = _train_loss_inside("local size", None, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = pool2.run(_train_loss_inside, "local size", 2, True)
    for losses, params, paths, _ in results:
        assert paths == ["per-op"] * 3
        assert losses == pytest.approx(ref_losses, rel=1e-12)
        assert _rel(params, ref_params) < 1e-12


def test_a_loss_inside_the_forward_equals_op_by_op(pool2):
    fast = pool2.run(_train_loss_inside, "mean", 2, True)[0]
    per_op = pool2.run(_train_loss_inside, "mean", 2, False)[0]
    assert per_op[2] == ["per-op"] * 3
    assert fast[0] == pytest.approx(per_op[0], rel=1e-12)
    assert _rel(fast[1], per_op[1]) < 1e-12


def test_torch_compile_of_a_model_with_its_loss_inside():
    """The compiled local forward cannot compute the loss over the logical batch: the local
    forward runs eagerly, with a warning, and equals one process. (Op by op, compiled, the
    unused logits' zero gradient would be a plain tensor, which AOT autograd refuses.)"""
    import sbp.nn

    ref_losses, ref_params, _, _ = _train_loss_inside("mean", None, None)
    torch.manual_seed(0)
    P = sbp.placement("cpu", [0])
    model = LossInside().double().to_global(P, B)
    run = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    with pytest.warns(UserWarning, match="computes a loss over the logical batch"):
        for x, y in _data(steps=3):
            logits, loss = run(_global(x, P), _global(y, P))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    assert sbp.nn.fast_path.state(model).last_path == "fast"
    assert losses == pytest.approx(ref_losses, rel=1e-12)
    assert _rel(_gather(model), ref_params) < 1e-12


class HandWrittenMean(torch.nn.Module):
    """A mean written as the batch's sum over its size: the check reads the logical size,
    the local run would read the local one, so it must run op by op."""

    def __init__(self):
        super().__init__()
        self.body = MLP()

    def forward(self, x):
        h = self.body(x)
        return h - (h.sum(0) / h.shape[0]).long().double()


def test_a_hand_written_mean_of_the_batch_runs_op_by_op(pool2):
    data = _data(steps=2)
    ref = _train(HandWrittenMean, None, None, None, data)
    got = pool2.run(_train, HandWrittenMean, sbp.placement("cpu", [0, 1]), S0, True, data)
    for losses, params, _, paths, _ in got:
        assert paths == ["per-op", "per-op"]
        assert losses == pytest.approx(ref[0], rel=1e-12)
        assert _rel(params, ref[1]) < 1e-12


def test_loss_names_are_torch_s_again_after_overlapping_calls_in_two_threads():
    """The names `torch.nn.functional.cross_entropy` / `nll_loss` (and
    `scaled_dot_product_attention`) route each thread's calls to its own handler while any
    thread needs them, and are torch's again after the last."""
    import threading

    from sbp.nn import fast_path

    original, original_nll = F.cross_entropy, F.nll_loss
    original_attention = F.scaled_dot_product_attention
    logits, labels = torch.randn(4, 3), torch.tensor([0, 1, 2, 1])
    seen, a_in, b_in, a_out = {}, threading.Event(), threading.Event(), threading.Event()

    def handler(who):
        def call(loss, *args, **kwargs):
            seen.setdefault(who, []).append(loss is original)
            return loss(*args, **kwargs) * 0

        return call

    def thread_b():
        a_in.wait(10)
        with fast_path._by_name_replaced(handler("B")):
            b_in.set()
            a_out.wait(10)
            seen["B value"] = F.cross_entropy(logits, labels).item()

    t = threading.Thread(target=thread_b)
    t.start()
    with fast_path._by_name_replaced(handler("A")):
        a_in.set()
        b_in.wait(10)
        seen["A value"] = F.cross_entropy(logits, labels).item()
    seen["main after A"] = F.cross_entropy(logits, labels).item()  # B's call still on
    a_out.set()
    t.join()
    assert F.cross_entropy is original and F.nll_loss is original_nll
    assert F.scaled_dot_product_attention is original_attention
    assert seen["A"] == seen["B"] == [True]
    assert seen["A value"] == seen["B value"] == 0
    assert seen["main after A"] == pytest.approx(original(logits, labels).item())


class MakesATrainedFactory(torch.nn.Module):
    """Under global_mode, a factory inside the forward is global in the checking pass too."""

    def __init__(self):
        super().__init__()
        self.body = MLP()

    def forward(self, x):
        scale = torch.ones(3, dtype=x.dtype, requires_grad=True)
        return self.body(x) * scale + torch.arange(3, dtype=x.dtype)


def _factory_in_forward():
    import sbp.nn

    P = sbp.placement("cpu", [0, 1])
    torch.manual_seed(0)
    model = MakesATrainedFactory().double().to_global(P, B)
    x = _global(_data(steps=1)[0][0], P)
    with sbp.global_mode(P):
        out = [model(x).full_tensor() for _ in range(2)]
    return sbp.nn.fast_path.state(model).last_path, out


def test_global_mode_factories_in_the_forward(pool2):
    torch.manual_seed(0)
    model = MakesATrainedFactory().double()
    want = model(_data(steps=1)[0][0])
    for path, outs in pool2.run(_factory_in_forward):
        assert path == "fast"
        for out in outs:
            torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


class ExpandsToTheBatch(torch.nn.Module):
    """Forwards the check alone cannot judge, by `kind`: broadcast values expanded to the
    batch (a ViT's class token) from the input's batch size, or a hard-coded one; the
    batch size read as a number, also where BatchNorm hides it from the outputs (not from
    its running statistics) or an output holds -inf; rows of a zero parameter, equal only
    by chance; a value that differs along the batch (arange); a write into the input; the
    batch's values written into a broadcast buffer (a queue, as MoCo keeps), by assignment
    or added in place."""

    def __init__(self, kind="input"):
        super().__init__()
        self.body, self.kind = MLP(), kind
        self.token = torch.nn.Parameter(torch.randn(1, 3))
        self.slots = torch.nn.Parameter(torch.zeros(10, 3))
        self.register_buffer("types", torch.zeros(1, 8))
        self.register_buffer("queue", torch.zeros(12, 3))
        self.norm = torch.nn.BatchNorm1d(3)

    def forward(self, x):
        kind = self.kind
        n = 10 if kind.startswith("hard-coded") else x.shape[0]  # (10: the logical batch)
        if kind in ("as a number", "with -inf"):
            out = self.body(x) * n + self.token.expand(n, -1)
            return out.masked_fill(torch.ones_like(out, dtype=torch.bool).tril(-9), -1e300)
        if kind == "hidden by BatchNorm":
            return self.norm(self.body(x) * n)
        if kind == "zero rows":
            return self.body(x) + self.slots[:n]
        if kind == "writes its input":
            x.sub_(1.0)
        h = self.body(x + self.types.expand(n, -1))
        if kind == "hard-coded, then BatchNorm":
            h = self.norm(h)
        if kind == "queue":
            self.queue[:n] = h.detach()
        elif kind == "adds into a queue":
            self.queue[:n].add_(h.detach())
        out = torch.cat([self.token.expand(n, -1), h], dim=1)
        if kind == "arange":
            mode = sbp.global_mode(x.placement) if x.is_global else contextlib.nullcontext()
            with mode:
                out = out + torch.arange(n, dtype=x.dtype)[:, None]
        return out


FAST_OR_NOT = {
    "input": "fast",
    "writes its input": "fast",
    "as a number": "per-op",
    "with -inf": "per-op",
    "hidden by BatchNorm": "per-op",
    "zero rows": "per-op",
    "arange": "per-op",
    "queue": "per-op",
    "adds into a queue": "per-op",
}


@pytest.mark.parametrize("kind", sorted(FAST_OR_NOT))
def test_what_the_check_alone_cannot_judge(pool2, kind):
    """Expanded from the input's batch size, values run on the fast path. Other values the
    check refuses (not an expanded view along the batch), or the first local run computes
    other outputs or buffers than the checking pass and is undone: op by op. All equal one
    process (a forward writing into its input too: the check puts the input back)."""
    data = _data(steps=2)
    make = functools.partial(ExpandsToTheBatch, kind)
    ref = _train(make, None, None, None, copy.deepcopy(data))  # (a forward may write into x)
    P = sbp.placement("cpu", [0, 1])
    for losses, params, buffers, paths, _ in pool2.run(_train, make, P, S0, True, data):
        assert paths == [FAST_OR_NOT[kind]] * 2
        assert losses == pytest.approx(ref[0], rel=1e-12)
        assert _rel(params, ref[1]) < 1e-12
        for b, want in zip(buffers, ref[2], strict=True):
            torch.testing.assert_close(b, want, rtol=1e-12, atol=1e-12)


def _why_per_op(kind):
    P = sbp.placement("cpu", [0, 1])
    torch.manual_seed(0)
    model = ExpandsToTheBatch(kind).double().to_global(P, B)
    sbp.nn.data_parallel(model)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model(_global(_data(steps=1)[0][0], P))
    return [str(w.message) for w in seen if "runs op by op" in str(w.message)]


@pytest.mark.parametrize("kind", ["queue", "adds into a queue"])
def test_the_check_itself_refuses_batch_rows_written_into_a_buffer(pool2, kind):
    """Not left to the first local run's comparison (equal values would pass it): the check
    sees the write (`g[index] = value` is no aten op there) or the gathered rows."""
    want = "writes a value laid out as" if kind == "queue" else "needs its inputs moved"
    for messages in pool2.run(_why_per_op, kind):
        assert len(messages) == 1 and want in messages[0], messages


def _hard_coded_batch(x, kind):
    P = sbp.placement("cpu", [0, 1])
    torch.manual_seed(0)
    model = ExpandsToTheBatch(kind).double().to_global(P, B)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        outs = [model(_global(x, P)).full_tensor() for _ in range(2)]
    said = [str(w.message) for w in seen if "runs op by op" in str(w.message)]
    return outs, sbp.nn.fast_path.state(model).last_path, said


@pytest.mark.parametrize("kind", ["hard-coded", "hard-coded, then BatchNorm"])
def test_a_hard_coded_batch_size_runs_op_by_op_on_every_rank(pool2, kind):
    """The check sees the logical batch; the local run's shapes do not fit, on every rank,
    and torch raises there: every rank goes op by op, saying so (before: the error). Also
    where the local run holds collectives (BatchNorm over the batch): the ranks learn that
    all of them left the run through the store, before any meets the verdict's all-reduce."""
    x = _data(steps=1)[0][0]
    torch.manual_seed(0)
    want = ExpandsToTheBatch(kind).double()(x)
    for outs, path, said in pool2.run(_hard_coded_batch, x, kind):
        for out in outs:
            torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
        assert path == "per-op"
        assert len(said) == 1 and "its local run raised RuntimeError" in said[0], said


class FlattensByView(torch.nn.Module):
    """`h.view(h.size(0), -1)` after BatchNorm: torch raises on an empty shard (-1 is then
    any size), on that rank alone, after the BatchNorm's collectives; `constant`: adds a
    constant made global in the forward, which the local run mixes with local tensors."""

    def __init__(self, constant=False):
        super().__init__()
        self.bn, self.fc, self.constant = torch.nn.BatchNorm1d(2), torch.nn.Linear(8, 3), constant

    def forward(self, x):
        h = self.bn(x)
        out = self.fc(h.view(h.size(0), -1))
        if self.constant:
            P = sbp.placement("cpu", [0, 1])
            out = out + sbp.to_global(torch.ones(3, dtype=out.dtype), P, B)
        return out


def _first_run_raising_on_one_rank(x, batch_norm, constant):
    import sbp.nn

    P = sbp.placement("cpu", [0, 1])
    torch.manual_seed(0)
    model = FlattensByView(constant).double().to_global(P, B)
    sbp.nn.data_parallel(model, batch_norm=batch_norm)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = model(_global(x, P))
        out.square().sum().backward()
    said = [str(w.message) for w in seen if "runs op by op" in str(w.message)]
    grads = [p.grad.full_tensor() for p in model.parameters()]
    running = model.bn.running_mean.full_tensor()
    return sbp.nn.fast_path.state(model).last_path, said, out.full_tensor(), grads, running


@pytest.mark.parametrize(
    "batch_norm, n, constant",
    [("local", 1, False), ("global", 1, False), ("global", 4, True)],
    ids=["per-shard BN, empty shard", "logical BN, empty shard", "a global constant"],
)
def test_a_first_local_run_raising_on_some_ranks_runs_op_by_op_on_all(
    pool2, batch_norm, n, constant
):
    """After the BatchNorm's collectives, one rank's local run raises (an empty shard) or
    every rank's does (sbp's PlacementError: a constant made global meets local tensors):
    every rank runs op by op, equal to one process. Before: with per-shard BatchNorm the
    other rank had started the running statistics' broadcast, which met the verdict's
    all-reduce (both waited out the timeout); the PlacementError was raised."""
    x = torch.randn(n, 2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(0)
    ref = FlattensByView().double()
    want = ref(x) + (1 if constant else 0)
    want.square().sum().backward()
    for path, said, out, grads, running in pool2.run(
        _first_run_raising_on_one_rank, x, batch_norm, constant
    ):
        assert path == "per-op" and len(said) == 1, said
        torch.testing.assert_close(out, want.detach(), rtol=1e-12, atol=1e-12)
        assert _rel(grads, [p.grad for p in ref.parameters()]) < 1e-12
        torch.testing.assert_close(running, ref.bn.running_mean, rtol=1e-12, atol=1e-14)


class RaisesInItsFirstLocalRun(MLP):
    """Raises an error sbp raises as it is (a bad index) in its first local run only."""

    raised = False

    def forward(self, x):
        if not x.is_global and not self.raised:
            self.raised = True
            raise sbp.IndexRangeError("an index out of range, found in the local run")
        return super().forward(x)


def test_a_layout_whose_first_local_run_raised_is_checked_again():
    """The next call of that layout brings another batch: it is checked again, with its own
    results to compare the first local run with (not the earlier batch's: they differ,
    and it ran op by op)."""
    P = sbp.placement("cpu", [0])
    torch.manual_seed(0)
    model = RaisesInItsFirstLocalRun().double()
    batches = [x for x, _ in _data(steps=2)]
    model.raised = True
    want = [model(x) for x in batches]
    model.raised = False
    model.to_global(P, B)
    with pytest.raises(sbp.IndexRangeError, match="found in the local run"):
        model(_global(batches[0], P))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no "runs op by op")
        out = model(_global(batches[1], P))
    assert sbp.nn.fast_path.state(model).last_path == "fast"
    torch.testing.assert_close(out.full_tensor(), want[1], rtol=1e-12, atol=1e-12)


class DoublesItsInput(torch.nn.Module):
    """Writes into its input, then fails the first local run: a zero state of a fixed size
    (torch raises on every rank) or the batch size read as a number (outputs differ)."""

    def __init__(self, kind):
        super().__init__()
        self.body, self.kind = MLP(), kind

    def forward(self, x):
        x.mul_(2)
        if self.kind == "raises":
            return self.body(x) + x.new_zeros(10, 3)  # (10: the logical batch)
        return self.body(x) * x.shape[0]


def _doubles_its_input(kind, x):
    P = sbp.placement("cpu", [0, 1])
    torch.manual_seed(0)
    model = DoublesItsInput(kind).double().to_global(P, B)
    g = _global(x, P)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model(g)
    return out.full_tensor(), g.full_tensor(), sbp.nn.fast_path.state(model).last_path


@pytest.mark.parametrize("kind", ["raises", "differs"])
def test_a_failed_first_local_run_undoes_its_write_into_the_input(pool2, kind):
    """The local run writes into the input's local tensor, whose version the undo did not
    read: op by op then doubled the input again (before: the output off by 21 and the
    input quadrupled, with no error)."""
    x = _data(steps=1)[0][0]
    torch.manual_seed(0)
    want_x = x.clone()
    want = DoublesItsInput(kind).double()(want_x)
    for out, written, path in pool2.run(_doubles_its_input, kind, x):
        assert path == "per-op"
        torch.testing.assert_close(written, want_x, rtol=0, atol=0)
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


class ScaledPerFeature(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.linear(x) * x.new_full((4,), 2.0)  # (4 features; a batch of 4 too)


def _scaled_per_feature(x):
    P = sbp.placement("cpu", [0, 1])
    torch.manual_seed(0)
    model = ScaledPerFeature().double().to_global(P, B)
    outs = [model(_global(x, P)).full_tensor() for _ in range(2)]
    return outs, sbp.nn.fast_path.state(model).last_path


def test_a_fill_of_the_features_size_equal_to_the_batchs_stays_on_the_fast_path(pool2):
    """A fill is taken as laid out as the batch only where an op needs it so: this one,
    broadcast along the features, is not (it went op by op once taken as the batch)."""
    x = _data(n=4, steps=1)[0][0]
    torch.manual_seed(0)
    want = ScaledPerFeature().double()(x)
    for outs, path in pool2.run(_scaled_per_feature, x):
        assert path == "fast"
        for out in outs:
            torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


class CastsAndTests(torch.nn.Module):
    """Converts dtypes (as autocast and `.float()` do) and branches on a broadcast value (as
    transformers' mask code does on position ids): both the same in the local run."""

    def __init__(self):
        super().__init__()
        self.body = MLP()

    def forward(self, x):
        h = self.body(x).to(torch.float32).to(torch.float64)
        if (self.body.head.bias == 12345).any() or not (self.body.head.bias < 1e9).all():
            return -h
        return h.cumsum(1)


@pytest.mark.parametrize("world", [1, 2])
def test_casts_and_tests_of_broadcast_values_run_on_the_fast_path(pool2, world):
    data = _data(steps=2)
    ref = _train(CastsAndTests, None, None, None, data)
    P = sbp.placement("cpu", list(range(world)))
    got = [_train(CastsAndTests, P, S0, True, data)] if world == 1 else None
    got = got or pool2.run(_train, CastsAndTests, P, S0, True, data)
    for losses, params, _, paths, _ in got:
        assert paths == ["fast", "fast"]
        assert losses == pytest.approx(ref[0], rel=1e-12)
        assert _rel(params, ref[1]) < 1e-12


def _conv_bn_under_autocast(world, fast, dtype):
    """Two steps of ConvBN (float32) under CPU autocast to `dtype`: the paths, the BatchNorm
    running statistics and the losses."""
    import sbp.nn

    torch.manual_seed(0)
    model = ConvBN()
    if world:
        P = sbp.placement("cpu", list(range(world)))
        model.to_global(P, B)
        sbp.nn.data_parallel(model, fast=fast)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    paths, losses = [], []
    for x, y in _data(n=8, steps=2, shape=(3, 4, 4), classes=4):  # (planes of 16: summed
        x = x.float()  # by product, `sbp.ops.batch_norm.SUM_BY_PRODUCT`)
        with torch.autocast("cpu", dtype=dtype):
            out = model(_global(x, P) if world else x)
        loss = F.cross_entropy(out.float(), _global(y, P) if world else y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        paths.append(sbp.nn.fast_path.state(model).last_path if world else None)
    stats = [model.bn.running_mean, model.bn.running_var]
    return paths, [t.full_tensor() if world else t for t in stats], losses


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_logical_batch_norm_under_autocast_runs_on_the_fast_path(pool2, dtype):
    """The local run's BatchNorm statistics are summed with autocast off, as the op-by-op
    rule's kernels are (below autocast): under autocast their `ones @ t` and `torch.mv`
    ran in half precision, the first local run differed from the check and torchvision's
    resnet18 and mobilenet_v2 ran op by op (before). Statistics equal op by op's and one
    process's (its convolutions round otherwise: the half-precision activations differ)."""
    _, want, want_losses = _conv_bn_under_autocast(0, True, dtype)
    per_op = pool2.run(_conv_bn_under_autocast, 2, False, dtype)[0]
    for paths, stats, losses in pool2.run(_conv_bn_under_autocast, 2, True, dtype):
        assert paths == ["fast", "fast"]
        for got, op_by_op, ref in zip(stats, per_op[1], want, strict=True):
            torch.testing.assert_close(got, op_by_op, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-3)
        assert losses == pytest.approx(want_losses, rel=1e-3)


class AttentionDropout(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], 1, 2, 12).chunk(3, dim=-1)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.5).flatten(1)


class ReturnsAnObject(torch.nn.Module):
    """Returns an object holding a tensor (as transformers' KV cache)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 3)

    def forward(self, x):
        out = self.fc(x)
        return out, types.SimpleNamespace(kept=out)


def _declined(make_model):
    import sbp.nn

    P = sbp.placement("cpu", [0, 1])
    torch.manual_seed(0)
    model = make_model().double().to_global(P, B)
    x = _global(_data(n=4, steps=1)[0][0].view(4, 8), P)
    with pytest.warns(UserWarning, match="runs op by op") as caught:
        out = model(x)
    returned = [type(t).__name__ for t in (out[1].kept,)] if isinstance(out, tuple) else []
    return sbp.nn.fast_path.state(model).last_path, str(caught[0].message), returned


def test_declines_what_the_local_run_cannot_reproduce(pool2):
    """An object returned as it is would hold the local run's local tensors: op by op."""
    for path, message, returned in pool2.run(_declined, ReturnsAnObject):
        assert path == "per-op"
        assert "SimpleNamespace" in message
        assert returned == ["GlobalTensor"]


def test_attention_dropout_on_the_cpu_runs_fast_and_equals_op_by_op(pool2):
    """On the CPU torch's attention with dropout is a composite drawing its mask by a
    `bernoulli_` the check sees; the local run seeds that draw as the op-by-op rule does.
    (A GPU's fused kernel draws inside: op by op there.)"""
    data = _data(steps=2)
    fast = pool2.run(_train, AttentionDropout, sbp.placement("cpu", [0, 1]), S0, True, data)
    per_op = pool2.run(_train, AttentionDropout, sbp.placement("cpu", [0, 1]), S0, False, data)
    torch_masks = _train(AttentionDropout, None, None, None, data)
    for got, want in zip(fast, per_op, strict=True):
        assert got[3] == ["fast", "fast"] and want[3] == ["per-op", "per-op"]
        assert got[0] == pytest.approx(want[0], rel=1e-12)
        assert _rel(got[1], want[1]) < 1e-12
        assert got[0] != pytest.approx(torch_masks[0], rel=1e-6)  # (sbp draws its own masks)


class FunctionalNorm(torch.nn.Module):
    """Calls F.batch_norm itself (no BatchNorm module): the fast path intercepts it with a
    mode over the whole forward instead of inside BatchNorm modules."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = torch.nn.Linear(8, 6), torch.nn.Linear(6, 3)
        self.weight = torch.nn.Parameter(torch.ones(6))
        self.register_buffer("mean", torch.zeros(6))
        self.register_buffer("var", torch.ones(6))

    def forward(self, x):
        h = F.batch_norm(self.inp(x), self.mean, self.var, self.weight, None, self.training)
        return self.out(torch.relu(h))


def _functional_norm(data):
    return _train_recording(FunctionalNorm, True, data)


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


def test_functional_batch_norm_outside_modules_equals_one_process(pool2):
    data = _data()
    ref_losses, ref_params, ref_buffers, _, _ = _train(FunctionalNorm, None, None, None, data)
    for (losses, params, buffers, paths, _), in_modules in pool2.run(_functional_norm, data):
        assert paths == ["fast"] * len(data) and in_modules == [False]
        assert losses == pytest.approx(ref_losses, abs=1e-12)
        assert _rel(params, ref_params) < 1e-12 and _rel(buffers, ref_buffers) < 1e-12


_SDPA_AT_IMPORT = F.scaled_dot_product_attention  # (a reference no name replacement reaches)


class Attending(torch.nn.Module):
    """Self-attention over 4 tokens with dropout, calling torch's attention by its name on
    torch.nn.functional (as transformers does) or through a reference taken at import."""

    def __init__(self, by_name: bool, p: float = 0.3, heads_dim: bool = True):
        super().__init__()
        self.by_name, self.p, self.heads_dim = by_name, p, heads_dim
        self.qkv, self.out = torch.nn.Linear(2, 6), torch.nn.Linear(8, 3)

    def forward(self, x):
        # (N, 1, L, E), one head; or (N, L, E), which torch's attention makes (1, N, L, E)
        shape = (x.shape[0], 1, 4, 2) if self.heads_dim else (x.shape[0], 4, 2)
        q, k, v = self.qkv(x.view(shape)).chunk(3, -1)
        attend = F.scaled_dot_product_attention if self.by_name else _SDPA_AT_IMPORT
        return self.out(attend(q, k, v, dropout_p=self.p).flatten(1))


class SequenceFirst(torch.nn.Module):
    """Dropout on `(L, N, E)`: the batch moved to dim 1 by a transpose, as in a
    sequence-first model (`nn.Transformer` without batch_first)."""

    def __init__(self):
        super().__init__()
        self.inp, self.drop = torch.nn.Linear(2, 4), torch.nn.Dropout(0.4)
        self.out = torch.nn.Linear(16, 3)

    def forward(self, x):
        h = self.inp(x.view(x.shape[0], 4, 2)).transpose(0, 1)  # (L, N, E)
        return self.out(self.drop(h).transpose(0, 1).flatten(1))


def test_dropout_on_the_batch_moved_to_another_dim_equals_op_by_op(pool2):
    """The mask of a dropout whose input has the batch on dim 1 is the op-by-op path's: the
    fast path takes it (it ran op by op before)."""
    data = _data()
    P = sbp.placement("cpu", [0, 1])
    fast = pool2.run(_train, SequenceFirst, P, (S0,), True, data)
    per_op = pool2.run(_train, SequenceFirst, P, (S0,), False, data)
    for (losses, params, _, paths, _), (want, want_params, _, want_paths, _) in zip(
        fast, per_op, strict=True
    ):
        assert paths == ["fast"] * len(data) and want_paths == ["per-op"] * len(data)
        assert losses == pytest.approx(want, rel=1e-12)
        assert _rel(params, want_params) < 1e-12


class DropsAWeight(torch.nn.Module):
    """Dropout on a broadcast tensor (a weight, not the batch): the same mask on every rank
    op by op, where the local run would draw one per rank."""

    def __init__(self):
        super().__init__()
        self.lin, self.drop = torch.nn.Linear(8, 3), torch.nn.Dropout(0.5)

    def forward(self, x):
        return F.linear(x, self.drop(self.lin.weight), self.lin.bias)


def _drops_a_weight(fast, data):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _train(DropsAWeight, sbp.placement("cpu", [0, 1]), (S0,), fast, data)
    return out, [str(w.message) for w in caught if "sbp:" in str(w.message)]


def test_dropout_on_a_tensor_not_laid_out_as_the_batch_runs_op_by_op(pool2):
    """The fast path declines a dropout whose input is not the batch, moved or not."""
    data = _data()
    fast = pool2.run(_drops_a_weight, True, data)
    per_op = pool2.run(_drops_a_weight, False, data)
    for ((losses, params, _, paths, _), said), ((want, want_params, *_), _) in zip(
        fast, per_op, strict=True
    ):
        assert paths == ["per-op"] * len(data)
        assert any("not as the batch" in w for w in said), said
        assert losses == pytest.approx(want, rel=1e-12)
        assert _rel(params, want_params) < 1e-12


@pytest.mark.parametrize("nd", [(S0, S0), (S0, B)])
def test_dropout_on_the_batch_moved_on_2x2_equals_op_by_op(pool4, nd):
    """The same on 2x2, the batch split over one hierarchy dim or both."""
    data = _data(n=12)
    P = sbp.placement("cpu", [[0, 1], [2, 3]])
    fast = pool4.run(_train, SequenceFirst, P, nd, True, data)
    per_op = pool4.run(_train, SequenceFirst, P, nd, False, data)
    for (losses, params, _, paths, _), (want, want_params, *_) in zip(fast, per_op, strict=True):
        assert paths == ["fast"] * len(data)
        assert losses == pytest.approx(want, rel=1e-12)
        assert _rel(params, want_params) < 1e-12


def _attending(by_name: bool, fast: bool, data, heads_dim: bool = True):
    make = functools.partial(Attending, by_name, heads_dim=heads_dim)
    return _train_recording(make, fast, data)


@pytest.mark.parametrize("by_name, heads_dim", [(True, True), (False, True), (True, False)])
def test_attention_dropout_by_name_or_reference_equals_op_by_op(pool2, by_name, heads_dim):
    """The local run catches attention's dropout where a model calls it by name, and
    through a mode over the whole forward where it holds a reference: either way it draws
    the op-by-op path's masks (the CPU's attention draws them by `bernoulli_`). 3-d
    attention too (`heads_dim=False`), whose dropout runs with the batch on dim 1."""
    data = _data()
    fast = pool2.run(_attending, by_name, True, data, heads_dim)
    per_op = pool2.run(_attending, by_name, False, data, heads_dim)
    for ((losses, params, _, paths, _), caught), ((want, want_params, _, _, _), _) in zip(
        fast, per_op, strict=True
    ):
        assert paths == ["fast"] * len(data) and caught == [by_name]
        assert losses == pytest.approx(want, rel=1e-12)
        assert _rel(params, want_params) < 1e-12
    no_dropout = _train(
        functools.partial(Attending, by_name, 0.0, heads_dim), None, None, None, data
    )[0]
    assert fast[0][0][0] != pytest.approx(no_dropout, rel=1e-6)  # (masks were drawn)


# ---------------------------------------------------------------- compiled local forward


def _counting(backend="aot_eager"):
    from torch._dynamo.testing import CompileCounterWithBackend

    return CompileCounterWithBackend(backend)


def test_compiled_local_forward_on_one_rank():
    """`data_parallel(model, compile=...)`: the fast path's local forward through
    torch.compile equals one process, and later steps reuse the graph (no recompile: the
    local leaves, swapped in per call, are the same inputs every step)."""
    data = _data(n=6, steps=3, shape=(3, 5, 5), classes=4)
    counter = _counting()
    got = _train(
        ConvBN, sbp.placement("cpu", [0]), S0, True, data, compile_local={"backend": counter}
    )
    ref = _train(ConvBN, None, None, None, data)
    assert got[3] == ["fast"] * 3
    assert counter.frame_count == 1 and counter.op_count > 0
    for a, b in zip(got[0], ref[0], strict=True):
        assert abs(a - b) <= 1e-12 * abs(b)
    assert _rel(got[1], ref[1]) < 1e-12
    assert _rel(got[2], ref[2]) < 1e-12  # running statistics and num_batches_tracked
    assert got[4] == {(B,)}


def _recording_backend():
    """A torch.compile backend that runs graphs as traced and notes each graph's inputs'
    types and its ops."""
    graphs = []

    def backend(gm, example_inputs):
        types = {type(t) for t in example_inputs if isinstance(t, torch.Tensor)}
        ops = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
        graphs.append((types, ops))
        return gm.forward

    return backend, graphs


def _convolutions_on(graphs, tensor_type) -> bool:
    return any(tensor_type in types and any("conv" in op for op in ops) for types, ops in graphs)


def test_torch_compile_of_a_model_compiles_its_local_forward():
    """torch.compile(model) of a data-parallel model: the call leaves the graph for the fast
    path, which compiles the module's forward on plain local tensors with the same backend
    (global parameters in the graph cost Python work per parameter every step); equal to
    one process. An input that is not data-parallel (broadcast) runs op by op, compiled with
    that backend too; fullgraph=True keeps it all one graph, op by op."""
    import sbp.nn

    data = _data(n=6, steps=3, shape=(3, 5, 5), classes=4)
    backend, graphs = _recording_backend()
    torch._dynamo.reset()
    got = _train(ConvBN, sbp.placement("cpu", [0]), S0, True, data, compiled=backend)
    ref = _train(ConvBN, None, None, None, data)
    assert got[3] == ["fast"] * 3
    assert _convolutions_on(graphs, torch.Tensor)
    assert not _convolutions_on(graphs, sbp.GlobalTensor)
    for a, b in zip(got[0], ref[0], strict=True):
        assert abs(a - b) <= 1e-12 * abs(b)
    assert _rel(got[1], ref[1]) < 1e-12 and _rel(got[2], ref[2]) < 1e-12
    assert got[4] == {(B,)}

    P = sbp.placement("cpu", [0])
    torch.manual_seed(0)
    model = ConvBN().double().eval()
    want = model(data[0][0])
    model.to_global(P, B)
    for fullgraph in (False, True):
        graphs.clear()
        torch._dynamo.reset()
        out = torch.compile(model, backend=backend, fullgraph=fullgraph)(_global(data[0][0], P, B))
        assert sbp.nn.fast_path.state(model).last_path == ("traced" if fullgraph else "per-op")
        assert _convolutions_on(graphs, sbp.GlobalTensor)
        assert torch.allclose(out.full_tensor(), want, rtol=1e-12, atol=1e-12)
    torch._dynamo.reset()


def test_error_on_graph_break_traces_the_model_in_one_graph():
    """Under torch._dynamo.error_on_graph_break(True) the model's call must not leave the
    graph: the fast path declines the compiled route and the call is traced op by op (the
    global tensors in the graph), equal to one process."""
    import sbp.nn

    P = sbp.placement("cpu", [0])
    torch.manual_seed(0)
    ref = ConvBN().double().eval()
    x = _data(n=6, steps=1, shape=(3, 5, 5), classes=4)[0][0]
    model = copy.deepcopy(ref).to_global(P, B)
    backend, graphs = _recording_backend()
    torch._dynamo.reset()
    with torch._dynamo.error_on_graph_break(True):
        out = torch.compile(model, backend=backend)(_global(x, P))
    torch._dynamo.reset()
    assert sbp.nn.fast_path.state(model).last_path == "traced"
    assert _convolutions_on(graphs, sbp.GlobalTensor)
    assert torch.allclose(out.full_tensor(), ref(x), rtol=1e-12, atol=1e-12)


def test_compiling_model_after_model_keeps_one_backend_per_kind():
    """Each torch.compile call makes its own backend object; equal ones share one entry of
    the fast path's backend list (it grew by one per call, for the life of the process),
    unequal ones do not, and every model's output equals one process."""
    import sbp.nn

    fast_path = sys.modules["sbp.nn.fast_path"]
    P = sbp.placement("cpu", [0])
    x = _data(n=6, steps=1, shape=(3, 5, 5), classes=4)[0][0]
    torch._dynamo.reset()
    before = len(fast_path._COMPILE_BACKENDS)
    indices = []
    for backend in ("aot_eager", "aot_eager", "aot_eager", "eager"):
        torch.manual_seed(0)
        ref = ConvBN().double().eval()
        model = copy.deepcopy(ref).to_global(P, B)
        out = torch.compile(model, backend=backend)(_global(x, P))
        assert sbp.nn.fast_path.state(model).last_path == "fast"
        assert torch.allclose(out.full_tensor(), ref(x), rtol=1e-12, atol=1e-12)
        indices.append(sbp.nn.fast_path.state(model).backend)
    torch._dynamo.reset()
    assert len(fast_path._COMPILE_BACKENDS) - before <= 2
    assert indices[0] == indices[1] == indices[2] != indices[3]


def _compiled_loss_steps(P, data, backend):
    """Three SGD steps whose loss function (the model's call and cross-entropy) is one
    torch.compile'd function; the losses, the parameters and each call's path."""
    import sbp.nn

    torch.manual_seed(0)
    model = ConvBN().double().to_global(P, B)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    loss_of = torch.compile(lambda x, y: F.cross_entropy(model(x), y), backend=backend)
    losses, paths = [], []
    for x, y in data:
        loss = loss_of(_global(x, P), _global(y, P))
        paths.append(sbp.nn.fast_path.state(model).last_path)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, _gather(model), paths


def test_a_model_called_inside_a_compiled_function():
    """Dynamo inlines the model's call into a compiled function that calls it (a loss
    function): the call leaves that graph for the fast path, whose local forward is
    compiled with the same backend on plain tensors, and the rest of the function is
    compiled around it; equal to one process."""
    data = _data(n=6, steps=3, shape=(3, 5, 5), classes=4)
    backend, graphs = _recording_backend()
    torch._dynamo.reset()
    losses, params, paths = _compiled_loss_steps(sbp.placement("cpu", [0]), data, backend)
    torch._dynamo.reset()
    ref = _train(ConvBN, None, None, None, data)  # (the same SGD)
    assert paths == ["fast"] * 3
    assert _convolutions_on(graphs, torch.Tensor)
    assert not _convolutions_on(graphs, sbp.GlobalTensor)
    assert any(any("cross_entropy" in op for op in ops) for _, ops in graphs)
    for a, b in zip(losses, ref[0], strict=True):
        assert abs(a - b) <= 1e-12 * abs(b)
    assert _rel(params, ref[1]) < 1e-12


def test_torch_compile_with_compile_options_alternating_paths():
    """A model under torch.compile that also has `data_parallel(compile=...)`, called with a
    split batch (the fast path, compiled with those options) and a broadcast one (op by op,
    compiled with torch.compile's backend) in turn: each compiled forward is made once,
    not again at every switch; every output equals one process."""
    import sbp.nn

    P = sbp.placement("cpu", [0])
    torch.manual_seed(0)
    ref = MLP().double().eval()
    model = copy.deepcopy(ref).to_global(P, B)
    sbp.nn.data_parallel(model, compile={"backend": "eager"})
    fast = sbp.nn.fast_path.state(model)
    torch._dynamo.reset()
    run = torch.compile(model, backend="aot_eager")
    x = torch.randn(6, 8, dtype=torch.float64)
    made, paths = [], []
    for nd in (S0, B, S0, B, S0):
        out = run(_global(x, P, nd))
        paths.append(fast.last_path)
        made.append([id(c) for _, c in fast._compiled])
        assert torch.allclose(out.full_tensor(), ref(x), rtol=1e-12, atol=1e-12)
    torch._dynamo.reset()
    assert paths == ["fast", "per-op"] * 2 + ["fast"]
    assert len(made[-1]) == 2 and all(m == made[-1] for m in made[1:])


def test_torch_compile_of_a_model_with_varying_batch_sizes():
    """Dynamo skips the call of a data-parallel model under torch.compile, so no frame
    around it is compiled per batch size (global shapes are static in a graph); every call
    takes the fast path with the compiled local forward, whose plain tensors Dynamo makes
    dynamic after the second shape: two compilations for 14 sizes, each call equal to one
    process."""
    import sbp.nn

    P = sbp.placement("cpu", [0])
    torch.manual_seed(0)
    ref = MLP().double()
    model = copy.deepcopy(ref).to_global(P, B)
    compiled_graphs, runs = [], []

    def backend(gm, example_inputs):
        compiled_graphs.append(gm)

        def run(*args):
            runs.append(1)
            return gm.forward(*args)

        return run

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(model, backend=backend)
    g = torch.Generator().manual_seed(3)
    sizes = range(2, 16)
    for n in sizes:
        x = torch.randn(n, 8, generator=g, dtype=torch.float64)
        out = step(_global(x, P))
        assert sbp.nn.fast_path.state(model).last_path == "fast"
        assert torch.allclose(out.full_tensor(), ref(x), rtol=1e-12, atol=1e-12)
    frames = counters["frames"]["total"]  # frames Dynamo traced: the local forward's only
    torch._dynamo.reset()
    assert len(compiled_graphs) == 2 and frames == 2
    assert len(runs) == len(sizes)


def _aot_recording():
    """aot_eager that records what Dynamo hands it: (input types, call targets) per graph,
    with those of its subgraphs (an autograd function's)."""
    from torch._dynamo.backends.debugging import aot_eager

    graphs = []

    def backend(gm, example_inputs):
        types = {type(t) for t in example_inputs if isinstance(t, torch.Tensor)}
        nodes = [n for g in gm.modules() if hasattr(g, "graph") for n in g.graph.nodes]
        graphs.append((types, {str(n.target) for n in nodes if n.op == "call_function"}))
        return aot_eager(gm, example_inputs)

    return backend, graphs


def _logical_compiled(data, how, make_model=ConvBN, P=None, nd=S0):
    """`how`: "model" (torch.compile of the model) or "local" (data_parallel(compile=...))."""
    import warnings

    backend, graphs = _aot_recording()
    options = {"compiled": backend} if how == "model" else {"compile_local": {"backend": backend}}
    P = sbp.placement("cpu", [0, 1]) if P is None else P
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _train(make_model, P, nd, True, data, **options)
    torch._dynamo.reset()
    local = [ops for types, ops in graphs if types == {torch.Tensor} and ops]
    reduced = any("sbp.all_reduce" in op for ops in local for op in ops)
    return got, [str(w.message) for w in caught if str(w.message).startswith("sbp:")], reduced


@pytest.mark.parametrize("how", ["model", "local"])
@pytest.mark.parametrize("n", [6, 7])
def test_compiled_local_forward_with_logical_batch_norm(pool2, how, n):
    """Logical BatchNorm over two ranks in a compiled local forward (torch.compile of the
    model, or data_parallel(compile=...)): the BatchNorm modules compute the logical
    batch's statistics in the graph, on plain tensors (their table all-reduced by
    `sbp::all_reduce`), with the backward autograd derives; losses, parameters,
    running statistics and num_batches_tracked equal one process, on an even batch and on
    an uneven one (4 and 3 samples: the count comes from the table)."""
    data = _data(n=n, steps=3, shape=(3, 5, 5), classes=4)
    ref = _train(ConvBN, None, None, None, data)
    for got, warned, reduced in pool2.run(_logical_compiled, data, how):
        assert got[3] == ["fast"] * 3 and warned == [] and reduced
        for a, b in zip(got[0], ref[0], strict=True):
            assert abs(a - b) <= 1e-12 * abs(b)
        assert _rel(got[1], ref[1]) < 1e-12 and _rel(got[2], ref[2]) < 1e-12


class _CheckpointedConvBN(ConvBN):
    def forward(self, x):
        def block(t):
            return torch.relu(self.bn(self.conv(t)))

        x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.fc(x.mean((2, 3)))


@pytest.mark.parametrize("how", ["model", "local"])
def test_compiled_logical_batch_norm_inside_activation_checkpointing(pool2, how):
    """Logical BatchNorm inside torch.utils.checkpoint, compiled: torch's partitioner
    recomputed the statistics' all-reduce (an ordered effect) in backward from a token
    that is None at run time, and every rank raised AssertionError
    (`tensors_saved_with_vc_check`). sbp's collectives are saved there instead
    (`sbp.comm.torch_effects`); equal to one process, compiled (whose recomputation does
    not update the running statistics a second time, as eager torch's does)."""
    data = _data(n=7, steps=2, shape=(3, 5, 5), classes=4)
    ref = _train(_CheckpointedConvBN, None, None, None, data, compiled="aot_eager")
    eager = _train(_CheckpointedConvBN, None, None, None, data)
    assert _rel(ref[1], eager[1]) < 1e-12 and ref[2][2] == 2 and eager[2][2] == 4
    for got, _, reduced in pool2.run(_logical_compiled, data, how, _CheckpointedConvBN):
        assert got[3] == ["fast"] * 2 and reduced
        for a, b in zip(got[0], ref[0], strict=True):
            assert abs(a - b) <= 1e-12 * abs(b)
        assert _rel(got[1], ref[1]) < 1e-12 and _rel(got[2], ref[2]) < 1e-12


def test_compiled_logical_batch_norm_on_a_2x2_placement(pool4):
    """On a 2x2 placement with the batch split along the first hierarchy dim only, each
    rank's statistics are those of the two ranks holding parts of its batch (which the
    second dim repeats); equal to one process, on every rank."""
    data = _data(n=7, steps=2, shape=(3, 5, 5), classes=4)
    ref = _train(ConvBN, None, None, None, data)
    P = sbp.placement("cpu", [[0, 1], [2, 3]])
    for got, warned, reduced in pool4.run(_logical_compiled, data, "model", ConvBN, P, (S0, B)):
        assert got[3] == ["fast"] * 2 and warned == [] and reduced
        for a, b in zip(got[0], ref[0], strict=True):
            assert abs(a - b) <= 1e-12 * abs(b)
        assert _rel(got[1], ref[1]) < 1e-12 and _rel(got[2], ref[2]) < 1e-12


def _conv_bn_instance_forward():
    """A BatchNorm whose instance has a forward of its own (as hooks set them)."""
    model = ConvBN()
    torch_forward = model.bn.forward
    model.bn.forward = lambda x: torch_forward(x) * 2.0 + 0.5
    return model


@pytest.mark.parametrize("how", ["model", "local"])
def test_compiled_logical_batch_norm_keeps_an_instance_forward(pool2, how):
    """A forward set on a BatchNorm instance is kept and runs (before: the compiled fast
    path put the logical forward in its place, silently, and removed it for good)."""
    data = _data(n=6, steps=2, shape=(3, 5, 5), classes=4)
    ref = _train(_conv_bn_instance_forward, None, None, None, data)
    for got, _, _ in pool2.run(_logical_compiled, data, how, _conv_bn_instance_forward):
        for a, b in zip(got[0], ref[0], strict=True):
            assert abs(a - b) <= 1e-12 * abs(b)
        assert _rel(got[1], ref[1]) < 1e-12 and _rel(got[2], ref[2]) < 1e-12


def _cumulative_compiled(data):
    from torch._dynamo.utils import counters

    counters.clear()
    got = _logical_compiled(data, "model", _conv_bn_cumulative)[0]
    return got, counters["stats"]["unique_graphs"]


def test_compiled_logical_batch_norm_with_a_cumulative_average(pool2):
    """momentum=None: the factor changes every step, and the graph must not be made again
    for each value (before: 11 graphs in 12 steps, then Dynamo's limit and eager frames);
    equal to one process."""
    data = _data(n=6, steps=12, shape=(3, 5, 5), classes=4)
    ref = _train(_conv_bn_cumulative, None, None, None, data)
    for got, graphs in pool2.run(_cumulative_compiled, data):
        assert got[3] == ["fast"] * 12 and graphs <= 6
        for a, b in zip(got[0], ref[0], strict=True):
            assert abs(a - b) <= 1e-12 * abs(b)
        assert _rel(got[1], ref[1]) < 1e-12 and _rel(got[2], ref[2]) < 1e-12


def _switched_submodule_mode(x, compiled):
    P = sbp.placement("cpu", [0, 1])
    torch.manual_seed(0)
    model = ConvBN().double().to_global(P, B)
    run = torch.compile(model, backend="aot_eager") if compiled else model
    outs = []
    with torch.no_grad():
        for bn_training in (False, True, False):
            model.eval()
            model.bn.train(bn_training)
            outs.append(run(_global(x, P)).full_tensor())
    torch._dynamo.reset()
    return outs, model.bn.running_mean.full_tensor()


@pytest.mark.parametrize("compiled", [False, True])
def test_a_submodule_mode_change_is_a_new_layout(pool2, compiled):
    """A model in eval mode called, then again with its BatchNorm in train mode, at the same
    shapes: the second call is checked anew (before: it reused the eval layout, which
    counted no BatchNorm call, and each rank normalised with its own shard's statistics)."""
    x = _data(n=6, steps=1, shape=(3, 5, 5), classes=4)[0][0]
    torch.manual_seed(0)
    ref = ConvBN().double()
    want = []
    with torch.no_grad():
        for bn_training in (False, True, False):
            ref.eval()
            ref.bn.train(bn_training)
            want.append(ref(x))
    for outs, running_mean in pool2.run(_switched_submodule_mode, x, compiled):
        for got, expected in zip(outs, want, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(running_mean, ref.bn.running_mean, rtol=1e-12, atol=1e-14)


class _TwoInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = ConvBN(), ConvBN()

    def forward(self, x, z):
        return self.a(x), self.b(z)


def _second_input_empty_part(x, z):
    import sbp.nn

    P = sbp.placement("cpu", [0, 1])
    backend, graphs = _aot_recording()
    torch.manual_seed(0)
    model = _TwoInputs().double().to_global(P, B)
    torch._dynamo.reset()
    oa, ob = torch.compile(model, backend=backend)(_global(x, P), _global(z, P))
    torch._dynamo.reset()
    local = [ops for types, ops in graphs if types == {torch.Tensor} and ops]
    path = sbp.nn.fast_path.state(model).last_path
    return path, local, oa.full_tensor(), ob.full_tensor()


def test_an_empty_part_of_any_batch_input_runs_the_local_forward_eagerly(pool2):
    """The second input has one sample over two ranks: its empty part on rank 1 would meet
    Inductor's failing convolution backward, so the call runs the local forward eagerly,
    like an empty part of the first input (before: only the first input was looked at)."""
    x, z = (
        torch.randn(6, 3, 5, 5, dtype=torch.float64),
        torch.randn(1, 3, 5, 5, dtype=torch.float64),
    )
    torch.manual_seed(0)
    ref = _TwoInputs().double()
    with torch.no_grad():
        wa, wb = ref(x, z)
    for path, local, oa, ob in pool2.run(_second_input_empty_part, x, z):
        assert path == "fast" and local == []
        torch.testing.assert_close(oa, wa, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(ob, wb, rtol=1e-12, atol=1e-12)


class _OwnBatchNorm(torch.nn.BatchNorm2d):
    def forward(self, x):
        return super().forward(x) * 1.0


def _conv_own_bn():
    model = ConvBN()
    model.bn = _OwnBatchNorm(6)
    return model


def test_compiled_logical_batch_norm_in_a_module_with_its_own_forward(pool2):
    """A BatchNorm subclass with a forward of its own cannot be given the logical one: a
    model under torch.compile then runs op by op (compiled), and the local forward under
    data_parallel(compile=...) eagerly, saying so; both equal one process."""
    data = _data(n=6, steps=2, shape=(3, 5, 5), classes=4)
    ref = _train(_conv_own_bn, None, None, None, data)
    for how, path in (("model", "per-op"), ("local", "fast")):
        for got, warned, _ in pool2.run(_logical_compiled, data, how, _conv_own_bn):
            assert got[3] == [path] * 2
            if how == "local":
                assert len(warned) == 1 and "its own forward" in warned[0]
            for a, b in zip(got[0], ref[0], strict=True):
                assert abs(a - b) <= 1e-12 * abs(b)
            assert _rel(got[1], ref[1]) < 1e-12 and _rel(got[2], ref[2]) < 1e-12


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


class ScaledByANumber(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = MLP()

    def forward(self, x, scale):
        if isinstance(scale, tuple):  # (a number and a flag, or a global tensor beside it)
            scale = scale[0] if scale[1] is True else scale[0] * scale[1].sum()
        return self.body(x) * scale


@pytest.mark.parametrize("wrap", ["number", "in a tuple", "beside a global tensor"])
def test_a_number_that_changes_every_call_is_warned_about(wrap):
    """Each new value of a number argument is a new layout, checked op by op again: after
    a few, one warning says to pass it as a tensor; every call still equals one process.
    (Before, numbers inside a tuple went unwarned.)"""
    import sbp.nn

    P = sbp.placement("cpu", [0])
    torch.manual_seed(0)
    plain = ScaledByANumber().double()
    model = copy.deepcopy(plain).to_global(P, B)
    x = _data(steps=1)[0][0]
    one = torch.ones(2, dtype=torch.float64) / 2

    def scale(value, g):
        return {"number": value, "in a tuple": (value, True), "beside a global tensor": (value, g)}[
            wrap
        ]

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        outs = [
            model(_global(x, P), scale(1.0 + k / 8, sbp.tensor(one, P, B))).full_tensor()
            for k in range(6)
        ]
        again = model(_global(x, P), scale(1.0, sbp.tensor(one, P, B))).full_tensor()  # (known)
    messages = [str(w.message) for w in seen if "number argument" in str(w.message)]
    assert len(messages) == 1 and "ScaledByANumber" in messages[0]
    assert sbp.nn.fast_path.state(model).last_path == "fast"
    for k, out in enumerate(outs):
        torch.testing.assert_close(out, plain(x, scale(1.0 + k / 8, one)), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(again, outs[0], rtol=0, atol=0)


class ActivatedBy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = MLP()

    def forward(self, x, activation, state=None):
        out = activation(self.body(x))
        if state is not None:  # (an object the forward writes into: a KV cache, say)
            state.seen.append(out)
        return out


class _State:
    def __init__(self):
        self.seen = []


def test_function_arguments_keep_the_fast_path_and_objects_run_op_by_op():
    """A function passed to forward (torch.tanh, a Python function) is only read: the call
    takes the fast path. Any other object may be written by the forward, and the checking
    pass would fill it with global tensors, the local run with local ones: op by op."""
    import sbp.nn

    P = sbp.placement("cpu", [0])
    torch.manual_seed(0)
    plain = ActivatedBy().double()
    model = copy.deepcopy(plain).to_global(P, B)
    x = _data(steps=1)[0][0]

    def halved(t):
        return t / 2

    for activation in (torch.tanh, halved):
        for _ in range(2):
            out = model(_global(x, P), activation).full_tensor()
            torch.testing.assert_close(out, plain(x, activation), rtol=1e-12, atol=1e-12)
            assert sbp.nn.fast_path.state(model).last_path == "fast"
    state = _State()
    out = model(_global(x, P), torch.tanh, state)
    assert sbp.nn.fast_path.state(model).last_path == "per-op"
    assert [type(t) for t in state.seen] == [sbp.GlobalTensor]
    torch.testing.assert_close(state.seen[0].full_tensor(), plain(x, torch.tanh))


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
    step, and look again only when a global tensor was rebound (`sbp.tensor.REBINDS`):
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
    parameters went uncounted: `sbp.tensor.REBINDS`)."""
    data = _data(steps=5)

    def run():
        return _switching_steps(data, sbp.placement("cpu", list(range(world))))

    want = _switching_steps(data, None)
    for got in request.getfixturevalue(f"pool{world}").run(run):
        assert _rel(got, want) < 1e-12


def _compiled_step_training(data, P, backend="eager"):
    """SGD steps of a function, under torch.compile, that runs the model, the loss and its
    backward (the optimizer's step outside)."""
    import sbp.nn

    torch.manual_seed(0)
    model = MLP().double()
    if P is not None:
        model.to_global(P, B)
        sbp.nn.data_parallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    compiled = torch.compile(step, backend=backend)
    for x, y in data:
        if P is not None:
            x, y = _global(x, P), _global(y, P)
        opt.zero_grad()
        compiled(x, y)
        opt.step()
    return [p.full_tensor() if P is not None else p.detach() for p in model.parameters()]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("world", [1, 2])
def test_a_compiled_function_with_the_backward_inside(request, world, backend):
    """torch.compile of a function holding the model's call, the loss and backward: the
    backward runs after a graph break, where Dynamo compiled sbp's dispatch (a gradient of
    ones made for the loss) and crashed on a half-made GlobalTensor; it now skips it. With
    AOT autograd, its backward makes global tensors (`__tensor_unflatten__`) there too."""
    data = _data(steps=3)

    def run():
        import torch._dynamo

        torch._dynamo.reset()
        P = sbp.placement("cpu", list(range(world)))
        return _compiled_step_training(data, P, backend)

    want = _compiled_step_training(data, None)
    for got in request.getfixturevalue(f"pool{world}").run(run, timeout=600):
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


class Checkpointed(torch.nn.Module):
    """An MLP whose middle block runs again in backward (torch.utils.checkpoint)."""

    def __init__(self, use_reentrant: bool):
        super().__init__()
        self.first = torch.nn.Linear(8, 16)
        self.middle = torch.nn.Sequential(
            torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16)
        )
        self.head = torch.nn.Linear(16, 3)
        self.use_reentrant = use_reentrant

    def forward(self, x):
        h = torch.relu(self.first(x))
        h = torch.utils.checkpoint.checkpoint(self.middle, h, use_reentrant=self.use_reentrant)
        return self.head(h)


@pytest.mark.filterwarnings("ignore:sbp. Checkpointed runs op by op")
@pytest.mark.parametrize("use_reentrant,compiled", [(False, None), (True, None), (True, "local")])
def test_torch_utils_checkpoint_in_a_forward_trains_as_one_process(pool2, use_reentrant, compiled):
    """The recomputation in backward comes after the local run gave the module its global
    parameters back (a PlacementError there): the first local run sees the checkpoint and
    the module runs op by op, where the recomputation is global too. A compiled local
    forward recomputes on local tensors: it keeps the fast path."""
    data = _data()
    make = functools.partial(Checkpointed, use_reentrant)
    want_losses, want_params, *_ = _train(make, None, None, None, data)
    P = sbp.placement("cpu", [0, 1])
    options = {"backend": "aot_eager"} if compiled else None
    results = pool2.run(_train, make, P, S0, True, data, compile_local=options)
    for losses, params, _, paths, _ in results:
        assert losses == pytest.approx(want_losses, rel=1e-12)
        for got, want in zip(params, want_params, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        assert paths == ["fast" if compiled else "per-op"] * len(data)


def _far_from_zero_batch():
    """A column of years (mean 2020, spread 1e-3: a shifted sum's square loses it all)."""
    g = torch.Generator().manual_seed(4)
    x = 2020 + 1e-3 * torch.randn(9, 4, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 3, (9,), generator=g)


def _batch_norm_far_from_zero(world, fast):
    import sbp.nn

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 3)).double()
    x, y = _far_from_zero_batch()
    if world is not None:
        P = sbp.placement("cpu", list(range(world)))
        model.to_global(P, B)
        sbp.nn.data_parallel(model, fast=fast)
        x, y = _global(x, P), _global(y, P)
    out = model(x)
    F.cross_entropy(out, y).backward()
    values = [out, *(p.grad for p in model.parameters()), *model[0].buffers()]
    return [v.full_tensor() if world is not None else v.detach() for v in values]


@pytest.mark.parametrize("fast", [True, False])
def test_logical_batch_norm_of_data_far_from_zero(pool2, fast):
    """The variance came from E[(x-K)^2] - E[x-K]^2 with K the running mean (0 at first):
    on data far from zero (years), cancellation took most of it (relative errors of 1e-4
    here, in float64). Each rank's own two-pass statistics, merged, equal one process's to
    the rounding that data 2e6 spreads from zero carry (x - mean loses ~2e-10 in float64)."""
    want = _batch_norm_far_from_zero(None, None)
    for got in pool2.run(_batch_norm_far_from_zero, 2, fast):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-10)


class GroupNormed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.norm = torch.nn.GroupNorm(4, 8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.conv(x))).mean((2, 3)))


def test_group_norm_takes_the_fast_path(pool2):
    """GroupNorm's statistics are each sample's: its rule gives the local batch size, as
    F.group_norm does on local tensors, so the local run is exact (before: op by op,
    'native_group_norm adjusts its local arguments')."""
    data = _data(n=7, shape=(3, 4, 4))
    want = _train(GroupNormed, None, None, None, data)
    for losses, params, _, paths, _ in pool2.run(
        _train, GroupNormed, sbp.placement("cpu", [0, 1]), S0, True, data
    ):
        assert paths == ["fast"] * len(data)
        assert losses == pytest.approx(want[0], rel=1e-12)
        for got, ref in zip(params, want[1], strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


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


def _deep_copied_compiled(x):
    import sbp.nn

    P = sbp.placement("cpu", [0, 1])
    torch.manual_seed(0)
    model = ConvBN().double().to_global(P, B)
    torch._dynamo.reset()
    torch.compile(model, backend="aot_eager")(_global(x, P))
    copied, detached = copy.deepcopy(model), copy.deepcopy(model)
    sbp.nn.fast_path.detach_fast_path(detached)  # (before any call of its own)
    out = torch.compile(copied, backend="aot_eager")(_global(x, P)).full_tensor()
    torch._dynamo.reset()
    path = sbp.nn.fast_path.state(copied).last_path
    return path, out.detach(), "forward" in detached.bn.__dict__


def test_a_deep_copy_keeps_track_of_its_logical_batch_norm_forwards(pool2):
    """A model copied after a compiled step: its copy's BatchNorm modules hold the logical
    forward, which the copy's fast path knows: it uses them, equal to one process, and
    detaching it before any call takes them away (before: they were left behind)."""
    x = _data(n=6, steps=1, shape=(3, 5, 5), classes=4)[0][0]
    torch.manual_seed(0)
    want = ConvBN().double()(x)
    for path, out, left in pool2.run(_deep_copied_compiled, x):
        assert path == "fast" and not left
        torch.testing.assert_close(out, want.detach(), rtol=1e-12, atol=1e-12)
