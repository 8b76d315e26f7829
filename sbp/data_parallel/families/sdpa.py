"""`F.scaled_dot_product_attention` on the data-parallel path. It is row-wise in the batch;
with dropout (`dropout_p`) it draws masks:
- on the CPU torch computes it as a composite whose `bernoulli_` the check sees (the
  dropout family judges it), drawing from the default generator: the local run seeds that
  alike for the call (`local`);
- elsewhere inside torch's fused kernel, where the local run cannot draw the op-by-op
  path's masks: the check refuses it (`watch`) and the module runs op by op."""

from __future__ import annotations

import torch

from sbp.data_parallel.by_name import _ATTENTION
from sbp.ops.nn import shard_seed

WATCHED = (_ATTENTION,)
LOCAL = (_ATTENTION,)


def watch(check, args: tuple, kwargs: dict) -> None:
    p = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
    if p and args[0].device.type != "cpu":
        check._fail("attention with dropout (dropout_p) draws masks in torch's kernel")


def run_local(run, func, args, kwargs):
    return local(run, *args, **kwargs)


def local(run, query, key, value, attn_mask=None, dropout_p=0.0, *args, **kwargs):
    """`F.scaled_dot_product_attention` in the local run. With dropout on the CPU, torch
    runs it as a composite drawing its mask by `bernoulli_` from the default generator, as
    the op-by-op path's `bernoulli_` rule draws it from a generator seeded by sbp's stream:
    the default generator is seeded alike for the call (and put back after)."""
    if not dropout_p or query.device.type != "cpu":  # (elsewhere the check refused it)
        return _ATTENTION(query, key, value, attn_mask, dropout_p, *args, **kwargs)
    run.dropouts += 1
    seed = shard_seed(run.fast.placement, run.data_nd)
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        return _ATTENTION(query, key, value, attn_mask, dropout_p, *args, **kwargs)
