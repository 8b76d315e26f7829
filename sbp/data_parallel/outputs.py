"""What the data-parallel fast path returns: global outputs that remember their local twin.

The fast path runs a module on local tensors and wraps each output as a global tensor
(`ExitLocal`). A loss of that output taken op by op costs a Python dispatch per aten op,
forward and backward (seven for a cross-entropy), where the same loss of the local output
is two C++ ops of the local graph. So the fast path returns `FastPathOutput`s:
`F.cross_entropy` and `F.nll_loss` (and `nn.CrossEntropyLoss`, `nn.NLLLoss`) of one, with
class-index targets laid out as the batch, run on the local tensors and return what the
op-by-op rule returns (`sbp.ops.nn.nll_loss_forward`): each rank's sum, a partial sum,
divided by the logical batch's total weight. So do the elementwise losses (`mse_loss`,
`l1_loss`, `smooth_l1_loss`, `huber_loss`, `binary_cross_entropy_with_logits`) of one
and a target laid out as it: a partial sum, a mean dividing by the logical count.

Any other use of an output (a torch function or method, an attribute read through torch,
but for a read of its shape, dtype or device) first turns it into a plain GlobalTensor, so
everything after runs op by op as before, and no other code of sbp meets the class. A
loss of an output changed under it (its local tensor written, a hook) runs op by op too.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves

from sbp import stand_ins
from sbp.boxing import box
from sbp.gradients import PLAIN_GETTERS
from sbp.layout import GlobalSpec
from sbp.ops.nn import NllLayout, check_labels, never_ignored, nll_layout
from sbp.signature import broadcast, is_all_broadcast, splits_to_partials
from sbp.tensor import GlobalTensor, rebox_differentiably, to_local_differentiably


class ExitLocal(torch.autograd.Function):
    """A local output wrapped as global; the gradient comes back laid out as the local graph
    needs it: split where the output is split, a partial sum where it is broadcast."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, spec: GlobalSpec, grad_spec: GlobalSpec, reducer, cls):
        ctx.grad_spec, ctx.reducer = grad_spec, reducer
        return cls(t.detach(), spec)

    @staticmethod
    def backward(ctx, grad):
        if ctx.reducer is not None:
            ctx.reducer.backward_started()
        if not isinstance(grad, GlobalTensor):
            whole = (broadcast,) * len(ctx.grad_spec.nd_sbp)
            grad = GlobalTensor(grad, ctx.grad_spec._replace(nd_sbp=whole))
        if torch.is_grad_enabled():  # create_graph: a gradient penalty differentiates it
            local = to_local_differentiably(rebox_differentiably(grad, ctx.grad_spec))
            return local, None, None, None, None
        return box(grad._local, grad._spec, ctx.grad_spec), None, None, None, None


class _Twin(NamedTuple):
    """An output's local tensor in the local graph, and the output as the fast path made it."""

    local: torch.Tensor
    node: Any  # the output's grad_fn (None without one)
    version: int  # of the local tensors' shared version counter
    spec: GlobalSpec
    data_nd: tuple  # how the batch is laid out
    reducer: Any  # told when backward starts (None where its hooks tell it)
    owner: Any  # what made it (its `twins` says whether it still makes FastPathOutputs)


class FastPathOutput(GlobalTensor):
    """A global output of the fast path, until it is used for anything but a loss: then it
    turns into a plain GlobalTensor, so the rest of sbp, and compiled code, which checks
    its inputs' types, only ever see those. Its twin is in the instance dict, so that its
    layout is GlobalTensor's and its class can change."""

    __slots__ = ()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with PLAIN_GETTERS():
            if func in _METADATA:  # (its logical shape, dtype...: nothing changes)
                return func(*args, **kwargs)
            local_loss = _LOCAL_LOSSES.get(func)
            if local_loss is not None:
                out = local_loss(*args, **kwargs)
                if out is not None:
                    return out
            for a in tree_leaves((args, kwargs)):
                if type(a) in _FAST_TYPES:
                    _demote(a)
            if func is _AUTOGRAD_GRAD or func is _AUTOGRAD_BACKWARD:
                return _through_local_leaves(func, args, kwargs)
            return func(*args, **kwargs)

    def __tensor_flatten__(self):
        """Passed to a compiled function (Dynamo and AOT autograd trace it), it becomes a
        GlobalTensor, and its model returns GlobalTensors from then on: the compiled code
        checks that each input has the traced type, before any of sbp's code could turn
        the next output into a GlobalTensor, so it would be compiled again every call."""
        self.__dict__["_twin"].owner.twins = False
        _demote(self)
        return GlobalTensor.__tensor_flatten__(self)


