"""Losses of the data-parallel fast path's outputs on local tensors (sbp.data_parallel.outputs).

Every case computes the loss and the parameters' gradients in one process on the logical
batch (float64) and compares; it also counts the global ops the loss ran op by op, which
say whether it ran on the local tensors (none) or fell back.
"""

import pytest
import torch
import torch.nn.functional as F

import sbp

S0, B = sbp.split(0), sbp.broadcast
N, CLASSES = 7, 5  # uneven on two ranks
POSITIONS = 3  # of the "positions" output: scores (N, CLASSES, POSITIONS), a K-dim loss


class Net(torch.nn.Module):
    """Class scores (N, C) (or the same as regression outputs), log-probabilities, or scores
    per position (N, C, POSITIONS)."""

    def __init__(self, output="scores"):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh())
        self.head = torch.nn.Linear(8, CLASSES * (POSITIONS if output == "positions" else 1))
        self.output = output

    def forward(self, x):
        out = self.head(self.body(x))
        if self.output == "positions":
            return out.view(len(x), CLASSES, POSITIONS)
        return F.log_softmax(out, dim=1) if self.output == "log_probs" else out


class _Count:
    """Counts the global ops dispatched op by op (an observer of `sbp.ops.registry`)."""

    def __init__(self):
        self.ops = 0

    def direct(self, *args):
        self.ops += 1

    strategy = custom = direct


def _data(ignored=False, output="scores"):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(N, 6, dtype=torch.float64, generator=g)
    if output == "regression":  # float targets in [0, 1) laid out as the output
        return x, torch.rand(N, CLASSES, dtype=torch.float64, generator=g)
    y = torch.randint(0, CLASSES, (N, POSITIONS) if output == "positions" else (N,), generator=g)
    if ignored:
        y[5] = -100  # on the second of two ranks
    return x, y


def _global(t, P):
    me = sbp.env.get_rank()
    return sbp.to_global(t[sbp.local_slices(t.shape, P, (S0,), P.coord(me))], P, S0)


def _loss_and_grads(loss_fn, world, output, ignored, weighted, use, target_sbp=S0):
    """On each rank: the fast path's output, `use(out)` (or nothing), then the loss of it
    and the targets laid out as `target_sbp`; returns
    the logical loss, the gradients, the ops run op by op in the loss's forward, and the
    output's class when the loss saw it."""
    from sbp.ops import registry

    P = sbp.placement("cpu", list(range(world)))
    x, y = _data(ignored, output)
    torch.manual_seed(0)
    model = Net(output).double().to_global(P, B)
    weight = torch.linspace(0.5, 2.0, CLASSES, dtype=torch.float64)
    kwargs = {"weight": sbp.to_global(weight, P, B)} if weighted else {}
    out = model(_global(x, P))
    if use is not None:
        out = use(out)
    kind = type(out).__name__
    count = _Count()
    registry.observers.append(count)
    try:
        target = _global(y, P) if target_sbp == S0 else sbp.to_global(y, P, target_sbp)
        loss = loss_fn(out, target, **kwargs)
    finally:
        registry.observers.remove(count)
    (loss if loss.dim() == 0 else loss.sum()).backward()
    grads = [p.grad.full_tensor() for p in model.parameters()]
    return loss.full_tensor(), grads, count.ops, kind


def _reference(loss_fn, output, ignored, weighted, use):
    x, y = _data(ignored, output)
    torch.manual_seed(0)
    model = Net(output).double()
    weight = torch.linspace(0.5, 2.0, CLASSES, dtype=torch.float64)
    kwargs = {"weight": weight} if weighted else {}
    out = model(x)
    if use is not None:
        out = use(out)
    loss = loss_fn(out, y, **kwargs)
    (loss if loss.dim() == 0 else loss.sum()).backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def _close(a, b):
    assert a.shape == b.shape
    assert torch.allclose(a, b, rtol=1e-12, atol=1e-14), (a, b)


def _check(results, reference, kind, local):
    """Every rank's loss and gradients equal one process's; the output had class `kind`
    when the loss saw it, and the loss ran on the local tensors (`local`) or op by op."""
    ref_loss, ref_grads = reference
    for loss, grads, ops, seen in results:
        assert seen == kind
        assert ops == 0 if local else ops > 0
        _close(loss, ref_loss)
        for g, r in zip(grads, ref_grads, strict=True):
            _close(g, r)


