"""Neural-network ops: convolution, softmax, losses, normalisation, pooling, embedding, dropout.

Most follow a batch split (`split(0)`) and keep parameters broadcast; a split
batch makes parameter gradients partial sums. BatchNorm in train mode and
mean-reduced losses are computed with the logical semantics: statistics and
averages over the whole logical batch, as one process would compute them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sbp import env
from sbp.errors import InputTypeError, InputValueError, LabelRangeError, PlacementError
from sbp.layout import GlobalSpec
from sbp.ops import class_split
from sbp.ops.arguments import LOCAL_INDEX_OPS
from sbp.ops.registry import (
    Call,
    Strategy,
    indices_within,
    rebox,
    rebox_to,
    register,
    register_strategy,
    split_except_dim,
    split_leading_dims,
    without_partials,
)
from sbp.ops.writes import assign
from sbp.random import draw_seed
from sbp.ranges import known_range
from sbp.signature import broadcast, partial_sum, split, splits_to_partials
from sbp.tensor import GlobalTensor

aten = torch.ops.aten
B, P = broadcast, partial_sum


def by_position(call: Call, sbps: dict[int, object], default=B) -> tuple:
    """An SBP for each global argument, chosen by its positional index."""

    out = []
    for i, a in enumerate(call.args):
        if isinstance(a, GlobalTensor):
            out.append(sbps.get(i, default))
    for a in call.kwargs.values():
        if isinstance(a, GlobalTensor):
            out.append(default)
    return tuple(out)


def _present(call: Call, sbps) -> tuple:
    """Output SBPs for the outputs that exist (masked-out gradients are None)."""
    return tuple(s for s, m in zip(sbps, call.out_meta, strict=False) if m is not None)


# ---------------------------------------------------------------- convolution


@register_strategy(aten.convolution)
def convolution(call: Call) -> list[Strategy]:
    S0, S1 = split(0), split(1)
    cands = [
        Strategy(by_position(call, {}), (B,)),
        Strategy(by_position(call, {0: S0}), (S0,)),
        Strategy(by_position(call, {0: P, 2: P}), (P,)),
    ]
    transposed, groups = call.arg(6, "transposed"), call.arg(8, "groups")
    if not transposed and groups == 1:
        cands.append(Strategy(by_position(call, {1: S0, 2: S0}), (S1,)))
    return cands


@register_strategy(aten.convolution_backward)
def convolution_backward(call: Call) -> list[Strategy]:
    S0 = split(0)
    return [
        Strategy(by_position(call, {}), _present(call, (B, B, B))),
        Strategy(by_position(call, {0: S0, 1: S0}), _present(call, (S0, P, P))),
        Strategy(by_position(call, {0: P}), _present(call, (P, P, P))),
    ]


# ---------------------------------------------------------------- softmax and losses


def _over_dim(call: Call, dim_pos: int, n_in: int) -> list[Strategy]:
    """Split along any dim but `dim`, or along `dim` too: the normaliser is then combined
    over the ranks (`sbp.ops.class_split`), one number per row, not the rows gathered."""
    ndim = len(call.specs[0].shape)
    if ndim == 0:
        return split_except_dim(call, dim_pos, n_in)
    dim = call.arg(dim_pos, "dim")
    along = split(dim + ndim if dim < 0 else dim)
    return [*split_except_dim(call, dim_pos, n_in), Strategy((along,) * n_in, (along,))]


@register_strategy(aten._log_softmax, aten._softmax, aten._safe_softmax, local=class_split.softmax)
def softmax(call: Call) -> list[Strategy]:
    return _over_dim(call, 1, 1)


@register_strategy(
    aten._log_softmax_backward_data,
    aten._softmax_backward_data,
    local=class_split.softmax_backward,
)
def softmax_backward(call: Call) -> list[Strategy]:
    return _over_dim(call, 2, 2)


@register_strategy(aten.glu)
def glu(call: Call) -> list[Strategy]:
    """Halves along `dim`: any other split stays local."""
    return split_except_dim(call, 1, 1, default=-1)


@register_strategy(aten.glu_backward)
def glu_backward(call: Call) -> list[Strategy]:
    return split_except_dim(call, 2, 2)


@register(aten.log_sigmoid_forward.default)
def log_sigmoid_forward(func, args, kwargs):
    """F.logsigmoid: elementwise, in any layout but partial. Its second output is a buffer
    for the backward, elementwise on the CPU but empty on CUDA (shape (0,)): whole there."""

    x = without_partials(args[0])
    local = x._local
    out, buffer = func._op(local)
    # (decided alike on every rank: an empty shard on CUDA has an empty buffer of its shape)
    if buffer.shape == local.shape and (local.device.type != "cuda" or local.numel() > 0):
        buffer_spec = x._spec._replace(dtype=buffer.dtype)
    else:
        whole = tuple(B for _ in x._spec.nd_sbp)
        buffer_spec = GlobalSpec(x._spec.placement, whole, tuple(buffer.shape), buffer.dtype)
    return GlobalTensor(out, x._spec), GlobalTensor(buffer, buffer_spec)


def _local_batch(batch_arg: int, input_arg: int):
    """local_args of GroupNorm: the batch size argument is the local input's."""

    def local_args(func, args, kwargs, rank, in_specs, out_specs):
        args = list(args)
        args[batch_arg] = args[input_arg].shape[0]
        return tuple(args), kwargs

    local_args.from_local_input = True  # (F.group_norm's, on local tensors)
    return local_args


