"""torch's recurrent layers (`nn.LSTM`, `nn.GRU`, `nn.RNN`) on global tensors
(sbp.nn.torch_recurrent, sbp.data_parallel.families.recurrent).

Their forward (and their cells') makes a missing initial state as a local tensor; `module.to_global` gives
them a global one. On the data-parallel fast path the check takes torch's recurrent call
as a whole, so these models run on local shards. Each test trains on global tensors and in
one process on the logical batch, float64 unless said.
"""

import contextlib
import functools
import warnings

import pytest
import torch
from fast_path_training import assert_trains_as_one_process, train

import sbp

B = sbp.broadcast
E, H, L, CLASSES = 4, 5, 6, 3
KINDS = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU, "rnn": torch.nn.RNN}


class Recurrent(torch.nn.Module):
    """A recurrent layer, then a head on its last output and its final state."""

    def __init__(self, kind="lstm", batch_first=True, given_state=False, layers=2, **options):
        super().__init__()
        self.rnn = KINDS[kind](E, H, num_layers=layers, batch_first=batch_first, **options)
        out = self.rnn.proj_size or H
        self.head = torch.nn.Linear(out * (2 if self.rnn.bidirectional else 1), CLASSES)
        self.given_state = given_state

    def forward(self, x, h0=None):
        """x: (N, L, E); h0: (N, layers, H). (The fast path takes inputs split on dim 0.)"""
        x = x if self.rnn.batch_first else x.transpose(0, 1)
        y, state = self.rnn(x, h0.transpose(0, 1)) if self.given_state else self.rnn(x)
        h = state[0] if isinstance(state, tuple) else state
        last = y[:, -1] if self.rnn.batch_first else y[-1]
        return self.head(last) + h[-1].sum(-1, keepdim=True)


class Cells(torch.nn.Module):
    """An LSTM cell and a GRU cell stepped along the sequence by hand."""

    def __init__(self):
        super().__init__()
        self.lstm, self.gru = torch.nn.LSTMCell(E, H), torch.nn.GRUCell(H, H)
        self.head = torch.nn.Linear(H, CLASSES)

    def forward(self, x, h0=None):
        state, g = None, None
        for t in range(x.shape[1]):
            state = self.lstm(x[:, t], state)
            g = self.gru(state[0], g)
        return self.head(g)


def _data(n, steps=2, dtype=torch.float64):
    g = torch.Generator().manual_seed(n)
    return [
        (
            torch.randn(n, L, E, generator=g, dtype=dtype),
            torch.randn(n, 2, H, generator=g, dtype=dtype),
            torch.randint(0, CLASSES, (n,), generator=g),
        )
        for _ in range(steps)
    ]


MODELS = {
    "lstm": Recurrent,
    "gru-sequence-first": functools.partial(Recurrent, "gru", batch_first=False),
    "rnn-relu-bidirectional": functools.partial(
        Recurrent, "rnn", nonlinearity="relu", bidirectional=True
    ),
    "lstm-projected-bidirectional": functools.partial(Recurrent, proj_size=2, bidirectional=True),
    "gru-given-state": functools.partial(Recurrent, "gru", given_state=True),
    "cells": Cells,
}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("n", [6, 7])
def test_recurrent_layers_train_on_the_fast_path(pool2, name, n):
    """Before: PlacementError ("mixes global tensors with a local torch.Tensor": the zero
    state torch's forward makes), and under global_mode op by op, gathering the batch."""
    assert_trains_as_one_process(pool2, MODELS[name], _data(n))


@pytest.mark.parametrize("name", ["lstm", "gru-sequence-first"])
def test_recurrent_layers_train_op_by_op(pool2, name):
    """fast=False: torch's recurrent kernel falls back to broadcast inputs, exactly."""
    assert_trains_as_one_process(pool2, MODELS[name], _data(5), fast=False, path="per-op")


def test_an_lstm_in_float32_and_a_rank_without_samples(pool4):
    """float32 reaches mkldnn's kernel on the CPU; a batch of 3 over 4 ranks leaves one
    rank an empty shard."""
    data = _data(3, dtype=torch.float32)
    assert_trains_as_one_process(pool4, MODELS["lstm"], data, dtype=torch.float32)


def _dropout_run(data, fast):
    P = sbp.placement("cpu", [0, 1])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = train(functools.partial(Recurrent, dropout=0.5), data, P, fast=fast)
    return result, [str(w.message) for w in seen if "runs op by op" in str(w.message)]


