"""Cross-entropy and NLL losses of the batch inside a data-parallel module's forward: the
local run computes the mean over the logical batch as the op-by-op rule does (this rank's
sum over the batch's total weight, summed over the ranks in one small all-reduce), with
the rule's layout (`sbp.ops.nn.nll_layout`) and total weight (`sbp.data_parallel.outputs`)."""

from __future__ import annotations

import torch
from torch.nn import _reduction

from sbp import comm
from sbp.data_parallel import outputs
from sbp.data_parallel.by_name import _LOSSES
from sbp.errors import LabelRangeError
from sbp.ops.nn import nll_layout

aten = torch.ops.aten

# F.cross_entropy and F.nll_loss of the batch (the local run computes the logical mean)
JUDGED = (aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
LOCAL = _LOSSES


def judge(check, func, args) -> bool:
    """A loss the local run computes as the rule does: scores and labels laid out as the
    batch, whole class weights (that need no gradient, as torch requires). Taken whole."""
    x, target, weight, reduction, _ = args
    layout = nll_layout(x, target, weight, reduction)
    if (
        tuple(x.sbp) != check.data_nd
        or layout.x != x._spec
        or layout.target != target._spec
        or (weight is not None and (layout.weight != weight._spec or weight.requires_grad))
    ):
        check._fail(f"{func} runs on tensors not laid out as the batch")
        return True
    check.losses += 1
    if check.loss_depth == 0:
        check.outside_modules = True
    return True


def run_local(run, func, args, kwargs):
    return local(run, func, *args, **kwargs)


def local(
    run,
    fn,
    input,
    target,
    weight=None,
    size_average=None,
    ignore_index=-100,
    reduce=None,
    reduction="mean",
    **options,
):
    """F.cross_entropy or F.nll_loss (`fn`) of the local batch as the op-by-op rule
    computes it: a mean is this rank's sum over the logical batch's total weight, which
    the ranks sum in one collective (with, for labels on the CPU, the count of labels
    outside the classes: a bad label is an error on every rank, not a hang).

    Soft (probability) targets pass as they are: they make no `nll_loss` op, and the
    check refused their mean (a partial sum). So does a call made again from inside
    this one (a torch function mode hands `fn` back to its name)."""
    if run.in_loss or target.is_floating_point():
        return fn(input, target, weight, size_average, ignore_index, reduce, reduction, **options)
    run.losses += 1
    if size_average is not None or reduce is not None:  # (deprecated: what they mean)
        reduction = _reduction.legacy_get_string(size_average, reduce)
    run.in_loss = True
    try:
        return _loss(run, fn, input, target, weight, ignore_index, reduction, options)
    finally:
        run.in_loss = False


def _loss(run, fn, input, target, weight, ignore_index, reduction, options):
    if reduction != "mean":  # (this rank's sum is its part; none is per sample)
        return fn(input, target, weight, ignore_index=ignore_index, reduction=reduction, **options)
    classes = input.shape[1] if input.dim() > 1 else input.shape[0]
    with torch.no_grad():  # (as torch's: no gradient flows through the divisor)
        counted = target != ignore_index
        parts = []
        if target.device.type == "cpu":
            bad = counted & ((target < 0) | (target >= classes))
            counted = counted & ~bad
            parts.append(bad.sum(dtype=input.dtype))
        mine = outputs.local_total_weight(target, counted, weight, input.dtype)
        totals = torch.stack([mine, *parts])
        if len(run.group) > 1:
            totals = comm.all_reduce(totals, "sum", run.group)
    if parts and totals[1] > 0:
        raise LabelRangeError(
            f"target holds {int(totals[1])} label(s) outside [0, {classes}) for an input "
            f"of {classes} classes (ignore_index={ignore_index})"
        )
    local = fn(input, target, weight, ignore_index=ignore_index, reduction="sum", **options)
    return local / totals[0]
