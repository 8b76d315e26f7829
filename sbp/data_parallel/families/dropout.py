"""Dropout on the data-parallel path: the local run draws the op-by-op path's masks with
the rules' own arithmetic (`sbp.ops.nn`: `shard_generator`, seeded as the rules of
`aten.native_dropout` and `aten.bernoulli_` seed theirs, keyed by this rank's coordinates
on the split hierarchy dims; `kept`, `dropout_mask`, `masked`)."""

from __future__ import annotations

import torch

from sbp.data_parallel.by_name import _DROPOUT
from sbp.ops.nn import dropout_mask, kept, masked, shard_generator
from sbp.tensor import GlobalTensor

aten = torch.ops.aten

JUDGED = (aten.native_dropout.default, aten.bernoulli_.float)
LOCAL = (_DROPOUT,)


def judge(check, func, args) -> None:
    """Dropout of a tensor laid out as the batch, or as the batch moved to another dim
    (`_batch_moved`): counted, with those drawn inside attention called by name."""
    x = args[0]
    if check.depth == 0 and not check.attention_depth:
        check.outside_modules = True
    if tuple(x.sbp) != check.data_nd and not _batch_moved(x, check.data_nd):
        check._fail(f"{func} runs on a tensor laid out as {x.sbp}, not as the batch", True)
    else:
        check.dropouts += 1
        check.by_name_dropouts += bool(check.attention_depth)


def _batch_moved(x: GlobalTensor, data_nd: tuple) -> bool:
    """Is `x` laid out as the batch moved to another dim (`x.transpose(0, 1)` of a
    sequence-first model, or the `(1, N, L, E)` torch's 3-d attention makes)? Nothing
    moved before (else the check failed), so every split is the batch's, and `x`'s local
    tensor is the local run's; a dropout's seed follows the split hierarchy dims, not the
    tensor dim, so the local run draws the same mask there."""
    dims = {s.dim for s in x.sbp if s.is_split}
    return len(dims) == 1 and all(
        s.is_split == d.is_split and not s.is_partial for s, d in zip(x.sbp, data_nd, strict=True)
    )


def run_local(run, func, args, kwargs):
    return local(run, *args, **kwargs)


def local(run, input, p=0.5, training=True, inplace=False):
    """`F.dropout` in the local run."""
    if not training or p == 0:
        return _DROPOUT(input, p, training, inplace)
    if p == 1:
        return input.mul_(0) if inplace else torch.zeros_like(input)
    gen = shard_generator(run.fast.placement, run.data_nd, input.device)
    run.dropouts += 1
    if input.device.type == "cpu":  # what aten.dropout runs on CPU (bernoulli_ rule)
        noise = kept(input, p, gen).div_(1 - p)
        return input.mul_(noise) if inplace else input * noise
    mask = dropout_mask(input, p, gen)
    if inplace:  # the fused kernel elsewhere (native_dropout rule)
        return input.mul_(mask).mul_(1.0 / (1 - p))
    return masked(input, mask, p)