def test_dropout_between_layers_runs_op_by_op(pool2):
    """torch draws the masks between layers inside its kernel, where the local run cannot
    draw the op-by-op path's: the module runs op by op, as with fast=False, and the
    warning says why (before: only the op inside that moved)."""
    data = _data(6)
    for ((losses, params, paths), said), ((want_losses, want_params, _), _) in zip(
        pool2.run(_dropout_run, data, True), pool2.run(_dropout_run, data, False), strict=True
    ):
        assert len(said) == 1 and "lstm is not taken whole (dropout between layers" in said[0]
        assert paths == ["per-op"] * len(data)
        assert losses == want_losses
        for got, ref in zip(params, want_params, strict=True):
            torch.testing.assert_close(got, ref, rtol=0, atol=0)


def _unbatched(x, h0):
    P = sbp.placement("cpu", [0, 1])
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(E, H, num_layers=2).double().to_global(P, B)
    cell = torch.nn.GRUCell(E, H).double().to_global(P, B)
    gx = sbp.tensor(x, placement=P, sbp=B)
    out, (h, c) = lstm(gx)
    given, _ = lstm(gx, tuple(sbp.tensor(t, P, B) for t in h0))
    return [t.full_tensor() for t in (out, h, c, given, cell(gx[0]))]


def test_an_unbatched_sequence(pool2):
    """A 2-d input (one sequence) gets a 2-d zero state, broadcast; a cell's 1-d input
    a 1-d one."""
    x = torch.randn(L, E, dtype=torch.float64)
    h0 = (torch.randn(2, H, dtype=torch.float64), torch.randn(2, H, dtype=torch.float64))
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(E, H, num_layers=2).double()
    cell = torch.nn.GRUCell(E, H).double()
    out, (h, c) = lstm(x)
    want = [out, h, c, lstm(x, h0)[0], cell(x[0])]
    for got in pool2.run(_unbatched, x, h0):
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _flatten_like_cudnn(rnn: torch.nn.RNNBase) -> None:
    """What `flatten_parameters` does on cuDNN, on the CPU: the weights are copied into one
    buffer and each set to its part of it (plain tensors only, as cuDNN's check of data
    pointers leaves global ones be)."""
    weights = rnn._flat_weights
    if any(isinstance(w, sbp.GlobalTensor) for w in weights):
        return
    with torch.no_grad():
        flat = torch.cat([w.reshape(-1) for w in weights])
        start = 0
        for w in weights:
            w.set_(flat[start : start + w.numel()].view_as(w))
            start += w.numel()


def _train_flattening(make, data, P=None, **kw):
    saved = torch.nn.RNNBase.flatten_parameters
    torch.nn.RNNBase.flatten_parameters = _flatten_like_cudnn
    try:
        return train(make, data, P, **kw)
    finally:
        torch.nn.RNNBase.flatten_parameters = saved


def test_the_local_run_keeps_torch_from_flattening_its_weights(pool2):
    """torch's forward takes weights in the module's tables that differ from the ones it
    last saw as new, and flattens them (cuDNN: into a new buffer). The local run's leaves
    must stay the parameters' memory (before, simulated: the second step ran on the first
    step's weights, silently)."""
    make = functools.partial(Recurrent, "lstm", layers=1)
    assert_trains_as_one_process(pool2, make, _data(6, steps=3), trainer=_train_flattening)


