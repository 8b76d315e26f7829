"""Reductions: over an unsplit dim a split stays; over a split dim the result is partial.

A sum over a split dim gives partial sums; a mean gives each rank's local mean
weighted by its share of the logical count (uneven shards stay exact); amax and
amin give partial max and min. Norms reduce |x|^p as a partial sum, finish on
broadcast, then take the root.
"""

from __future__ import annotations

import math

import torch

from sbp import env
from sbp.kernels import fill_value
from sbp.layout import GlobalSpec
from sbp.ops.registry import (
    Call,
    Strategy,
    register,
    register_strategy,
    split_except_dim,
    without_partials,
)
from sbp.signature import Partial, broadcast, partial_sum, split

aten = torch.ops.aten


def reduced_dims(call: Call, dim_pos: int = 1) -> tuple[list[int], bool]:
    """The normalised reduced dims and keepdim of a reduction call."""
    ndim = len(call.specs[0].shape)
    dims = call.arg(dim_pos, "dim", None)
    if call.func.overloadpacket in (aten.sum, aten.mean) and call.func._overloadname == "default":
        dims = None
    if ndim == 0:  # (dim 0 or -1 of a 0-dim tensor is the tensor itself: no dim to reduce)
        dims = []
    elif dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        dims = list(range(ndim))
    elif isinstance(dims, int):
        dims = [dims]
    dims = sorted({d + ndim if d < 0 else d for d in dims})
    keepdim = bool(call.arg(dim_pos + 1, "keepdim", False))
    return dims, keepdim


def reduction_candidates(call: Call, over_split) -> list[Strategy]:
    """B -> B; S(d) kept on unreduced dims; S(d) over a reduced dim -> `over_split`."""
    dims, keepdim = reduced_dims(call)
    ndim = len(call.specs[0].shape)
    cands = [Strategy((broadcast,), (broadcast,))]
    for d in range(ndim):
        if d in dims:
            if over_split is not None:
                cands.append(Strategy((split(d),), (over_split,)))
        else:
            out_d = d if keepdim else d - sum(r < d for r in dims)
            cands.append(Strategy((split(d),), (split(out_d),)))
    return cands


@register_strategy(aten.sum)
def sum_(call: Call) -> list[Strategy]:
    return [*reduction_candidates(call, partial_sum), Strategy((partial_sum,), (partial_sum,))]


def _mean_share(func, args, kwargs, outs, in_specs, out_specs):
    """Turn each rank's local mean over split dims into its share of the logical mean."""

    spec: GlobalSpec = in_specs[0]
    dims, _ = reduced_dims(Call(func, args, kwargs, [spec], []))
    local = spec.local_shape(env.get_rank())
    local_count = math.prod(local[d] for d in dims)
    logical_count = math.prod(spec.shape[d] for d in dims)
    if local_count == logical_count:
        return outs
    out = torch.zeros_like(outs[0]) if local_count == 0 else outs[0] * (local_count / logical_count)
    return [out, *outs[1:]]


@register_strategy(aten.mean, post=_mean_share)
def mean(call: Call) -> list[Strategy]:
    return [*reduction_candidates(call, partial_sum), Strategy((partial_sum,), (partial_sum,))]


def _identity_if_empty(op: str):
    """local_args of max/min: a rank whose shard is empty along a reduced dim (uneven split,
    1 row on 2 ranks) reduces one identity element instead (-inf for max), as torch refuses
    an empty max; its partial result then leaves the others' unchanged."""

    def local_args(func, args, kwargs, rank, in_specs, out_specs):
        x = args[0]
        if x.numel() != 0:
            return args, kwargs
        dims, _ = reduced_dims(Call(func, args, kwargs, [in_specs[0]], []))
        shape = [1 if (n == 0 and d in dims) else n for d, n in enumerate(x.shape)]
        filler = torch.full(shape, fill_value(x.dtype, op), dtype=x.dtype, device=x.device)
        return (filler, *args[1:]), kwargs

    return local_args


@register_strategy(aten.amax, aten.max.default, local_args=_identity_if_empty("max"))
def amax(call: Call) -> list[Strategy]:
    return reduction_candidates(call, Partial("max"))


@register_strategy(aten.amin, aten.min.default, local_args=_identity_if_empty("min"))
def amin(call: Call) -> list[Strategy]:
    return reduction_candidates(call, Partial("min"))


@register_strategy(
    aten.var,
    aten.std,
    aten.var_mean,
    aten.std_mean,
    aten.prod,
    aten.argmax,
    aten.argmin,
    aten.max.dim,
    aten.min.dim,
)
def over_unsplit_only(call: Call) -> list[Strategy]:
    """Not decomposable as one partial: keep splits on unreduced dims, else broadcast."""
    cands = reduction_candidates(call, None)
    n_out = sum(m is not None for m in call.out_meta)
    return [Strategy(c.inputs, c.outputs * n_out) for c in cands]


