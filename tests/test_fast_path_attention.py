"""torch's multi-head attention on the data-parallel fast path (sbp.data_parallel.families.attention).

`nn.MultiheadAttention` merges the sequence with the split batch inside its forward, which
op by op is a move; the check takes the call as a whole where its tensors are laid out as
the batch, so these models run on local shards. Each test trains on the fast path and in
one process on the logical batch, float64.
"""

import functools

import pytest
import torch
from fast_path_training import train

import sbp

S0, B = sbp.split(0), sbp.broadcast
E, HEADS, L, CLASSES = 8, 2, 5, 3


class Attention(torch.nn.Module):
    """Self-attention over a batch-first input, with the options under test."""

    def __init__(self, batch_first=True, weights=False, padding=False, causal=False):
        super().__init__()
        self.attention = torch.nn.MultiheadAttention(E, HEADS, batch_first=batch_first)
        self.head = torch.nn.Linear(E, CLASSES)
        self.batch_first, self.weights, self.padding = batch_first, weights, padding
        mask = torch.triu(torch.ones(L, L, dtype=torch.bool), 1) if causal else None
        self.register_buffer("mask", mask)

    def forward(self, x, pad=None):
        h = x if self.batch_first else x.transpose(0, 1)
        out, w = self.attention(
            h, h, h, key_padding_mask=pad if self.padding else None, attn_mask=self.mask
        )
        out = out if self.batch_first else out.transpose(0, 1)
        logits = self.head(out.mean(1))
        return logits + w.sum((1, 2)).unsqueeze(1) if self.weights else logits


class Encoder(torch.nn.Module):
    """A Transformer encoder and a decoder layer attending to the encoder's output."""

    def __init__(self, norm_first=False, dropout=0.0):
        super().__init__()
        self.encoder = torch.nn.TransformerEncoderLayer(
            E, HEADS, 16, dropout=dropout, batch_first=True, norm_first=norm_first
        )
        self.decoder = torch.nn.TransformerDecoderLayer(
            E, HEADS, 16, dropout=dropout, batch_first=True
        )
        self.head = torch.nn.Linear(E, CLASSES)

    def forward(self, x, pad=None):
        memory = self.encoder(x)
        return self.head(self.decoder(x[:, :3], memory).mean(1))


class ViT(torch.nn.Module):
    """torchvision's vision transformer on 4x4 images made from the input (a class token
    expanded to the batch, torch's attention, no dropout by default)."""

    def __init__(self):
        import torchvision

        super().__init__()
        self.image = torch.nn.Linear(L * E, 3 * 4 * 4)
        self.vit = torchvision.models.VisionTransformer(
            image_size=4, patch_size=2, num_layers=2, num_heads=HEADS, hidden_dim=E,
            mlp_dim=16, num_classes=CLASSES,
        )  # fmt: skip

    def forward(self, x, pad=None):
        return self.vit(self.image(x.flatten(1)).view(-1, 3, 4, 4))


class ToMemory(torch.nn.Module):
    """Attention of the batch to a learnt memory expanded to the batch: key and value are
    broadcast, not laid out as the batch."""

    def __init__(self):
        super().__init__()
        self.memory = torch.nn.Parameter(torch.randn(4, E))
        self.attention = torch.nn.MultiheadAttention(E, HEADS, batch_first=True)
        self.head = torch.nn.Linear(E, CLASSES)

    def forward(self, x, pad=None):
        memory = self.memory.expand(x.shape[0], -1, -1)
        return self.head(self.attention(x, memory, memory, need_weights=False)[0].mean(1))


def _data(n: int, steps: int = 3):
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(steps):
        x = torch.randn(n, L, E, generator=g, dtype=torch.float64)
        pad = torch.zeros(n, L, dtype=torch.bool)
        pad[::2, -2:] = True  # (every other sample's last two positions are padding)
        batches.append((x, pad, torch.randint(0, CLASSES, (n,), generator=g)))
    return batches


MODELS = {
    "batch-first": Attention,
    "sequence-first": functools.partial(Attention, batch_first=False),
    "weights-padding-causal": functools.partial(Attention, weights=True, padding=True, causal=True),
    "encoder-decoder": Encoder,
    "encoder-norm-first": functools.partial(Encoder, norm_first=True),
    "vit": ViT,
}


CASES = [(name, 6) for name in MODELS] + [
    # (the merged batch x heads rows split at a whole sample; a Transformer layer's
    # feed-forward `linear` on (7, L, E) merges the uneven batch with the sequence, which
    # sends it op by op)
    (name, 7)
    for name in MODELS
    if name not in ("encoder-decoder", "encoder-norm-first", "vit")
]


