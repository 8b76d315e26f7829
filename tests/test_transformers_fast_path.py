"""transformers models trained on global tensors through the data-parallel fast path, their
loss (`labels=`) included: small randomly initialised BERT (given its token type ids, as
its tokenizer does), Llama and ViT in a world of 2, with and without an attention mask,
equal one process on the logical batch (float64), and run on the local shards."""

from __future__ import annotations

import inspect

import pytest
import torch

import sbp

pytest.importorskip("transformers", reason="needs the `hf` extra")

BATCH, TOKENS, VOCAB = 4, 12, 100
S0, B = sbp.split(0), sbp.broadcast


# name: (config class, model class, the config's arguments): small, randomly initialised
MODELS = {
    "bert": (
        "BertConfig",
        "BertForSequenceClassification",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=32,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            num_labels=3,
        ),
    ),
    # (a pad_token_id and no attention mask: transformers looks for pads)
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, pad_token_id=0)
        | dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    ),
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
        | dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32),
    ),
    "vit": (
        "ViTConfig",
        "ViTForImageClassification",
        dict(image_size=8, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2)
        | dict(num_attention_heads=2, intermediate_size=64, num_labels=3)
        | dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    ),
}


# (each sample's choices flattened into rows inside the model)
MODELS["bert-choices"] = ("BertConfig", "BertForMultipleChoice", MODELS["bert"][2])


def _model(name: str):
    """`-dropout`: Llama's attention dropout on; `-padded` changes the batches only."""
    import transformers as T

    base = name.removesuffix("-padded").removesuffix("-dropout")
    config_class, model_class, options = MODELS[base]
    if name.endswith("-dropout"):
        options = options | {"attention_dropout": 0.1}
    torch.manual_seed(0)
    return getattr(T, model_class)(getattr(T, config_class)(**options)).double()