class Truncated(torch.nn.Module):
    """Truncated backprop through time: the final state goes back in with the next chunk."""

    def __init__(self, kind="lstm"):
        super().__init__()
        self.rnn = KINDS[kind](E, H, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(H, CLASSES)

    def forward(self, x, state=None):
        y, state = self.rnn(x, state)
        return self.head(y[:, -1]), state


def _train_truncated(make, data, P=None, fast=True, dtype=torch.float64):
    """`out, state = model(x, state)`, the state detached between chunks (it comes back
    split on dim 1, the batch's dim in torch's state)."""
    torch.manual_seed(0)
    model = make().to(dtype)
    if P is not None:
        model.to_global(P, B)
        sbp.nn.data_parallel(model, fast=fast)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, paths, state = [], [], None
    for x, _, y in data:
        if P is not None:
            x, y = (sbp.tensor(t, placement=P, sbp=sbp.split(0)) for t in (x, y))
        out, state = model(x) if state is None else model(x, state)
        state = tuple(s.detach() for s in state) if isinstance(state, tuple) else state.detach()
        loss = torch.nn.functional.cross_entropy(out, y)
        optim.zero_grad()
        loss.backward()
        optim.step()
        if P is not None:
            paths.append(sbp.nn.fast_path.state(model).last_path)
        losses.append(loss.item())
    params = [p.full_tensor() if P is not None else p.detach() for p in model.parameters()]
    return losses, params, paths


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("n", [6, 7])
def test_a_state_passed_back_in_runs_on_the_fast_path(pool2, kind, n):
    """The state a call returns is split on dim 1; passed back in with a batch split on
    dim 0 (before: every call after the first ran op by op, with no warning)."""
    make = functools.partial(Truncated, kind)
    assert_trains_as_one_process(pool2, make, _data(n, steps=3), trainer=_train_truncated)


class SequenceFirst(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = torch.nn.GRU(E, H)
        self.head = torch.nn.Linear(H, CLASSES)

    def forward(self, x):
        return self.head(self.rnn(x)[0][-1])


def _sequence_first(x):
    P = sbp.placement("cpu", [0, 1])
    torch.manual_seed(0)
    model = SequenceFirst().double().to_global(P, B)
    sbp.nn.data_parallel(model)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = model(sbp.tensor(x, placement=P, sbp=sbp.split(1)))
    said = [str(w.message) for w in seen if "runs op by op" in str(w.message)]
    return out.full_tensor(), sbp.nn.fast_path.state(model).last_path, said


def test_a_sequence_first_batch_runs_op_by_op_and_says_so(pool2):
    """A batch split on dim 1 only (torch's sequence-first layout) runs op by op, exactly;
    the warning says how to get the fast path (before: silently slow)."""
    x = torch.randn(L, 5, E, dtype=torch.float64)
    torch.manual_seed(0)
    want = SequenceFirst().double()(x)
    for out, path, said in pool2.run(_sequence_first, x):
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
        assert path == "per-op"
        assert len(said) == 1 and "takes a batch split on dim 0" in said[0], said


class ZeroState(torch.nn.Module):
    """An LSTM given its initial state as torch's tutorials make it: zeros (and, for the
    cell state, halves) of the batch's size, `x.new_zeros(layers, x.size(0), H)`, or
    `torch.zeros` under `sbp.global_mode` (`factory`); `size`: of a fixed batch size."""

    def __init__(self, factory=False, size=None):
        super().__init__()
        self.rnn = torch.nn.LSTM(E, H, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(H, CLASSES)
        self.factory, self.size = factory, size

    def forward(self, x, _=None):
        shape = (2, self.size or x.size(0), H)
        if self.factory:
            h, c = torch.zeros(shape, dtype=x.dtype), torch.full(shape, 0.5, dtype=x.dtype)
        else:
            h, c = x.new_zeros(shape), x.new_full(shape, 0.5)
        y, _ = self.rnn(x, (h, c))
        return self.head(y[:, -1])


def _train_in_global_mode(make, data, P=None, **kw):
    """`train`, the global steps inside `sbp.global_mode(P)` (torch's factories make
    global tensors; the model is made before), saying what it warned."""
    torch.manual_seed(0)
    model = make()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with sbp.global_mode(P) if P is not None else contextlib.nullcontext():
            losses, params, paths = train(lambda: model, data, P, **kw)
    said = [str(w.message) for w in seen if "op by op" in str(w.message)]
    return losses, params, paths + said


@pytest.mark.parametrize("factory", [False, True])
@pytest.mark.parametrize("n", [6, 7])
def test_a_zero_state_of_the_batchs_size_runs_on_the_fast_path(pool2, factory, n):
    """The state made in the forward of the batch's size is laid out as the batch (before:
    broadcast, so the LSTM ran op by op, "the initial state is not laid out as the batch");
    the local run makes it of its shard's size."""
    make = functools.partial(ZeroState, factory)
    assert_trains_as_one_process(pool2, make, _data(n), trainer=_train_in_global_mode)


def test_a_zero_state_of_a_fixed_size_runs_op_by_op(pool2):
    """A state of a fixed size equal to the batch's: the local run's LSTM meets shards of
    4 and 3 rows with a state of 7 and torch raises on both ranks; they go op by op
    together, saying why, and train as one process."""
    make = functools.partial(ZeroState, size=7)
    data = _data(7)
    want_losses, want_params, _ = train(make, data)
    P = sbp.placement("cpu", [0, 1])
    for losses, params, paths in pool2.run(_train_in_global_mode, make, data, P):
        assert paths[:2] == ["per-op"] * 2
        assert len(paths) == 3 and "its local run raised RuntimeError" in paths[2], paths
        assert losses == pytest.approx(want_losses, rel=1e-10)
        for got, ref in zip(params, want_params, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
