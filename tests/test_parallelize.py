"""Tensor parallelism stated at module boundaries (`sbp.nn.parallelize`): a Megatron MLP
stack trains as one process does and communicates what Megatron does, under
`sbp.strict()`: 1 all-reduce per block forward (its output, Megatron's g) and 1 per block
backward but the first (its input's gradient, Megatron's f), nothing else."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

import sbp
from sbp.nn import ColwiseParallel, RowwiseParallel

BLOCKS = 4


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32, dtype=torch.float64)
        self.fc2 = torch.nn.Linear(32, 16, dtype=torch.float64)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[Block() for _ in range(BLOCKS)])


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 16, generator=g, dtype=torch.float64), torch.randn(
        8, 16, generator=g, dtype=torch.float64
    )


def _train(model, opt, x, y, steps: int) -> list[torch.Tensor]:
    losses = []
    for _ in range(steps):
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def _adamw(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.01)


def _parallel_training(strict: bool) -> tuple[list, list, dict, dict]:
    P = sbp.placement.all("cpu")
    model = sbp.nn.parallelize(
        _model(), {"*.fc1": ColwiseParallel(), "*.fc2": RowwiseParallel()}, P
    )
    x, y = (t.to_global(P, sbp.broadcast) for t in _data())
    opt = _adamw(model)
    _train(model, opt, x, y, steps=1)  # (the first step makes the optimizer's state)
    with sbp.strict(model) if strict else sbp.comm_stats():
        with sbp.comm_stats(trace=True) as st:
            losses = _train(model, opt, x, y, steps=2)
    phases = {"forward": 0, "backward": 0}
    for e in st.events:
        phases[e.phase] += 1
    params = [p.full_tensor() for p in model.parameters()]
    return [float(v.full_tensor()) for v in losses], params, dict(st.by_kind), phases


@pytest.mark.parametrize("world", [2, 4])
def test_megatron_mlp_communicates_as_megatron_and_trains_as_one_process(world, pool2, pool4):
    plain = _model()
    x, y = _data()
    want = [float(v) for v in _train(plain, _adamw(plain), x, y, steps=3)][1:]
    pool = pool2 if world == 2 else pool4
    for losses, params, kinds, phases in pool.run(_parallel_training, True):
        assert losses == pytest.approx(want, rel=1e-12, abs=1e-12)
        for got, ref in zip(params, plain.parameters(), strict=True):
            torch.testing.assert_close(got, ref.detach(), rtol=1e-10, atol=1e-12)
        assert kinds == {"all_reduce": 2 * (2 * BLOCKS - 1)}  # two steps
        assert phases == {"forward": 2 * BLOCKS, "backward": 2 * (BLOCKS - 1)}


def test_plan_arguments_are_named():
    P = sbp.placement("cpu", [0])
    with pytest.raises(sbp.InputValueError, match="no module matches"):
        sbp.nn.parallelize(_model(), {"*.fc9": ColwiseParallel()}, P)
    with pytest.raises(sbp.InputTypeError, match="ColwiseParallel\\(\\) or RowwiseParallel"):
        sbp.nn.parallelize(_model(), {"*.fc1": "colwise"}, P)
    with pytest.raises(sbp.InputTypeError, match="lay out Linear and Embedding"):
        sbp.nn.parallelize(_model(), {"0": ColwiseParallel()}, P)
    with pytest.raises(sbp.InputTypeError, match="placement"):
        sbp.nn.parallelize(_model(), {"*.fc1": ColwiseParallel()}, [0, 1])
    with pytest.raises(sbp.InputTypeError, match="output must be"):
        RowwiseParallel(output=sbp.partial_sum)


class Attention(torch.nn.Module):
    """Causal self-attention; qkv rows ordered (heads, {q, k, v}, head dim), so a split of
    qkv's output features gives each rank whole heads."""

    def __init__(self, hidden: int = 16, heads: int = 4, softmax: bool = False):
        super().__init__()
        self.hd, self.softmax = hidden // heads, softmax
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, dtype=torch.float64)
        self.proj = torch.nn.Linear(hidden, hidden, dtype=torch.float64)

    def forward(self, x):
        b, t, _ = x.shape
        qkv = self.qkv(x).view(b, t, -1, 3, self.hd)
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
        if self.softmax:  # torch's matmul flattens (batch, heads) for bmm: a strided split
            scores = q @ k.transpose(-2, -1) / math.sqrt(self.hd)
            mask = torch.ones_like(scores, dtype=torch.bool).triu(1)  # (laid out as scores)
            o = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(o.transpose(1, 2).reshape(b, t, -1))


