"""Losses inside a data-parallel module's forward: the local run takes the mean over the
logical batch (one small all-reduce); a loss of the batch that is not separable runs op
by op."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from data_parallel_helpers import MLP, S0, B, _data, _gather, _global, _rel, _shard, _train

import sbp


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