class _LossTwin(NamedTuple):
    """A fast-path loss's local tensor in the local graph, and the loss as made."""

    local: torch.Tensor  # this rank's part (a partial sum), a scalar
    node: Any  # the loss's grad_fn (its ExitLocal)
    version: int  # of the local tensor
    reducer: Any  # told when backward starts (None where its hooks tell it)
    owner: Any  # what made it (see FastPathOutput)


class FastPathLoss(FastPathOutput):
    """A reduced loss of a FastPathOutput, computed on the local tensors. `loss.backward()`
    runs the local graph's backward from this rank's loss: what the global loss's only
    node (ExitLocal) would hand it, a gradient of ones, without making that gradient as a
    global tensor through sbp's rules and running the node's Python backward (~70 us a
    step on the CPU proxy, the most of what backward adds to a compiled step); `inputs`
    given are the parameters' local leaves there. Any other
    use, a backward given a gradient or create_graph, or a loss changed under it
    (a hook, retain_grad, an in-place op: each a use) turns it into a plain GlobalTensor
    first, as FastPathOutput does."""

    __slots__ = ()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is _BACKWARD and _local_backward(args, kwargs or {}):
            return None
        if func is _AUTOGRAD_BACKWARD:  # (the function: as the method where it can)
            method = _as_method_call(args, kwargs or {})
            if method is not None and _local_backward(*method):
                return None
        return super().__torch_function__(func, types, args, kwargs)


_BACKWARD = torch.Tensor.backward
_AUTOGRAD_BACKWARD, _AUTOGRAD_GRAD = torch.autograd.backward, torch.autograd.grad
_FAST_TYPES = (FastPathOutput, FastPathLoss)


