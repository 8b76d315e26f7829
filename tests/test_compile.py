"""torch.compile on global tensors: whole graphs of local ops and sbp's collective ops.

Each compiled run is compared with the same steps in eager global mode and with
single-process torch on the logical tensors, in float64, to 1e-10. The graphs are
traced with AOT autograd and run by the `aot_eager` backend: the traced program
(collectives, BatchNorm rules, backward) is what is checked; Inductor's code
generation adds minutes of C++ compilation on this machine and is exercised by
the slow test and `benchmarks/compile.py`.
"""

import pytest
import torch
import torch.nn.functional as F

import sbp

S0, S1, B = sbp.split(0), sbp.split(1), sbp.broadcast
TOL = 1e-10


def _counter(backend="aot_eager"):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    return CompileCounterWithBackend(backend)


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class ConvBN(torch.nn.Module):
    """Convolution, BatchNorm (logical statistics over the split batch), linear head."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4 * 6 * 6, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def _mobilenet():
    import torchvision

    return torchvision.models.mobilenet_v2(num_classes=4, dropout=0.0)


MODELS = {
    "mlp": (MLP, (8,)),
    "convbn": (ConvBN, (3, 8, 8)),
    "mobilenet_v2": (_mobilenet, (3, 32, 32)),
}


def _model(name):
    torch.manual_seed(4)
    return MODELS[name][0]().double()


def _batches(name, steps=3, batch=10):
    g = torch.Generator().manual_seed(2)
    shape = MODELS[name][1]
    return [
        (
            torch.randn(batch, *shape, generator=g, dtype=torch.float64),
            torch.randint(0, 4, (batch,), generator=g),
        )
        for _ in range(steps)
    ]


def _cross_entropy(model, x, y):
    return F.cross_entropy(model(x), y)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.5)


def _train(model, batches, loss_fn, place, step=None):
    """Steps of SGD; returns losses, every step's gradients, final parameters and buffers.

    `place(t)` makes a batch tensor global (identity for single-process torch);
    `step` replaces `opt.step` (a compiled one, say)."""
    opt = _sgd(model.parameters())
    step = step(opt) if step else opt.step
    losses, grads = [], []
    for x, y in batches:
        loss = loss_fn(model, place(x), place(y))
        opt.zero_grad()
        loss.backward()
        grads.append([_full(p.grad) for p in model.parameters()])
        step()
        losses.append(loss.item())
    return (
        losses,
        grads,
        [_full(p) for p in model.parameters()],
        [_full(b) for b in model.buffers()],
    )


def _full(t):
    return t.full_tensor() if isinstance(t, sbp.GlobalTensor) else t.detach()


def _split_batch(P):
    me = sbp.env.get_rank()

    def place(t):
        local = sbp.local_slices(t.shape, P, S0, P.coord(me))
        return sbp.to_global(t[local], P, S0)

    return place


def _data_parallel(name):
    """Broadcast parameters, split batch: eager global, then compiled model and optimizer step."""
    P = sbp.placement("cpu", list(range(sbp.env.get_world_size())))
    batches = _batches(name)
    eager = _train(_model(name).to_global(P, B), batches, _cross_entropy, _split_batch(P))
    counter = _counter()
    loss_fn = torch.compile(_cross_entropy, backend=counter, fullgraph=True)
    model = _model(name).to_global(P, B)

    def step(opt):  # torch.optim breaks the graph on purpose at the start of step()
        return torch.compile(opt.step, backend="aot_eager")

    compiled = _train(model, batches, loss_fn, _split_batch(P), step)
    return eager, compiled, counter.frame_count


def _close(got, want, tol=TOL):
    """Largest difference relative to the size of the reference, over lists of tensors."""
    for a, b in zip(got, want, strict=True):
        if isinstance(a, list):
            _close(a, b, tol)
        elif isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())
        else:
            assert abs(a - b) <= tol * max(1.0, abs(b))


WORLDS = [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(4, marks=pytest.mark.slow)]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", ["mlp", "convbn"])
def test_compiled_data_parallel_equals_eager_and_one_process(request, world, name):
    """fullgraph compiled forward + backward and compiled SGD steps; BatchNorm is logical."""
    pool = request.getfixturevalue(f"pool{world}")
    ref = _train(_model(name), _batches(name), _cross_entropy, lambda t: t)
    for eager, compiled, frames in pool.run(_data_parallel, name, timeout=600):
        assert frames == 1  # one graph for the whole forward and loss, recompiled never
        _close(eager, ref)
        _close(compiled, ref)


def _mse(model, x, y):
    return ((model(x) - y) ** 2).mean()


def _mlp_2d():
    """2x2 placement: weights split on dim 1 along the second hierarchy dim, batch on the first."""
    me = sbp.env.get_rank()
    P = sbp.placement("cpu", [[0, 1], [2, 3]])
    results = []
    for compiled in (False, True):
        model = _model("mlp").to_global(P, (B, B))  # then split (to_global re-boxes globals)
        for layer in (model.fc1, model.fc2):
            layer.weight = torch.nn.Parameter(layer.weight.detach().to_global(sbp=(B, S1)))

        def place(t):
            return sbp.to_global(t[sbp.local_slices(t.shape, P, (S0, B), P.coord(me))], P, (S0, B))

        counter = _counter()
        loss_fn = torch.compile(_mse, backend=counter, fullgraph=True) if compiled else _mse
        out = _train(model, _mlp_targets(), loss_fn, place)
        results.append((out, [tuple(p.sbp) for p in model.parameters()], counter.frame_count))
    return results


def _mlp_targets():
    g = torch.Generator().manual_seed(3)
    return [
        (
            torch.randn(7, 8, generator=g, dtype=torch.float64),
            torch.randn(7, 4, generator=g, dtype=torch.float64),
        )
        for _ in range(3)
    ]


def test_compiled_split_weight_mlp_on_2x2_equals_one_process(pool4):
    ref = _train(_model("mlp"), _mlp_targets(), _mse, lambda t: t)
    for (eager, sbps, _), (compiled, csbps, frames) in pool4.run(_mlp_2d):
        assert sbps == csbps == [(B, S1), (B, B), (B, S1), (B, B)]
        assert frames == 1
        _close(eager, ref)
        _close(compiled, ref)


def _graph_recorder():
    """An AOT backend that keeps the forward and backward graphs it was given."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    return aot_autograd(fw_compiler=keep, bw_compiler=keep), graphs


