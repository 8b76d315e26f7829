"""torch.compile and the data-parallel fast path: a compiled model's call leaving its
graph, the local forward compiled (`data_parallel(compile=...)`), logical BatchNorm in a
compiled local forward."""

import copy
import functools
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from data_parallel_helpers import (
    MLP,
    S0,
    B,
    ConvBN,
    _conv_bn_cumulative,
    _data,
    _gather,
    _global,
    _rel,
    _train,
)

import sbp

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