@register_strategy(aten.native_group_norm, local_args=_local_batch(3, 0))
def group_norm(call: Call) -> list[Strategy]:
    """Statistics per sample and group: a split batch stays split (so do mean and rstd)."""
    n = len(call.specs)
    return [
        Strategy((B,) * n, (B, B, B)),
        Strategy((split(0),) + (B,) * (n - 1), (split(0),) * 3),
    ]


@register_strategy(aten.native_group_norm_backward, local_args=_local_batch(5, 1))
def group_norm_backward(call: Call) -> list[Strategy]:
    """The input's gradient split as the batch; weight and bias gradients partial sums."""
    n = len(call.specs)  # grad_out, input, mean, rstd (split), weight (broadcast) if any
    kinds = [(split(0), P, P)[i] for i, m in enumerate(call.out_meta) if m is not None]
    whole = tuple(B for m in call.out_meta if m is not None)
    return [
        Strategy((B,) * n, whole),
        Strategy((split(0),) * 4 + (B,) * (n - 4), tuple(kinds)),
    ]


def _batch_layout(spec: GlobalSpec, classes: bool = False) -> tuple:
    """Keep splits of the batch dim (0), and with `classes` of the class dim (1); everything
    else broadcast."""
    keep = (0, 1) if classes else (0,)
    return tuple(s if s.is_split and s.dim in keep else B for s in spec.nd_sbp)


class NllLayout(NamedTuple):
    """How nll_loss_forward lays out one kind of call (a training loop's loss makes the same
    call every step): the specs x, target and weight are computed in, and the results'."""

    x: GlobalSpec
    target: GlobalSpec
    weight: GlobalSpec | None
    out: GlobalSpec  # reduction none: per sample, split as the batch; else a partial sum
    total: GlobalSpec  # the total weight, broadcast
    total_parts: GlobalSpec  # this rank's local total weight, a partial sum
    inside: bool  # this rank holds data
    classes_split: bool  # x split along the classes: each rank picks its targets' scores


_nll_layouts: dict = {}


def nll_layout(x, target, weight, reduction: int) -> NllLayout:
    rank = env.get_rank()
    key = (x._spec, target._spec, None if weight is None else weight._spec, reduction, rank)
    layout = _nll_layouts.get(key)
    if layout is not None:
        return layout
    spec = x._spec
    # (N, C) or (N, C, d1, ...): the batch and the classes may stay split (the loss is then
    # a partial sum over the ranks holding a row's classes); a single sample (C,) is whole
    batched = len(spec.shape) >= 2
    nd = _batch_layout(spec, classes=True) if batched else tuple(B for _ in spec.nd_sbp)
    batch_nd = _batch_layout(spec) if batched else nd
    broadcast_nd = (B,) * len(nd)
    total = GlobalSpec(spec.placement, broadcast_nd, (), spec.dtype)
    per_sample = tuple(P if s.is_split and s.dim == 1 else s for s in nd)  # reduction none
    layout = NllLayout(
        x=spec._replace(nd_sbp=nd),
        target=target._spec._replace(nd_sbp=batch_nd),
        weight=None if weight is None else weight._spec._replace(nd_sbp=broadcast_nd),
        out=GlobalSpec(spec.placement, per_sample, tuple(target.shape), spec.dtype)
        if reduction == 0
        else total._replace(nd_sbp=splits_to_partials(nd)),
        total=total,
        total_parts=total._replace(nd_sbp=splits_to_partials(batch_nd)),
        inside=rank in spec.placement,
        classes_split=nd != batch_nd,
    )
    if len(_nll_layouts) > 64:
        _nll_layouts.clear()
    _nll_layouts[key] = layout
    return layout


