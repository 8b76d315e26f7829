"""Dropout and attention with dropout on the data-parallel fast path: the local run draws
the op-by-op path's masks (by module, by name, on the batch moved to another dim)."""

import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from data_parallel_helpers import S0, B, _data, _rel, _train, _train_recording

import sbp

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
