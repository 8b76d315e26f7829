"""torch's `F.embedding_bag` (`nn.EmbeddingBag`) of a 2-d batch in the data-parallel check
(an op family of `sbp.data_parallel.families`).

Each row of a 2-d input is one bag, reduced to one output row from that row alone, so the
call is row-wise in the batch. Op by op, though, it flattens the batch and makes its
offsets with `torch.arange` over the logical size, and the op has no rule: it runs on
broadcast inputs. So the check takes the call as a whole where the input (and any
per-sample weights) are laid out as the batch and the weight broadcast, and runs it on
the local tensors, as the local run will. Not taken: explicit offsets (bags of any size
in one flat input), `max_norm` (which writes the weight), `scale_grad_by_freq` (counts
over the whole batch) and `sparse` gradients.
"""

from __future__ import annotations

import functools
import inspect

import torch.nn.functional as F

from sbp.data_parallel.batch_rows import rows_as_global
from sbp.signature import is_all_broadcast
from sbp.tensor import GlobalTensor

CALLS = (F.embedding_bag,)


@functools.cache
def _signature() -> inspect.Signature:
    return inspect.signature(F.embedding_bag)


def why_not_row_wise(args: tuple, kwargs: dict, data_nd: tuple) -> str:
    """ "" where the call's local run on each rank's tensors gives that rank's rows of the
    logical result; else why not. Decided from the layouts alone, alike on every rank."""
    bound = _signature().bind(*args, **kwargs).arguments
    input, weight = bound["input"], bound["weight"]
    if bound.get("offsets") is not None:
        return "bags given by offsets"
    for name in ("max_norm", "scale_grad_by_freq", "sparse"):
        if bound.get(name):
            return f"{name} is set"
    if not isinstance(input, GlobalTensor) or input.dim() != 2:
        return "an input that is not a 2-d batch"
    if tuple(input.sbp) != data_nd:
        return f"the input is laid out as {tuple(input.sbp)}"
    if not isinstance(weight, GlobalTensor) or not is_all_broadcast(weight.sbp):
        return "the weight is not broadcast"
    per_sample = bound.get("per_sample_weights")
    if per_sample is not None and (
        not isinstance(per_sample, GlobalTensor)
        or tuple(per_sample.sbp) != data_nd
        or per_sample.shape != input.shape
    ):
        return "per_sample_weights are not laid out as the input"
    return ""


def run_whole(func, args: tuple, kwargs: dict, data_nd: tuple) -> GlobalTensor:
    """The call on this rank's local tensors, as the local run makes it (no collective, no
    fallback); its result laid out as the batch."""
    bound = _signature().bind(*args, **kwargs)
    input = bound.arguments["input"]
    local = {k: v._local if isinstance(v, GlobalTensor) else v for k, v in bound.arguments.items()}
    return rows_as_global(func(**local), input.placement, data_nd, 0, input.shape[0])