@register(aten.linalg_vector_norm.default)
def vector_norm(func, args, kwargs):
    """sum(|x|^p) is a partial sum over split dims: reduce it, then take the root."""
    x = args[0]
    ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    rest = dict(zip(("dim", "keepdim"), args[2:4], strict=False)) | {
        k: v for k, v in kwargs.items() if k != "ord"
    }
    x = without_partials(x)
    dtype = rest.get("dtype")  # (torch casts the input to it first)
    a = (x if dtype is None else x.to(dtype)).abs()  # (real: |z| of a complex z)
    dim, keepdim = rest.get("dim"), rest.get("keepdim", False)
    if ord_ in (float("inf"), float("-inf")):
        out = a.amax(dim=dim, keepdim=keepdim) if ord_ > 0 else a.amin(dim=dim, keepdim=keepdim)
        return _finish(out, None)
    if ord_ == 0:
        return _finish((a != 0).to(a.dtype).sum(dim=dim, keepdim=keepdim), None)
    powered = a * a if ord_ == 2 else a.pow(ord_)
    out = powered.sum(dim=dim if dim is not None else list(range(x.dim())), keepdim=keepdim)
    return _finish(out, 1.0 / ord_)


@register(aten.norm.ScalarOpt_dim)
def norm_over_dims(func, args, kwargs):
    """`torch.norm(x, p, dim)`'s overload (F.pairwise_distance's): the vector norm."""
    x, p, dim = args[:3]
    keepdim = args[3] if len(args) > 3 else kwargs.get("keepdim", False)
    return aten.linalg_vector_norm.default(x, 2 if p is None else p, dim, keepdim)


def _finish(out, root):
    out = without_partials(out)
    return out if root is None else out.pow(root)


@register(aten.any.default, aten.all.default)
def any_all(func, args, kwargs):
    """any/all of the whole tensor: a max/min of 0-1 flags, reduced like amax/amin."""
    flags = aten._to_copy.default(without_partials(args[0]) != 0, dtype=torch.int32)
    out = flags.amax() if func is aten.any.default else flags.amin()
    return without_partials(out) != 0


# ---------------------------------------------------------------- scans along a dim
# (a scan, cumsum or cummax, runs along `dim` only: a split of any other dim stays)


@register_strategy(aten.cumsum)
def cumsum(call: Call) -> list[Strategy]:
    """Also linear: partial sums stay partial."""
    return [*split_except_dim(call, 1, 1), Strategy((partial_sum,), (partial_sum,))]


@register_strategy(aten.cumprod, aten.logcumsumexp, aten._logcumsumexp)
def scan(call: Call) -> list[Strategy]:
    return split_except_dim(call, 1, 1)


@register_strategy(aten.cummax, aten.cummin)
def scan_with_indices(call: Call) -> list[Strategy]:
    return split_except_dim(call, 1, 1, n_out=2)


@register_strategy(aten.cumprod_backward, aten.cummaxmin_backward)
def scan_backward(call: Call) -> list[Strategy]:
    """(grad, input, dim, output) and (grad, input, indices, dim): every tensor as the input."""
    dim_pos = 2 if call.func.overloadpacket is aten.cumprod_backward else 3
    return split_except_dim(call, dim_pos, len(call.specs))


# ---------------------------------------------------------------- selections along a dim
# (topk and sort pick along `dim` only: a split of any other dim stays, and their indices,
# counted along the unsplit `dim`, are the logical ones. Top-k accuracy over a batch split
# on dim 0 keeps it split: no gather of the logits. Over a split `dim` they run broadcast.)


@register_strategy(aten.topk)
def topk(call: Call) -> list[Strategy]:
    """topk(self, k, dim=-1, largest, sorted): values and indices laid out alike."""
    return split_except_dim(call, 2, 1, n_out=2, default=-1)


@register_strategy(aten.sort.default, aten.sort.stable)
def sort(call: Call) -> list[Strategy]:
    """sort(self, dim=-1, descending) and sort(self, *, stable, dim=-1, descending)."""
    return split_except_dim(call, 1, 1, n_out=2, default=-1)


@register_strategy(aten.kthvalue.default, aten.mode.default)
def select_one(call: Call) -> list[Strategy]:
    """kthvalue(self, k, dim=-1, keepdim) and mode(self, dim=-1, keepdim): one value and its
    index per row along `dim`, which goes unless keepdim."""
    dim_pos = 2 if call.func.overloadpacket is aten.kthvalue else 1
    ndim = len(call.specs[0].shape)
    dim = call.arg(dim_pos, "dim", -1)
    dim = dim + ndim if dim < 0 else dim
    keepdim = bool(call.arg(dim_pos + 1, "keepdim", False))
    cands = [Strategy((broadcast,), (broadcast, broadcast))]
    for d in range(ndim):
        if d != dim:
            out = split(d if keepdim or d < dim else d - 1)
            cands.append(Strategy((split(d),), (out, out)))
    return cands