LOSSES = {
    "cross_entropy": (F.cross_entropy, "scores"),
    "cross_entropy_sum": (lambda o, t, **k: F.cross_entropy(o, t, reduction="sum", **k), "scores"),
    "cross_entropy_none": (
        lambda o, t, **k: F.cross_entropy(o, t, reduction="none", **k),
        "scores",
    ),
    "label_smoothing": (
        lambda o, t, **k: F.cross_entropy(o, t, label_smoothing=0.1, **k),
        "scores",
    ),
    "module": (lambda o, t, **k: torch.nn.CrossEntropyLoss(**k)(o, t), "scores"),
    "nll_loss": (F.nll_loss, "log_probs"),
    "positions": (F.cross_entropy, "positions"),  # K-dim: (N, C, d) scores, (N, d) targets
    "positions_none": (
        lambda o, t, **k: F.cross_entropy(o, t, reduction="none", label_smoothing=0.1, **k),
        "positions",
    ),
}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("ignored,weighted", [(False, False), (True, False), (True, True)])
def test_a_loss_of_an_output_runs_on_local_tensors(pool2, world, name, ignored, weighted):
    loss_fn, output = LOSSES[name]
    args = (loss_fn, world, output, ignored, weighted, None)
    # (a world of one in this process: no launcher variables, no process group)
    results = pool2.run(_loss_and_grads, *args) if world == 2 else [_loss_and_grads(*args)]
    reference = _reference(loss_fn, output, ignored, weighted, None)
    _check(results, reference, "FastPathOutput", local=True)


REGRESSION = {
    "mse": F.mse_loss,
    "mse_sum": lambda o, t: F.mse_loss(o, t, reduction="sum"),
    "mse_none": lambda o, t: F.mse_loss(o, t, reduction="none"),
    "l1": F.l1_loss,
    "smooth_l1": lambda o, t: F.smooth_l1_loss(o, t, beta=0.5),
    "huber": lambda o, t: F.huber_loss(o, t, delta=0.5),
    "bce_with_logits": F.binary_cross_entropy_with_logits,
    "module": lambda o, t: torch.nn.MSELoss()(o, t),
}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", sorted(REGRESSION))
def test_an_elementwise_loss_of_an_output_runs_on_local_tensors(pool2, world, name):
    args = (REGRESSION[name], world, "regression", False, False, None)
    results = pool2.run(_loss_and_grads, *args) if world == 2 else [_loss_and_grads(*args)]
    reference = _reference(REGRESSION[name], "regression", False, False, None)
    _check(results, reference, "FastPathOutput", local=True)


def test_an_elementwise_loss_with_a_weight_runs_op_by_op(pool2):
    """A weight (or pos_weight, size_average, reduce) is left to the rule: equal to one
    process all the same."""
    weighted = lambda o, t: F.mse_loss(o, t, weight=torch.ones_like(t) * 0.5)  # noqa: E731
    results = pool2.run(_loss_and_grads, weighted, 2, "regression", False, False, None)
    reference = _reference(weighted, "regression", False, False, None)
    _check(results, reference, "FastPathOutput", local=False)


def _learnt_target(world):
    """mse of an output and a target that requires grad (distillation, say): the local loss
    declines (the target's local tensor has no graph); its gradient and the model's equal
    one process's."""
    P = sbp.placement("cpu", list(range(world)))
    x, y = _data(output="regression")
    torch.manual_seed(0)
    model = Net().double().to_global(P, B)
    target = _global(y, P).requires_grad_()
    out = model(_global(x, P))
    kind = type(out).__name__
    F.mse_loss(out, target).backward()
    grads = [p.grad.full_tensor() for p in model.parameters()]
    return kind, target.grad.full_tensor(), grads


def test_a_target_that_requires_grad_gets_its_gradient(pool2):
    x, y = _data(output="regression")
    torch.manual_seed(0)
    model = Net().double()
    y.requires_grad_()
    F.mse_loss(model(x), y).backward()
    for kind, target_grad, grads in pool2.run(_learnt_target, 2):
        assert kind == "FastPathOutput"
        _close(target_grad, y.grad)
        for g, p in zip(grads, model.parameters(), strict=True):
            _close(g, p.grad)


def _in_place(out):
    return out.mul_(2)


def _hooked(out):
    seen = []
    out.register_hook(lambda g: seen.append(g) or g * 3)
    return out