def _ops_in(graph) -> list:
    """The ops a graph calls; an op with effects (sbp's collectives) is called through
    `with_effects(token, op, ...)`, which threads a token through them to keep their order."""
    with_effects = torch.ops.higher_order.with_effects
    return [
        str(n.args[1] if n.target is with_effects else n.target)
        for n in graph.graph.nodes
        if n.op == "call_function"
    ]


def _dropped_collective(name, make_inplace):
    """Loss of the compiled model; collectives are in-place ones on fake tensors if asked."""
    from sbp.comm import functional, shm

    P = sbp.placement("cpu", list(range(sbp.env.get_world_size())))
    model = _model(name).to_global(P, B)
    x, y = _batches(name, steps=1)[0]
    place = _split_batch(P)
    backend, graphs = _graph_recorder()
    tracing, usable, usable_big = functional.tracing, shm.usable, shm.usable_big
    if make_inplace:  # what sbp did before: gloo's in-place collectives, even while tracing
        functional.tracing = lambda t=None: False
        shm.usable = shm.usable_big = lambda t: False
    try:
        loss = torch.compile(_cross_entropy, backend=backend, fullgraph=True)(
            model, place(x), place(y)
        )
        if not make_inplace:  # (in-place ones leave a process group in the graph: no backward)
            loss.backward()
    finally:
        functional.tracing, shm.usable, shm.usable_big = tracing, usable, usable_big
        torch._dynamo.reset()
    grads = [p.grad.full_tensor() for p in model.parameters() if p.grad is not None]
    return loss.item(), grads, [_ops_in(g) for g in graphs]


def test_no_collective_is_dropped_from_the_graph(pool2):
    """In a world of 2 the compiled loss is the one-process loss; the graph holds the
    all-reduces as sbp's op (`sbp::all_reduce`, returning its result). The same run with
    in-place collectives on fake tensors (what tracing would do without the switch) loses
    them."""
    reduce = "sbp.all_reduce.default"
    model = _model("convbn")
    x, y = _batches("convbn", steps=1)[0]
    ref = _cross_entropy(model, x, y)
    ref.backward()
    ref_grads = [p.grad for p in model.parameters()]
    for loss, grads, graphs in pool2.run(_dropped_collective, "convbn", False):
        _close([loss], [ref.item()])
        _close(grads, ref_grads)
        forward = graphs[0]
        # nll_loss (total weight) and BatchNorm (its sums and shift; grads in backward)
        assert forward.count(reduce) >= 2
        assert graphs[1].count(reduce) >= 1
    for loss, _, graphs in pool2.run(_dropped_collective, "convbn", True):
        assert abs(loss - ref.item()) > 1e-3  # the hazard is real: this is what is prevented
        assert reduce not in graphs[0]