def _as_method_call(args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """The arguments of `torch.autograd.backward(loss, ...)` as those of `loss.backward(...)`,
    for one FastPathLoss; else None."""
    tensors = args[0] if args else kwargs.get("tensors")
    if isinstance(tensors, (tuple, list)) and len(tensors) == 1:
        tensors = tensors[0]
    if type(tensors) is not FastPathLoss or len(args) > 1 or kwargs.get("grad_variables"):
        return None
    names = ("retain_graph", "create_graph", "inputs")
    return (tensors,), {"gradient": kwargs.get("grad_tensors"), **{k: kwargs.get(k) for k in names}}


def _through_local_leaves(func: Any, args: tuple, kwargs: dict) -> Any:
    """`torch.autograd.backward(..., inputs=...)` and `torch.autograd.grad(outputs, inputs)`
    of fast-path outputs: a fast-path parameter is in no graph, so its local leaf stands
    for it among the inputs (as in `GlobalTensor.backward`). `grad` returns the gradient
    at such a leaf as a global tensor: this rank's share, a partial sum over the ranks
    splitting the batch (differentiable where the local one is: create_graph)."""
    if func is _AUTOGRAD_BACKWARD:
        if kwargs.get("inputs") is not None:
            kwargs = {**kwargs, "inputs": tuple(stand_ins.replace(kwargs["inputs"]))}
        return func(*args, **kwargs)
    args, kwargs = list(args), dict(kwargs)
    where = (args, 1) if len(args) > 1 else (kwargs, "inputs")
    inputs = where[0][where[1]]
    inputs = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
    leaves = stand_ins.replace(inputs)
    where[0][where[1]] = tuple(leaves)
    grads = func(*args, **kwargs)
    return tuple(
        g if leaf is t or g is None else _leaf_grad_as_global(g, t)
        for g, leaf, t in zip(grads, leaves, inputs, strict=True)
    )


def _leaf_grad_as_global(grad: torch.Tensor, p: torch.Tensor) -> GlobalTensor:
    spec = stand_ins.grad_spec(p)._replace(dtype=grad.dtype)
    if not grad.requires_grad:
        return GlobalTensor(grad, spec)
    # (its gradient, of a partial sum, is whole: broadcast)
    whole = spec._replace(nd_sbp=(broadcast,) * len(spec.nd_sbp))
    return ExitLocal.apply(grad, spec, whole, None, GlobalTensor)


def _local_backward(args: tuple, kwargs: dict) -> bool:
    """`loss.backward()` of an unchanged FastPathLoss run on its local tensor; False (and
    nothing done) for any other call."""
    loss = args[0]
    if len(args) != 1 or kwargs.get("gradient") is not None or kwargs.get("create_graph"):
        return False
    twin = loss.__dict__["_twin"]
    with PLAIN_GETTERS():
        if (
            loss.grad_fn is not twin.node
            or twin.local._version != twin.version
            or loss.retains_grad
            or loss._backward_hooks
        ):
            return False
    if twin.reducer is not None:  # (told inside the backward, as ExitLocal's tells it)
        reducer = twin.reducer
        twin.local.grad_fn.register_prehook(lambda grads: reducer.backward_started())
    inputs = kwargs.get("inputs")
    if inputs is not None:  # (a parameter's gradient is its local leaf's, in the local graph)
        inputs = stand_ins.replace(inputs)
    torch.autograd.backward(twin.local, retain_graph=kwargs.get("retain_graph"), inputs=inputs)
    return True


# Reads of an output's metadata, which change nothing and reach no data: it stays one.
_METADATA = frozenset(
    [
        *(
            getattr(torch.Tensor, name).__get__
            for name in ("shape", "dtype", "device", "ndim", "requires_grad", "is_cuda")
        ),
        torch.Tensor.size,
        torch.Tensor.dim,
        torch.Tensor.numel,
        torch.Tensor.__len__,
        torch.Tensor.is_floating_point,
    ]
)


def _demote(x: FastPathOutput) -> None:
    object.__setattr__(x, "__class__", GlobalTensor)  # (local and spec stay: no rebinding)
    del x.__dict__["_twin"]


def wrap(
    t: torch.Tensor,
    spec: GlobalSpec,
    grad_spec: GlobalSpec,
    data_nd: tuple,
    reducer: Any,
    owner: Any,
) -> GlobalTensor:
    """The global output of local output `t`, differentiable where `t` requires grad and
    grad mode is on; a FastPathOutput remembering `t` while `owner.twins` holds (not of an
    inference tensor: it has no version to tell whether it changed, and no backward)."""
    cls = FastPathOutput if owner.twins and not t.is_inference() else GlobalTensor
    if torch.is_grad_enabled() and t.requires_grad:
        out = ExitLocal.apply(t, spec, grad_spec, reducer, cls)
        with PLAIN_GETTERS():
            node = out.grad_fn
    else:
        out, node = cls(t, spec), None
    if cls is FastPathOutput:
        out.__dict__["_twin"] = _Twin(t, node, t._version, spec, data_nd, reducer, owner)
    return out


def _unchanged_twin(x: Any) -> _Twin | None:
    """`x`'s twin where `x` is still the output the fast path made (under PLAIN_GETTERS)."""
    twin = x.__dict__["_twin"] if type(x) is FastPathOutput else None
    if (
        twin is None
        or x.grad_fn is not twin.node
        or x._local._version != twin.version
        or x._spec is not twin.spec
        or x.requires_grad != twin.local.requires_grad
        or x.retains_grad
        or x._backward_hooks
    ):
        return None
    return twin


_layouts: dict = {}  # (x's spec, target's, weight's, reduction, data_nd): NllLayout or None
_counts: dict = {}  # (number, dtype, device): the divisor tensor of a mean over that many
_REDUCTIONS = {"none": 0, "mean": 1, "sum": 2}  # (torch's enum, which nll_layout takes)


def _loss_layout(x, target, weight, reduction: str, data_nd: tuple) -> NllLayout | None:
    """The op-by-op rule's layout of the loss where its inputs are laid out as the rule
    computes in (nothing to move), so it can run on the local tensors; else None (kept
    per key: a training loop makes the same call every step)."""
    if type(target) is not GlobalTensor or not (weight is None or type(weight) is GlobalTensor):
        return None
    if weight is not None and weight.requires_grad:  # (torch refuses its gradient: op by op)
        return None
    x_spec, t = x._spec, target._spec
    w = None if weight is None else weight._spec
    key = (x_spec, t, w, reduction, data_nd)
    if key in _layouts:
        return _layouts[key]
    layout = None
    if (
        reduction in _REDUCTIONS
        and len(x_spec.shape) >= 2  # (N, C) or (N, C, d1, ...)
        and x_spec.nd_sbp == data_nd
        and t.placement == x_spec.placement
        and t.shape == x_spec.shape[:1] + x_spec.shape[2:]
        and not t.dtype.is_floating_point
        and (w is None or (w.placement == x_spec.placement and is_all_broadcast(w.nd_sbp)))
    ):
        layout = nll_layout(x, target, weight, _REDUCTIONS[reduction])
        if layout.target != t:
            layout = None
    if len(_layouts) > 64:
        _layouts.clear()
    _layouts[key] = layout
    return layout


def _loss_of_twin(
    loss, x, target, weight, size_average, reduce, reduction: str, ignore_index: int, **options
) -> GlobalTensor | None:
    """`loss` (F.cross_entropy or F.nll_loss) of output `x` on the local tensors, or None
    where it runs op by op: x not class scores (N, C, ...) laid out as the batch, a target or
    weight laid out otherwise, or the deprecated `size_average` / `reduce`."""
    twin = _unchanged_twin(x)
    if twin is None or size_average is not None or reduce is not None:
        return None
    layout = _loss_layout(x, target, weight, reduction, twin.data_nd)
    if layout is None:
        return None
    bounds = check_labels(target, x._spec.shape[1], ignore_index)
    weight = None if weight is None else weight._local
    local = loss(
        twin.local,
        target._local,
        weight,
        ignore_index=ignore_index,
        reduction="none" if reduction == "none" else "sum",
        **options,
    )
    if reduction == "mean":
        local = local / _total_weight(twin.local, target, weight, ignore_index, bounds, layout)
    return _global_loss(local, layout.out, layout.total, reduction, twin)


def _global_loss(local, out: GlobalSpec, whole: GlobalSpec, reduction: str, twin: _Twin):
    """The local loss as the global one (`out`), joined to the local graph where it has one:
    its gradient comes split as the output's (reduction none), or whole."""
    if not local.requires_grad:
        return GlobalTensor(local, out)
    if reduction == "none":
        return ExitLocal.apply(local, out, out, twin.reducer, GlobalTensor)
    if not twin.owner.twins:  # (passed to compiled code: plain GlobalTensors from then on)
        return ExitLocal.apply(local, out, whole, twin.reducer, GlobalTensor)
    loss = ExitLocal.apply(local, out, whole, twin.reducer, FastPathLoss)
    with PLAIN_GETTERS():
        node = loss.grad_fn
    loss.__dict__["_twin"] = _LossTwin(local, node, local._version, twin.reducer, twin.owner)
    return loss


def _total_weight(scores, target, weight, ignore_index: int, bounds, layout: NllLayout):
    """The divisor of the mean, as the op-by-op rule finds it: the logical targets' number
    where none can be ignored (their range `bounds`: no collective), else their total
    weight, summed over ranks."""
    if weight is None and never_ignored(bounds, ignore_index):
        key = (math.prod(target._spec.shape), layout.total.dtype, scores.device)
        count = _counts.get(key)
        if count is None:
            if len(_counts) > 64:
                _counts.clear()
            count = _counts[key] = torch.full((), key[0], dtype=key[1], device=key[2])
        return count
    labels = target._local
    with torch.no_grad():  # (as torch's: no gradient flows through the divisor)
        mine = local_total_weight(labels, labels != ignore_index, weight, scores.dtype)
    return box(mine, layout.total_parts, layout.total)


def local_total_weight(labels, counted, weight, dtype: torch.dtype) -> torch.Tensor:
    """This rank's part of a mean loss's divisor: how many of its labels count (`counted`),
    or the sum of their class weights."""
    if weight is None:
        return counted.sum(dtype=dtype)
    return weight[labels.where(counted, 0)].where(counted, 0).sum()


def _cross_entropy(
    input,
    target,
    weight=None,
    size_average=None,
    ignore_index=-100,
    reduce=None,
    reduction="mean",
    label_smoothing=0.0,
):
    return _loss_of_twin(
        F.cross_entropy,
        input,
        target,
        weight,
        size_average,
        reduce,
        reduction,
        ignore_index,
        label_smoothing=label_smoothing,
    )


def _nll_loss(
    input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean"
):
    return _loss_of_twin(
        F.nll_loss, input, target, weight, size_average, reduce, reduction, ignore_index
    )


class _PointwiseLayout(NamedTuple):
    """An elementwise loss's result specs (see `_pointwise_layout`)."""

    out: GlobalSpec  # reduction none: as the output; else this rank's sum, a partial sum
    whole: GlobalSpec  # a reduced loss's gradient comes whole (broadcast)
    count: int  # the logical number of elements a mean divides by


_pointwise_layouts: dict = {}  # (x's spec, target's, reduction, data_nd): _PointwiseLayout


def _pointwise_layout(x, target, reduction: str, data_nd: tuple) -> _PointwiseLayout | None:
    """Where target is laid out as output `x` (the same shape and dtype, split as the
    batch), an elementwise loss of them on the local tensors is the logical loss's share:
    its elements (reduction none), or a partial sum (sum; mean divides by the logical
    count). Else None: it runs op by op."""
    if type(target) is not GlobalTensor or target.requires_grad:  # (its local has no graph)
        return None
    x_spec, t = x._spec, target._spec
    key = (x_spec, t, reduction, data_nd)
    if key in _pointwise_layouts:
        return _pointwise_layouts[key]
    layout = None
    if (
        reduction in _REDUCTIONS
        and x_spec.nd_sbp == data_nd
        and t == x_spec
        and x_spec.dtype.is_floating_point
    ):
        whole = GlobalSpec(x_spec.placement, (broadcast,) * len(data_nd), (), x_spec.dtype)
        partial = whole._replace(nd_sbp=splits_to_partials(data_nd))
        out = x_spec if reduction == "none" else partial
        layout = _PointwiseLayout(out, whole, math.prod(x_spec.shape))
    if len(_pointwise_layouts) > 64:
        _pointwise_layouts.clear()
    _pointwise_layouts[key] = layout
    return layout


def _pointwise_loss_of_twin(
    loss, x, target, reduction: str, unsupported: tuple = (), **options
) -> GlobalTensor | None:
    """`loss` (mse, l1, smooth L1, Huber, binary cross-entropy with logits) of output `x`
    on the local tensors, or None where it runs op by op: a target laid out otherwise, or
    an argument given that the local loss leaves to the rule (`unsupported`: a weight, the
    deprecated `size_average` / `reduce`)."""
    twin = _unchanged_twin(x)
    if twin is None or any(a is not None for a in unsupported):
        return None
    layout = _pointwise_layout(x, target, reduction, twin.data_nd)
    if layout is None:
        return None
    local = loss(
        twin.local, target._local, reduction="none" if reduction == "none" else "sum", **options
    )
    if reduction == "mean":
        local = local / layout.count
    return _global_loss(local, layout.out, layout.whole, reduction, twin)


def _mse_loss(input, target, size_average=None, reduce=None, reduction="mean", weight=None):
    return _pointwise_loss_of_twin(
        F.mse_loss, input, target, reduction, (size_average, reduce, weight)
    )


def _l1_loss(input, target, size_average=None, reduce=None, reduction="mean", weight=None):
    return _pointwise_loss_of_twin(
        F.l1_loss, input, target, reduction, (size_average, reduce, weight)
    )


def _smooth_l1_loss(input, target, size_average=None, reduce=None, reduction="mean", beta=1.0):
    return _pointwise_loss_of_twin(
        F.smooth_l1_loss, input, target, reduction, (size_average, reduce), beta=beta
    )


def _huber_loss(input, target, reduction="mean", delta=1.0, weight=None):
    return _pointwise_loss_of_twin(F.huber_loss, input, target, reduction, (weight,), delta=delta)


def _bce_with_logits(
    input, target, weight=None, size_average=None, reduce=None, reduction="mean", pos_weight=None
):
    return _pointwise_loss_of_twin(
        F.binary_cross_entropy_with_logits,
        input,
        target,
        reduction,
        (weight, size_average, reduce, pos_weight),
    )


_LOCAL_LOSSES = {
    F.cross_entropy: _cross_entropy,
    F.nll_loss: _nll_loss,
    F.mse_loss: _mse_loss,
    F.l1_loss: _l1_loss,
    F.smooth_l1_loss: _smooth_l1_loss,
    F.huber_loss: _huber_loss,
    F.binary_cross_entropy_with_logits: _bce_with_logits,
}
