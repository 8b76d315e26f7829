"""Sharded data parallelism (`model.to_global(P, sbp.split(0))`) used as FSDP2 / DeepSpeed /
OneFlow users use it: tied weights, a unit called twice, frozen parameters, eval and
no_grad, two forwards, a loss inside the forward, dropout, autocast, custom and bad
`units`, uneven and empty shards, several backwards, state dicts and deepcopy.

Every case runs on 2 ranks and in one process with plain torch on the logical batch
(float64, the same initial weights and data) and compares what a user sees: losses,
outputs, `.grad`, parameters after SGD steps. Where the sharded path falls back to op by
op (documented), the test says so and still compares. The strict xfails are the cases
that fail today; their reasons say how.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sbp
import sbp.testing

S0, B = sbp.split(0), sbp.broadcast
D = 6
Z2 = {"reshard_after_forward": False}
RANKS = [0, 1]

# ---------------------------------------------------------------------------- models


class Blk(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 5), nn.Linear(5, D)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Net(nn.Module):
    """Units blocks.0, blocks.1 (a ModuleList's children); inp and out are the root unit.
    `out` rows: 3 by default (uneven over 2 ranks)."""

    def __init__(self, layers=2, out=3):
        super().__init__()
        self.inp = nn.Linear(4, D)
        self.blocks = nn.ModuleList(Blk() for _ in range(layers))
        self.out = nn.Linear(D, out)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


class TiedGPT(nn.Module):
    """GPT-style tie: lm_head.weight is wte.weight (both in the root unit)."""

    def __init__(self, vocab=7):
        super().__init__()
        self.wte = nn.Embedding(vocab, D)
        self.blocks = nn.ModuleList(Blk() for _ in range(2))
        self.lm_head = nn.Linear(D, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids):
        x = self.wte(ids)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(x)


class TiedUnit(nn.Module):
    """The embedding is a ModuleList child (a unit by the policy), the head in the root
    shares its weight."""

    def __init__(self, vocab=7):
        super().__init__()
        self.layers = nn.ModuleList([nn.Embedding(vocab, D), Blk(), Blk()])
        self.lm_head = nn.Linear(D, vocab, bias=False)
        self.lm_head.weight = self.layers[0].weight

    def forward(self, ids):
        x = ids
        for m in self.layers:
            x = m(x)
        return self.lm_head(x)


class Twice(Net):
    """blocks.0 applied twice in one forward (weight sharing across depth)."""

    def forward(self, x):
        x = self.inp(x)
        x = self.blocks[0](x)
        x = self.blocks[1](x)
        x = self.blocks[0](x)
        return self.out(x)


class SeqShared(nn.Module):
    """One block object twice in an nn.Sequential."""

    def __init__(self):
        super().__init__()
        b = Blk()
        self.inp, self.seq, self.out = nn.Linear(4, D), nn.Sequential(b, Blk(), b), nn.Linear(D, 3)

    def forward(self, x):
        return self.out(self.seq(self.inp(x)))


class ReadsOutsideSimple(Net):
    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x) + F.linear(x, self.blocks[1].fc1.weight)[:, :3]


class LossInside(Net):
    def forward(self, x, y):
        return F.cross_entropy(super().forward(x), y)


class DropNet(Net):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.3)
        self.blocks[0].drop = nn.Dropout(0.5)

    def forward(self, x):
        x = self.drop(self.inp(x))
        for b in self.blocks:
            x = b(x)
            if hasattr(b, "drop"):
                x = b.drop(x)
        return self.out(x)


class MixedDtypes(Net):
    """blocks.0 holds a float32 gate beside float64 linears."""

    def __init__(self):
        super().__init__()
        self.blocks[0].gate = nn.Linear(D, D)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
            if hasattr(b, "gate"):
                x = x * torch.sigmoid(b.gate(x.float())).double()
        return self.out(x)


class DeadBranch(Net):
    """blocks.1 runs but its output is unused; blocks.2 never runs."""

    def __init__(self):
        super().__init__(layers=4)

    def forward(self, x):
        x = self.inp(x)
        x = self.blocks[0](x)
        _ = self.blocks[1](x)
        x = self.blocks[3](x)
        return self.out(x)


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(4, D), nn.Linear(D, 3)
        self.experts = nn.ModuleDict({"a": Blk(), "b": Blk()})

    def forward(self, x, which):
        return self.out(self.experts[which](self.inp(x)))


class WeightNormed(Net):
    def __init__(self):
        super().__init__()
        torch.nn.utils.parametrizations.weight_norm(self.blocks[0].fc1)
        torch.nn.utils.parametrizations.weight_norm(self.out)


class Checkpointed(Net):
    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False)
        return self.out(x)


class Scalar(Net):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return super().forward(x) * self.scale


# ------------------------------------------------------------------------------ helpers


def _vec(n=4, steps=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(n, 4, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (n,), generator=g),
        )
        for _ in range(steps)
    ]


def _ids(n=4, steps=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, 7, (n, 5), generator=g)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


def _ce(out, y):
    return F.cross_entropy(out.flatten(0, -2), y.flatten())


def _full(t):
    if t is None:
        return None
    return (t.full_tensor() if isinstance(t, sbp.GlobalTensor) else t.detach()).clone()


def _grads(model):
    return [_full(p.grad) for p in model.parameters()]


class _On:
    """Where a case runs: `ranks` None for one process with plain torch."""

    def __init__(self, ranks):
        self.P = None if ranks is None else sbp.placement("cpu", ranks)

    def batch(self, t):
        if self.P is None:
            return t
        coord = self.P.coord(sbp.env.get_rank())
        return sbp.to_global(t[sbp.local_slices(t.shape, self.P, (S0,), coord)], self.P, (S0,))

    def model(self, cls, opts=None, seed=0, nd=S0, **kw):
        torch.manual_seed(seed)
        model = cls(**kw).double()
        if self.P is not None:
            model.to_global(self.P, nd)
            if opts:
                sbp.nn.data_parallel(model, **opts)
        return model

    def path(self, model):
        return None if self.P is None else sbp.nn.fast_path.state(model).last_path

    def no_sync(self, model):
        return contextlib.nullcontext() if self.P is None else sbp.nn.no_sync(model)


def _close(got, want, what=""):
    if isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), what
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            _close(a, b, f"{what}[{i}]")
    elif want is None or got is None:
        assert got is None and want is None, f"{what}: {got} vs {want}"
    else:
        torch.testing.assert_close(
            torch.as_tensor(got), torch.as_tensor(want), rtol=1e-10, atol=1e-12, msg=what
        )


def _compare(pool, fn, *args, path="sharded", keys=None):
    """`fn(ranks, *args)` on the 2 ranks and in one process: equal `keys` (all but
    "paths"), and every call of the ranks ran on `path`."""
    want = fn(None, *args)
    for got in pool.run(fn, RANKS, *args):
        assert got["paths"] and all(p == path for p in got["paths"]), got["paths"]
        for k in keys or [k for k in want if k != "paths"]:
            _close(got[k], want[k], k)
    return want


def _train(ranks, cls, data, opts=None, clip=None, fwd=None, prepare=None, steps_zero=True):
    """SGD-momentum steps of `cls` on `data`: losses, gradients of each step (after the
    optional clip), parameters after."""
    on = _On(ranks)
    model = on.model(cls, opts)
    if prepare is not None:
        prepare(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    out = {"losses": [], "grads": [], "norms": [], "paths": []}
    for i, (x, y) in enumerate(data):
        if fwd is None:
            loss = _ce(model(on.batch(x)), on.batch(y))
        else:
            loss = fwd(model, on, x, y, i)
        if steps_zero:
            opt.zero_grad()
        loss.backward()
        if clip is not None:
            out["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        out["grads"].append(_grads(model))
        opt.step()
        out["losses"].append(loss.item())
        out["paths"].append(on.path(model))
    out["params"] = [_full(p) for p in model.parameters()]
    return out


# ------------------------------------------------------------------- tied and shared


@pytest.mark.parametrize("opts", [None, Z2], ids=["zero3", "zero2"])
def test_tied_embedding_and_head_with_clipping(pool2, opts):
    """GPT's tie (both in the root unit), clip_grad_norm_ below the total norm."""
    want = _compare(pool2, _train, TiedGPT, _ids(), opts, 0.05)
    assert min(want["norms"]) > 0.05


def test_tied_weight_shared_by_a_unit_and_the_root(pool2):
    """The tied weight is held by a ModuleList child and the root's head: the root's."""
    _compare(pool2, _train, TiedUnit, _ids())


@pytest.mark.parametrize("cls", [Twice, SeqShared])
@pytest.mark.parametrize("opts", [None, Z2], ids=["zero3", "zero2"])
def test_unit_called_twice_in_one_forward(pool2, cls, opts):
    _compare(pool2, _train, cls, _vec(), opts)


def test_unit_parameter_read_outside_its_unit_runs_op_by_op(pool2):
    """The check fails (the parameter is still split there) and the model runs op by op,
    with one process's numbers."""
    _compare(pool2, _train, ReadsOutsideSimple, _vec(), None, path="per-op")


# ------------------------------------------------------------------------------ frozen


def _freeze_unit(model):
    for p in model.blocks[0].parameters():
        p.requires_grad_(False)


def _freeze_some(model):
    model.blocks[1].fc1.bias.requires_grad_(False)
    model.inp.weight.requires_grad_(False)


@pytest.mark.parametrize("freeze", [_freeze_unit, _freeze_some], ids=["unit", "some"])
@pytest.mark.parametrize("opts", [None, Z2], ids=["zero3", "zero2"])
def test_frozen_parameters(pool2, freeze, opts):
    """Frozen parameters keep `.grad` None (compared), the others train as one process's."""
    want = _compare(pool2, _train, Net, _vec(), opts, None, None, freeze)
    assert want["grads"][0].count(None) in (2, 4)


def _freeze_midway(ranks, unfreeze):
    on = _On(ranks)
    model = on.model(Net)
    if unfreeze:
        _freeze_unit(model)
    out = {"grads": [], "paths": []}
    for i, (x, y) in enumerate(_vec(steps=3)):
        if i == 1:
            for p in [*model.blocks[0].parameters(), model.out.weight]:
                p.requires_grad_(unfreeze)
        model.zero_grad()
        _ce(model(on.batch(x)), on.batch(y)).backward()
        out["grads"].append(_grads(model))
        out["paths"].append(on.path(model))
    return out


@pytest.mark.parametrize("unfreeze", [False, True], ids=["freeze", "unfreeze"])
def test_requires_grad_changed_between_steps(pool2, unfreeze):
    _compare(pool2, _freeze_midway, unfreeze)


# ------------------------------------------------------------------- eval and no_grad


def _inference(ranks, mode):
    on = _On(ranks)
    model = on.model(Net)
    x, y = _vec(n=5)[0]
    out = {"paths": []}
    if mode == "eval":
        model.eval()
        ctx = contextlib.nullcontext()
    else:
        ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with ctx:
        o = model(on.batch(x))
    out["out"] = _full(o)
    out["requires_grad"] = torch.tensor(o.requires_grad)
    out["paths"].append(on.path(model))
    model.train()
    _ce(model(on.batch(x)), on.batch(y)).backward()
    out["grads"] = _grads(model)
    out["paths"].append(on.path(model))
    return out


@pytest.mark.parametrize("mode", ["eval", "no_grad", "inference_mode"])
def test_eval_and_no_grad_forward_then_training(pool2, mode):
    _compare(pool2, _inference, mode)


def _no_grad_between(ranks, opts):
    """A grad forward, a no_grad forward of the same model (a target), then backward."""
    on = _On(ranks)
    model = on.model(Net, opts)
    (x1, y1), (x2, _) = _vec()
    o = model(on.batch(x1))
    with torch.no_grad():
        t = model(on.batch(x2))
    (_ce(o, on.batch(y1)) + (o * t).mean()).backward()
    return {"t": _full(t), "grads": _grads(model), "paths": [on.path(model)]}


@pytest.mark.parametrize("opts", [None, Z2], ids=["zero3", "zero2"])
def test_no_grad_forward_between_forward_and_backward(pool2, opts):
    _compare(pool2, _no_grad_between, opts)


def _forward_without_backward(ranks, opts):
    """A grad-enabled forward whose output is dropped (validation without no_grad)."""
    on = _On(ranks)
    model = on.model(Net, opts)
    (x1, y1), (x2, y2) = _vec()
    _ce(model(on.batch(x1)), on.batch(y1))
    out = {"grads": [], "paths": []}
    for x, y in [(x2, y2), (x1, y1)]:
        model.zero_grad()
        _ce(model(on.batch(x)), on.batch(y)).backward()
        out["grads"].append(_grads(model))
        out["paths"].append(on.path(model))
    return out


@pytest.mark.parametrize("opts", [None, Z2], ids=["zero3", "zero2"])
def test_forward_without_backward_then_training(pool2, opts):
    _compare(pool2, _forward_without_backward, opts)


# ------------------------------------------------------------ forwards and backwards


def _two_forwards(ranks, cls, opts):
    on = _On(ranks)
    model = on.model(cls, opts)
    (x1, y1), (x2, y2) = _vec()
    l1 = _ce(model(on.batch(x1)), on.batch(y1))
    l2 = _ce(model(on.batch(x2)), on.batch(y2))
    (l1 + 2 * l2).backward()
    return {"grads": _grads(model), "paths": [on.path(model)]}


@pytest.mark.parametrize("cls", [Net, Twice])
@pytest.mark.parametrize("opts", [None, Z2], ids=["zero3", "zero2"])
def test_two_forwards_then_one_backward_of_the_sum(pool2, cls, opts):
    _compare(pool2, _two_forwards, cls, opts)


def _loss_inside(model, on, x, y, i):
    return model(on.batch(x), on.batch(y))


def test_loss_computed_inside_the_forward(pool2):
    _compare(pool2, _train, LossInside, _vec(), None, None, _loss_inside)


def _accumulate(ranks, opts):
    """Three backwards without zero_grad: `.grad` sums them."""
    on = _On(ranks)
    model = on.model(Net, opts)
    out = {"grads": [], "paths": []}
    for x, y in _vec(steps=3):
        _ce(model(on.batch(x)), on.batch(y)).backward()
        out["grads"].append(_grads(model))
        out["paths"].append(on.path(model))
    return out


@pytest.mark.parametrize("opts", [None, Z2], ids=["zero3", "zero2"])
def test_gradient_accumulation_without_zero_grad(pool2, opts):
    _compare(pool2, _accumulate, opts)


def _zero_not_none(ranks):
    on = _On(ranks)
    model = on.model(Net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {"grads": [], "paths": []}
    for x, y in _vec(steps=3):
        opt.zero_grad(set_to_none=False)
        _ce(model(on.batch(x)), on.batch(y)).backward()
        out["grads"].append(_grads(model))
        opt.step()
        out["paths"].append(on.path(model))
    out["params"] = [_full(p) for p in model.parameters()]
    return out


def test_zero_grad_set_to_none_false(pool2):
    _compare(pool2, _zero_not_none)


def _input_grad(ranks):
    on = _On(ranks)
    model = on.model(Net)
    x, y = _vec()[0]
    xb = on.batch(x).requires_grad_()
    _ce(model(xb), on.batch(y)).backward()
    return {"x_grad": _full(xb.grad), "grads": _grads(model), "paths": [on.path(model)]}


def test_gradient_of_the_input(pool2):
    _compare(pool2, _input_grad)


# ----------------------------------------------------------------- model structure


def _experts(model, on, x, y, i):
    return _ce(model(on.batch(x), "ab"[i]), on.batch(y))


def test_unit_used_in_one_step_only(pool2):
    """A ModuleDict's expert per step (a layout each): the unused one keeps `.grad` None."""
    want = _compare(pool2, _train, Experts, _vec(), None, None, _experts, keys=["grads", "params"])
    assert want["grads"][0].count(None) == 4


def test_unit_output_unused_and_unit_never_called(pool2):
    want = _compare(pool2, _train, DeadBranch, _vec())
    assert want["grads"][0].count(None) == 8


def test_weight_norm_parametrizations(pool2):
    _compare(pool2, _train, WeightNormed, _vec())


def test_activation_checkpointing_runs_op_by_op(pool2):
    _compare(pool2, _train, Checkpointed, _vec(), path="per-op")


def _submodules_called_directly(ranks):
    """A unit and a root submodule called by the user outside the model's forward (op by
    op on global tensors), then a step of the model."""
    on = _On(ranks)
    model = on.model(Net)
    h = torch.randn(4, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    o1, o2 = model.blocks[0](on.batch(h)), model.out(on.batch(h))
    (o1.sum() + o2.sum()).backward()
    out = {"o1": _full(o1), "o2": _full(o2), "grads_direct": _grads(model)}
    model.zero_grad()
    x, y = _vec()[0]
    _ce(model(on.batch(x)), on.batch(y)).backward()
    out["grads"], out["paths"] = _grads(model), [on.path(model)]
    return out


def test_submodules_called_outside_the_model(pool2):
    _compare(pool2, _submodules_called_directly)


def _edited_in_place(ranks):
    """Parameters written in place between steps (EMA loads, re-initialisation)."""
    on = _On(ranks)
    model = on.model(Net)
    out = {"grads": [], "paths": []}
    for x, y in _vec():
        model.zero_grad()
        _ce(model(on.batch(x)), on.batch(y)).backward()
        out["grads"].append(_grads(model))
        out["paths"].append(on.path(model))
        with torch.no_grad():
            model.blocks[0].fc1.weight.mul_(0.5)
            model.inp.bias.add_(1.0)
    return out


def test_parameters_edited_in_place_between_steps(pool2):
    _compare(pool2, _edited_in_place)


# ---------------------------------------------------------- dropout and autocast


def _dropout(ranks, nd, fast):
    on = _On(ranks)
    model = on.model(DropNet, {"fast": fast}, nd=nd)
    sbp.manual_seed(123)
    out = {"losses": [], "grads": [], "paths": []}
    for x, y in _vec(n=6):
        loss = _ce(model(on.batch(x)), on.batch(y))
        model.zero_grad()
        loss.backward()
        out["losses"].append(loss.item())
        out["grads"].append(_grads(model))
        out["paths"].append(on.path(model))
    return out


def test_dropout_draws_equal_the_broadcast_model_op_by_op(pool2):
    """Dropout draws differ from one process's by design; sharded, the masks (losses and
    gradients) are the broadcast model's op by op (= its fast path). (Op by op, the
    sharded model draws others: the linears' outputs come out laid out otherwise.)"""
    sharded = pool2.run(_dropout, RANKS, S0, True)
    per_op = pool2.run(_dropout, RANKS, B, False)
    for got, want in zip(sharded, per_op, strict=True):
        assert got["paths"] == ["sharded"] * 2 and want["paths"] == ["per-op"] * 2
        _close(got["losses"], want["losses"], "loss")
        _close(got["grads"], want["grads"], "grad")


def _autocast(ranks, nd, fast):
    on = _On(ranks)
    torch.manual_seed(0)
    model = Net().float()
    if on.P is not None:
        model.to_global(on.P, nd)
        sbp.nn.data_parallel(model, fast=fast)
    x, y = _vec()[0]
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        o = model(on.batch(x.float()))
        loss = _ce(o, on.batch(y))
    loss.backward()
    return {
        "dtype": str(o.dtype),
        "loss": loss.item(),
        "grads": [g.double() for g in _grads(model)],
        "path": on.path(model),
    }


def test_autocast_bfloat16(pool2):
    """Sharded under CPU autocast: the broadcast model's op-by-op gradients bit for bit,
    and one process's up to bfloat16 rounding (sums split over ranks)."""
    one = _autocast(None, None, None)
    sharded = pool2.run(_autocast, RANKS, S0, True)
    per_op = pool2.run(_autocast, RANKS, B, False)
    for got, ref in zip(sharded, per_op, strict=True):
        assert got["path"] == "sharded" and got["dtype"] == one["dtype"] == "torch.bfloat16"
        assert got["loss"] == ref["loss"]
        for a, b in zip(got["grads"], ref["grads"], strict=True):
            assert torch.equal(a, b)
        torch.testing.assert_close(got["loss"], one["loss"], rtol=1e-2, atol=0)
        for a, b in zip(got["grads"], one["grads"], strict=True):
            torch.testing.assert_close(a, b, rtol=5e-2, atol=3e-3)


# ---------------------------------------------------------------------------- units


@pytest.mark.parametrize(
    "units",
    [["blocks.0.fc1", "out", "blocks.1"], [], ["blocks.0", "blocks.0"], "auto"],
    ids=["custom", "none", "repeated", "auto"],
)
@pytest.mark.parametrize("reshard", [True, False], ids=["zero3", "zero2"])
def test_units_named_by_the_user(pool2, units, reshard):
    opts = {"units": units, "reshard_after_forward": reshard}
    _compare(pool2, _train, Net, _vec(), opts)


BAD = [
    ({"units": ["nope"]}, sbp.errors.InputValueError, "units names 'nope'"),
    (
        {"units": ["blocks.0", "blocks.0.fc1"]},
        sbp.errors.InputValueError,
        "units 'blocks.0.fc1' lies",
    ),
    ({"units": ["blocks.0.fc1", "blocks.0"]}, sbp.errors.InputValueError, "lies inside"),
    ({"units": [""]}, sbp.errors.InputValueError, "units names ''"),
    ({"units": "blocks.0"}, sbp.errors.InputTypeError, "units must be a list"),
    ({"units": [3]}, sbp.errors.InputTypeError, "units must be a list"),
    ({"reshard_after_forward": "yes"}, sbp.errors.InputTypeError, "reshard_after_forward must"),
    ({"reshard_after_forward": 1}, sbp.errors.InputTypeError, "reshard_after_forward must"),
]


def _bad_options(ranks):
    P = sbp.placement("cpu", ranks)
    out = []
    for kw, _, _ in BAD:
        torch.manual_seed(0)
        model = Net().double().to_global(P, S0)
        try:
            sbp.nn.data_parallel(model, **kw)
            out.append(None)
        except Exception as e:
            out.append((type(e), str(e)))
        x, y = _vec()[0]
        _ce(model(_On(ranks).batch(x)), _On(ranks).batch(y)).backward()  # still usable
        out[-1] = (out[-1], sbp.nn.fast_path.state(model).last_path)
    return out


def test_bad_units_and_reshard_values_raise_named_errors(pool2):
    """Each bad value raises an sbp.SbpError naming the argument, and leaves the model
    training on the sharded path."""
    for got in pool2.run(_bad_options, RANKS):
        for (raised, path), (kw, kind, words) in zip(got, BAD, strict=True):
            assert raised is not None, kw
            assert raised[0] is kind and issubclass(raised[0], sbp.SbpError), (kw, raised)
            assert words in raised[1], (kw, raised)
            assert path == "sharded", kw


def _mixed_dtypes(ranks):
    """A unit holding float32 and float64 parameters: a named error at the first call;
    naming units of one dtype each then trains as one process."""
    on = _On(ranks)
    torch.manual_seed(0)
    model = MixedDtypes().double()
    model.blocks[0].gate.float()
    out = {"error": None, "paths": []}
    if on.P is not None:
        model.to_global(on.P, S0)
    x, y = _vec()[0]
    try:
        loss = _ce(model(on.batch(x)), on.batch(y))
    except sbp.errors.InputValueError as e:
        out["error"] = str(e)
        units = ["blocks.0.fc1", "blocks.0.fc2", "blocks.0.gate", "blocks.1"]
        sbp.nn.data_parallel(model, units=units)
        loss = _ce(model(on.batch(x)), on.batch(y))
    loss.backward()
    out["grads"] = [g.double() for g in _grads(model)]
    out["paths"].append(on.path(model))
    return out


def test_mixed_dtypes_in_one_unit(pool2):
    want = _mixed_dtypes(None)
    for got in pool2.run(_mixed_dtypes, RANKS):
        assert "unit 'blocks.0' holds parameters of dtypes" in got["error"]
        assert got["paths"] == ["sharded"]
        for a, b in zip(got["grads"], want["grads"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)  # (the gate: float32)


def _switch_options(ranks):
    """ZeRO-2, custom units, back to the defaults, between steps."""
    on = _On(ranks)
    model = on.model(Net)
    out = {"grads": [], "paths": []}
    options = [Z2, {"units": ["blocks.0", "out"]}, {"reshard_after_forward": True, "units": "auto"}]
    for i, (x, y) in enumerate(_vec(steps=4)):
        model.zero_grad()
        _ce(model(on.batch(x)), on.batch(y)).backward()
        out["grads"].append(_grads(model))
        out["paths"].append(on.path(model))
        if on.P is not None and i < 3:
            sbp.nn.data_parallel(model, **options[i])
    return out


def test_options_switched_between_steps(pool2):
    _compare(pool2, _switch_options)


# --------------------------------------------------------------- uneven and empty


@pytest.mark.parametrize("opts", [None, Z2], ids=["zero3", "zero2"])
def test_batch_smaller_than_the_ranks(pool2, opts):
    """One sample over 2 ranks: rank 1 holds none."""
    _compare(pool2, _train, Net, _vec(n=1), opts)


def _one_row_net():
    return Net(out=1)


def test_parameter_with_fewer_rows_than_ranks(pool2):
    """out: 1 row (weight 1x6, bias of 1) over 2 ranks: rank 1 holds none of them."""
    data = [(x, y * 0) for x, y in _vec()]
    _compare(pool2, _train, _one_row_net, data)


# ------------------------------------------------------ state dict and deepcopy


def _state_dict(ranks, plain):
    on = _On(ranks)
    model = on.model(Net)
    (x, y), (x2, y2) = _vec()
    if plain:  # a one-process checkpoint (plain tensors) into the sharded model
        torch.manual_seed(7)
        sd = {k: v.clone() for k, v in Net().double().state_dict().items()}
    else:  # a step, then the sharded model's own state dict into another
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        _ce(model(on.batch(x)), on.batch(y)).backward()
        opt.step()
        sd = model.state_dict()
        model = on.model(Net, seed=5)
    model.load_state_dict(sd)
    out = {"loaded": [_full(p) for p in model.parameters()], "keys": sorted(sd)}
    if on.P is not None:
        assert {tuple(p.sbp) for p in model.parameters()} == {(S0,)}
    _ce(model(on.batch(x2)), on.batch(y2)).backward()
    out["grads"], out["paths"] = _grads(model), [on.path(model)]
    return out


@pytest.mark.parametrize("plain", [False, True], ids=["sharded", "one_process"])
def test_state_dict_round_trip(pool2, plain):
    want = _state_dict(None, plain)
    for got in pool2.run(_state_dict, RANKS, plain):
        assert got["keys"] == want["keys"] and got["paths"] == ["sharded"]
        _close(got["loaded"], want["loaded"], "loaded")
        _close(got["grads"], want["grads"], "grad")


def _deepcopy(ranks, ran_before):
    on = _On(ranks)
    model = on.model(Net)
    (x, y), (x2, y2) = _vec()
    if ran_before:
        _ce(model(on.batch(x)), on.batch(y)).backward()
        model.zero_grad()
    before = [_full(p) for p in model.parameters()]
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    out = {"paths": []}
    for a, b in [(x, y), (x2, y2)]:
        opt.zero_grad()
        _ce(twin(on.batch(a)), on.batch(b)).backward()
        opt.step()
        out["paths"].append(on.path(twin))
    out["twin"] = [_full(p) for p in twin.parameters()]
    _close([_full(p) for p in model.parameters()], before, "original after the copy trained")
    assert all(p.grad is None for p in model.parameters())
    _ce(model(on.batch(x2)), on.batch(y2)).backward()  # the original still trains
    out["original_grads"] = _grads(model)
    out["paths"].append(on.path(model))
    return out


@pytest.mark.parametrize("ran_before", [False, True], ids=["fresh", "after_a_step"])
def test_deepcopy_then_train_the_copy(pool2, ran_before):
    _compare(pool2, _deepcopy, ran_before)


# ------------------------------------------------------------ several backwards, inputs=, no_sync


def _retain(ranks):
    on = _On(ranks)
    model = on.model(Net)
    x, y = _vec()[0]
    loss = _ce(model(on.batch(x)), on.batch(y))
    loss.backward(retain_graph=True)
    loss.backward()
    return {"grads": _grads(model), "paths": [on.path(model)]}


def test_backward_twice_with_retain_graph(pool2):
    """A retained graph backpropagated twice doubles every gradient (before: only the first
    unit reached was reduced again, silently)."""
    _compare(pool2, _retain)


def _retain_then_step(ranks):
    on = _On(ranks)
    model = on.model(Net)
    (x, y), (x2, y2) = _vec()
    loss = _ce(model(on.batch(x)), on.batch(y))
    loss.backward(retain_graph=True)
    loss.backward()
    model.zero_grad()
    _ce(model(on.batch(x2)), on.batch(y2)).backward()
    return {"grads": _grads(model), "paths": [on.path(model)]}


def test_gradients_after_a_retained_double_backward_do_not_leak(pool2):
    """Nothing of a retained double backward is left over for the next step (before: the
    unreduced gradients were added after zero_grad)."""
    _compare(pool2, _retain_then_step)


def _two_backwards(ranks, opts):
    on = _On(ranks)
    model = on.model(Net, opts)
    (x1, y1), (x2, y2) = _vec()
    l1 = _ce(model(on.batch(x1)), on.batch(y1))
    l2 = _ce(model(on.batch(x2)), on.batch(y2))
    l1.backward()
    g1 = _grads(model)
    l2.backward()
    return {"g1": g1, "grads": _grads(model), "paths": [on.path(model)]}


@pytest.mark.parametrize("opts", [None, Z2], ids=["zero3", "zero2"])
def test_two_forwards_then_two_backwards(pool2, opts):
    """Two forwards, then each loss backpropagated: the second adds its gradients to every
    unit (before: to the last unit only)."""
    _compare(pool2, _two_backwards, opts)


def _backward_inputs(ranks):
    on = _On(ranks)
    model = on.model(Net)
    x, y = _vec()[0]
    loss = _ce(model(on.batch(x)), on.batch(y))
    loss.backward(inputs=[model.blocks[1].fc1.weight, model.out.bias])
    return {"grads": _grads(model), "paths": [on.path(model)]}


def test_backward_with_inputs_sets_only_those(pool2):
    """backward(inputs=[...]) sets `.grad` on those parameters only, as in one process
    (before: on every parameter of their units)."""
    _compare(pool2, _backward_inputs)


def _no_sync_discarded(ranks):
    on = _On(ranks)
    model = on.model(Net)
    (x1, y1), (x2, y2) = _vec()
    l1 = _ce(model(on.batch(x1)), on.batch(y1))
    with on.no_sync(model):
        l1.backward()
    model.zero_grad()  # the micro-batch is discarded (a skipped step)
    _ce(model(on.batch(x2)), on.batch(y2)).backward()
    return {"grads": _grads(model), "paths": [on.path(model)]}


def test_zero_grad_discards_a_no_sync_backward(pool2):
    """A backward under no_sync leaves `.grad` as partial sums, which zero_grad() discards
    (before: they waited inside sbp and leaked into the next step)."""
    _compare(pool2, _no_sync_discarded)


def _autograd_grad(ranks):
    on = _On(ranks)
    model = on.model(Net)
    x, y = _vec()[0]
    loss = _ce(model(on.batch(x)), on.batch(y))
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return {"grads": [_full(g) for g in grads], "paths": [on.path(model)]}


@pytest.mark.xfail(
    strict=True,
    raises=sbp.testing.SpmdError,
    reason="RuntimeError: The differentiated Tensor at index 0 appears to not have been used "
    "in the graph (the broadcast model's fast path too; fast=False works)",
)
def test_autograd_grad_of_the_parameters(pool2):
    _compare(pool2, _autograd_grad)


def test_zero_dim_parameter(pool2):
    """A 0-dim parameter (a learnt scale) stays broadcast beside the sharded ones (before:
    `to_global(P, split(0))` raised on it)."""
    _compare(pool2, _train, Scalar, _vec())


def _units_container(ranks):
    on = _On(ranks)
    try:
        on.model(Net, {"units": ["blocks"]})
    except sbp.InputValueError as e:
        return str(e)
    return "no error"


def test_units_naming_a_container(pool2):
    """units=["blocks"] names a ModuleList, which is never called: a named error (before:
    accepted, and every call ran op by op with a misleading warning)."""
    for message in pool2.run(_units_container, [0, 1]):
        assert "'blocks', a ModuleList with no forward of its own" in message