def _slice_write(x, rows):
    x[rows].mul_(3)  # (the rows of one rank: the other uses nothing of the collective)
    return x * 1


def _empty_shard_layer_norm(x, w):
    h = x @ w  # (1, 5), split(1); LayerNorm boxes it split(0): one rank's shard is empty
    return F.layer_norm(h, (h.shape[-1],)).pow(2).sum()


def _one_rank_collectives(case):
    """A compiled function where only some ranks use what a collective gives them: each
    rank's graph must still hold it (rank 0's did, rank 1's lost it: a hang until the
    timeout, or collectives paired wrongly). Returns values, gradients, collectives."""
    P = sbp.placement("cpu", [0, 1])
    backend, graphs = _graph_recorder()
    sbp.env.init(timeout=30.0)
    try:
        if case == "slice write":
            x = sbp.tensor(torch.arange(36.0, dtype=torch.float64).view(6, 6), P, S0)
            out = torch.compile(_slice_write, backend=backend, fullgraph=True)(x, slice(1, 3))
            result, grad = (out.full_tensor(), x.full_tensor()), None
        else:
            torch.manual_seed(0)
            x, w = torch.randn(1, 4, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
            gw = sbp.tensor(w, P, S1).requires_grad_()
            fn = torch.compile(_empty_shard_layer_norm, backend=backend, fullgraph=True)
            loss = fn(sbp.tensor(x, P, B), gw)
            loss.backward()
            result, grad = loss.full_tensor(), gw.grad.full_tensor()
    finally:
        sbp.env.init(timeout=60.0)  # (the pool's own)
        torch._dynamo.reset()
    kinds = ("all_to_all", "all_reduce", "all_gather", "broadcast")
    return result, grad, sum(op.count(k) for op in _ops_in(graphs[0]) for k in kinds)


@pytest.mark.parametrize("case", ["slice write", "empty shard"])
def test_a_collective_only_some_ranks_use_stays_in_every_rank_s_graph(pool2, case):
    if case == "slice write":
        x = torch.arange(36.0, dtype=torch.float64).view(6, 6)
        want = (_slice_write(x, slice(1, 3)).clone(), x)
    else:
        torch.manual_seed(0)
        x, w = torch.randn(1, 4, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
        w.requires_grad_()
        loss = _empty_shard_layer_norm(x, w)
        loss.backward()
        want = loss.detach()
    runs = pool2.run(_one_rank_collectives, case, timeout=300)
    assert runs[0][2] == runs[1][2] >= 1  # the same collectives on both ranks
    for result, grad, _ in runs:
        if case == "slice write":
            _close(list(result), list(want))
        else:
            _close([result], [want])
            _close([grad], [w.grad])


def _slice_write_by_inductor(rows):
    """`_slice_write` compiled by inductor, its caches off (a cached program would not be
    the one this code compiles)."""
    import torch._inductor.config as inductor_config

    P = sbp.placement("cpu", [0, 1])
    sbp.env.init(timeout=30.0)
    try:
        with inductor_config.patch(force_disable_caches=True):
            x = sbp.tensor(torch.arange(36.0, dtype=torch.float64).view(6, 6), P, S0)
            out = torch.compile(_slice_write, backend="inductor")(x, rows)
        return out.full_tensor(), x.full_tensor()
    finally:
        sbp.env.init(timeout=60.0)  # (the pool's own)
        torch._dynamo.reset()


def test_inductor_keeps_an_all_reduce_only_some_ranks_use(pool2):
    """Inductor dropped sbp's all-reduce from the graph of the rank that uses nothing of
    its result (its rows of the write are empty): the other rank waited for it until the
    timeout. The op is an ordered effect: never dead code."""
    x = torch.arange(36.0, dtype=torch.float64).view(6, 6)
    want = (_slice_write(x, slice(1, 3)).clone(), x)
    for result in pool2.run(_slice_write_by_inductor, slice(1, 3), timeout=300):
        _close(list(result), list(want))


class _TwoBranches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = ConvBN(), ConvBN()

    def forward(self, x, z):
        return self.a(x), self.b(z)


def _two_branch_step(x, y, z, yz):
    """`_TwoBranches`, traced op by op and compiled by Inductor (caches off), one step."""
    import torch._inductor.config as inductor_config

    import sbp.nn

    P = sbp.placement("cpu", [0, 1])
    place = _split_batch(P)
    torch.manual_seed(0)
    model = sbp.nn.data_parallel(_TwoBranches().double().to_global(P, B), fast=False)
    try:
        with inductor_config.patch(force_disable_caches=True):
            oa, ob = torch.compile(model, backend="inductor")(place(x), place(z))
        loss = F.cross_entropy(oa, place(y)) + F.cross_entropy(ob, place(yz))
        loss.backward()
        return loss.item(), [p.grad.full_tensor() for p in model.parameters()]
    finally:
        torch._dynamo.reset()


def test_inductor_keeps_all_reduces_in_program_order(pool2):
    """The second input's single sample leaves rank 1 a table of zeros for its BatchNorm,
    which depends on nothing: Inductor moved that all-reduce ahead of the first
    BatchNorm's on rank 1 alone (torch loses the ordering edge of effectful ops), the
    ranks paired up different tables, and the loss came out 2.86 against 3.04, with no
    error. `sbp.comm.torch_effects` restores the edge."""
    g = torch.Generator().manual_seed(1)
    x, z = (torch.randn(n, 3, 8, 8, generator=g, dtype=torch.float64) for n in (6, 1))
    y, yz = (torch.randint(0, 4, (n,), generator=g) for n in (6, 1))
    torch.manual_seed(0)
    ref = _TwoBranches().double()
    oa, ob = ref(x, z)
    want = F.cross_entropy(oa, y) + F.cross_entropy(ob, yz)
    want.backward()
    for loss, grads in pool2.run(_two_branch_step, x, y, z, yz, timeout=300):
        assert abs(loss - want.item()) <= 1e-12 * abs(want.item())
        _close(grads, [p.grad for p in ref.parameters()])


def _batch_norm_of_one_sample(x):
    """BatchNorm2d traced op by op (aot_eager) on one sample over two ranks, with sbp's
    shared memory off (as across hosts, on CUDA, or off x86-64): rank 1's shard is empty."""
    import sbp.nn
    from sbp.comm import shm

    P = sbp.placement("cpu", [0, 1])
    usable, shm.usable = shm.usable, lambda t: False
    sbp.env.init(timeout=30.0)
    try:
        model = torch.nn.BatchNorm2d(2).double().to_global(P, B)
        run = torch.compile(sbp.nn.data_parallel(model, fast=False), backend="aot_eager")
        out = run(sbp.tensor(x, P, S0))
        out.pow(3).sum().backward()
        return [out.full_tensor(), model.weight.grad.full_tensor(), model.bias.grad.full_tensor()]
    finally:
        shm.usable = usable
        sbp.env.init(timeout=60.0)  # (the pool's own)
        torch._dynamo.reset()


def test_a_traced_collective_with_a_constant_input_stays_in_its_graph(pool2):
    """On the rank with an empty shard the BatchNorm tables are constants: AOT's
    partitioner moved that rank's backward all-reduce into its forward graph and
    recomputed the forward one in backward (torch's functional collectives are pure
    ops), so the ranks paired different collectives and hung. sbp's collective ops are
    ordered effects, kept where they were traced."""
    x = torch.randn(1, 2, 3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    ref = torch.nn.BatchNorm2d(2).double()
    out = ref(x)
    out.pow(3).sum().backward()
    for got in pool2.run(_batch_norm_of_one_sample, x, timeout=120):
        _close(got, [out.detach(), ref.weight.grad, ref.bias.grad])


def _checkpointed_tensor_parallel(x, w1, w2):
    """A column- then row-split MLP block under torch.utils.checkpoint, compiled; the block
    ends in an all-reduce (relu of the partial sum)."""

    def block(h, a, b):
        return torch.relu(torch.tanh(h @ a.T) @ b.T)

    def loss_of(h, a, b):
        return torch.utils.checkpoint.checkpoint(block, h, a, b, use_reentrant=False).pow(2).sum()

    P = sbp.placement("cpu", [0, 1])
    a, b = sbp.tensor(w1, P, S0).requires_grad_(), sbp.tensor(w2, P, S1).requires_grad_()
    try:
        loss = torch.compile(loss_of, backend="aot_eager")(sbp.tensor(x, P, B), a, b)
        loss.backward()
    finally:
        torch._dynamo.reset()
    return [loss.full_tensor(), a.grad.full_tensor(), b.grad.full_tensor()]


def test_a_collective_inside_activation_checkpointing_compiles(pool2):
    """torch recomputes a checkpointed region's ops in backward, but cannot recompute an
    ordered effect (it saves a token that is None at run time: AssertionError on every
    rank); sbp's collectives there are saved instead (`sbp.comm.torch_effects`)."""
    g = torch.Generator().manual_seed(0)
    x, w1, w2 = (
        torch.randn(*s, generator=g, dtype=torch.float64) for s in ((5, 6), (8, 6), (6, 8))
    )
    a, b = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    loss = torch.relu(torch.tanh(x @ a.T) @ b.T).pow(2).sum()
    loss.backward()
    for got in pool2.run(_checkpointed_tensor_parallel, x, w1, w2):
        _close(got, [loss.detach(), a.grad, b.grad])


def _collectives_of_a_transposed_tensor(t):
    """sbp.comm's in-place all-reduce and broadcast on a transposed (non-contiguous) local
    tensor, eagerly and compiled by Inductor."""
    import torch._inductor.config as inductor_config

    from sbp import comm

    ranks = (0, 1)

    def reduce_and_broadcast(x):
        u, v = (x * 1).t(), (x * 2).t()
        comm.all_reduce(u, "sum", ranks)
        comm.broadcast(v, 1, ranks)
        return u + 0, v + 0

    mine = t * (sbp.env.get_rank() + 1)
    try:
        with inductor_config.patch(force_disable_caches=True):
            got = torch.compile(reduce_and_broadcast, backend="inductor")(mine)
    finally:
        torch._dynamo.reset()
    return list(got), list(reduce_and_broadcast(mine))


def test_collectives_of_a_transposed_tensor_compile(pool2):
    """The traced collectives' fake results had contiguous strides while their eager
    bodies return the input's (a clone): Inductor checks and raised on every rank."""
    t = torch.arange(18.0, dtype=torch.float64).view(6, 3)
    for got, eager in pool2.run(_collectives_of_a_transposed_tensor, t, timeout=300):
        _close(got, [3 * t.t(), 4 * t.t()])
        _close(eager, [3 * t.t(), 4 * t.t()])


def _adam_steps(P, name: str, compiled: bool):
    """A Linear layer's weight after two Adam (AdamW) steps, the step compiled or not; with
    `P`, the layer made global and the batch split."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # (a compiled Adam stacks its step sizes thus)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        x = torch.randn(6, 4)
        if P is not None:
            model.to_global(P, B)
            x = sbp.tensor(x, P, S0)
        optim = getattr(torch.optim, name)(model.parameters(), lr=0.1, foreach=True)
        step = torch.compile(optim.step, backend="aot_eager") if compiled else optim.step
        for _ in range(2):
            optim.zero_grad()
            model(x).pow(2).mean().backward()
            step()
        return model.weight.full_tensor() if P is not None else model.weight.detach()
    finally:
        torch.set_default_dtype(default)
        torch._dynamo.reset()


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_a_compiled_adam_step_on_global_parameters(pool2, name):
    """Compiled, torch's Adam passes its step sizes to `_foreach_addcdiv_` as one local 1-d
    tensor (the `Tensor scalars` overload); before, that raised PlacementError, as a local
    tensor among global ones. It is a list of numbers, taken as the Scalar[] overload takes
    Python numbers."""
    want = _adam_steps(None, name, compiled=False)
    P = sbp.placement("cpu", [0, 1])
    for got in pool2.run(_adam_steps, P, name, True, timeout=300):
        _close([got], [want])


def _collectives_of_a_step(backend):
    """Collectives sbp.comm runs in a training step of ConvBN (logical BatchNorm) made global
    on all ranks, eagerly or compiled with `backend`, after a first step that compiles."""
    P = sbp.placement("cpu", list(range(sbp.env.get_world_size())))
    model = _model("convbn").to_global(P, B)
    run = model if backend is None else torch.compile(model, backend=_counter(backend))
    place = _split_batch(P)
    counts = []
    for x, y in _batches("convbn", steps=2):
        with sbp.comm_stats() as stats:
            F.cross_entropy(run(place(x)), place(y)).backward()
        counts.append(dict(stats.by_kind))
    return counts[-1]


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_a_compiled_step_runs_the_collectives_of_an_eager_one(pool2, backend):
    """No collective is added either: one all-reduce per BatchNorm layer forward and one
    backward (through shared memory on one host, counted as they run), and the gradients'
    flat all-reduce, as in eager mode. A duplicated one (a graph cached from older rules
    had two per layer forward; a partitioner that recomputed one in backward would add
    another) is an extra sync of every rank per layer."""
    eager_runs = pool2.run(_collectives_of_a_step, None)
    compiled_runs = pool2.run(_collectives_of_a_step, backend)
    for eager, compiled in zip(eager_runs, compiled_runs, strict=True):
        assert compiled == eager
        assert eager["all_reduce"] == 3  # BatchNorm forward, backward; the gradients


def _layout_guards():
    """One compiled function fed inputs of several layouts and placements."""
    world = sbp.env.get_world_size()
    P, Q = sbp.placement("cpu", list(range(world))), sbp.placement("cpu", list(range(world))[::-1])
    torch.manual_seed(5)
    w, x = torch.randn(6, 3, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64)
    counter = _counter()
    f = torch.compile(lambda x, w: (x @ w).relu().sum(0), backend=counter, fullgraph=True)
    cases = [(P, S0, B), (P, B, B), (P, S0, B), (P, S1, S0), (Q, S0, B), (P, S0, B)]
    out = []
    for place, sx, sw in cases:
        got = f(sbp.tensor(x, placement=place, sbp=sx), sbp.tensor(w, placement=place, sbp=sw))
        out.append((got.full_tensor(), tuple(got.sbp), counter.frame_count))
    return out, (x @ w).relu().sum(0)


def test_a_new_placement_or_sbp_recompiles(pool2):
    """Dynamo guards on the spec: a new layout gets its own graph, a seen one reuses its own."""
    for out, ref in pool2.run(_layout_guards):
        assert [frames for _, _, frames in out] == [1, 2, 2, 3, 4, 4]
        for got, _, _ in out:
            _close([got], [ref])
        # sum(0) of a batch split is a partial sum; of a broadcast batch, broadcast
        assert [s for _, s, _ in out] == [(sbp.partial_sum,)] + [(B,)] + [(sbp.partial_sum,)] * 4


def _views_of_split_inputs():
    """Slices of split tensors (partial or split views of a base) fed to compiled code:
    Dynamo replays the view on a fake base, through the re-box that made it."""
    world = sbp.env.get_world_size()
    P = sbp.placement("cpu", list(range(world)))
    torch.manual_seed(6)
    x, w = torch.randn(6, 4, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    rows, cols = sbp.tensor(x, placement=P, sbp=S0), sbp.tensor(x, placement=P, sbp=S1)
    f = torch.compile(lambda t, w: (t * 2) @ w, backend="aot_eager")
    model = torch.nn.Linear(4, 2).double()
    want_model = model(x[:4]).detach()
    model.to_global(P, B)
    compiled_model = torch.compile(model, backend="aot_eager")
    wg = sbp.tensor(w, placement=P, sbp=B)
    got = {
        "rows[:4]": f(rows[:4], wg).full_tensor(),
        "rows[2]": f(rows[2].unsqueeze(0), wg).full_tensor(),
        "cols[:, 1:3]": torch.compile(lambda t: t * 2, backend="aot_eager")(cols[:, 1:3]),
        "model(rows[:4])": compiled_model(rows[:4]).full_tensor(),
    }
    got["cols[:, 1:3]"] = got["cols[:, 1:3]"].full_tensor()
    want = {
        "rows[:4]": (x[:4] * 2) @ w,
        "rows[2]": (x[2:3] * 2) @ w,
        "cols[:, 1:3]": x[:, 1:3] * 2,
        "model(rows[:4])": want_model,
    }
    base = sbp.tensor(x, placement=P, sbp=S1)

    def scale_in_place(v):
        v.mul_(3)
        return v * 1

    try:  # the compiled code holds the view's copy, not its base: the write must not be lost
        torch.compile(scale_in_place, backend="aot_eager")(base[:, 1:3])
        written = "no error"
    except Exception as e:
        written = str(e)
    return got, want, (rows[:4].sbp, cols[:, 1:3].sbp), written, base.full_tensor(), x


def test_views_of_split_inputs_compile(pool2):
    """A batch trimmed before a compiled model (batch[:n] of a split batch, a partial view
    in eager) failed with a fake-tensor error: the re-box replayed on a fake base made real
    buffers. A write into such a view inside the compiled code, which eager passes on to
    the base, raises rather than leave the base unwritten."""
    for got, want, view_sbps, written, base, x in pool2.run(_views_of_split_inputs):
        assert view_sbps == ((sbp.partial_sum,), (sbp.partial_sum,))
        for key in want:
            _close([got[key]], [want[key]])
        assert "SbpSignatureError" in written and "cannot reach the base" in written
        assert torch.equal(base, x)


def _copied_views_read_by_compiled_code():
    """Copied views whose base was written after they were taken, passed into compiled
    code: on the call that traces the graph and on a later call that reuses it."""
    P = sbp.placement("cpu", [0, 1])
    torch.manual_seed(7)
    x = torch.randn(5, 7, dtype=torch.float64)
    h = sbp.tensor(x, placement=P, sbp=S1)
    f = torch.compile(lambda t: t.sum(0) * 2, backend="aot_eager")
    first, later = h[:, 1:5], h[:, 2:6]
    h.mul_(10.0)
    got = [f(first).full_tensor()]
    h.add_(1.0)
    got.append(f(later).full_tensor())
    return got, [(x * 10)[:, 1:5].sum(0) * 2, (x * 10 + 1)[:, 2:6].sum(0) * 2]


def test_copied_views_read_by_compiled_code_show_their_base_now(pool2):
    """A copied view (a slice across a split dim) shows what its base holds when compiled
    code reads it, as in eager: it went in as it was when taken."""
    for got, want in pool2.run(_copied_views_read_by_compiled_code):
        _close(got, want)


def _cache_keys():
    """AOT autograd's cache key of one global tensor, as sbp is, and as if its source differed."""
    import sys

    tensor_module = sys.modules["sbp.tensor"]
    P = sbp.placement("cpu", [0])
    t = sbp.tensor(torch.ones(3), placement=P, sbp=B)
    now = t._stable_hash_for_caching()
    real = tensor_module._source_fingerprint
    tensor_module._source_fingerprint = lambda: "another version of sbp"
    try:
        edited = t._stable_hash_for_caching()
    finally:
        tensor_module._source_fingerprint = real
    return now, t._stable_hash_for_caching(), edited


def test_the_compile_cache_key_names_the_sbp_source(pool1):
    """A graph traced by another version of sbp's rules is never served from torch's on-disk
    cache: the key of a global input changes with sbp's source (it did not, and a benchmark
    ran a stale graph with two all-reduces per BatchNorm instead of one)."""
    for now, again, edited in pool1.run(_cache_keys):
        assert now == again
        assert edited != now


def _tangent_layouts():
    """Backward from compiled outputs, with gradients in other layouts than the outputs'."""
    P = sbp.placement("cpu", list(range(sbp.env.get_world_size())))
    torch.manual_seed(6)
    w, x = torch.randn(6, 3, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64)
    dy = torch.randn(5, 3, dtype=torch.float64)
    f = torch.compile(lambda x, w: (x @ w) * 2, backend=_counter(), fullgraph=True)
    grads = []
    for sx, sw, sdy in [(S0, B, B), (S1, S0, B), (S0, B, S1)]:
        gw = sbp.tensor(w, placement=P, sbp=sw).requires_grad_()
        out = f(sbp.tensor(x, placement=P, sbp=sx), gw)
        out.backward(sbp.tensor(dy, placement=P, sbp=sdy))
        grads.append((tuple(out.sbp), gw.grad.full_tensor(), tuple(gw.grad.sbp)))
    return grads


def test_gradients_in_other_layouts_than_the_outputs(pool2):
    """Outputs split or partial, gradients broadcast or split: each is re-boxed to the layout
    the traced backward expects (tangent coercion), and the weight gradient is exact."""
    torch.manual_seed(6)
    x = torch.randn(6, 3, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64)
    x, dy = x[1], torch.randn(5, 3, dtype=torch.float64)
    want = x.t() @ (2 * dy)
    for grads in pool2.run(_tangent_layouts):
        assert [g[0] for g in grads] == [(S0,), (sbp.partial_sum,), (S0,)]
        for _, got, _ in grads:
            _close([got], [want])
        assert [g[2] for g in grads] == [(B,), (S0,), (B,)]  # each leaf's grad in its sbp


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_compiled_mobilenet_v2_data_parallel_equals_one_process(request, world):
    """mobilenet_v2, fullgraph, logical BatchNorm over the split batch (52 BatchNorms).

    Three steps of mobilenet_v2 on 10 images are ill-conditioned: scaling the input by
    1 + 1e-15 moves one-process torch's own losses, gradients and parameters by 1.1e-8
    (relative to their size), so rounding alone differs by ~5e-8 here: 1e-6, not 1e-10."""
    pool = request.getfixturevalue(f"pool{world}")
    ref = _train(_model("mobilenet_v2"), _batches("mobilenet_v2"), _cross_entropy, lambda t: t)
    for eager, compiled, frames in pool.run(_data_parallel, "mobilenet_v2", timeout=1800):
        assert frames == 1
        _close(eager, ref, 1e-6)
        _close(compiled, ref, 1e-6)


class _Rolled(torch.nn.Module):
    """Ops whose rules are new in this model's path: GroupNorm, PReLU, roll, a reshape of a
    permuted tensor (a view of a local that cannot be viewed), gather, ELU, smooth L1."""

    def __init__(self):
        super().__init__()
        self.lin, self.norm, self.act = (
            torch.nn.Linear(6, 6),
            torch.nn.GroupNorm(2, 6),
            torch.nn.PReLU(6),
        )

    def forward(self, x):
        h = self.act(self.norm(self.lin(x).view(len(x), 6, 1))).view(len(x), 2, 3)
        h = torch.roll(h, 1, 2).permute(0, 2, 1).reshape(len(x), 6)
        return F.elu(h) + torch.gather(h, 1, torch.zeros_like(h, dtype=torch.long))


def _rolled_step():
    P = sbp.placement("cpu", [0, 1])
    torch.manual_seed(0)
    model = _Rolled().double().to_global(P, B)
    sbp.nn.data_parallel(model, fast=False)  # (traced op by op through the global tensors)
    g = torch.Generator().manual_seed(3)
    x, t = (torch.randn(8, 6, dtype=torch.float64, generator=g) for _ in range(2))
    place = _split_batch(P)
    loss_of = torch.compile(
        lambda a, b: F.smooth_l1_loss(model(a), b), fullgraph=True, backend="aot_eager"
    )
    with sbp.comm_stats() as stats:
        loss = loss_of(place(x), place(t))
        loss.backward()
    return _full(loss), [_full(p.grad) for p in model.parameters()], dict(stats.fallbacks)


def test_compiled_new_rules_equal_one_process(pool2):
    torch.manual_seed(0)
    model = _Rolled().double()
    g = torch.Generator().manual_seed(3)
    x, t = (torch.randn(8, 6, dtype=torch.float64, generator=g) for _ in range(2))
    want = F.smooth_l1_loss(model(x), t)
    want.backward()
    for loss, grads, fallbacks in pool2.run(_rolled_step):
        _close([loss, *grads], [want.detach(), *(p.grad for p in model.parameters())])
        assert fallbacks == {}


def _add_partial_into(w, x):
    w.add_(x.sum(0))  # x split(0): its sum is a partial sum; w stays broadcast
    return w * 2


def _inplace_keeps_layout():
    P = sbp.placement("cpu", list(range(sbp.env.get_world_size())))
    x = torch.arange(12, dtype=torch.float64).reshape(4, 3)
    w = sbp.tensor(torch.ones(3, dtype=torch.float64), placement=P, sbp=B)
    eager = _add_partial_into(w, sbp.tensor(x, placement=P, sbp=S0))
    eager_sbp = tuple(w.sbp)
    w = sbp.tensor(torch.ones(3, dtype=torch.float64), placement=P, sbp=B)
    f = torch.compile(_add_partial_into, backend=_counter(), fullgraph=True)
    compiled = f(w, sbp.tensor(x, placement=P, sbp=S0))
    return eager.full_tensor(), eager_sbp, compiled.full_tensor(), tuple(w.sbp), _full(w)


def test_inplace_op_keeps_its_layout_eager_and_traced(pool2):
    """`w.add_(partial)` on a broadcast `w` keeps `w` broadcast (the partial sum is reduced
    first), as torch keeps the tensor it writes; so a graph can write its input in place."""
    x = torch.arange(12, dtype=torch.float64).reshape(4, 3)
    want = 1 + x.sum(0)
    for eager, eager_sbp, compiled, sbp_after, w in pool2.run(_inplace_keeps_layout):
        _close([eager, compiled, w], [2 * want, 2 * want, want])
        assert eager_sbp == (B,) and sbp_after == (B,)
