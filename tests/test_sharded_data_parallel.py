"""Sharded data parallelism as a layout (ZeRO / FSDP; issue 53): the user-visible contract.

`model.to_global(P, sbp.split(0))` keeps on each rank its part of every parameter along
dim 0 (`sbp.local_slices`), the batch is `split(0)`, and training equals the same model
trained in one process with plain torch on the logical batch: the same initial weights,
the same data, in float64 so that 1e-10 separates semantics from rounding. Gradients and
the optimizer's state stay laid out as the parameters (`split(0)`). Parameters whose dim 0
does not divide over the ranks (uneven shards, a rank holding no rows) are included.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sbp

S0, B = sbp.split(0), sbp.broadcast
P22 = [[0, 1], [2, 3]]
RTOL = 1e-10


def _path(model):
    """How the model's last call ran: "sharded" (the sharded data-parallel path), "fast"
    (broadcast parameters), "per-op"."""
    return sbp.nn.fast_path.state(model).last_path


def _assert_paths(paths):
    assert paths and all(p == "sharded" for p in paths), paths


# ---------------------------------------------------------------------------- models


class MLP(nn.Module):
    """fc2's rows (7) and the head's (3) do not divide over 2 or 4 ranks: on 4 ranks one rank
    holds no row of the head."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 10)
        self.fc2 = nn.Linear(10, 7)
        self.head = nn.Linear(7, 3)

    def forward(self, x):
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class Block(nn.Module):
    """A pre-LN GPT-2 block: causal attention, then an MLP."""

    def __init__(self, d=8, heads=2, hidden=18):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x):
        n, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, -1)
        q, k, v = (a.view(n, t, self.heads, d // self.heads).transpose(1, 2) for a in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(n, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    """Token and position embeddings, 2 blocks, a final LayerNorm, an LM head; the vocabulary
    (11) and the context (5) do not divide over 2 or 4 ranks."""

    def __init__(self, vocab=11, context=5, d=8, layers=2):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class TinyConvNet(nn.Module):
    """mobilenet-like: a strided stem, a depthwise and a pointwise conv, each with BatchNorm
    and ReLU6, global average pooling, a classifier; the pointwise conv's 5 channels do not
    divide over 2 ranks."""

    def __init__(self):
        super().__init__()
        self.stem, self.bn1 = nn.Conv2d(3, 6, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(6)
        self.dw, self.bn2 = nn.Conv2d(6, 6, 3, padding=1, groups=6, bias=False), nn.BatchNorm2d(6)
        self.pw, self.bn3 = nn.Conv2d(6, 5, 1, bias=False), nn.BatchNorm2d(5)
        self.fc = nn.Linear(5, 4)

    def forward(self, x):
        x = F.relu6(self.bn1(self.stem(x)))
        x = F.relu6(self.bn2(self.dw(x)))
        x = F.relu6(self.bn3(self.pw(x)))
        return self.fc(x.mean((2, 3)))


MODELS = {"mlp": MLP, "gpt": TinyGPT, "conv": TinyConvNet}


def _make(name):
    torch.manual_seed(0)
    return MODELS[name]().double()


def _data(name, steps=3, n=None, seed=1):
    """`steps` logical batches of `n` samples for model `name` (the MLP's 10 split unevenly
    over 4 ranks)."""
    n = n or (10 if name == "mlp" else 8)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        if name == "mlp":
            x, y = (
                torch.randn(n, 6, generator=g, dtype=torch.float64),
                torch.randint(0, 3, (n,), generator=g),
            )
        elif name == "gpt":
            ids = torch.randint(0, 11, (n, 6), generator=g)
            x, y = ids[:, :-1], ids[:, 1:]
        else:
            x = torch.randn(n, 3, 8, 8, generator=g, dtype=torch.float64)
            y = torch.randint(0, 4, (n,), generator=g)
        out.append((x.contiguous(), y.contiguous()))
    return out


def _optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def _criterion(out, y):
    return F.cross_entropy(out.flatten(0, -2), y.flatten())


# ------------------------------------------------------------------------- on the ranks


def _shard(t, P, nd):
    """This rank's part of the logical tensor `t` laid out as `nd` on `P`."""
    return t[sbp.local_slices(t.shape, P, nd, P.coord(sbp.env.get_rank()))]


def _batch(t, P, nd):
    return sbp.to_global(_shard(t, P, nd), P, nd)


def _expected_nd(name, layout):
    """The sbp of parameter `name` after `layout`'s conversions, applied in order: a list of
    (submodule name, nd), "" for the whole model."""
    nd = None
    for prefix, want in layout:
        if prefix == "" or name.startswith(prefix + "."):
            nd = want
    return nd


def _layout(model, P):
    """For each parameter: its name, its sbp, and whether this rank's local tensor is its slice
    of the logical value (`sbp.local_slices`)."""
    out = []
    for name, p in model.named_parameters():
        full = p.full_tensor()
        out.append((name, tuple(p.sbp), torch.equal(p.to_local(), _shard(full, P, p.sbp))))
    return out


def _state_sbps(opt, model):
    """(parameter name, state key, sbp) of each tensor in the optimizer's state that has its
    parameter's shape, and (name, ".grad", sbp) of each gradient."""
    names = {p: n for n, p in model.named_parameters()}
    out = {(names[p], ".grad", tuple(p.grad.sbp)) for p in model.parameters()}
    for p, state in opt.state.items():
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and v.shape == p.shape and p.dim() > 0:
                out.add((names[p], k, tuple(v.sbp)))
    return out


def _step(model, opt, x, y, P, clip=None, got=None):
    with sbp.global_mode(P) if P is not None else contextlib.nullcontext():
        loss = _criterion(model(x), y)  # (global_mode: the GPT's torch.arange)
    opt.zero_grad()
    loss.backward()
    if clip is not None:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        got["norms"].append(norm.item())
        got["clipped"] = [_full(p.grad) for p in model.parameters()]
    opt.step()
    return loss.item()


def _train(
    name,
    opt_name,
    data,
    ranks=None,
    layout=(("", (S0,)),),
    batch_nd=(S0,),
    clip=None,
    reshard=True,
):
    """Train model `name` on `data`: with `ranks` None in one process with plain torch, else on
    `sbp.placement("cpu", ranks)`, converted by `layout` (see `_expected_nd`), the batch laid
    out as `batch_nd`. Returns a dict of what a test compares."""
    model = _make(name)
    P = None if ranks is None else sbp.placement("cpu", ranks)
    if P is not None:
        for prefix, nd in layout:
            (model.get_submodule(prefix) if prefix else model).to_global(P, nd)
        sbp.nn.data_parallel(model, reshard_after_forward=reshard)
    opt = _optimizer(opt_name, model.parameters())
    got = {
        "losses": [],
        "paths": [],
        "norms": [],
        "names": [n for n, _ in model.named_parameters()],
    }
    if P is not None:
        got["layout_before"] = _layout(model, P)
    for x, y in data:
        if P is not None:
            x, y = _batch(x, P, batch_nd), _batch(y, P, batch_nd)
        got["losses"].append(_step(model, opt, x, y, P, clip, got))
        if P is not None:
            got["paths"].append(_path(model))
    got["params"] = [_full(p) for p in model.parameters()]
    got["buffers"] = [_full(b) for b in model.buffers()]
    if P is not None:
        got["layout_after"] = _layout(model, P)
        got["state_sbps"] = _state_sbps(opt, model)
    return got


def _full(t):
    """The logical value, a copy (a broadcast tensor's `full_tensor()` is its local tensor,
    which a later step writes)."""
    return (t.full_tensor() if isinstance(t, sbp.GlobalTensor) else t.detach()).clone()


# ------------------------------------------------------------------------ comparisons


def _close(got, want, what):
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(
            torch.as_tensor(a), torch.as_tensor(b), rtol=RTOL, atol=1e-12, msg=f"{what} {i}"
        )


def _check(got, ref, opt_name, layout=(("", (S0,)),), buffers=True):
    """`got` (trained on the ranks) equals `ref` (one process); every parameter, gradient and
    state tensor is laid out as `layout` says, each rank holding its slice."""
    _assert_paths(got["paths"])
    _close(got["losses"], ref["losses"], "loss of step")
    _close(got["params"], ref["params"], "parameter")
    if buffers:
        _close(got["buffers"], ref["buffers"], "buffer")
    names = ref["names"]
    want = [(n, _expected_nd(n, layout), True) for n in names]
    assert got["layout_before"] == want
    assert got["layout_after"] == want
    keys = (".grad",) + STATE[opt_name]
    assert got["state_sbps"] == {(n, k, _expected_nd(n, layout)) for n in names for k in keys}


STATE = {"sgd": ("momentum_buffer",), "adamw": ("exp_avg", "exp_avg_sq")}


# ------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_training_equals_one_process(request, name, opt_name, world):
    """3 steps: the losses, the parameters after them, each rank's slice of every parameter
    (before and after), and the gradients and optimizer state laid out split(0)."""
    pool = request.getfixturevalue(f"pool{world}")
    data = _data(name)
    got = pool.run(_train, name, opt_name, data, list(range(world)))
    ref = _train(name, opt_name, data)
    for rank_got in got:
        _check(rank_got, ref, opt_name)


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_zero2_equals_one_process(pool2, name):
    """reshard_after_forward=False (ZeRO-2: each unit's gathered parameters kept for
    backward): the same training as one process."""
    data = _data(name)
    got = pool2.run(_train, name, "adamw", data, [0, 1], reshard=False)
    ref = _train(name, "adamw", data)
    for rank_got in got:
        _check(rank_got, ref, "adamw")


@pytest.mark.parametrize("world", [2, 4])
def test_clip_grad_norm_over_sharded_gradients(request, world):
    """`clip_grad_norm_` of the split(0) gradients: the total norm and the clipped gradients are
    one process's (the norm is over the logical gradients, not this rank's slices)."""
    pool = request.getfixturevalue(f"pool{world}")
    data = _data("mlp")
    got = pool.run(_train, "mlp", "sgd", data, list(range(world)), clip=0.2)
    ref = _train("mlp", "sgd", data, clip=0.2)
    assert min(ref["norms"]) > 0.2  # the clip scales every step's gradients
    for rank_got in got:
        _close(rank_got["norms"], ref["norms"], "total norm of step")
        _close(rank_got["clipped"], ref["clipped"], "clipped gradient")
        _check(rank_got, ref, "sgd")


def test_conv_net_with_batch_norm(pool2):
    """A mobilenet-like net with BatchNorm, 2 steps on 2 ranks: the losses, the parameters and
    the running statistics (logical batch statistics, as in one process). Its buffers stay
    broadcast (before: `to_global(P, split(0))` raised on the 0-dim `num_batches_tracked`)."""
    data = _data("conv", steps=2)
    got = pool2.run(_train, "conv", "sgd", data, [0, 1])
    ref = _train("conv", "sgd", data)
    for rank_got in got:
        _check(rank_got, ref, "sgd")


def _per_shard_statistics(layout):
    """The conv net trained 2 steps on 2 ranks with per-shard BatchNorm statistics
    (`batch_norm="local"`, as torch DDP without SyncBatchNorm)."""
    P = sbp.placement("cpu", [0, 1])
    model = _make("conv").to_global(P, layout)
    sbp.nn.data_parallel(model, batch_norm="local")
    opt = _optimizer("sgd", model.parameters())
    losses = []
    for x, y in _data("conv", steps=2):
        losses.append(_step(model, opt, _batch(x, P, (S0,)), _batch(y, P, (S0,)), P))
    params = [_full(p) for p in model.parameters()]
    return losses, params, [_full(b) for b in model.buffers()], _path(model)


def test_per_shard_batch_norm_statistics(pool2):
    """batch_norm="local" on the sharded path: each rank's statistics, the first rank's
    running statistics kept, exactly as the broadcast model's fast path computes them."""
    for (losses, params, buffers, path), (want_l, want_p, want_b, want_path) in zip(
        pool2.run(_per_shard_statistics, S0), pool2.run(_per_shard_statistics, B), strict=True
    ):
        assert (path, want_path) == ("sharded", "fast")
        _close(losses, want_l, "loss of step")
        _close(params, want_p, "parameter")
        _close(buffers, want_b, "buffer")


def _batch_norm_running_mean(ranks, nd):
    """`F.batch_norm` in train mode on a split(0) batch, its running mean laid out as `nd`."""
    P = sbp.placement("cpu", ranks)
    x = torch.arange(24.0, dtype=torch.float64).view(4, 6).sin()
    mean = sbp.tensor(torch.zeros(6, dtype=torch.float64), placement=P, sbp=nd)
    var = sbp.tensor(torch.ones(6, dtype=torch.float64), placement=P, sbp=nd)
    F.batch_norm(_batch(x, P, (S0,)), mean, var, training=True, momentum=0.1)
    return mean.full_tensor(), var.full_tensor()


def test_split_running_statistics_are_updated(pool2):
    """Running statistics laid out split(0) are updated in train mode (before: sbp updated
    whole copies of them, and they stayed 0 and 1, silently)."""
    x = torch.arange(24.0, dtype=torch.float64).view(4, 6).sin()
    mean, var = torch.zeros(6, dtype=torch.float64), torch.ones(6, dtype=torch.float64)
    F.batch_norm(x, mean, var, training=True, momentum=0.1)
    broadcast = pool2.run(_batch_norm_running_mean, [0, 1], B)[0]
    _close(broadcast, (mean, var), "running statistic (broadcast)")  # (passes today)
    split = pool2.run(_batch_norm_running_mean, [0, 1], S0)[0]
    _close(split, (mean, var), "running statistic (split(0))")


def _accumulate(ranks, data, no_sync=True):
    """SGD-momentum steps, each on 2 micro-batches (each loss halved): two backwards, the first
    under `sbp.nn.no_sync(model)` if asked, then the step. `ranks` None: one process on the
    concatenated batch, one backward per step."""
    model = _make("mlp")
    P = None if ranks is None else sbp.placement("cpu", ranks)
    if P is not None:
        model.to_global(P, S0)
    opt = _optimizer("sgd", model.parameters())
    paths = []
    for batch in data:
        opt.zero_grad()
        if P is None:
            x, y = (torch.cat(t) for t in zip(*batch, strict=True))
            _criterion(model(x), y).backward()
        else:
            for i, (x, y) in enumerate(batch):
                loss = _criterion(model(_batch(x, P, (S0,))), _batch(y, P, (S0,))) / 2
                paths.append(_path(model))
                held = sbp.nn.no_sync(model) if no_sync and i == 0 else contextlib.nullcontext()
                with held:
                    loss.backward()
        opt.step()
    grads = None if P is None else {tuple(p.grad.sbp) for p in model.parameters()}
    return [_full(p) for p in model.parameters()], grads, paths


@pytest.mark.parametrize("no_sync", [True, False])
def test_accumulation_equals_one_process_on_the_whole_batch(pool2, no_sync):
    """Gradient accumulation over 2 micro-batches of 4, then a step: one process's step on the
    8 samples; the gradients stay split(0)."""
    data = list(zip(_data("mlp", n=4, seed=2), _data("mlp", n=4, seed=3), strict=True))
    got = pool2.run(_accumulate, [0, 1], data, no_sync)
    want, _, _ = _accumulate(None, data)
    for params, grads, paths in got:
        _assert_paths(paths)
        _close(params, want, "parameter")
        assert grads == {(S0,)}


# Mixed layouts, set the documented way (docs/api.md: `module.to_global` re-boxes the
# parameters that are global already): the whole model, then one submodule otherwise.
MIXED = {
    "split, head broadcast": (("", (S0,)), ("head", (B,))),
    "broadcast, fc2 split": (("", (B,)), ("fc2", (S0,))),
}


@pytest.mark.parametrize("layout", list(MIXED))
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_mixed_layout_equals_one_process(pool2, layout, opt_name):
    data = _data("mlp")
    got = pool2.run(_train, "mlp", opt_name, data, [0, 1], layout=MIXED[layout])
    ref = _train("mlp", opt_name, data)
    for rank_got in got:
        _check(rank_got, ref, opt_name, layout=MIXED[layout])


@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_hsdp_on_2x2_equals_one_process(pool4, name, opt_name):
    """HSDP: parameters replicated along the placement's dim 0 and sharded along its dim 1
    (`(broadcast, split(0))`), the batch split over both."""
    layout = (("", (B, S0)),)
    data = _data(name)
    got = pool4.run(_train, name, opt_name, data, P22, layout=layout, batch_nd=(S0, S0))
    ref = _train(name, opt_name, data)
    for rank_got in got:
        _check(rank_got, ref, opt_name, layout=layout)


@pytest.mark.filterwarnings("ignore:sbp. MLP runs op by op")
def test_parameters_split_where_the_batch_is_not_run_op_by_op(pool4):
    """Parameters split along the placement's dim 1 while the batch is split along dim 0
    only: the sharded path declines (each gradient would be summed over ranks holding the
    same samples), the model runs op by op, exact."""
    layout = (("", (B, S0)),)
    data = _data("mlp")
    got = pool4.run(_train, "mlp", "sgd", data, P22, layout=layout, batch_nd=(S0, B))
    ref = _train("mlp", "sgd", data)
    for rank_got in got:
        assert set(rank_got["paths"]) == {"per-op"}
        _close(rank_got["losses"], ref["losses"], "loss of step")
        _close(rank_got["params"], ref["params"], "parameter")


def _save_sharded(directory, data):
    """AdamW steps of the split(0) MLP on every rank of the world, then a DCP checkpoint of the
    model and the optimizer."""
    P = sbp.placement.all("cpu")
    model = _make("mlp").to_global(P, S0)
    opt = _optimizer("adamw", model.parameters())
    paths = []
    for x, y in data:
        _step(model, opt, _batch(x, P, (S0,)), _batch(y, P, (S0,)), P)
        paths.append(_path(model))
    sbp.checkpoint.save({"model": model, "optim": opt}, directory)
    return paths, _state_sbps(opt, model)


def _resume(directory, data, layout):
    """An MLP of other initial weights laid out `layout` (broadcast or split(0)) and a new
    AdamW, loaded from `directory`, then trained on `data`."""
    P = sbp.placement.all("cpu")
    torch.manual_seed(1)
    model = MLP().double().to_global(P, layout)
    opt = _optimizer("adamw", model.parameters())
    sbp.checkpoint.load({"model": model, "optim": opt}, directory)
    loaded = [_full(p) for p in model.parameters()]
    losses = [_step(model, opt, _batch(x, P, (S0,)), _batch(y, P, (S0,)), P) for x, y in data]
    sbps = {tuple(p.sbp) for p in model.parameters()}
    return loaded, [_full(p) for p in model.parameters()], losses, sbps, _path(model)


@pytest.mark.parametrize("layout", [B, S0], ids=["broadcast", "sharded"])
def test_checkpoint_saved_sharded_on_4_resumes_on_2(pool4, pool2, tmp_path, layout):
    """2 AdamW steps sharded on 4 ranks, saved (model and optimizer) with DCP; loaded on 2 ranks
    into a broadcast model (DDP-style) or a sharded one, and its optimizer, 1 more step: one
    process's 3 steps (the Adam moments and step counts came through)."""
    data = _data("mlp")
    saved = pool4.run(_save_sharded, str(tmp_path), data[:2])
    resumed = pool2.run(_resume, str(tmp_path), data[2:], layout)
    ref2 = _train("mlp", "adamw", data[:2])
    ref3 = _train("mlp", "adamw", data)
    names = ref3["names"]
    for paths, state in saved:
        _assert_paths(paths)
        keys = (".grad",) + STATE["adamw"]
        assert state == {(n, k, (S0,)) for n in names for k in keys}
    for loaded, params, losses, sbps, path in resumed:
        # (broadcast: the data-parallel path; split(0): the sharded one, on 2 ranks now)
        assert sbps == {(layout,)} and path == ("fast" if layout == B else "sharded")
        _close(loaded, ref2["params"], "loaded parameter")
        _close(losses, ref3["losses"][2:], "loss of step")
        _close(params, ref3["params"], "parameter")