USES = {"in_place": _in_place, "hook": _hooked, "view": lambda out: out.view(N, CLASSES)}


def _metadata_read(out):
    assert out.shape == out.size() == (N, CLASSES) and out.size(1) == CLASSES
    assert (out.dim(), out.ndim, len(out), out.numel()) == (2, 2, N, N * CLASSES)
    assert out.dtype == torch.float64 and out.is_floating_point() and out.requires_grad
    assert out.device.type == "cpu" and not out.is_cuda
    return out


def test_reading_the_shape_keeps_an_output_whose_loss_runs_locally(pool2):
    """Shape, dtype and device reads (the logical ones) change nothing: the output stays a
    FastPathOutput and its loss runs on the local tensors."""
    results = pool2.run(_loss_and_grads, F.cross_entropy, 2, "scores", False, False, _metadata_read)
    reference = _reference(F.cross_entropy, "scores", False, False, _metadata_read)
    _check(results, reference, "FastPathOutput", local=True)


@pytest.mark.parametrize("use", sorted(USES))
def test_any_other_use_first_makes_an_output_a_global_tensor(pool2, use):
    """An output used for anything else before its loss is a plain GlobalTensor from then
    on: its loss runs op by op and sees what the use did."""
    results = pool2.run(_loss_and_grads, F.cross_entropy, 2, "scores", False, False, USES[use])
    reference = _reference(F.cross_entropy, "scores", False, False, USES[use])
    _check(results, reference, "GlobalTensor", local=False)


def test_targets_laid_out_otherwise_run_the_loss_op_by_op(pool2):
    """Targets not split as the batch (here whole on every rank): the local loss declines,
    the rule moves them, and the result is one process's."""
    results = pool2.run(_loss_and_grads, F.cross_entropy, 2, "scores", False, False, None, B)
    reference = _reference(F.cross_entropy, "scores", False, False, None)
    _check(results, reference, "FastPathOutput", local=False)


def _compiled_losses(steps):
    from torch._dynamo.utils import counters

    P = sbp.placement("cpu", [0])
    x, y = _data()
    torch.manual_seed(0)
    model = Net().double().to_global(P, B)
    loss_of = torch.compile(lambda out, t: F.cross_entropy(out, t), backend="eager")
    torch._dynamo.reset()
    counters.clear()
    losses, kinds = [], []
    for _ in range(steps):
        out = model(_global(x, P))
        kinds.append(type(out).__name__)
        loss = loss_of(out, _global(y, P))
        loss.backward()
        losses.append(loss.full_tensor())
    return losses, kinds, counters["stats"]["unique_graphs"]


def test_an_output_passed_to_a_compiled_function_compiles_it_once():
    """Compiled code checks its inputs' types before sbp's code runs: the first output it
    gets becomes a GlobalTensor as it is traced, and the model returns GlobalTensors from
    then on, so the function is compiled once."""
    ref_loss, _ = _reference(F.cross_entropy, "scores", False, False, None)
    losses, kinds, graphs = _compiled_losses(3)
    torch._dynamo.reset()
    assert kinds == ["FastPathOutput", "GlobalTensor", "GlobalTensor"]
    assert graphs == 1
    for loss in losses:
        _close(loss, ref_loss)


def _backward(loss, params, variant, seen):
    """`variant` of a backward from `loss` (global or plain); returns the loss's `.grad`
    where it was retained."""
    if variant == "plain":
        loss.backward()
    elif variant == "twice":  # (the second one accumulates)
        loss.backward(retain_graph=True)
        loss.backward()
    elif variant == "gradient":
        loss.backward(gradient=torch.full_like(loss, 2.0))
    elif variant == "inputs":
        loss.backward(inputs=params[:2])
    elif variant == "hook":
        loss.register_hook(lambda g: seen.append(1) or g * 3)
        loss.backward()
    elif variant == "retain_grad":
        loss.retain_grad()
        loss.backward()
        return loss.grad
    elif variant == "scaled":  # (an op of the loss first)
        (loss * 0.5).backward()
    elif variant == "scaled inputs":  # (the global loss's graph, given parameters)
        (loss * 0.5).backward(inputs=params[1:3])
    elif variant == "autograd":  # (torch.autograd.backward is not the method)
        torch.autograd.backward([loss])
    elif variant == "autograd inputs":
        torch.autograd.backward(loss, inputs=params[1:3])
    return None


