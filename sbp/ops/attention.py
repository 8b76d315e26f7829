"""Rules for attention and padding, the ops a Hugging Face transformer falls back on otherwise.

Scaled dot-product attention is independent per batch item and per head, so a
split of the batch dim (0) or of the head dim (1) of query, key and value runs
locally and gives outputs split the same way; an attention mask follows where
it has that dim whole, and is broadcast where it has size 1 (or fewer dims).
`constant_pad_nd` keeps the split of every dim it does not pad, and a partial
sum when it pads with zeros.
"""

from __future__ import annotations

import torch

from sbp.ops.registry import Call, Strategy, register_strategy
from sbp.signature import broadcast, partial_sum, split

aten = torch.ops.aten
B = broadcast


def _mask_sbp(mask_shape: tuple, dim: int, size: int):
    """The sbp of an attention mask (broadcastable to (N, H, L, S)) when the logical
    attention dim `dim` (0 batch, 1 heads) is split."""
    k = len(mask_shape) - 4 + dim  # the mask's own dim aligned with `dim`
    if k < 0 or mask_shape[k] == 1:
        return B
    if mask_shape[k] == size:
        return split(k)
    return None  # cannot happen for a valid mask; no candidate


def _sdpa_candidates(call: Call, n_main: int, n_out: int) -> list[Strategy]:
    """`n_main` global (N, H, L, E)-shaped tensors first (query, key, value, ...), then perhaps
    a global attention mask; outputs all split like the query."""
    specs = call.specs
    q_shape = specs[1].shape if n_main == 6 else specs[0].shape  # backward starts with grad_out
    qkv = specs[1:4] if n_main == 6 else specs[0:3]
    extra = specs[n_main:]
    cands = [Strategy((B,) * len(specs), (B,) * n_out)]
    dropout_p = call.arg(6 if n_main == 6 else 3, "dropout_p", 0.0)
    if dropout_p:  # random masks are drawn per call: keep the one-process draw
        return cands
    for dim in (0, 1):
        size = q_shape[dim]
        if any(s.shape[dim] != size for s in qkv):  # grouped-query heads: no head split
            continue
        mask = tuple(_mask_sbp(s.shape, dim, size) for s in extra)
        if None in mask:
            continue
        cands.append(Strategy((split(dim),) * n_main + mask, (split(dim),) * n_out))
    return cands


@register_strategy(aten._scaled_dot_product_flash_attention_for_cpu)
def sdpa_flash_cpu(call: Call) -> list[Strategy]:
    """(query, key, value, ..., attn_mask=) -> (output, logsumexp)."""
    return _sdpa_candidates(call, 3, 2)


@register_strategy(aten._scaled_dot_product_flash_attention_for_cpu_backward)
def sdpa_flash_cpu_backward(call: Call) -> list[Strategy]:
    """(grad_out, query, key, value, out, logsumexp, ..., attn_mask=) -> grads of q, k, v."""
    return _sdpa_candidates(call, 6, 3)


def _padded_dims(ndim: int, pad: list[int]) -> set[int]:
    """Dims that `pad` (pairs from the last dim backwards) changes."""
    return {ndim - 1 - i // 2 for i, p in enumerate(pad) if p != 0}


@register_strategy(aten.constant_pad_nd)
def constant_pad_nd(call: Call) -> list[Strategy]:
    ndim = len(call.specs[0].shape)
    padded = _padded_dims(ndim, list(call.arg(1, "pad")))
    cands = [Strategy((B,), (B,))]
    cands += [Strategy((split(d),), (split(d),)) for d in range(ndim) if d not in padded]
    if call.arg(2, "value", 0) in (0, 0.0, None):
        cands.append(Strategy((partial_sum,), (partial_sum,)))
    return cands