class GPTBlock(torch.nn.Module):
    def __init__(self, softmax: bool = False):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(16, dtype=torch.float64)
        self.attn = Attention(softmax=softmax)
        self.ln2 = torch.nn.LayerNorm(16, dtype=torch.float64)
        self.mlp = Block()

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


GPT_PLAN = {
    "*.qkv": ColwiseParallel(),
    "*.proj": RowwiseParallel(),
    "*.fc1": ColwiseParallel(),
    "*.fc2": RowwiseParallel(),
}


def _as_one_process(results: list, plain: torch.nn.Module, x, y) -> list:
    """Check each rank's (losses of step 2, parameters after it, ...) against `plain`
    trained 2 steps in one process; return each rank's remaining result."""
    want = [float(v) for v in _train(plain, _adamw(plain), x, y, steps=2)][1:]
    for losses, params, _ in results:
        assert losses == pytest.approx(want, rel=1e-12, abs=1e-12)
        for got, ref in zip(params, plain.parameters(), strict=True):
            torch.testing.assert_close(got, ref.detach(), rtol=1e-10, atol=1e-12)
    return [rest for _, _, rest in results]


def _second_step_strict(model, x, y, key) -> tuple[list, list, dict]:
    """Two AdamW steps (the first makes the optimizer's state), the second under
    `sbp.strict()` and traced: its loss, the parameters after it, and its collectives
    counted by `key(event)`."""
    opt = _adamw(model)
    _train(model, opt, x, y, steps=1)
    with sbp.strict(model), sbp.comm_stats(trace=True) as st:
        losses = _train(model, opt, x, y, steps=1)
    counts: dict = {}
    for e in st.events:
        counts[key(e)] = counts.get(key(e), 0) + 1
    params = [p.full_tensor() for p in model.parameters()]
    return [float(v.full_tensor()) for v in losses], params, counts


