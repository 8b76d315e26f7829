"""BatchNorm on the data-parallel path: train-mode BatchNorm over the logical batch (one
all-reduce forward, one backward: `sbp.ops.batch_norm.LogicalBatchNorm`, the rule's own
arithmetic), or per shard with `batch_norm="local"` (torch DDP's, the running statistics
then broadcast from the first rank)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sbp.ops import batch_norm

aten = torch.ops.aten

# torch picks cuDNN's (MIOpen's) BatchNorm for a tensor on the GPU
BATCH_NORMS = (
    aten.native_batch_norm.default,
    aten.cudnn_batch_norm.default,
    aten.miopen_batch_norm.default,
)
SHARD_BATCH_NORM = torch.ops.sbp.shard_batch_norm.default  # batch_norm="local", op by op
JUDGED = (*BATCH_NORMS, SHARD_BATCH_NORM)
LOCAL = (F.batch_norm,)


def judge(check, func, args) -> None:
    """BatchNorm of a tensor laid out as the batch; a train-mode one is counted, with the
    logical count of its statistics (the local run's `LogicalBatchNorm` takes it)."""
    x = args[0]
    if check.depth == 0:
        check.outside_modules = True
    if tuple(x.sbp) != check.data_nd:
        check._fail(f"{func} runs on a tensor laid out as {x.sbp}, not as the batch", True)
    elif func is SHARD_BATCH_NORM or args[5]:
        check.bn_counts.append(batch_norm._count(x))


def run_local(run, func, args, kwargs):
    return local(run, *args, **kwargs)


def local(
    run,
    input,
    running_mean,
    running_var,
    weight=None,
    bias=None,
    training=False,
    momentum=0.1,
    eps=1e-5,
):
    """`F.batch_norm` in the local run."""
    if not training:
        return F.batch_norm(input, running_mean, running_var, weight, bias, False, momentum, eps)
    counts = run.layout.bn_counts
    if run.bn_calls >= len(counts):
        raise RuntimeError("sbp data-parallel fast path: more BatchNorm calls than checked")
    count = counts[run.bn_calls]
    run.bn_calls += 1
    group = run.group
    if run.fast.batch_norm == "local" or len(group) == 1:
        if len(group) > 1:
            run.to_sync += [t for t in (running_mean, running_var) if t is not None]
        return F.batch_norm(input, running_mean, running_var, weight, bias, True, momentum, eps)
    return batch_norm.LogicalBatchNorm.apply(
        input,
        weight,
        bias,
        running_mean,
        running_var,
        momentum if momentum is not None else 0.0,
        eps,
        count,
        batch_norm.GroupSum(group),
    )