def _batches(name: str, steps: int = 2) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        labels = torch.randint(0, 3, (BATCH,), generator=g)
        if name == "vit":
            pixels = torch.randn(BATCH, 3, 8, 8, generator=g, dtype=torch.float64)
            out.append({"pixel_values": pixels, "labels": labels})
            continue
        ids = torch.randint(0, VOCAB, (BATCH, TOKENS), generator=g)
        causal = name.startswith(("llama", "gpt2"))
        batch = {"input_ids": ids, "labels": ids if causal else labels}
        if name.startswith("bert"):  # (as its tokenizer gives them: BERT's own default is a
            # buffer expanded to the batch and embedded, rows equal by value only: op by op)
            batch["token_type_ids"] = torch.zeros_like(ids)
        if name.endswith("-padded"):  # the first half unpadded, the second padded
            mask = torch.ones(BATCH, TOKENS, dtype=torch.long)
            mask[BATCH // 2, TOKENS - 3 :] = mask[BATCH - 1, TOKENS // 2 :] = 0
            batch["attention_mask"] = mask
            if causal:
                batch["labels"] = ids.masked_fill(mask == 0, -100)
        if name.startswith("bert-choices"):  # (3 choices of each sample: its text, shifted)
            choices = {k: v for k, v in batch.items() if k != "labels"}
            batch = {k: torch.stack([v, v.roll(1, 1), v.roll(2, 1)], 1) for k, v in choices.items()}
            batch["labels"] = labels
        out.append(batch)
    return out


def _options(name: str) -> dict:
    return {"use_cache": False} if name.startswith(("llama", "gpt2")) else {}


def _train(name: str, world: int | None, fast: bool = True, nd: tuple | None = None, sharded=False):
    """Losses and parameters after SGD steps; where `world` is given, on global tensors:
    on ranks 0..world-1 and the batch split(0), or where `nd` is given, on a 2x2 placement
    and the batch laid out as `nd`; parameters broadcast, or `sharded` (split(0))."""
    import sbp.nn

    model = _model(name)
    P = None if world is None else sbp.placement("cpu", list(range(world)))
    if nd is not None:
        P = sbp.placement("cpu", [[0, 1], [2, 3]])
    nd = nd or (sbp.split(0),)
    if P is not None:
        model.to_global(P, (sbp.split(0) if sharded else sbp.broadcast,) * P.ndim)
        sbp.nn.data_parallel(model, fast=fast)
        sbp.manual_seed(0)  # (the dropout masks: the same draws for both paths)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, paths = [], []
    for batch in _batches(name):
        if P is not None:
            me = P.coord(sbp.env.get_rank())
            batch = {
                k: sbp.to_global(v[sbp.local_slices(v.shape, P, nd, me)].contiguous(), P, nd)
                for k, v in batch.items()
            }
            with sbp.global_mode(P):
                loss = model(**batch, **_options(name)).loss
            paths.append(sbp.nn.fast_path.state(model).last_path)
        else:
            loss = model(**batch, **_options(name)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = [p.full_tensor() if P is not None else p.detach() for p in model.parameters()]
    return losses, params, paths, _mask_functions(), _intercepted_by_name(model, P)


def _intercepted_by_name(model, P) -> list[bool]:
    """Per layout checked, did the local run intercept BatchNorm, dropout and losses where
    they are called (modules, names on torch.nn.functional) rather than by a mode over the
    whole forward (`Layout.in_modules`)?"""
    if P is None:
        return []
    return [layout.in_modules for layout in sbp.nn.fast_path.state(model)._layouts.values()]


def _mask_functions() -> list:
    """transformers' mask functions as the checking pass leaves them (it wraps them)."""
    from transformers import masking_utils as m

    table = m.ALL_MASK_ATTENTION_FUNCTIONS
    functions = (m.sdpa_mask, m._ignore_causal_mask_sdpa, table["sdpa"], table["eager"])
    return [(f.__qualname__, hasattr(f, "__wrapped__")) for f in functions]


@pytest.mark.parametrize(
    "name",
    ["bert", "llama", "vit", "gpt2", "bert-padded", "llama-padded", "bert-choices-padded"],
)
def test_transformers_model_trains_on_the_fast_path(pool2, name):
    """With an attention mask too (`-padded`: one rank's rows have no padding, so its
    local run skips the mask where the other's builds it, each exact for its rows). For
    multiple choice the mask has a row per choice, not per sample (before: op by op, the
    mask taken as broadcast)."""
    ref_losses, ref_params, _, functions, _ = _train(name, None)
    for losses, params, paths, after, _ in pool2.run(_train, name, 2):
        assert paths == ["fast", "fast"]
        assert after == functions  # (the checking pass's wrappers are gone)
        # (transformers computes a causal LM's loss in float32)
        rel = 1e-6 if name.startswith(("llama", "gpt2")) else 1e-12
        assert losses == pytest.approx(ref_losses, rel=rel)
        for p, q in zip(params, ref_params, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert-padded"])
def test_transformers_model_trains_sharded(pool2, name):
    """Parameters split(0) (sharded data parallelism, ZeRO-3): the blocks of
    `model.*.layers` / `h` are the units, the embeddings (GPT-2's tied to its head)
    and final norm the root unit; the same training as one process."""
    ref_losses, ref_params, *_ = _train(name, None)
    for losses, params, paths, *_ in pool2.run(_train, name, 2, True, None, True):
        assert paths == ["sharded", "sharded"]
        rel = 1e-6 if name.startswith(("llama", "gpt2")) else 1e-12
        assert losses == pytest.approx(ref_losses, rel=rel)
        for p, q in zip(params, ref_params, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("nd", [(S0, S0), (S0, B)], ids=["S0,S0", "S0,B"])
@pytest.mark.parametrize("name", ["llama", "bert"])
def test_transformers_model_trains_on_the_fast_path_on_2x2(pool4, name, nd):
    """On a 2-D placement too: the models' merges of the batch with the sequence
    (`view(-1, hidden)`) keep the split, so nothing moves (they ran op by op before)."""
    ref_losses, ref_params, *_ = _train(name, None)
    for losses, params, paths, *_ in pool4.run(_train, name, 4, True, nd):
        assert paths == ["fast", "fast"]
        rel = 1e-6 if name == "llama" else 1e-12  # (a causal LM's loss is float32)
        assert losses == pytest.approx(ref_losses, rel=rel)
        for p, q in zip(params, ref_params, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12)


def _forward_with_cache(world: int | None):
    """Llama's loss and the keys and values of its returned KV cache (use_cache is on by
    default), for the padded batch."""
    import sbp.nn

    model = _model("llama")
    batch = _batches("llama-padded", steps=1)[0]
    if world is None:
        out = model(**batch)
        return (
            out.loss.item(),
            [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)],
            None,
        )
    P = sbp.placement("cpu", list(range(world)))
    model.to_global(P, sbp.broadcast)
    me = P.coord(sbp.env.get_rank())
    batch = {
        k: sbp.to_global(
            v[sbp.local_slices(v.shape, P, sbp.split(0), me)].contiguous(), P, sbp.split(0)
        )
        for k, v in batch.items()
    }
    results = []
    for _ in range(2):  # the checking pass, then the local run
        with sbp.global_mode(P):
            out = model(**batch)
        cache = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
        results.append(
            (
                out.loss.item(),
                [t.full_tensor() for t in cache],
                sbp.nn.fast_path.state(model).last_path,
                {tuple(t.sbp) for t in cache},
            )
        )
    return results


def test_a_returned_kv_cache_holds_global_tensors(pool2):
    """use_cache on (transformers' default): the fast path opens the returned cache, so its
    keys and values come back global, laid out as the batch, equal to one process."""
    want_loss, want_cache, _ = _forward_with_cache(None)
    for results in pool2.run(_forward_with_cache, 2):
        for loss, cache, _, layouts in results:
            assert layouts == {(sbp.split(0),)}
            assert loss == pytest.approx(want_loss, rel=1e-6)
            for got, want in zip(cache, want_cache, strict=True):
                torch.testing.assert_close(got, want.detach(), rtol=1e-9, atol=1e-12)
        assert [path for _, _, path, _ in results] == ["fast", "fast"]


def test_attention_dropout_on_the_cpu_runs_on_the_fast_path(pool2):
    """Attention with dropout (Llama's attention_dropout): on the CPU torch draws its mask by
    a `bernoulli_` the check sees, and the local run seeds the draw as the op-by-op rule
    does, so training runs fast and equals the op-by-op path to rounding."""
    fast = pool2.run(_train, "llama-dropout", 2, True)
    per_op = pool2.run(_train, "llama-dropout", 2, False)
    for (losses, params, paths, _, by_name), (want_losses, want_params, want_paths, *_) in zip(
        fast, per_op, strict=True
    ):
        assert paths == ["fast", "fast"] and want_paths == ["per-op", "per-op"]
        assert by_name == [True]  # (the attention's dropout caught by name: no mode)
        assert losses == pytest.approx(want_losses, rel=1e-12)
        for p, q in zip(params, want_params, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
    ref_losses, *_ = _train("llama", None)  # (no dropout: the masks made a difference)
    assert fast[0][0] != pytest.approx(ref_losses, rel=1e-6)


def _cache_of(model, out) -> dict:
    """`out`'s KV cache as the keyword argument the model takes (transformers 5.x renamed
    `past_key_values=` to `cache=`)."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: out.past_key_values}


def _greedy_generate(world: int | None):
    """GPT-2's greedy `generate` with its KV cache (passed back into the model every step),
    on the logical batch or split over the ranks; and a decoding step by hand, the cache
    the prefill returned passed back in."""
    import sbp.nn

    model = _model("gpt2").eval()
    ids = torch.randint(1, VOCAB, (BATCH, 6), generator=torch.Generator().manual_seed(3))
    options = dict(max_new_tokens=4, do_sample=False, use_cache=True, pad_token_id=0)
    if world is None:
        with torch.no_grad():
            prefill = model(ids[:, :5], use_cache=True)
            step = model(ids[:, 5:], **_cache_of(model, prefill), use_cache=True)
            return model.generate(ids, **options), step.logits
    P = sbp.placement("cpu", list(range(world)))
    model.to_global(P, B)
    sbp.nn.data_parallel(model)
    g = sbp.to_global(ids[sbp.local_slices(ids.shape, P, S0, P.coord(sbp.env.get_rank()))], P, S0)
    with torch.no_grad(), sbp.global_mode(P):
        prefill = model(g[:, :5], use_cache=True)
        step = model(g[:, 5:], **_cache_of(model, prefill), use_cache=True)
        return model.generate(g, **options).full_tensor(), step.logits.full_tensor()


def test_greedy_generate_with_a_kv_cache(pool2):
    """A cache passed into the model is written by its forward: the fast path's checking
    pass filled it with global keys, and its local run added local ones, so generate()
    with use_cache raised a PlacementError at its first step. Such a call runs op by op."""
    want_tokens, want_logits = _greedy_generate(None)
    for tokens, logits in pool2.run(_greedy_generate, 2):
        assert torch.equal(tokens, want_tokens)
        torch.testing.assert_close(logits, want_logits, rtol=1e-9, atol=1e-12)


def _checkpointed_training(world: int | None):
    """GPT-2 trained with gradient checkpointing on (non-reentrant, as transformers sets it)."""
    import sbp.nn

    model = _model("gpt2")
    enable = getattr(model, "activation_checkpointing_enable", None)  # (its newer name)
    (enable or model.gradient_checkpointing_enable)({"use_reentrant": False})
    model.train()
    P = None if world is None else sbp.placement("cpu", list(range(world)))
    if P is not None:
        model.to_global(P, B)
        sbp.nn.data_parallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, paths = [], []
    for batch in _batches("gpt2"):
        if P is not None:
            me = P.coord(sbp.env.get_rank())
            batch = {
                k: sbp.to_global(v[sbp.local_slices(v.shape, P, S0, me)].contiguous(), P, S0)
                for k, v in batch.items()
            }
        with sbp.global_mode(P) if P is not None else torch.enable_grad():
            loss = model(**batch, use_cache=False).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        paths.append(None if P is None else sbp.nn.fast_path.state(model).last_path)
    params = [p.full_tensor() if P is not None else p.detach() for p in model.parameters()]
    return losses, params, paths


@pytest.mark.filterwarnings("ignore:sbp. GPT2LMHeadModel runs op by op while gradient")
def test_gradient_checkpointing_trains_as_one_process(pool2):
    """Checkpointing runs a block's forward again in backward, where the fast path's local
    run had given the module its global parameters back (a PlacementError in backward):
    while it is on, the model runs op by op."""
    want_losses, want_params, _ = _checkpointed_training(None)
    for losses, params, paths in pool2.run(_checkpointed_training, 2):
        assert losses == pytest.approx(want_losses, rel=1e-6)  # (a float32 loss)
        for got, want in zip(params, want_params, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
        assert paths == ["per-op", "per-op"]