def _gpt(softmax: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(GPTBlock(softmax), GPTBlock(softmax))


def _gpt_softmax() -> torch.nn.Module:
    return _gpt(softmax=True)


def _gpt_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return tuple(torch.randn(2, 6, 16, generator=g, dtype=torch.float64) for _ in range(2))


MODELS = {
    "mlp": (_model, _data),
    "gpt": (_gpt, _gpt_data),
    "gpt_softmax": (_gpt_softmax, _gpt_data),
}


def _gpt_parallel_training() -> tuple[list, list, dict]:
    P = sbp.placement.all("cpu")
    model = sbp.nn.parallelize(_gpt(), GPT_PLAN, P)
    x, y = (t.to_global(P, sbp.broadcast) for t in _gpt_data())
    return _second_step_strict(model, x, y, lambda e: e.phase)


def test_gpt_blocks_communicate_as_megatron_and_train_as_one_process(pool2):
    """Two pre-LayerNorm blocks (attention with whole heads per rank, MLP): 2 all-reduces
    per block forward and 2 backward, LayerNorm's parameters broadcast; before
    `parallelize`, the same weight layouts ran 25 collectives per step (benchmarks/)."""
    for phases in _as_one_process(pool2.run(_gpt_parallel_training), _gpt(), *_gpt_data()):
        assert phases == {"forward": 4, "backward": 4}


def _dp_tp_training() -> tuple[list, list, dict]:
    P = sbp.placement("cpu", [[0, 1], [2, 3]])
    plan = {"*.fc1": ColwiseParallel(), "*.fc2": RowwiseParallel()}
    model = sbp.nn.parallelize(_model(), plan, P)  # tp along hierarchy dim 1
    x, y = (t.to_global(P, (sbp.split(0), sbp.broadcast)) for t in _data())
    return _second_step_strict(model, x, y, lambda e: (e.phase, e.op))


def test_dp_x_tp_on_a_2d_placement(pool4):
    """Batch split along hierarchy dim 0, the plan along dim 1: the tensor-parallel
    all-reduces of 1-D (4 forward, 3 backward) plus the data-parallel gradient reduction
    in one bucket, as Megatron's (before: one bucket per gradient layout, 3)."""
    for causes in _as_one_process(pool4.run(_dp_tp_training), _model(), *_data()):
        assert causes == {
            ("forward", "to_global"): BLOCKS,
            ("backward", "to_global"): BLOCKS - 1,
            ("backward", "gradient buckets"): 1,
        }


@contextlib.contextmanager
def _buckets_of(nbytes: int | None) -> Iterator[None]:
    """Gradient buckets of `nbytes` in this worker (None: as they are) while it runs."""
    saved = sbp.gradients.BUCKET_BYTES
    sbp.gradients.BUCKET_BYTES = saved if nbytes is None else nbytes
    try:
        yield
    finally:
        sbp.gradients.BUCKET_BYTES = saved


def _dp_tp_small_buckets(bucket_bytes: int) -> tuple[list, list, list]:
    """DP x TP as above, gradient buckets of `bucket_bytes`: the second step's collectives
    in the order they ran, as (phase, op)."""
    P = sbp.placement("cpu", [[0, 1], [2, 3]])
    plan = {"*.fc1": ColwiseParallel(), "*.fc2": RowwiseParallel()}
    model = sbp.nn.parallelize(_model(), plan, P)
    x, y = (t.to_global(P, (sbp.split(0), sbp.broadcast)) for t in _data())
    opt = _adamw(model)
    _train(model, opt, x, y, steps=1)
    with _buckets_of(bucket_bytes), sbp.comm_stats(trace=True) as st:
        losses = _train(model, opt, x, y, steps=1)
    params = [p.full_tensor() for p in model.parameters()]
    order = [(e.phase, e.op) for e in st.events]
    return [float(v.full_tensor()) for v in losses], params, order


def test_dp_x_tp_gradient_buckets_overlap_backward(pool4):
    """With buckets of one block's gradients (4352 bytes per rank), each bucket's
    data-parallel all-reduce starts as soon as it is full, while backward goes on: the
    first starts before backward's last tensor-parallel all-reduce (the second block's
    input gradient), as torch DDP overlaps its buckets. Equal to one process."""
    for order in _as_one_process(pool4.run(_dp_tp_small_buckets, 4352), _model(), *_data()):
        buckets = [i for i, e in enumerate(order) if e == ("backward", "gradient buckets")]
        tp_backward = [i for i, e in enumerate(order) if e == ("backward", "to_global")]
        assert len(buckets) == BLOCKS and len(tp_backward) == BLOCKS - 1
        assert buckets[0] < tp_backward[-1]


def _by_layouts(model: torch.nn.Module, P, tp_dim: int) -> torch.nn.Module:
    """Megatron's weight layouts set parameter by parameter, no plan: fc1/qkv split(0),
    fc2/proj weights split(1), the rest broadcast (split along hierarchy dim `tp_dim`)."""
    model.to_global(P, (sbp.broadcast,) * P.ndim)
    for name, p in model.named_parameters():
        kind, attr = name.split(".")[-2:]
        s = sbp.broadcast
        if kind in ("fc1", "qkv"):
            s = sbp.split(0)
        elif kind in ("fc2", "proj") and attr == "weight":
            s = sbp.split(1)
        nd = tuple(s if h == tp_dim else sbp.broadcast for h in range(P.ndim))
        p.data = p.to_global(P, nd)  # (a global parameter re-boxed in place)
    return model


def _propagated_training(
    model_name: str, two_d: bool, bucket_bytes: int | None = None
) -> tuple[list, list, dict]:
    P = sbp.placement("cpu", [[0, 1], [2, 3]] if two_d else [0, 1])
    make, data = MODELS[model_name]
    model = _by_layouts(make(), P, P.ndim - 1)
    batch = (sbp.split(0), sbp.broadcast) if two_d else (sbp.broadcast,)
    x, y = (t.to_global(P, batch) for t in data())
    opt = _adamw(model)
    _train(model, opt, x, y, steps=1)
    with _buckets_of(bucket_bytes), sbp.comm_stats(trace=True) as st:
        losses = _train(model, opt, x, y, steps=1)
    counts: dict = {}
    for e in st.events:
        counts[e.phase, e.kind] = counts.get((e.phase, e.kind), 0) + 1
    params = [p.full_tensor() for p in model.parameters()]
    if sbp.env.get_rank() not in P:  # (ranks outside the 1-D placement hold nothing)
        return None
    return [float(v.full_tensor()) for v in losses], params, counts


@pytest.mark.parametrize(
    "model_name, two_d, want",
    [
        # Megatron: 1 all-reduce per block forward, 1 per block but the first backward
        ("mlp", False, {("forward", "all_reduce"): 4, ("backward", "all_reduce"): 3}),
        # the same, and the data-parallel gradients in one bucket
        ("mlp", True, {("forward", "all_reduce"): 4, ("backward", "all_reduce"): 4}),
        # Megatron: 2 all-reduces per block each way. The first LayerNorm's input needs no
        # gradient: its backward takes the incoming gradient partial and only its weights'
        # small gradients are reduced (in the bucket) where Megatron all-reduces the whole
        # gradient: the same count, fewer bytes (before: 4 + 5, a reduce-scatter there)
        ("gpt", False, {("forward", "all_reduce"): 4, ("backward", "all_reduce"): 4}),
        # the same, and one bucket per hierarchy dim: the data-parallel gradients, and that
        # LayerNorm's weights' over the tensor-parallel dim (Megatron 4 + 5; before: 4 + 7)
        ("gpt", True, {("forward", "all_reduce"): 4, ("backward", "all_reduce"): 5}),
        # attention written out, softmax(q @ k^T) @ v with the heads split: torch's matmul
        # flattens (batch, heads), a strided split, and the products stay local (before:
        # 13 + 24 in benchmarks/tensor_parallel.py, gathering and re-splitting the heads)
        ("gpt_softmax", False, {("forward", "all_reduce"): 4, ("backward", "all_reduce"): 4}),
        ("gpt_softmax", True, {("forward", "all_reduce"): 4, ("backward", "all_reduce"): 5}),
    ],
)
def test_megatron_layouts_by_propagation_alone(pool4, model_name, two_d, want):
    """No plan, only each weight's sbp: a partial sum is resolved once, where it pays,
    and Megatron's count runs (before these rules: MLP 4 + 5, GPT 7 + 18 collectives per
    step). Equal to one process."""
    make, data = MODELS[model_name]
    results = pool4.run(_propagated_training, model_name, two_d)
    for counts in _as_one_process(results if two_d else results[:2], make(), *data()):
        assert counts == want


def _sequence_parallel_training() -> tuple[list, list, dict]:
    """Megatron's sequence parallelism: the residual stream split along the sequence
    (dim 1) around LayerNorm; gathered at each column-parallel input, reduce-scattered at
    each row-parallel output."""
    P = sbp.placement.all("cpu")
    plan = {
        **GPT_PLAN,
        "*.proj": RowwiseParallel(sbp.split(1)),
        "*.fc2": RowwiseParallel(sbp.split(1)),
    }
    model = sbp.nn.parallelize(_gpt(), plan, P)
    x, y = (sbp.tensor(t, placement=P, sbp=sbp.split(1)) for t in _gpt_data())
    return _second_step_strict(model, x, y, lambda e: (e.phase, e.op, e.kind))


def test_sequence_parallel_gpt_blocks(pool2):
    """Per block: 2 all-gathers (qkv's and fc1's inputs) and 2 reduce-scatters (proj's and
    fc2's outputs; an all-to-all on gloo) forward, the same backward, and one bucket for
    the LayerNorms' gradients (partial over the sequence shards, as Megatron all-reduces
    them); LayerNorm runs on the shards. Equal to one process."""
    for kinds in _as_one_process(pool2.run(_sequence_parallel_training), _gpt(), *_gpt_data()):
        assert kinds == {
            ("forward", "to_global", "all_gather"): 4,
            ("forward", "to_global", "all_to_all"): 4,
            ("backward", "to_global", "all_gather"): 4,
            ("backward", "to_global", "all_to_all"): 4,
            ("backward", "gradient buckets", "all_reduce"): 1,
        }


def test_small_buckets_of_gradients_partial_along_both_dims(pool4):
    """GPT blocks by propagation on `[[0, 1], [2, 3]]` with buckets of 2 KiB: the
    data-parallel buckets start while backward goes on, and the buckets holding the first
    LayerNorm's weights' gradients (partial along both dims) wait for its end, reduced one
    dim after the other. Equal to one process; more buckets than with one (4 + 5)."""
    results = pool4.run(_propagated_training, "gpt", True, 2048)
    losses, params, counts = results[0]
    for got in results:
        assert got[0] == losses
    plain = _gpt()
    want = [float(v) for v in _train(plain, _adamw(plain), *_gpt_data(), steps=2)][1:]
    assert losses == pytest.approx(want, rel=1e-12, abs=1e-12)
    for got, ref in zip(params, plain.parameters(), strict=True):
        torch.testing.assert_close(got, ref.detach(), rtol=1e-10, atol=1e-12)
    assert counts[("forward", "all_reduce")] == 4
    assert counts[("backward", "all_reduce")] == 4 + 13, counts  # (4 tensor-parallel)