@pytest.mark.parametrize(("name", "n"), CASES)
def test_torch_attention_trains_on_the_fast_path(pool2, name, n):
    """Before: op by op ("aten.view.default needs its inputs moved")."""
    data = _data(n)
    want_losses, want_params, _ = train(MODELS[name], data)
    P = sbp.placement("cpu", [0, 1])
    for losses, params, paths in pool2.run(train, MODELS[name], data, P):
        assert paths == ["fast"] * len(data)
        assert losses == pytest.approx(want_losses, rel=1e-12)
        for got, ref in zip(params, want_params, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


def test_torch_attention_in_eval_mode(pool2):
    """Without grad, in eval mode, the local run takes torch's fused attention
    (`_native_multi_head_attention`); the check ran the composite."""
    data = _data(6)
    want_losses, _, _ = train(Encoder, data, training=False)
    P = sbp.placement("cpu", [0, 1])
    for losses, _, paths in pool2.run(train, Encoder, data, P, False):
        assert paths == ["fast"] * len(data)
        assert losses == pytest.approx(want_losses, rel=1e-10)


def test_attention_the_check_refuses_runs_op_by_op(pool2):
    """Key and value not laid out as the batch (a memory expanded to it): the call is judged
    op by op, which moves its tensors, and the module runs op by op, as one process."""
    data = _data(6)
    want_losses, want_params, _ = train(ToMemory, data)
    P = sbp.placement("cpu", [0, 1])
    for losses, params, paths in pool2.run(train, ToMemory, data, P):
        assert paths == ["per-op"] * len(data)
        assert losses == pytest.approx(want_losses, rel=1e-12)
        for got, ref in zip(params, want_params, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


def _with_attention_dropout(make, need_weights=True):
    model = make()
    model.attention.dropout = 0.5
    if not need_weights:  # (the dropout inside torch's scaled_dot_product_attention)
        forward = model.attention.forward
        model.attention.forward = functools.partial(forward, need_weights=False)
    return model


def _dropout_inside_attention_only(make):
    model = make()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


DROPOUT_MODELS = {
    "attention-weights": functools.partial(_with_attention_dropout, Attention),
    "attention-sdpa": functools.partial(_with_attention_dropout, Attention, need_weights=False),
    "encoder-decoder": functools.partial(
        _dropout_inside_attention_only, functools.partial(Encoder, dropout=0.3)
    ),
}


@pytest.mark.parametrize(
    ("name", "n"), [(name, 6) for name in DROPOUT_MODELS] + [("encoder-decoder", 7)]
)
def test_dropout_inside_torch_attention(pool2, name, n):
    """Dropout inside the attention (on its weights, or inside scaled_dot_product_attention
    when no weights are asked for): the local run draws the masks of the op-by-op path, so
    both train alike. A batch of 7 splits the (batch x heads) rows where no split of their
    merged dim does: the masks would differ, so the module runs op by op."""
    data = _data(n)
    P = sbp.placement("cpu", [0, 1])
    make = DROPOUT_MODELS[name]
    fast, slow = pool2.run(train, make, data, P), pool2.run(train, make, data, P, True, False)
    for (losses, params, paths), (want_losses, want_params, _) in zip(fast, slow, strict=True):
        assert paths == ["fast" if n == 6 else "per-op"] * len(data)
        assert losses == pytest.approx(want_losses, rel=1e-12)
        for got, ref in zip(params, want_params, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


def test_vit_in_a_world_of_one(pool1):
    """On one rank split and broadcast hold the same data, and the planner may pick either
    for ViT's `cat` of the class token (expanded, broadcast) and the split patches: the
    check takes them as laid out alike (before: op by op, "aten.cat.default needs its
    inputs moved")."""
    data = _data(4)
    want_losses, want_params, _ = train(ViT, data)
    for losses, params, paths in pool1.run(train, ViT, data, sbp.placement("cpu", [0])):
        assert paths == ["fast"] * len(data)
        assert losses == pytest.approx(want_losses, rel=1e-12)
        for got, ref in zip(params, want_params, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


def test_transformer_layers_with_dropout_take_the_fast_path(pool2):
    """nn.Transformer layers with dropout everywhere (their Dropout modules and inside the
    attention). Op by op (`fast=False`) a Dropout module right after the attention may see
    its output laid out otherwise and draw other masks, so the runs are not compared; the
    check compared the first local run with its own op-by-op run, and would have sent the
    module op by op had a mask differed."""
    data = _data(6)
    make = functools.partial(Encoder, dropout=0.3)
    for losses, _, paths in pool2.run(train, make, data, sbp.placement("cpu", [0, 1])):
        assert paths == ["fast"] * len(data)
        assert all(0 < loss < 10 for loss in losses)


def _encoder_in_eval(nested: bool, P=None):
    """nn.TransformerEncoder in eval mode, without grad, given a key padding mask."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(E, HEADS, 16, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested).double().eval()
    x, pad, _ = _data(6, steps=1)[0]
    if P is not None:
        encoder.to_global(P, B)
        x, pad = sbp.tensor(x, placement=P, sbp=S0), sbp.tensor(pad, placement=P, sbp=S0)
    try:
        with torch.no_grad():
            out = encoder(x, src_key_padding_mask=pad)
    except sbp.SbpError as e:
        return type(e).__name__, str(e)
    if P is None:
        return out
    return out.full_tensor(), sbp.nn.fast_path.state(encoder).last_path


def test_transformer_encoder_in_eval_with_a_padding_mask(pool2):
    """torch's encoder takes nested tensors there (before: a raw NotImplementedError from
    the meta kernel sbp asks for, op by op): a named error on every rank, saying to build
    it with enable_nested_tensor=False, which runs on the fast path as one process."""
    P = sbp.placement("cpu", [0, 1])
    for kind, message in pool2.run(_encoder_in_eval, True, P):
        assert kind == "InputTypeError" and "enable_nested_tensor=False" in message
    want = _encoder_in_eval(False)
    for out, path in pool2.run(_encoder_in_eval, False, P):
        assert path == "fast"
        torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
