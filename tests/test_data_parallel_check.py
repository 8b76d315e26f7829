"""The data-parallel checking pass and the first local run's verdict: what runs on the
fast path, what runs op by op, and why (the check's reasons, warned once)."""

import contextlib
import copy
import functools
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from data_parallel_helpers import MLP, S0, B, _data, _global, _rel, _train

import sbp


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