def _backward_of_loss(world, variant):
    """On each rank: the fast path's loss, `variant` of its backward; returns the loss's
    class before backward, the ops run op by op during backward, the gradients, whether a
    hook on the loss ran, and the loss's retained gradient."""
    from sbp.ops import registry

    P = sbp.placement("cpu", list(range(world)))
    x, y = _data()
    torch.manual_seed(0)
    model = Net().double().to_global(P, B)
    loss = F.cross_entropy(model(_global(x, P)), _global(y, P))
    params = list(model.parameters())
    kind, count, seen = type(loss).__name__, _Count(), []
    registry.observers.append(count)
    try:
        grad = _backward(loss, params, variant, seen)
    finally:
        registry.observers.remove(count)
    grads = [None if p.grad is None else p.grad.full_tensor() for p in params]
    return kind, count.ops, grads, bool(seen), None if grad is None else grad.full_tensor()


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize(
    "variant",
    [
        "plain",
        "twice",
        "gradient",
        "inputs",
        "hook",
        "retain_grad",
        "scaled",
        "scaled inputs",
        "autograd",
        "autograd inputs",
    ],
)
def test_a_loss_s_backward_runs_on_the_local_graph(request, world, variant):
    """A reduced loss of an output is a FastPathLoss: `loss.backward()` (retain_graph, or
    inputs: the parameters' local leaves) runs the local graph's backward from this rank's
    loss, with no op run op by op; a backward given a gradient, a hook, retain_grad or an
    op of the loss first take the global loss's own graph. Every way, the gradients (and
    the hook's effect, and the retained gradient) equal one process's. (`inputs` gave the
    parameters no gradient before, of a FastPathLoss or of a loss used first: the global
    parameters are not in the local graph; so did `torch.autograd.backward(loss, inputs=)`
    until this session.)"""
    torch.manual_seed(0)
    model = Net().double()
    x, y = _data()
    loss = F.cross_entropy(model(x), y)
    params = list(model.parameters())
    seen = []
    ref_grad = _backward(loss, params, variant, seen)
    want = [p.grad for p in params]
    pool = request.getfixturevalue(f"pool{world}")
    for kind, ops, grads, hooked, grad in pool.run(_backward_of_loss, world, variant):
        assert kind == "FastPathLoss"
        local = ("plain", "twice", "inputs", "autograd", "autograd inputs")
        assert (ops == 0) == (variant in local)
        assert hooked == bool(seen)
        for g, w in zip(grads, want, strict=True):
            assert (g is None) == (w is None)
            if w is not None:
                _close(g, w)
        if ref_grad is not None:
            _close(grad, ref_grad)


def _grads_by_autograd(loss_of, params, variant):
    """`torch.autograd.grad` of `loss_of()` at `params`: the gradients, and where `variant`
    is "penalty", the parameters' `.grad` after a backward of the loss plus the squared
    norm of those gradients (a gradient penalty: create_graph)."""
    if variant == "grad":
        return list(torch.autograd.grad(loss_of(), params[1:3])), None
    if variant == "output":  # (a model's output, given its gradient)
        out, weight = loss_of(output=True)
        return list(torch.autograd.grad(out, params[:2], grad_outputs=weight)), None
    loss = loss_of()
    grads = torch.autograd.grad(loss, params, create_graph=True)
    (loss + sum((g * g).sum() for g in grads)).backward()
    return list(grads), [p.grad for p in params]


def _autograd_grads(world, variant):
    P = sbp.placement("cpu", list(range(world)))
    x, y = _data()
    torch.manual_seed(0)
    model = Net().double().to_global(P, B)
    gx, gy = _global(x, P), _global(y, P)
    weight = _global(torch.linspace(0, 1, N * CLASSES, dtype=torch.float64).view(N, -1), P)

    def loss_of(output=False):
        return (model(gx), weight) if output else F.cross_entropy(model(gx), gy)

    grads, after = _grads_by_autograd(loss_of, list(model.parameters()), variant)
    layouts = [g.sbp for g in grads]
    grads = [g.full_tensor() for g in grads]
    return layouts, grads, None if after is None else [g.full_tensor() for g in after]


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("variant", ["grad", "output", "penalty"])
def test_autograd_grad_at_the_parameters_of_the_fast_path(request, world, variant):
    """`torch.autograd.grad(loss, params)` of a fast-path loss (or output) gives the
    logical gradients, as partial sums (each rank's share, summed when used), and a
    gradient penalty trains as in one process. (It raised "appears to not have been used
    in the graph" before: the global parameters are in no graph, their local leaves are.)"""
    torch.manual_seed(0)
    model = Net().double()
    x, y = _data()
    weight = torch.linspace(0, 1, N * CLASSES, dtype=torch.float64).view(N, -1)

    def loss_of(output=False):
        return (model(x), weight) if output else F.cross_entropy(model(x), y)

    want, want_after = _grads_by_autograd(loss_of, list(model.parameters()), variant)
    pool = request.getfixturevalue(f"pool{world}")
    for layouts, grads, after in pool.run(_autograd_grads, world, variant):
        assert all(nd == (sbp.partial_sum,) for nd in layouts)
        for g, w in zip(grads, want, strict=True):
            _close(g, w.detach())
        for g, w in zip(after or [], want_after or [], strict=True):
            _close(g, w)