@register(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def nll_loss_forward(func, args, kwargs):
    """Mean over the logical batch: local sums divided by the all-reduced total weight.
    (`nll_loss2d` is the same loss for (N, C, H, W) scores, and for any K-dim ones, which
    torch reshapes to 4-D.)"""

    x, target, weight, reduction, ignore_index = args
    layout = nll_layout(x, target, weight, reduction)
    shape = x._spec.shape
    check_labels(target, shape[1] if len(shape) > 1 else shape[0], ignore_index)
    x, target = rebox_to(x, layout.x), rebox_to(target, layout.target)
    weight = None if weight is None else rebox_to(weight, layout.weight)
    if layout.inside and layout.classes_split:
        out, tw = _nll_of_split_classes(
            x._local, target._local, weight, reduction, ignore_index, layout
        )
    elif layout.inside:
        out, tw = func._op(
            x._local,
            target._local,
            None if weight is None else weight._local,
            2 if reduction == 1 else reduction,  # a mean is divided by the logical total
            ignore_index,
        )
    else:
        out = torch.empty((), dtype=x.dtype) if reduction else torch.empty(0, dtype=x.dtype)
        tw = torch.empty((), dtype=x.dtype)
    if reduction == 0:
        return GlobalTensor(out, layout.out), GlobalTensor(tw, layout.total)
    if reduction == 1 and weight is None and never_ignored(known_range(target), ignore_index):
        # every logical target counts: the divisor is their number, no collective needed
        total = GlobalTensor(tw.new_full((), target.numel()), layout.total)
    else:
        total = rebox_to(GlobalTensor(tw, layout.total_parts), layout.total)
    if reduction == 2:
        return GlobalTensor(out, layout.out), total
    return GlobalTensor(out / total._local if layout.inside else out, layout.out), total


def _nll_of_split_classes(x, target, weight, reduction: int, ignore_index: int, layout):
    """nll_loss's local results where this rank holds some of the classes: its part of the
    loss (the targets in its slice), and the total weight of its rows' targets."""
    w = None if weight is None else weight._local
    lo = class_split.class_offset(layout.x, 1)
    out = class_split.picked(x, target, w, ignore_index, lo)
    tw = class_split.target_weights(target, w, ignore_index, x.dtype).sum()
    return (out if reduction == 0 else out.sum()), tw


def check_labels(target, classes: int, ignore_index: int) -> tuple[int, int] | None:
    """A label outside [0, classes) fails torch's kernel on the rank that holds it alone, and
    the other ranks would wait for it in the next collective until the timeout. Where
    `to_global` learnt the logical labels' range, every rank knows it alike and raises here;
    else it returns that range (None where unknown), for `never_ignored`.

    A bound equal to `ignore_index` hides what lies between it and the valid labels; only
    the other bound is checked then. Unknown ranges (GPU labels, labels computed by ops)
    are left to the kernel."""

    bounds = known_range(target)
    if bounds is None:
        return None
    lo, hi = bounds
    if (lo >= 0 or lo == ignore_index) and (hi < classes or hi == ignore_index):
        return bounds
    bad = lo if lo < 0 and lo != ignore_index else hi
    raise LabelRangeError(
        f"target holds label {bad}, outside [0, {classes}) for an input of "
        f"{classes} classes (ignore_index={ignore_index})"
    )


def never_ignored(bounds: tuple[int, int] | None, ignore_index: int) -> bool:
    """Is `ignore_index` outside the logical targets' range (`known_range`, None unknown)?"""
    return bounds is not None and not bounds[0] <= ignore_index <= bounds[1]


@register_strategy(aten.nll_loss_backward, aten.nll_loss2d_backward, local=class_split.nll_backward)
def nll_loss_backward(call: Call) -> list[Strategy]:
    S0, S1 = split(0), split(1)
    reduction = call.arg(4, "reduction")
    first = {0: S0} if reduction == 0 else {}
    cands = [Strategy(by_position(call, {}), (B,))]
    if call.arg(1, "self").dim() > 1:  # (one unbatched sample, (C,): no batch to split)
        cands.append(Strategy(by_position(call, {**first, 1: S0, 2: S0}), (S0,)))
        # the classes split: each rank writes its targets' gradients (`class_split`)
        cands.append(Strategy(by_position(call, {1: S1}), (S1,)))
    return cands


# ---------------------------------------------------------------- pooling, layer norm, embedding


@register_strategy(aten.max_pool2d_with_indices, aten._adaptive_avg_pool2d, aten.avg_pool2d)
def pool(call: Call) -> list[Strategy]:
    return split_leading_dims(call, 1, sum(m is not None for m in call.out_meta))


@register_strategy(
    aten.max_pool2d_with_indices_backward,
    aten._adaptive_avg_pool2d_backward,
    aten.avg_pool2d_backward,
)
def pool_backward(call: Call) -> list[Strategy]:
    return split_leading_dims(call, len(call.specs), 1)


@register_strategy(aten.native_layer_norm)
def layer_norm(call: Call) -> list[Strategy]:
    ndim = len(call.specs[0].shape)
    lead = ndim - len(call.arg(1, "normalized_shape"))
    cands = [Strategy(by_position(call, {}), (B, B, B))]
    cands += [Strategy(by_position(call, {0: split(d)}), (split(d),) * 3) for d in range(lead)]
    return cands


@register_strategy(aten.native_layer_norm_backward)
def layer_norm_backward(call: Call) -> list[Strategy]:
    ndim = len(call.specs[0].shape)
    lead = ndim - len(call.arg(2, "normalized_shape"))
    cands = [Strategy(by_position(call, {}), _present(call, (B, B, B)))]
    for d in range(lead):
        s = split(d)
        cands.append(
            Strategy(by_position(call, {0: s, 1: s, 3: s, 4: s}), _present(call, (s, P, P)))
        )
    # Linear in the incoming gradient (input, mean, rstd and weight whole): a partial sum
    # goes through, and is resolved where a consumer needs it whole (or, for the weights'
    # gradients, in the buckets), not here for want of a candidate (issue 51).
    cands.append(Strategy(by_position(call, {0: P}), _present(call, (P, P, P))))
    return cands


@register_strategy(
    aten.embedding,
    check=indices_within((1, "indices"), lambda a: a[0].shape[0]),
    local=class_split.embedding,
)
def embedding(call: Call) -> list[Strategy]:
    if call.arg(4, "sparse", False):
        raise InputValueError(
            "F.embedding(..., sparse=True) (nn.Embedding(sparse=True)) on global tensors: "
            "sbp has no sparse gradients; use sparse=False (a dense gradient)"
        )
    ndim = len(call.specs[1].shape)
    cands = [Strategy((B, B), (B,))] + [Strategy((B, split(d)), (split(d),)) for d in range(ndim)]
    cands.append(Strategy((split(1), B), (split(ndim),)))  # column split: no communication
    # the vocabulary split (Megatron's VocabParallelEmbedding): each rank looks up the ids
    # in its rows, zeros elsewhere, so the result is a partial sum (`class_split`)
    return [*cands, Strategy((split(0), B), (P,))]


# F.embedding_bag of a 2-D batch makes its offsets with torch.arange over the logical
# input's size: a plain tensor equal on every rank, an index constant (as aten.index's).
# The ops have no rule: they run on broadcast inputs (and warn once).
LOCAL_INDEX_OPS.update(
    {
        aten._embedding_bag.default,
        aten._embedding_bag_forward_only.default,
        aten._embedding_bag_backward.default,
        aten._embedding_bag_dense_backward.default,
        aten._embedding_bag_per_sample_weights_backward.default,
    }
)


@register_strategy(aten.embedding_dense_backward)
def embedding_backward(call: Call) -> list[Strategy]:
    ndim = len(call.specs[1].shape)
    cands = [Strategy((B, B), (B,))]
    if not call.arg(4, "scale_grad_by_freq", False):  # (else: counts over all the indices)
        cands += [Strategy((split(d), split(d)), (P,)) for d in range(ndim)]
    cands.append(Strategy((P, B), (P,)))  # linear in the gradient (position ids: broadcast)
    return cands + [Strategy((split(ndim), B), (split(1),))]  # column split


@register(aten._nested_tensor_from_mask.default, aten._nested_tensor_from_mask_left_aligned.default)
def nested_from_mask(func, args, kwargs):
    """nn.TransformerEncoder's nested-tensor path (eval, no grad, a key padding mask), which
    torch takes on global tensors: no nested tensor is global."""
    raise InputTypeError(
        f"{func}: nested tensors are not global; nn.TransformerEncoder takes them in eval "
        "mode without grad where given a src_key_padding_mask: build it with "
        "enable_nested_tensor=False"
    )


# ---------------------------------------------------------------- dropout and random ops


def shard_seed(placement, nd_sbp: tuple) -> int:
    """The seed of this rank's random draws for a tensor laid out as `nd_sbp`, taken from
    sbp's stream (every rank takes one): keyed by its coordinates on the split hierarchy
    dims, strided splits included (0 elsewhere), so ranks holding the same data draw the
    same values. The data-parallel fast path's local run draws its dropout masks from it
    too."""
    if env.get_rank() not in placement:
        return draw_seed(None)
    coord = placement.coord(env.get_rank())
    held = (c if s.is_split or s.is_strided else 0 for c, s in zip(coord, nd_sbp, strict=True))
    return draw_seed(tuple(held))


def shard_generator(placement, nd_sbp: tuple, device) -> torch.Generator:
    """A generator on `device` seeded by `shard_seed` (one seed taken from sbp's stream):
    what the random ops' rules draw from, and the fast path's local dropout."""
    gen = torch.Generator(device=device)
    gen.manual_seed(shard_seed(placement, nd_sbp))
    return gen


def kept(like: torch.Tensor, p: float, gen: torch.Generator) -> torch.Tensor:
    """Dropout's draws shaped as `like`: 1 where kept (probability 1 - p), else 0, as
    `native_dropout` draws its mask (and torch's dropout on the CPU its noise)."""
    return torch.empty_like(like).bernoulli_(1 - p, generator=gen)


def dropout_mask(like: torch.Tensor, p: float, gen: torch.Generator) -> torch.Tensor:
    """`native_dropout`'s mask: `kept` as booleans."""
    return kept(like, p, gen).to(torch.bool)


def masked(x: torch.Tensor, mask: torch.Tensor, p: float) -> torch.Tensor:
    """`native_dropout`'s output (p < 1): the kept values, scaled by 1 / (1 - p)."""
    return x * mask * (1.0 / (1 - p))


def _generator(spec: GlobalSpec, device) -> torch.Generator:
    return shard_generator(spec.placement, spec.nd_sbp, device)


@register(aten.bernoulli_.float)
def bernoulli_(func, args, kwargs):
    """Each shard draws its own mask; a broadcast tensor draws the same mask on every rank."""
    x, p = args[0], args[1] if len(args) > 1 else kwargs.get("p", 0.5)
    x = without_partials(x) if any(s.is_partial for s in x.sbp) else x
    gen = _generator(x._spec, x._local.device)
    if env.get_rank() in x._spec.placement:
        x._local.bernoulli_(p, generator=gen)
    assign(args[0], x._local, x._spec)  # (a partial tensor's draws, made partial again)
    return args[0]


@register(aten.native_dropout.default)
def native_dropout(func, args, kwargs):
    x, p, train = args[0], args[1], args[2] if len(args) > 2 else kwargs.get("train")
    x = without_partials(x)
    if not train or p == 0:
        return x, GlobalTensor(
            torch.ones_like(x._local, dtype=torch.bool), x._spec._replace(dtype=torch.bool)
        )
    gen = _generator(x._spec, x._local.device)
    mask = dropout_mask(x._local, p, gen)
    out = masked(x._local, mask, p) if p < 1 else torch.zeros_like(x._local)
    return GlobalTensor(out, x._spec), GlobalTensor(mask, x._spec._replace(dtype=torch.bool))


@register_strategy(aten.native_dropout_backward)
def native_dropout_backward(call: Call) -> list[Strategy]:
    ndim = len(call.specs[0].shape)
    return [Strategy((B, B), (B,))] + [
        Strategy((split(d), split(d)), (split(d),)) for d in range(ndim)
    ]


@register(aten._local_scalar_dense.default)
def item(func, args, kwargs):
    """`.item()`: the logical value (communicates; every rank of the placement calls it)."""

    x = rebox(args[0], (B,) * args[0].placement.ndim)
    if env.get_rank() not in x.placement:
        raise PlacementError(
            f".item(): rank {env.get_rank()} is outside {x.placement} and holds no value"
        )
    return x._local.item()