def _model_for_penalty(kind):
    torch.manual_seed(0)
    if kind == "batch_norm":  # (logical statistics over the ranks: sums in the backward)
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(), torch.nn.Linear(8, 5)
        ).double()
    return Net().double()


def _input_gradient_penalty(world, kind="mlp"):
    """WGAN-GP's penalty: the gradient of the model's output at its input (create_graph),
    then a backward of the output's mean plus the penalty. Global when `world`: the input
    gradient, whether it requires grad, the parameters' gradients (logical values)."""
    import sbp.nn

    model = _model_for_penalty(kind)
    x, _ = _data()
    if world is None:
        xs = x.clone().requires_grad_()
    else:
        P = sbp.placement("cpu", list(range(world)))
        model.to_global(P, B)
        xs = _global(x, P).requires_grad_()
    out = model(xs)
    (g,) = torch.autograd.grad(out, xs, grad_outputs=torch.ones_like(out), create_graph=True)
    (out.mean() + 10 * (g.norm(2, dim=1) - 1).pow(2).mean()).backward()
    if world is None:
        return g.detach(), g.requires_grad, [p.grad for p in model.parameters()]
    path = sbp.nn.fast_path.state(model).last_path
    grads = [p.grad.full_tensor() for p in model.parameters()]
    return g.detach().full_tensor(), g.requires_grad and path == "fast", grads


@pytest.mark.parametrize("kind", ["mlp", "batch_norm"])
@pytest.mark.parametrize("world", [1, 2])
def test_a_penalty_on_the_input_gradient(request, world, kind):
    """The input's gradient from the fast path's local graph is differentiable under
    create_graph (before: it did not require grad, and the parameters' gradients missed
    the penalty's, silently), through logical BatchNorm too (before: a raw RuntimeError
    from its sums, or half the weight's gradient: an output's gradient re-boxed into the
    local graph was not differentiable)."""
    want, differentiable, want_grads = _input_gradient_penalty(None, kind)
    assert differentiable
    pool = request.getfixturevalue(f"pool{world}")
    for g, fast_and_differentiable, grads in pool.run(_input_gradient_penalty, world, kind):
        assert fast_and_differentiable
        _close(g, want)
        for got, w in zip(grads, want_grads, strict=True):
            _close(got, w)


def _penalty_through_a_re_box(world):
    """x split over the ranks, re-boxed to broadcast and cubed; the gradient at x with
    create_graph, then a backward of its squares: x's gradient (logical)."""
    P = sbp.placement("cpu", list(range(world)))
    x, _ = _data()
    gx = _global(x, P).requires_grad_()
    f = (gx.to_global(sbp=B) ** 3).sum() + (sbp.to_global(gx.to_local() ** 2, P, S0)).sum()
    (g,) = torch.autograd.grad(f, gx, create_graph=True)
    (g * g).sum().backward()
    return g.detach().full_tensor(), gx.grad.full_tensor()


def test_a_penalty_through_re_boxes(pool2):
    """The gradients of to_global, to_local and a re-box are differentiable under
    create_graph (before: their backward made new tensors outside autograd, and the
    penalty's gradient was missing, silently)."""
    x, _ = _data()
    xs = x.clone().requires_grad_()
    f = (xs**3).sum() + (xs**2).sum()
    (g,) = torch.autograd.grad(f, xs, create_graph=True)
    (g * g).sum().backward()
    for got_g, got_grad in pool2.run(_penalty_through_a_re_box, 2):
        _close(got_g, g.detach())
        _close(got_grad, xs.grad)
