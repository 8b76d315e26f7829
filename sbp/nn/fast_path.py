"""The data-parallel fast path: run a whole module on the local shards when that is exact.

`model.to_global(P, broadcast)` makes every parameter and buffer broadcast; a
batch made global with `split(0)` then flows through per-op dispatch, where
every aten op finds that nothing has to move. For such a module the per-op
work is pure overhead, so the module's forward runs once per input layout op
by op under a watcher (`sbp.ops.registry.observers`) that checks every op is
batch-separable: no input moved, no partial result, no op with its own
cross-sample semantics other than BatchNorm, dropout and a cross-entropy (nll)
loss, which this module reproduces on local tensors. If the check passes, every
later call with that layout runs the module's own forward on local tensors:
- parameters are replaced for the call by local leaves sharing their storage,
  buffers by their local tensors (BatchNorm updates them in place);
- `F.batch_norm` in train mode computes the logical batch's statistics
  (`sbp.ops.batch_norm`: one all-reduce forward, one backward) or, with
  `batch_norm="local"`, per-shard statistics as torch DDP does (running
  statistics are then broadcast from the first rank, as DDP broadcasts buffers);
  `F.dropout` draws the same masks as the per-op rule; `F.cross_entropy` and
  `F.nll_loss` take the mean over the logical batch (one small all-reduce);
- outputs are wrapped back into global tensors; the gradient arriving at a
  broadcast output becomes a partial sum, and at a partial sum (a loss) whole,
  so every local gradient is this rank's share of the logical one;
- the leaves' gradients are summed by `sbp.gradients.Reducer`, bucket by
  bucket during backward, and land in each parameter's `.grad` in its sbp
  (kept plain until `.grad` is read: `sbp.gradients.take_waiting`).
Anything else (another layout, parameters that are not broadcast, a module
whose check failed, ranks outside the placement) runs op by op as before.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import functools
import itertools
import threading
import types
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from operator import attrgetter, is_
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn import _reduction
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from sbp import comm, env, gradients, local_constants, random
from sbp.comm import arrival
from sbp.errors import (
    CommTimeoutError,
    IndexRangeError,
    InputTypeError,
    InputValueError,
    LabelRangeError,
    MetaMismatchError,
    PlacementError,
)
from sbp.layout import GlobalSpec
from sbp.nn import (
    compiled_batch_norm,
    outputs,
    recomputation,
    row_wise_calls,
    shard_batch_norm,
    torch_attention,
    torch_embedding_bag,
    torch_recurrent,
)
from sbp.nn.batch_rows import moved_to
from sbp.nn.names_replaced import NamesReplaced
from sbp.nn.output_leaves import output_leaves
from sbp.ops import batch_norm, registry
from sbp.ops.basic import like, new_alloc, same_layout
from sbp.ops.conversions import to_copy
from sbp.ops.decomposed import composite_definition
from sbp.ops.nn import nll_layout, shard_seed
from sbp.ops.out_variants import out_variant
from sbp.placement import placement as Placement
from sbp.signature import broadcast, is_all_broadcast, partial_sum, split, splits_to_partials
from sbp.tensor import HOOKS_SET, REBINDS, GlobalTensor, from_local, read_now, watch

aten = torch.ops.aten
ATTR = "_sbp_data_parallel"
LAYOUTS = 64  # input layouts remembered per module (LRU)
# A warning from a helper of `DataParallel.call` names the line that called the module: past
# the helper, call, __call__, the module's forward, and torch's _call_impl, _wrapped_call_impl
CALLER = 7
NEW_NUMBERS_WARNED = 4  # layouts differing only in a number's value, before a warning
FIRST_RUN_WINDOW_S = 10.0  # how long a rank whose first local run raised waits for the others
# sbp's verdicts on the data, raised on every rank together (op by op would raise them too),
# and a failed collective: raised as they are from a first local run
# (a MetaMismatchError: ranks out of step, which running op by op cannot mend)
RAISED_AS_THEY_ARE = (LabelRangeError, IndexRangeError, CommTimeoutError, MetaMismatchError)
# output values besides tensors that the local run may return as they are
_PLAIN_VALUES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
# argument values besides tensors that the forward can only read (a flag, a name, a function)
_CONSTANT_TYPES = (*_PLAIN_VALUES, enum.Enum, types.FunctionType, types.BuiltinFunctionType)


@dataclass
class Layout:
    """What the checking pass found for one input layout."""

    ok: bool
    reason: str = ""
    out_specs: list = field(default_factory=list)  # GlobalSpec or a plain value, per output leaf
    bn_counts: list[int] = field(default_factory=list)  # logical count of each train-mode BN
    dropouts: int = 0  # random draws of dropout
    by_name_dropouts: int = 0  # of them, in attention called by name (`_by_name_replaced`)
    losses: int = 0  # cross-entropy (or nll) losses of the batch inside the forward
    # Every BatchNorm and dropout call came from a BatchNorm or Dropout module, or from an
    # attention called through `torch.nn.functional`'s attribute, and every loss through
    # those attributes: the local run then intercepts them there only (a mode over the
    # whole forward costs ~5% of a mobilenet_v2 forward, ~20% of a small GPT-2's)
    in_modules: bool = True
    # (the module input's position, or keyword, and the limit an op checked it against):
    # index tensors of embeddings and gathers that are inputs (`sbp.ops.registry.IndexLimit`)
    index_inputs: list = field(default_factory=list)
    # per output leaf on this rank, found at the first local run: (rank, [(local shape, the
    # gradient's spec) or None for a plain value]); the layout's inputs fix data_nd
    exits: tuple | None = None
    # a rank's part of the batch is empty (fewer samples than parts): its local forward runs
    # eagerly, as Inductor's convolution backward fails on an empty batch (torch 2.14)
    empty_part: bool = False
    tried: bool = False  # a local run of it completed (`DataParallel._first_local_run`)
    # the checking pass's outputs' local tensors and the buffers it left, until then
    expected: tuple | None = None

    def exits_on(self, rank: int, data_nd: tuple) -> list:
        """Each global output's local shape on `rank` and the spec its gradient comes in."""
        if self.exits is None or self.exits[0] != rank:
            self.exits = (
                rank,
                [
                    (s.local_shape(rank), _share_spec(s, data_nd))
                    if isinstance(s, GlobalSpec)
                    else None
                    for s in self.out_specs
                ],
            )
        return self.exits[1]


def _all_of(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Do contiguous `a` and `b` hold the same elements (one is a whole view of the other)?"""
    return a is b or (
        a.numel() == b.numel()
        and a.storage_offset() == b.storage_offset()
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.is_contiguous()
        and b.is_contiguous()
    )


class _NotDataParallel(Exception):
    """An argument the fast path cannot take (`DataParallel._layout_key`)."""


def _global_inputs(args: tuple, kwargs: dict) -> Iterator[tuple[tuple, GlobalTensor]]:
    """(path, tensor) of each global input, in tuples too (a recurrent layer's (h, c)
    state): the path is the argument's position or keyword, then the indices inside."""
    stack = [((k,), a) for k, a in reversed([*enumerate(args), *kwargs.items()])]
    while stack:
        path, a = stack.pop()
        if isinstance(a, GlobalTensor):
            yield path, a
        elif type(a) is tuple:
            stack.extend(((*path, i), v) for i, v in reversed(list(enumerate(a))))


def _input_at(args: tuple, kwargs: dict, path: tuple) -> Any:
    value = args[path[0]] if type(path[0]) is int else kwargs[path[0]]
    for i in path[1:]:
        value = value[i]
    return value


def _map_globals(a: Any, fn: Callable) -> Any:
    """`a` with `fn` applied to each global tensor in it (itself, or in tuples)."""
    if isinstance(a, GlobalTensor):
        return fn(a)
    if type(a) is tuple:
        return tuple(_map_globals(v, fn) for v in a)
    return a


class _Check:
    """Watches every op of the checking pass (see `sbp.ops.registry.observers`)."""

    # (a dtype or device conversion keeps the layout: autocast and `.float()` convert; a new
    # tensor of the input's shape takes its layout, and one of another shape is a constant)
    SAME_LAYOUT = (same_layout, like, new_alloc, to_copy)
    # torch picks cuDNN's (MIOpen's) BatchNorm for a tensor on the GPU
    BATCH_NORMS = (
        aten.native_batch_norm.default,
        aten.cudnn_batch_norm.default,
        aten.miopen_batch_norm.default,
    )
    SHARD_BATCH_NORM = torch.ops.sbp.shard_batch_norm.default  # batch_norm="local", op by op
    DROPOUT = (aten.native_dropout.default, aten.bernoulli_.float)
    # Functions of their inputs' values alone: on broadcast inputs (which the checked ops
    # computed from broadcast values only) the local run gets the same result on every rank,
    # as BatchNorm's momentum=None reading num_batches_tracked, or transformers' masks
    # testing a broadcast position tensor (`(ids == 0).all()`) do, or spectral_norm's norms
    # of a broadcast weight.
    OF_BROADCAST_VALUES = (
        aten._local_scalar_dense.default,
        aten.all.default,
        aten.any.default,
        aten.linalg_vector_norm.default,
        aten.norm.ScalarOpt_dim,
    )
    # F.cross_entropy and F.nll_loss of the batch (the local run computes the logical mean)
    LOSSES = (aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)

    def __init__(self, data_nd: tuple, batch: int | None = None):
        """`batch`: the logical batch size where every part of it holds samples (see
        `fills`), else None."""
        self.data_nd = data_nd
        self.batch = batch
        self.fills: list[GlobalTensor] = []  # (`fill_made`)
        self.reason = ""
        self.bn_counts: list[int] = []
        self.dropouts = self.losses = self.by_name_dropouts = 0
        self.depth = 0  # inside a BatchNorm or Dropout module's forward
        self.loss_depth = 0  # inside F.cross_entropy or F.nll_loss called by name
        self.attention_depth = 0  # inside F.scaled_dot_product_attention called by name
        self.whole_calls = 0  # inside a call taken as a whole (torch's multi-head attention)
        self.outside_modules = False
        self.index_limits: list[registry.IndexLimit] = []

    def _fail(self, reason: str, always: bool = False) -> None:
        """`always`: also inside a call taken as a whole (a dropout's layout, which sets
        its masks)."""
        if not self.reason and (always or not self.whole_calls):
            self.reason = reason

    def _no_partials(self, func, specs, inputs=()) -> None:
        """A partial sum mixes samples: the local run's part of it may differ from the
        rule's (`h.sum(0) / h.shape[0]` reads the logical size in the check, the local one
        in the local run). Only the losses the local run computes itself make one. An op
        may keep one it is given (the rules keep a partial sum only through linear ops:
        `loss / n`, `a * loss`, `loss_a + loss_b`); a number read from the batch's size
        there (`loss * x.shape[0]`) is caught when the first local run's outputs differ."""
        kept = {h for s in inputs for h, x in enumerate(s.nd_sbp) if x.is_partial}
        for s in specs:
            if s is not None and any(
                x.is_partial and h not in kept for h, x in enumerate(s.nd_sbp)
            ):
                self._fail(f"{func} mixes samples (its result is a partial sum)")

    def direct(self, func, d) -> None:
        self._no_partials(func, [d.direct], d.in_specs)

    def strategy(self, func, rule, args, d, checked=None) -> None:
        """`args`: the op's global inputs; `checked`: an index tensor the rule checked
        (`registry.IndexLimit`, see `indexed_inputs`)."""
        if checked is not None:
            self.index_limits.append(checked)
        if not all(map(self._in_place_or_sliced, args, d.in_specs)):
            # (an op with no rule passes where its inputs are broadcast already: a
            # parametrization's ops on parameters, which every rank computes alike)
            moved = "has no SBP rule" if rule is registry._FALLBACK else "needs its inputs moved"
            self._fail(f"{func} {moved}")
        elif rule.local_args is not None and not getattr(
            rule.local_args, "from_local_input", False
        ):
            self._fail(f"{func} adjusts its local arguments")
        self._no_partials(func, d.out_specs, d.in_specs)

    def indexed_inputs(self, args: tuple, kwargs: dict) -> list:
        """(position or keyword, limit) of each module input that an op checked as an index
        tensor, itself or a view of all of it (`ids.view(-1, n)`): the local run checks the
        input's known range against the limit on every call, as the op did here, so that a
        bad index raises on every rank, not in one rank's kernel alone."""
        inputs = list(_global_inputs(args, kwargs))
        found = []
        for limit in self.index_limits:
            t = limit.index._local
            for path, a in inputs:
                if _all_of(a._local, t):
                    found.append((path, dataclasses.replace(limit, index=None)))
                    break
        return found

    def _in_place_or_sliced(self, g: GlobalTensor, need: GlobalSpec) -> bool:
        """Is `g` laid out as the op needs it, or broadcast and needed split on the batch's
        hierarchy dims along a dim it is expanded along (stride 0: a ViT's class token
        expanded to the batch)? The local run expands it for its own rows, from the local
        batch size, as it sizes views; the gradient sums over the rows either way. Equal
        rows alone are not enough: rows of a zero parameter `p[:n]` are equal until
        trained, and the local run would train rows 0..n-1 on every rank. A fill made in
        the forward of the batch's size on those dims is taken too (`fill_made`)."""
        spec = g._spec
        if spec == need or _one_rank_alike(spec, need):
            return True
        if need._replace(nd_sbp=spec.nd_sbp) != spec or not is_all_broadcast(spec.nd_sbp):
            return False
        dims = set()
        for s, batch in zip(need.nd_sbp, self.data_nd, strict=True):
            if s.is_split and batch.is_split:
                dims.add(s.dim)
            elif not s.is_broadcast:
                return False
        local = g._local
        if all(local.shape[k] <= 1 or local.stride(k) == 0 for k in dims):
            return True
        return all(g.shape[k] == self.batch for k in dims) and self._is_fill(g)

    def custom(self, func, args) -> bool | None:
        rule = registry._resolve(func)
        if rule in self.SAME_LAYOUT:
            self._no_partials(func, [args[0]._spec])  # (a loss converted: op by op)
            return
        if rule is out_variant:  # (its functional op and the copy into `out` are watched;
            return  # an `out` of another shape takes the result's layout, as local runs do)
        if rule is composite_definition:  # (`F.linear` under inference mode: the ops of
            return  # its definition are watched, as autograd's dispatch would have run them)
        if func in self.OF_BROADCAST_VALUES and is_all_broadcast(args[0].sbp):
            return True  # (not the ops sbp's rule runs: the local run calls torch's)
        if func in self.LOSSES:
            self._loss(func, *args)
            return True
        if (
            func not in self.BATCH_NORMS
            and func is not self.SHARD_BATCH_NORM
            and func not in self.DROPOUT
        ):
            self._fail(f"{func} has its own global semantics")
            return
        x = args[0]
        if self.depth == 0 and not (func in self.DROPOUT and self.attention_depth):
            self.outside_modules = True
        if tuple(x.sbp) != self.data_nd and not (func in self.DROPOUT and self._batch_moved(x)):
            self._fail(f"{func} runs on a tensor laid out as {x.sbp}, not as the batch", True)
        elif (func in self.BATCH_NORMS and args[5]) or func is self.SHARD_BATCH_NORM:
            self.bn_counts.append(batch_norm._count(x))
        elif func in self.DROPOUT:
            self.dropouts += 1
            self.by_name_dropouts += bool(self.attention_depth)

    def whole_call(self, kind, func, args: tuple, kwargs: dict) -> Any:
        """A torch function that is row-wise in the batch (`_WHOLE_CALLS`: multi-head
        attention, recurrent layers, embedding bags), taken as a whole where its tensors
        are laid out as the batch: nothing inside is judged; else its ops are, and a
        failure among them says why the whole was not taken."""
        args, kwargs = self._fills_as_batch(args, kwargs)
        why = kind.why_not_row_wise(args, kwargs, self.data_nd)
        if why:
            before = self.reason
            out = func(*args, **kwargs)
            if self.reason and not before:  # (an op inside failed: say why the whole did)
                self.reason = (
                    f"{getattr(func, '__name__', func)} is not taken whole ({why}): {self.reason}"
                )
            return out
        self.whole_calls += 1
        try:
            return kind.run_whole(func, args, kwargs, self.data_nd)
        finally:
            self.whole_calls -= 1

    def fill_made(self, out: Any) -> None:
        """A fill made in the forward (`x.new_zeros(layers, x.size(0), hidden)`, an RNN's
        initial state as torch's tutorials make it, or `torch.zeros` under global_mode) is
        broadcast here; where an op needs it split as the batch along dims of the batch's
        size, it is taken as laid out so (`_in_place_or_sliced`, `_fills_as_batch`): every
        row holds the same value, and the local run makes it from its own batch size. One
        made of a fixed size that happens to be the batch's is not the local run's rows:
        with every part of the batch holding samples (`batch`), its local run then meets a
        shard of fewer rows on every rank alike, where torch raises or the outputs differ
        from this pass's (`DataParallel._first_local_run`: op by op)."""
        if self.batch is not None and isinstance(out, GlobalTensor) and is_all_broadcast(out.sbp):
            self.fills.append(out)

    def _is_fill(self, g: GlobalTensor) -> bool:
        return any(g is f for f in self.fills)

    def _fills_as_batch(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A whole call's arguments with each fill of one dim of the batch's size laid out
        as the batch on that dim (a recurrent layer's initial state)."""

        def as_batch(a):
            if not isinstance(a, GlobalTensor):
                return a
            dims = [d for d, n in enumerate(a.shape) if n == self.batch]
            if len(dims) != 1 or not self._is_fill(a):
                return a
            return a.to_global(sbp=moved_to(self.data_nd, dims[0]))

        if not self.fills:
            return args, kwargs
        return tree_map(as_batch, (args, kwargs))

    def _batch_moved(self, x: GlobalTensor) -> bool:
        """Is `x` laid out as the batch moved to another dim (`x.transpose(0, 1)` of a
        sequence-first model, or the `(1, N, L, E)` torch's 3-d attention makes)? Nothing
        moved before (else the check failed), so every split is the batch's, and `x`'s local
        tensor is the local run's; a dropout's seed follows the split hierarchy dims, not the
        tensor dim, so the local run draws the same mask there."""
        dims = {s.dim for s in x.sbp if s.is_split}
        return len(dims) == 1 and all(
            s.is_split == d.is_split and not s.is_partial
            for s, d in zip(x.sbp, self.data_nd, strict=True)
        )

    def write(self, g: GlobalTensor, items: list, value: Any) -> None:
        """`g[items] = value`, written in logical coordinates: the local run writes the same
        index into its local tensor, which is exact where `g` is taken whole along every dim
        it splits and the value is a number, or laid out as `g` with those dims whole too
        (a queue buffer given the batch's rows, `queue[:n] = h`, is not)."""
        splits = [s.dim for s in g.sbp if s.is_split]
        whole = all(items[d] == slice(None) for d in splits)
        if isinstance(value, GlobalTensor):
            laid_out = tuple(value.sbp) == tuple(g.sbp) and value.dim() == g.dim()
            fits = laid_out and all(value.shape[d] == g.shape[d] for d in splits)
            shown = f"a value laid out as {value.sbp}"
        else:
            fits = not isinstance(value, torch.Tensor) or value.dim() == 0
            shown = "a local tensor"
        if any(s.is_partial for s in g.sbp) or not (whole and fits):
            self._fail(f"`g[index] = value` writes {shown} into a tensor laid out as {g.sbp}")

    def _loss(self, func, x, target, weight, reduction, ignore_index) -> None:
        """A loss the local run computes as the rule does: scores and labels laid out as the
        batch, whole class weights (that need no gradient, as torch requires)."""
        layout = nll_layout(x, target, weight, reduction)
        if (
            tuple(x.sbp) != self.data_nd
            or layout.x != x._spec
            or layout.target != target._spec
            or (weight is not None and (layout.weight != weight._spec or weight.requires_grad))
        ):
            self._fail(f"{func} runs on tensors not laid out as the batch")
            return
        self.losses += 1
        if self.loss_depth == 0:
            self.outside_modules = True


def _one_rank_alike(spec: GlobalSpec, need: GlobalSpec) -> bool:
    """Do `spec` and `need` differ only by split against broadcast on hierarchy dims of one
    rank, which hold the same data either way? (In a world of one the planner may pick
    either, at no cost.)"""
    if need._replace(nd_sbp=spec.nd_sbp) != spec:
        return False
    sizes = spec.placement.hierarchy
    return all(
        a == b or (n == 1 and not a.is_partial and not b.is_partial)
        for a, b, n in zip(spec.nd_sbp, need.nd_sbp, sizes, strict=True)
    )


# torch's functions that are row-wise in the batch, each with the module that judges a call
# of it whole and runs it (`why_not_row_wise`, `run_whole`)
_WHOLE_CALLS = {
    func: kind
    for kind in (torch_attention, torch_recurrent, torch_embedding_bag)
    for func in kind.CALLS
}


# new tensors of one value: as methods, or torch's factories under global_mode
_FILLS = frozenset(
    (
        torch.Tensor.new_zeros,
        torch.Tensor.new_ones,
        torch.Tensor.new_full,
        torch.zeros,
        torch.ones,
        torch.full,
    )
)


class _WholeCalls(TorchFunctionMode):
    """In the checking pass, torch's functions that are row-wise in the batch, as called:
    - `F.scaled_dot_product_attention` with dropout (`dropout_p`) off the CPU draws its
      masks inside torch's fused kernel, where the local run cannot draw the op-by-op
      path's masks, so the module runs op by op. On the CPU torch computes it as a
      composite whose `bernoulli_` the check sees (`_Run.attention`);
    - `F.multi_head_attention_forward`, torch's recurrent functions (`torch.lstm`, ...) and
      `F.embedding_bag` are taken as a whole (`_Check.whole_call`);
    - a fill is noted (`_Check.fill_made`)."""

    def __init__(self, check: _Check):
        super().__init__()
        self.check = check

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _unrouted(func) is _ATTENTION:
            p = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
            if p and args[0].device.type != "cpu":
                self.check._fail("attention with dropout (dropout_p) draws masks in torch's kernel")
        kind = _WHOLE_CALLS.get(func)
        if kind is not None:
            return self.check.whole_call(kind, func, args, kwargs)
        out = func(*args, **kwargs)
        if func in _FILLS:
            self.check.fill_made(out)
        return out


class _Depth:
    """Counts the checking pass's depth inside BatchNorm and dropout modules (`depth`), or
    inside the functions the local run replaces by name (`loss_depth`, `attention_depth`)."""

    def __init__(self, check: _Check, counter: str = "depth"):
        self.check, self.counter = check, counter

    def __enter__(self) -> None:
        setattr(self.check, self.counter, getattr(self.check, self.counter) + 1)

    def __exit__(self, *exc) -> None:
        setattr(self.check, self.counter, getattr(self.check, self.counter) - 1)


class _LocalOps(TorchFunctionMode):
    """Inside the local forward: BatchNorm and dropout with the per-op path's semantics."""

    def __init__(self, run: _Run):
        super().__init__()
        self.run = run

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.batch_norm:
            return self.run.batch_norm(*args, **kwargs)
        original = _unrouted(func)
        if original is _DROPOUT:
            return self.run.dropout(*args, **kwargs)
        if original is torch_attention.ATTENTION:
            # (the mode is off inside its own call: its dropout is reached by name)
            with _by_name_replaced(self.run.by_name):
                return func(*args, **kwargs)
        if original is _ATTENTION:
            return self.run.attention(*args, **kwargs)
        if original in _LOSSES:
            return self.run.loss(func, *args, **kwargs)
        return func(*args, **kwargs)


class _Run:
    """One local forward: the layout it follows and what BatchNorm and dropout need."""

    def __init__(self, fast: DataParallel, layout: Layout, data_nd: tuple):
        self.fast, self.layout, self.data_nd = fast, layout, data_nd
        self.group = fast.group(data_nd)
        self.bn_calls = self.dropouts = self.losses = 0
        self.in_loss = False
        self.to_sync: list[torch.Tensor] = []

    def batch_norm(
        self,
        input,
        running_mean,
        running_var,
        weight=None,
        bias=None,
        training=False,
        momentum=0.1,
        eps=1e-5,
    ):
        if not training:
            return F.batch_norm(
                input, running_mean, running_var, weight, bias, False, momentum, eps
            )
        counts = self.layout.bn_counts
        if self.bn_calls >= len(counts):
            raise RuntimeError("sbp data-parallel fast path: more BatchNorm calls than checked")
        count = counts[self.bn_calls]
        self.bn_calls += 1
        group = self.group
        if self.fast.batch_norm == "local" or len(group) == 1:
            if len(group) > 1:
                self.to_sync += [t for t in (running_mean, running_var) if t is not None]
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

    def dropout(self, input, p=0.5, training=True, inplace=False):
        if not training or p == 0:
            return _DROPOUT(input, p, training, inplace)
        if p == 1:
            return input.mul_(0) if inplace else torch.zeros_like(input)
        gen = torch.Generator(device=input.device)
        gen.manual_seed(shard_seed(self.fast.placement, self.data_nd))
        self.dropouts += 1
        if input.device.type == "cpu":  # what aten.dropout runs on CPU (bernoulli_ rule)
            noise = torch.empty_like(input).bernoulli_(1 - p, generator=gen).div_(1 - p)
            return input.mul_(noise) if inplace else input * noise
        mask = torch.empty_like(input).bernoulli_(1 - p, generator=gen).to(torch.bool)
        if inplace:  # the fused kernel elsewhere (native_dropout rule)
            return input.mul_(mask).mul_(1.0 / (1 - p))
        return input * mask * (1.0 / (1 - p))

    def attention(self, query, key, value, attn_mask=None, dropout_p=0.0, *args, **kwargs):
        """`F.scaled_dot_product_attention`. With dropout on the CPU, torch runs it as a
        composite drawing its mask by `bernoulli_` from the default generator, as the
        op-by-op path's `bernoulli_` rule draws it from a generator seeded by sbp's stream:
        the default generator is seeded alike for the call (and put back after)."""
        if not dropout_p or query.device.type != "cpu":  # (elsewhere the check refused it)
            return _ATTENTION(query, key, value, attn_mask, dropout_p, *args, **kwargs)
        self.dropouts += 1
        seed = shard_seed(self.fast.placement, self.data_nd)
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            return _ATTENTION(query, key, value, attn_mask, dropout_p, *args, **kwargs)

    def by_name(self, fn, *args, **kwargs):
        """A call of a function the local run replaces by name (`_by_name_replaced`)."""
        if fn is _ATTENTION:
            return self.attention(*args, **kwargs)
        if fn is _DROPOUT:
            return self.dropout(*args, **kwargs)
        return self.loss(fn, *args, **kwargs)

    def loss(
        self,
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
        if self.in_loss or target.is_floating_point():
            return fn(
                input, target, weight, size_average, ignore_index, reduce, reduction, **options
            )
        self.losses += 1
        if size_average is not None or reduce is not None:  # (deprecated: what they mean)
            reduction = _reduction.legacy_get_string(size_average, reduce)
        self.in_loss = True
        try:
            return self._loss(fn, input, target, weight, ignore_index, reduction, options)
        finally:
            self.in_loss = False

    def _loss(self, fn, input, target, weight, ignore_index, reduction, options):
        if reduction != "mean":  # (this rank's sum is its part; none is per sample)
            return fn(
                input, target, weight, ignore_index=ignore_index, reduction=reduction, **options
            )
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
            if len(self.group) > 1:
                totals = comm.all_reduce(totals, "sum", self.group)
        if parts and totals[1] > 0:
            raise LabelRangeError(
                f"target holds {int(totals[1])} label(s) outside [0, {classes}) for an input "
                f"of {classes} classes (ignore_index={ignore_index})"
            )
        local = fn(input, target, weight, ignore_index=ignore_index, reduction="sum", **options)
        return local / totals[0]


BATCH_NORMS = torch.nn.modules.batchnorm._BatchNorm
SPECIAL_MODULES = (BATCH_NORMS, torch.nn.modules.dropout._DropoutNd)


@contextlib.contextmanager
def _forwards_replaced(modules: list[torch.nn.Module], replacement) -> Iterator[None]:
    """For the call, each module's forward is `replacement(module, its forward)`."""
    own = [m.__dict__.get("forward") for m in modules]
    for m in modules:  # (the instance dict: nn.Module.__setattr__ is slow)
        m.__dict__["forward"] = replacement(m, m.forward)
    try:
        yield
    finally:
        for m, f in zip(modules, own, strict=True):
            if f is None:
                del m.__dict__["forward"]
            else:
                m.__dict__["forward"] = f


@contextlib.contextmanager
def _by_name_replaced(handler: Callable) -> Iterator[None]:
    """For the call, in this thread, `torch.nn.functional.cross_entropy(...)`,
    `nll_loss(...)` and `scaled_dot_product_attention(...)` are `handler(the function,
    ...)`: a model's loss (transformers' `nn.functional.cross_entropy`,
    `nn.CrossEntropyLoss`) and attention (transformers' `sdpa_attention_forward`) look them
    up as they are called. The names stay replaced while any thread's call is on; each
    thread's calls go to its innermost handler, or to torch's function where it has none."""
    handlers = _HANDLERS.__dict__.setdefault("stack", [])
    with _NAMES.held():
        handlers.append(handler)
        try:
            yield
        finally:
            handlers.pop()


def _route_names() -> list:
    saved = []
    for f in _BY_NAME:
        name = f.__name__
        current = getattr(F, name)
        route = _ROUTES.get(current)
        if route is None:  # (made once per function: installs come at every local run)
            route = _ROUTES[current] = _routed(current)
            _ROUTED[route] = current
        setattr(F, name, route)
        saved.append((F, name, current))
    return saved


# torch's functions, taken before any replacement (a mode is handed the replacement where a
# Python function of torch.nn.functional passes itself by its module's name)
_LOSSES = (F.cross_entropy, F.nll_loss)
_ATTENTION = F.scaled_dot_product_attention
_DROPOUT = F.dropout  # (by name only inside torch's multi-head attention: `_LocalOps`)
_BY_NAME = (*_LOSSES, _ATTENTION, _DROPOUT)
_ROUTES: dict = {}  # a function the names held: the replacement routing to it
_ROUTED: dict = {}  # a replacement: the function it routes to
_HANDLERS = threading.local()  # .stack: this thread's handlers, innermost last
_NAMES = NamesReplaced(_route_names)


def _unrouted(func: Any) -> Any:
    """`func`, or the function a name's replacement routes to (one lookup: the modes ask
    it of every torch call)."""
    return _ROUTED.get(func, func)


def _routed(original: Callable) -> Callable:
    @functools.wraps(original)
    def call(*args, **kwargs):
        handlers = getattr(_HANDLERS, "stack", None)
        if not handlers:
            return original(*args, **kwargs)
        return handlers[-1](original, *args, **kwargs)

    return call


def _called_by_name(check: _Check, modes: int) -> Callable:
    """In the checking pass: a handler counting the depth of calls made through a name on
    `torch.nn.functional` that the local run replaces. A torch function mode (sbp's
    global_mode) calls the name again from inside any call, through a reference held
    elsewhere too; it runs with itself off torch's mode stack, shorter than the forward's
    (`modes`), and that is not a call by name."""

    def call(fn, *args, **kwargs):
        if torch._C._len_torch_function_stack() < modes or fn is _DROPOUT:
            return fn(*args, **kwargs)  # (a dropout's layout is judged as its op runs)
        with _Depth(check, "attention_depth" if fn is _ATTENTION else "loss_depth"):
            return fn(*args, **kwargs)

    return call


def _batch_sizes(args: tuple, kwargs: dict, data_nd: tuple) -> list[int]:
    """The logical leading sizes of the inputs laid out as the batch, in argument order."""
    return [
        leaf.shape[0]
        for leaf in tree_flatten((args, kwargs))[0]
        if isinstance(leaf, GlobalTensor) and tuple(leaf.sbp) == data_nd and leaf.dim()
    ]


def _within(context, forward):
    def inside(*args, **kwargs):
        with context:
            return forward(*args, **kwargs)

    return inside


def _local_forward(run: _Run, mode: _LocalOps):
    """The forward of a BatchNorm or dropout module in the local run: torch's own forward
    (torch 2.x `_BatchNorm.forward`, `Dropout.forward`) with the run's batch_norm or dropout
    called directly, or, for modules with their own forward, inside the local ops' mode."""

    def replacement(m: torch.nn.Module, forward):
        if isinstance(m, BATCH_NORMS) and shard_batch_norm.torch_forward(m):
            return lambda input: shard_batch_norm.batch_norm_forward(m, input, run.batch_norm)
        if type(m).forward is torch.nn.Dropout.forward:
            return lambda input: run.dropout(input, m.p, m.training, m.inplace)
        return _within(mode, forward)

    return replacement


def _differs(what: str, got: list, expected: list) -> str:
    """Why the local run's tensors are not the checking pass's, or "" where they agree up
    to rounding (sbp's logical BatchNorm sums in another order)."""
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        if a.shape != b.shape:
            return f"{what} {i} has local shape {tuple(a.shape)}, not {tuple(b.shape)}"
        if not a.is_floating_point():
            if not torch.equal(a, b):
                return f"{what} {i} differs from the op-by-op run's"
            continue
        rtol = 1e-3 if torch.finfo(a.dtype).bits >= 32 else 5e-2
        a64, b64 = a.detach().double(), b.double()
        finite = b64[b64.isfinite()]
        atol = rtol * float(finite.abs().max()) if finite.numel() else 0.0
        if not torch.allclose(a64, b64, rtol=rtol, atol=atol, equal_nan=True):
            gap = (a64 - b64).nan_to_num(nan=0.0, posinf=float("inf")).abs().max()
            return (
                f"{what} {i} differs from the op-by-op run's by {float(gap):.3g} (does the "
                "forward read the batch size as a number?)"
            )
    return ""


class _Undo:
    """What a trial run of the module changes, to put back: the buffers (BatchNorm's
    running statistics), global inputs the forward writes into (`x.sub_(1)`), and sbp's
    random stream (dropout)."""

    def __init__(self, buffers: list, args: tuple, kwargs: dict):
        self.buffers = buffers
        self.saved = [b._local.clone() for b in buffers]
        # (a global tensor's version counts writes through sbp (the checking pass), its
        # local's those of the local run; an inference tensor has none, and no write of it
        # can be undone: none is allowed)
        self.inputs = [
            (a, (a._version, a._local._version), a._local.clone())
            for _, a in _global_inputs(args, kwargs)
            if not a.is_inference()
        ]
        self.rng = dict(random._state)

    def __call__(self) -> None:
        for b, s in zip(self.buffers, self.saved, strict=True):
            b._local.copy_(s)
        for g, versions, saved in self.inputs:
            if (g._version, g._local._version) != versions:
                g._local.copy_(saved)
        random._state.update(self.rng)


class _EnterLocal(torch.autograd.Function):
    """A global input's local tensor; its gradient goes back as this rank's share."""

    @staticmethod
    def forward(ctx, g: GlobalTensor, grad_spec: GlobalSpec):
        ctx.grad_spec = grad_spec
        return g._local.view_as(g._local)

    @staticmethod
    def backward(ctx, grad):
        if torch.is_grad_enabled():  # create_graph: the gradient is differentiated too
            return from_local(grad.contiguous(), ctx.grad_spec, ctx.grad_spec.nd_sbp), None
        return GlobalTensor(grad.contiguous(), ctx.grad_spec), None


def _share_spec(spec: GlobalSpec, data_nd: tuple) -> GlobalSpec:
    """How a gradient enters the local graph at a tensor laid out as `spec`: this rank's
    share. A broadcast value's gradient as a partial sum on the hierarchy dims the batch
    splits; a partial sum's (the batch's loss) whole, as each rank's part counts fully."""
    nd = tuple(
        partial_sum if d.is_split and s.is_broadcast else broadcast if s.is_partial else s
        for s, d in zip(spec.nd_sbp, data_nd, strict=True)
    )
    return spec._replace(nd_sbp=nd)


_SPEC, _LOCAL, _REQUIRES_GRAD = (
    attrgetter("_spec"),
    attrgetter("_local"),
    attrgetter("requires_grad"),
)
_LEAF_VERSIONS = itertools.count(1)
_NUMBERS = itertools.count()  # of DataParallel objects

# How many submodules any module was given (`model.head = Linear(...)`, `add_module`): the
# tables a `_Slots` read may then no longer be the module's, though they still hold the
# same tensors (the old head's). Counted by torch's global registration hook.
SUBMODULES_SET = [0]


def _count_submodule(module: torch.nn.Module, name: str, submodule: Any) -> None:
    SUBMODULES_SET[0] += 1


torch.nn.modules.module.register_module_module_registration_hook(_count_submodule)


class _Slots:
    """Where the module keeps each parameter and buffer (a submodule's `_parameters` or
    `_buffers` table, and a name), the global tensor found there, and the local tensor a
    local run puts there instead: a leaf sharing a parameter's storage, a buffer's local.

    A model has hundreds of them and every call checks them, so the lists are parallel
    and the checks run as C loops (`map`)."""

    def __init__(self, found: list[tuple[dict, str, GlobalTensor, bool]]):
        self.tables = [table for table, _, _, _ in found]
        self.names = [name for _, name, _, _ in found]
        self.tensors = [t for _, _, t, _ in found]
        watch(self.tensors)
        self.specs = list(map(_SPEC, self.tensors))
        self.is_param = [is_param for _, _, _, is_param in found]
        self.params = list({id(t): t for _, _, t, is_param in found if is_param}.values())
        self.buffers = [t for _, _, t, is_param in found if not is_param]
        self.version = 0  # which making of the local leaves (unique over all _Slots)
        self.submodules_seen = SUBMODULES_SET[0]  # when the tables were found
        self._hooks_seen = -1  # `HOOKS_SET` when the parameters' hooks were last read
        self._hooked: list = []  # the parameters with gradient hooks of the user's then
        self._locals: list = []  # each slot's local tensor when `local` was made
        self._trained: list = []  # each parameter's requires_grad then
        self._leaves: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id: (local, leaf)
        self.local: list = []  # per slot, what the local run puts there
        # `tensor.REBINDS` when the specs were last found the same, and when `local` was
        # last found up to date: while it stays, no global tensor can differ (skip reading)
        self._specs_seen = REBINDS[0]
        self._refreshed = -1

    def unchanged(self) -> bool:
        """The same global tensors in the same places, with the same specs? (Module tables
        are written with no hook: they are read every call; a submodule set since may
        have replaced a table.)"""
        if self.submodules_seen != SUBMODULES_SET[0]:
            return False
        if not all(map(is_, map(dict.get, self.tables, self.names), self.tensors)):
            return False
        rebinds = REBINDS[0]
        if rebinds != self._specs_seen:
            if not all(map(is_, map(_SPEC, self.tensors), self.specs)):
                return False
            self._specs_seen = rebinds
        return True

    def hooked(self) -> bool:
        """Does a parameter hold a gradient hook of the user's (`p.register_hook`,
        `register_post_accumulate_grad_hook`)? The local run's gradients go to local leaves
        and would pass it by. (Read again when hooks were registered since; the hooked
        ones are read every call, so a removed hook lets the local runs back.)"""
        if self._hooks_seen != HOOKS_SET[0]:
            self._hooks_seen = HOOKS_SET[0]
            self._hooked = [p for p in self.params if gradients.has_user_hooks(p)]
        elif self._hooked:
            self._hooked = [p for p in self._hooked if gradients.has_user_hooks(p)]
        return bool(self._hooked)

    def same_as(self, found: list[tuple[dict, str, GlobalTensor, bool]]) -> bool:
        """Are these the slots `found` (the same tables, names and tensors, specs unchanged)?"""
        return (
            len(found) == len(self.tensors)
            and all(a is b for (a, _, _, _), b in zip(found, self.tables, strict=True))
            and [name for _, name, _, _ in found] == self.names
            and all(a is b for (_, _, a, _), b in zip(found, self.tensors, strict=True))
            and list(map(_SPEC, self.tensors)) == self.specs
        )

    def refresh(self) -> None:
        """Make a parameter's local leaf again when its local tensor or requires_grad changed.
        (requires_grad is read every call: torch's C++ can turn it off unseen, as
        `torch.detach_(p)` does.)"""
        with gradients.PLAIN_GETTERS():
            trained = list(map(_REQUIRES_GRAD, self.params))
        rebinds = REBINDS[0]
        if trained == self._trained and (
            rebinds == self._refreshed
            or (
                len(self.tensors) == len(self._locals)
                and all(map(is_, map(_LOCAL, self.tensors), self._locals))
            )
        ):
            self._refreshed = rebinds
            return
        locals_ = list(map(_LOCAL, self.tensors))
        leaves = {}
        for p, grad in zip(self.params, trained, strict=True):
            cached = self._leaves.get(id(p))
            if cached is not None and cached[0] is p._local and cached[1].requires_grad == grad:
                leaves[id(p)] = cached
            else:
                leaves[id(p)] = (p._local, p._local.detach().requires_grad_(grad))
        self._leaves, self._locals, self._trained = leaves, locals_, trained
        self.local = [
            leaves[id(t)][1] if is_param else local
            for t, local, is_param in zip(self.tensors, locals_, self.is_param, strict=True)
        ]
        self.version = next(_LEAF_VERSIONS)
        self._refreshed = rebinds

    def leaf(self, p: GlobalTensor) -> torch.Tensor:
        return self._leaves[id(p)][1]

    @contextlib.contextmanager
    def swapped(self, recurrent: list[torch.nn.RNNBase]) -> Iterator[None]:
        """The local tensors in the module's tables for the duration, and in the lists of
        weights that torch's recurrent layers pass (`_flat_weights`, kept beside the
        tables)."""
        for table, name, local in zip(self.tables, self.names, self.local, strict=True):
            table[name] = local
        flat = [(m, m._flat_weights, getattr(m, "_flat_weight_refs", None)) for m in recurrent]
        for m, weights, _ in flat:
            local = [self._leaves[id(w)][1] if id(w) in self._leaves else w for w in weights]
            m.__dict__["_flat_weights"] = local
            # (and the references torch compares with the tables: else its forward takes
            # the tables' leaves as new weights and flattens them, which on cuDNN moves them
            # into a new buffer, apart from the parameters' memory)
            m.__dict__["_flat_weight_refs"] = [None if w is None else weakref.ref(w) for w in local]
        try:
            yield
        finally:
            for table, name, t in zip(self.tables, self.names, self.tensors, strict=True):
                table[name] = t
            for m, weights, refs in flat:
                m.__dict__["_flat_weights"] = weights
                if refs is not None:
                    m.__dict__["_flat_weight_refs"] = refs


def _numbers_blanked(k: Any) -> Any:
    """A layout key's entry (`DataParallel._layout_key`) with each number's value left out,
    in tuples too: `(int, 5)` becomes `int`, a tuple of constants `(tuple, (5, "a"))`
    becomes `(tuple, (int, "a"))`."""
    if type(k) is not tuple or len(k) != 2:
        return k
    kind, value = k
    if kind in (int, float):
        return kind
    if kind is tuple:
        return (
            tuple,
            tuple(type(v) if type(v) in (int, float) else _numbers_blanked(v) for v in value),
        )
    return k


def _is_constant(value: Any) -> bool:
    """Is a plain argument a value the forward can only read (a flag, a number, a name)?
    Any other object (a Hugging Face KV cache) may be written by the forward: the checking
    pass would fill it with global tensors and the local run with local ones."""
    if isinstance(value, tuple):
        return all(_is_constant(v) for v in value)
    return isinstance(value, _CONSTANT_TYPES)


class DataParallel:
    """The fast path's state for one module (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, placement: Placement):
        self.placement = placement
        self.enabled = True
        self.batch_norm = "global"
        self.bucket_bytes = gradients.BUCKET_BYTES
        self.sync = True
        # how the last call ran (for tests and users): "fast", "per-op", or "traced" (op by
        # op in one graph of torch.compile)
        self.last_path = ""
        self.trace: list | None = None  # gradient reducer events, when a list
        self._module_ref = module
        self._original = module.forward
        self._layouts: OrderedDict = OrderedDict()
        self._groups: dict = {}  # data_nd: `group(data_nd)` on this placement
        self._warned: set[str] = set()
        self._numbers_seen: dict[tuple, int] = {}  # layout keys but for numbers: how many
        self._slots: _Slots | None = None
        self._special: list[torch.nn.Module] = []  # BatchNorm and dropout submodules
        self._recurrent: list[torch.nn.RNNBase] = []  # LSTM, GRU and RNN submodules
        self._checkpointable: list[torch.nn.Module] = []  # (attribute gradient_checkpointing)
        self._dropouts: list[torch.nn.Module] = []  # the dropout ones
        self._reducer: gradients.Reducer | None = None
        self._reducer_key: tuple | None = None
        self._buffers_in_flight: tuple | None = None  # (Pending, buffers): _broadcast_buffers
        self.shard_batch_norms: list = []  # batch_norm="local": modules with the per-shard forward
        # batch_norm="global" in a compiled local forward: modules with the logical forward,
        # installed for `_special` (the modules found with it), and their ranks
        self.logical_batch_norms: list = []
        self._logical_for: list | None = None
        self._bn_groups = compiled_batch_norm.Groups()
        self.compile_options: dict | None = None  # torch.compile's options for the local forward
        self._compiled: list = []  # [(options, the forward under torch.compile)]
        self._compile_declined = False  # warned that a call runs eagerly
        self.backend: int | None = None  # its last compiled call's, in _COMPILE_BACKENDS
        self.number = next(_NUMBERS)  # what a trace of its call is guarded on
        # outputs are `sbp.nn.outputs.FastPathOutput`s (their losses run on local tensors)
        # until one is passed to a compiled function
        self.twins = True
        gradients.LEAF_OWNERS.add(self)  # (a backward's inputs=[parameters]: local_leaves)

    def __deepcopy__(self, memo: dict) -> DataParallel:
        """`copy.deepcopy` of the module: the copy gets a fresh fast path with the same
        settings. The layouts, local leaves, reducer and compiled forwards belong to the
        original's tensors (copied, the copy's backward filled the original's gradients)."""
        module = copy.deepcopy(self._module_ref, memo)
        fresh = memo[id(self)] = DataParallel(module, self.placement)
        fresh._original = copy.deepcopy(self._original, memo)
        fresh.enabled, fresh.batch_norm, fresh.sync = self.enabled, self.batch_norm, self.sync
        fresh.bucket_bytes = self.bucket_bytes
        fresh.compile_options = copy.deepcopy(self.compile_options, memo)
        fresh.shard_batch_norms = copy.deepcopy(self.shard_batch_norms, memo)
        # (the copied modules keep the logical forward and their copy of the groups)
        fresh.logical_batch_norms = copy.deepcopy(self.logical_batch_norms, memo)
        fresh._bn_groups = copy.deepcopy(self._bn_groups, memo)
        return fresh

    # ------------------------------------------------------------ the call
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call(args, kwargs)

    def call(self, args: tuple, kwargs: dict, backend: Any = None) -> Any:
        """One call of the module. `backend`: the call comes from a model under
        torch.compile (see `_under_torch_compile`), whose backend then compiles the local
        forward, or the module's forward op by op where the local one cannot be compiled."""
        self.settle_buffers()
        if not self.enabled or env.get_rank() not in self.placement:
            return self._per_op(args, kwargs, backend)
        if not self._params_broadcast():  # (first: it finds the BatchNorm and dropout modules)
            return self._per_op(args, kwargs, backend)
        key, data_nd = self._layout_key(args, kwargs)
        if key is None:
            return self._per_op(args, kwargs, backend)
        why = self._per_op_reason()
        if why is not None:
            self._warn_once(f"runs op by op {why}")
            return self._per_op(args, kwargs, backend)
        layout = self._layouts.get(key)
        if layout is None:
            self._note_new_numbers(key)
            layout = self._layouts[key] = self._check(args, kwargs, data_nd)
            if len(self._layouts) > LAYOUTS:
                self._layouts.popitem(last=False)
            if not layout.ok:
                self._warn_once(f"runs op by op: {layout.reason}")
        else:
            self._layouts.move_to_end(key)
        if layout.empty_part:
            backend = None
        if not layout.ok or (
            backend is not None and self._local_compile_declined(layout, data_nd) is not None
        ):
            return self._per_op(args, kwargs, backend)
        for path, limit in layout.index_inputs:  # (as the ops checked them op by op)
            limit.check(_input_at(args, kwargs, path))
        self.last_path = "fast"
        if layout.tried:
            return self._run_local(args, kwargs, layout, data_nd, backend)
        try:
            return self._first_local_run(args, kwargs, layout, data_nd, backend)
        except BaseException:
            if layout.ok:  # (raised before the verdict: checked again, with its own batch)
                self._layouts.pop(key, None)
            raise

    def _warn_once(self, what: str, stacklevel: int = CALLER) -> None:
        """Warn that the module `what`, once per module, from the line that called it."""
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn(f"sbp: {type(self._module_ref).__name__} {what}", stacklevel=stacklevel)

    def _note_new_numbers(self, key: tuple) -> None:
        """A number argument is part of the layout (the forward may branch on it), so each
        new value is checked again, op by op: warn once where calls keep bringing new ones
        (a token count passed as an int every step), as that costs more than it saves."""
        numbers = tuple(map(_numbers_blanked, key))
        seen = self._numbers_seen[numbers] = self._numbers_seen.get(numbers, 0) + 1
        if len(self._numbers_seen) > 4 * LAYOUTS:
            self._numbers_seen.clear()
        if seen == NEW_NUMBERS_WARNED and "numbers" not in self._warned:
            self._warned.add("numbers")
            warnings.warn(
                f"sbp: {type(self._module_ref).__name__} is checked again, op by op, for "
                "each new value of a number argument; pass a value that changes every call "
                "as a tensor (global, broadcast) so its layout stays the same",
                stacklevel=CALLER,
            )

    def _first_local_run(self, args, kwargs, layout: Layout, data_nd: tuple, backend=None):
        """A layout's first local run, compared with the checking pass (its outputs, this
        rank's parts, and the buffers it left) and undone where they differ: the module then
        runs op by op, as for a failed check. The check cannot see a forward that reads the
        batch size as a number (`h * h.shape[0]`: the logical size there, the local one
        here), or a fill of a fixed size equal to the batch's (`_Check.fill_made`). An
        error there sends every rank op by op, as a difference does, but a bad label or
        index, a failed collective or ranks out of step (`RAISED_AS_THEY_ARE`) is raised as it is. Where the
        run holds collectives (BatchNorm over the batch, a loss), the others may be
        waiting inside one of them for a rank that raised, where the verdict's all-reduce
        must not meet them: the ranks first learn through the store that all of them left
        the run (`_left_together`)."""
        expected, layout.expected = layout.expected, None  # (raised: forgotten, see `call`)
        undo = _Undo(self._slots.buffers, args, kwargs)
        eager = self._eager(backend)
        grad = torch.is_grad_enabled()
        watch = recomputation.Recomputation() if eager and grad else None
        why, error, statistics = "", None, []
        try:
            with watch or contextlib.nullcontext():
                out = self._run_local(args, kwargs, layout, data_nd, backend, statistics)
        except RAISED_AS_THEY_ARE:
            raise
        except Exception as e:
            out, error = None, e  # (out never returned: this rank's verdict goes op by op)
            why = f"its local run raised {type(e).__name__}: {e}"
        if layout.bn_counts or layout.losses:
            self._left_together(error)
        if eager and not why:
            leaves = [t for t in output_leaves(out)[0] if isinstance(t, GlobalTensor)]
            got = [t._local for t in leaves]
            if watch is not None and watch.found(leaves):
                why = recomputation.REASON
            elif expected is not None:
                why = _differs("output", got, expected[0])
                if not why and not (self.batch_norm == "local" and len(self.group(data_nd)) > 1):
                    # (per-shard statistics are the first rank's only once broadcast)
                    why = _differs("buffer", [b._local for b in self._slots.buffers], expected[1])
        flag = torch.tensor([float(bool(why))])  # (every rank of the placement goes one way)
        if comm.all_reduce(flag, "max", self.placement.flat_ranks).item() == 0:
            layout.tried = True
            if statistics:
                self._sync_statistics(statistics, data_nd, grad)
            return out
        undo()
        layout.ok, layout.reason = False, why or "its local run differs on another rank"
        warnings.warn(
            f"sbp: {type(self._module_ref).__name__} runs op by op: {layout.reason}",
            stacklevel=CALLER,
        )
        return self._per_op(args, kwargs, backend)

    def _left_together(self, error: Exception | None) -> None:
        """Return once every rank of the placement has left the first local run, asked
        through the store; raise where a rank gave up waiting: `error` where this rank
        raised it, else `CommTimeoutError` naming the rank that gave up. A rank that
        raised waits `FIRST_RUN_WINDOW_S` (the others may be waiting for it inside a
        collective of the run, until their timeout); one that did not, the timeout."""
        timeout = env.get_timeout().total_seconds()
        me = f"rank {env.get_rank()}"
        if error is None:
            window, gave_up = timeout, f"{me} waited the timeout of {timeout} s"
        else:
            window = min(timeout / 2, FIRST_RUN_WINDOW_S)
            gave_up = f"{me}'s local run raised {type(error).__name__}: {error}"
        verdict = arrival.arrived_together(self.placement.flat_ranks, window, gave_up)
        if verdict == arrival.ALL:
            return
        if error is not None:
            raise error
        if verdict is not None:  # (None: no store; the verdict's all-reduce then tells)
            raise CommTimeoutError(
                f"{type(self._module_ref).__name__}'s first local run on the fast path: "
                f"another rank did not leave it in time ({verdict})"
            )

    def _eager(self, backend) -> bool:
        """Does this call run the local forward eagerly? (A compiled one draws dropout masks
        from torch's generator: other values than the checking pass's, by design.)"""
        return backend is None and self.compile_options is None

    def _per_op(self, args, kwargs, backend=None):
        self.last_path = "per-op"
        forward = self._original if backend is None else self._compiled_with({"backend": backend})
        out = forward(*args, **kwargs)
        shard_batch_norm.sync_statistics(self.shard_batch_norms, self.placement)
        return out

    def _per_op_reason(self) -> str | None:
        """Why a call must run op by op whatever its layout, or None. The local run would
        pass a parameter's gradient hooks by; and gradient checkpointing (Hugging Face's
        `gradient_checkpointing_enable()`) runs a block's forward again in backward, after
        the local run gave the module its global parameters back."""
        if self._slots.hooked():
            return (
                "while a parameter has a gradient hook (register_hook, "
                "register_post_accumulate_grad_hook)"
            )
        if any(m.gradient_checkpointing is True and m.training for m in self._checkpointable):
            return "while gradient checkpointing is on (it runs the forward again in backward)"
        return None

    def _layout_key(self, args, kwargs) -> tuple[tuple | None, tuple]:
        """A hashable key of the call's layout, or None when it is not a data-parallel call:
        global inputs on the placement, split or broadcast, others plain values. The
        hierarchy dims along which some input is split on dim 0 hold the batch; an input
        split on another dim is split along those only (a recurrent state passed back in is
        split on its dim 1)."""
        # (each BatchNorm and dropout module's own mode: one may differ from the model's)
        modes = tuple(m.training for m in self._special)
        key: list = [self._module_ref.training, modes, torch.is_grad_enabled(), tuple(kwargs)]
        data: set[int] = set()
        other: set[int] = set()

        def key_of(a):
            if isinstance(a, GlobalTensor):
                spec = a._spec
                if spec.placement != self.placement:
                    raise _NotDataParallel
                for h, s in enumerate(spec.nd_sbp):
                    if s.is_split:
                        (data if s.dim == 0 else other).add(h)
                    elif not s.is_broadcast:
                        raise _NotDataParallel
                return spec
            if type(a) is tuple and not _is_constant(a):
                return (tuple, tuple(map(key_of, a)))
            if not _is_constant(a):  # (a local tensor, a KV cache the forward writes into)
                raise _NotDataParallel
            return (type(a), a)

        try:
            key.extend(map(key_of, (*args, *kwargs.values())))
        except _NotDataParallel:
            return None, ()
        if not data or not other <= data:
            if other:  # (a sequence-first batch, split on dim 1: worth saying, it is slow)
                self._warn_once(
                    "runs op by op: the fast path takes a batch split on dim 0, and its inputs "
                    "are split on other dims only, or along other placement dims (pass the "
                    "batch first, and transpose it inside the forward if need be)",
                    stacklevel=CALLER + 1,  # (from a helper of call)
                )
            return None, ()
        data_nd = tuple(split(0) if h in data else broadcast for h in range(self.placement.ndim))
        return tuple(key), data_nd

    def _params_broadcast(self) -> bool:
        """Are the module's parameters and buffers still the broadcast ones seen last time?"""
        old = self._slots
        if old is not None and old.unchanged():
            return True
        self._slots = None
        allb = (broadcast,) * self.placement.ndim
        self._special = [m for m in self._module_ref.modules() if isinstance(m, SPECIAL_MODULES)]
        self._recurrent = [m for m in self._module_ref.modules() if isinstance(m, torch.nn.RNNBase)]
        self._checkpointable = [
            m for m in self._module_ref.modules() if hasattr(m, "gradient_checkpointing")
        ]
        self._dropouts = [m for m in self._special if not isinstance(m, BATCH_NORMS)]
        found = []
        for sub in self._module_ref.modules():
            for is_param, table in ((True, sub._parameters), (False, sub._buffers)):
                for name, t in table.items():
                    if t is None:
                        continue
                    if not (
                        isinstance(t, GlobalTensor)
                        and t._spec.placement == self.placement
                        and t._spec.nd_sbp == allb
                    ):
                        return False
                    found.append((table, name, t, is_param))
        if old is not None and old.same_as(found):  # (a submodule set elsewhere)
            old.submodules_seen = SUBMODULES_SET[0]
            self._slots = old
            return True
        self._slots = _Slots(found)
        if old is None or old.names != self._slots.names or old.specs != self._slots.specs:
            # Other tensors (a new head for fine-tuning, a resized embedding): the layouts
            # checked with the old ones may expect other outputs; check them again
            self._layouts.clear()
        return True

    # ------------------------------------------------------------ checking pass
    def _check(self, args, kwargs, data_nd) -> Layout:
        """Run the module op by op, watching every op, without lasting effects."""
        buffers = self._slots.buffers
        undo = _Undo(buffers, args, kwargs)
        sizes = _batch_sizes(args, kwargs, data_nd)
        empty_part = any(size < len(self.group(data_nd)) for size in sizes)
        check = _Check(data_nd, sizes[0] if sizes and not empty_part else None)
        left = None  # the buffers as the forward left them
        registry.observers.append(check)
        try:
            counted = _forwards_replaced(self._special, lambda m, f: _within(_Depth(check), f))
            modes = torch._C._len_torch_function_stack() + 1  # (with _WholeCalls)
            by_name = _by_name_replaced(_called_by_name(check, modes))
            row_wise = row_wise_calls.unjudged(check, sizes[0] if sizes else None)
            with torch.no_grad(), counted, by_name, row_wise, _WholeCalls(check):
                out = self._original(*args, **kwargs)
            left = [b._local.clone() for b in buffers]
        finally:
            registry.observers.remove(check)
            undo()
        leaves, _ = output_leaves(out)  # (a transformers KV cache opened)
        specs = []
        for leaf in leaves:
            if isinstance(leaf, GlobalTensor):
                specs.append(leaf._spec)
            elif isinstance(leaf, torch.Tensor):
                check._fail("the module returns a local tensor")
            elif isinstance(leaf, _PLAIN_VALUES):
                specs.append(leaf)
            else:  # (the local run's would hold local tensors)
                check._fail(
                    f"the module returns a {type(leaf).__name__}, which the local run would "
                    "fill with local tensors"
                )
        if check.reason:
            return Layout(False, check.reason)
        return Layout(
            True,
            expected=([leaf._local for leaf in leaves if isinstance(leaf, GlobalTensor)], left),
            out_specs=specs,
            bn_counts=check.bn_counts,
            dropouts=check.dropouts,
            by_name_dropouts=check.by_name_dropouts,
            losses=check.losses,
            in_modules=not check.outside_modules,
            index_inputs=check.indexed_inputs(args, kwargs),
            empty_part=empty_part,
        )

    # ------------------------------------------------------------ local run
    def group(self, data_nd: tuple) -> tuple[int, ...]:
        """This rank's ranks holding parts of the same batch (kept per layout: every call
        asks)."""
        group = self._groups.get(data_nd)
        if group is None:
            group = batch_norm.split_group(self.placement, data_nd, env.get_rank())
            self._groups[data_nd] = group
        return group

    def _prepare_reducer(self, data_nd: tuple) -> None:
        """The local leaves up to date, and a reducer over them for this layout."""
        slots = self._slots
        slots.refresh()
        key = (slots.version, data_nd)
        if self._reducer_key != key:
            trained = [p for p in slots.params if p.requires_grad]
            self._reducer = gradients.Reducer(
                trained,
                [slots.leaf(p) for p in trained],
                self.group(data_nd),
                splits_to_partials(data_nd),
                bucket_bytes=self.bucket_bytes,
            )
            self._reducer_key = key
        self._reducer.sync, self._reducer.trace = self.sync, self.trace
        self._reducer.on_finish = self.settle_buffers
        self._reducer.forward_started()

    def _run_local(
        self, args, kwargs, layout: Layout, data_nd: tuple, backend=None, statistics=None
    ):
        """Run the forward on local tensors. Per-shard running statistics are then
        broadcast from the first rank, or, given a `statistics` list, put in it (a first
        run: a collective must not start before every rank's verdict)."""
        grad = torch.is_grad_enabled()
        self._prepare_reducer(data_nd)
        run = _Run(self, layout, data_nd)
        compiled = self._compiled_forward(run, layout, backend)

        def enter(a):
            read_now(a)  # (a copied view of a base written since: taken again)
            if grad and a.requires_grad:
                return _EnterLocal.apply(a, _share_spec(a._spec, data_nd))
            # (compiled: a new alias, as tracing the global input outside marked its local
            # tensor's sizes static, and the local graph's batch size may become dynamic)
            return a._local if compiled is None else a._local.detach()

        largs = [_map_globals(a, enter) for a in args]
        lkwargs = {k: _map_globals(v, enter) for k, v in kwargs.items()}
        bn_calls = len(layout.bn_counts)  # the BatchNorm calls the run intercepts
        if compiled is not None:
            # the modules' own forwards, traced: per-shard BatchNorm, torch's dropout
            forward, local_ops = compiled, contextlib.nullcontext()
            if len(run.group) > 1 and self.batch_norm == "local":
                run.to_sync = [t._local for t in shard_batch_norm.running_statistics(self._special)]
            elif len(run.group) > 1 and layout.bn_counts:
                local_ops = self._logical_batch_norm(run.group)
        elif not (layout.bn_counts or layout.dropouts or layout.losses):
            # no train-mode BatchNorm, dropout or loss (whatever the module's own mode says)
            forward, local_ops = self._original, contextlib.nullcontext()
        elif layout.in_modules:
            # A batch in one part: each BatchNorm module's own forward is the logical one
            own_batch_norm = len(run.group) == 1
            special = self._dropouts if own_batch_norm else self._special
            bn_calls = 0 if own_batch_norm else bn_calls
            forward = self._original
            local_ops = contextlib.ExitStack()
            local_ops.enter_context(
                _forwards_replaced(special, _local_forward(run, _LocalOps(run)))
            )
            if layout.losses or layout.by_name_dropouts:
                local_ops.enter_context(_by_name_replaced(run.by_name))
        else:
            forward, local_ops = self._original, _LocalOps(run)
        with self._slots.swapped(self._recurrent), local_constants.suspended(), local_ops:
            out = forward(*largs, **lkwargs)
        ran, checked = (
            (run.bn_calls, run.dropouts, run.losses),
            (bn_calls, layout.dropouts, layout.losses),
        )
        if compiled is None and ran != checked:
            raise RuntimeError(
                "sbp data-parallel fast path: {} BatchNorm, {} dropout and {} loss calls, "
                "{} {} and {} when the layout was checked (use sbp.nn.data_parallel(module, "
                "fast=False))".format(*ran, *checked)
            )
        if statistics is not None:
            statistics += run.to_sync
        elif run.to_sync:
            self._sync_statistics(run.to_sync, data_nd, grad)
        return self._wrap(out, layout, data_nd, grad)

    def _sync_statistics(self, to_sync: list, data_nd: tuple, grad: bool) -> None:
        """The first rank's running statistics, broadcast while a backward follows (it
        settles them), else at once."""
        backward_follows = grad and self._reducer is not None and bool(self._reducer.params)
        self._broadcast_buffers(to_sync, data_nd)
        if not backward_follows:
            self.settle_buffers()

    def _compiled_forward(self, run: _Run, layout: Layout, backend=None):
        """The module's forward compiled for local tensors (`data_parallel(module,
        compile=...)`, or the backend of a torch.compile'd model), or None where this call
        runs it eagerly: compiling it off, or where the eager run must intercept
        BatchNorm calls (`_local_compile_declined`) or compute a loss inside the forward
        over the logical batch (a compiled model that returns its loss and more could not
        run op by op either: torch's backward makes the unused outputs' zero gradients
        plain tensors, which AOT autograd refuses for global outputs)."""
        options = self.compile_options
        if layout.empty_part:
            return None
        if options is None:
            if backend is None:
                return None
            options = {"backend": backend}
        # (a call from torch.compile was checked in `call`, which ran it op by op if declined)
        why = None if backend is not None else self._local_compile_declined(layout, run.data_nd)
        if why is None and layout.losses:
            why = "it computes a loss over the logical batch"
        if why is not None:
            if not self._compile_declined:
                self._compile_declined = True
                warnings.warn(
                    f"sbp: {type(self._module_ref).__name__} runs its local forward eagerly, "
                    f"not compiled: {why}",
                    stacklevel=4,
                )
            return None
        return self._compiled_with(options)

    def _local_compile_declined(self, layout: Layout, data_nd: tuple) -> str | None:
        """Why the local forward cannot be compiled for this layout, or None: F.batch_norm
        outside BatchNorm modules, which the eager run intercepts per call, or logical
        BatchNorm over several ranks (the ranks splitting the batch, by `data_nd`) in a
        BatchNorm module with a forward of its own (`compiled_batch_norm` replaces
        torch's)."""
        # (what the checking pass recorded, not module.training: a BatchNorm submodule
        # may be in train mode inside a model in eval mode, as when adapting statistics)
        if not layout.bn_counts:
            return None
        if not layout.in_modules:
            return "F.batch_norm called outside BatchNorm modules"
        if self.batch_norm == "global" and len(self.group(data_nd)) > 1:
            if not all(
                shard_batch_norm.torch_forward(m)
                for m in self._special
                if isinstance(m, BATCH_NORMS)
            ):
                return "logical BatchNorm over several ranks in a module with its own forward"
        return None

    @contextlib.contextmanager
    def _logical_batch_norm(self, group: tuple[int, ...]) -> Iterator[None]:
        """While a compiled local forward runs: its BatchNorm modules compute the logical
        batch's statistics over `group` (`compiled_batch_norm`)."""
        if self._logical_for is not self._special:  # (installed for the modules found now)
            compiled_batch_norm.remove(self.logical_batch_norms)
            self.logical_batch_norms = compiled_batch_norm.install(
                self._module_ref, self._bn_groups
            )
            self._logical_for = self._special
        groups = self._bn_groups
        groups.ranks, groups.index = group, group.index(env.get_rank())
        try:
            yield
        finally:
            groups.ranks = None

    def _compiled_with(self, options: dict) -> Callable:
        """The module's own forward under torch.compile with `options`, made once per
        options: it compiles for local tensors (the fast path) and for global ones (op by
        op) alike, each with its own guards. A few are kept: a model under torch.compile
        with `data_parallel(compile=...)` too may switch between two."""
        for known, compiled in self._compiled:
            if known == options:
                return compiled
        original = self._original

        # (a frame of sbp's own: torch.compile of a torch.nn method compiles a wrapper
        # frame shared by every such method, and shares its recompile limit with them)
        def forward(*args, **kwargs):
            return original(*args, **kwargs)

        compiled = torch.compile(forward, **options)
        self._compiled = [*self._compiled[-3:], (dict(options), compiled)]
        return compiled

    def local_leaves(self, tensors: list) -> list:
        """`tensors` with each of the module's parameters replaced by its local leaf, where
        the local graph accumulates its gradient (a loss's `backward(inputs=...)`)."""
        leaves = map(self._leaf_of, tensors)
        return [t if leaf is None else leaf for t, leaf in zip(tensors, leaves, strict=True)]

    def leaf_grad_spec(self, p: torch.Tensor) -> GlobalSpec | None:
        """See `sbp.gradients.leaf_grad_spec`."""
        if self._leaf_of(p) is None or self._reducer is None:
            return None
        return p._spec._replace(nd_sbp=self._reducer.partial_nd)

    def _leaf_of(self, t: torch.Tensor) -> torch.Tensor | None:
        """The local leaf standing for parameter `t` in the local runs, or None."""
        cached = None if self._slots is None else self._slots._leaves.get(id(t))
        if cached is None or cached[0] is not getattr(t, "_local", None):
            return None
        return cached[1]

    def _broadcast_buffers(self, tensors: list[torch.Tensor], data_nd: tuple) -> None:
        """Per-shard statistics differ per rank: keep the first rank's, as torch DDP does.

        When a backward follows, the copy runs while it does: it is settled
        (`settle_buffers`) when the gradients are, or at the module's next call, state_dict
        or load_state_dict, whichever comes first. Until then another rank's running
        statistics are still its own shard's (torch DDP leaves them so until its next
        forward)."""
        self.settle_buffers()
        group = self.group(data_nd)
        flat = torch.cat([t.reshape(-1) for t in tensors])
        self._buffers_in_flight = (comm.broadcast_async(flat, group[0], group), tensors)

    def settle_buffers(self) -> None:
        """Wait for the running statistics' broadcast and write them into the buffers.

        Train-mode BatchNorm's backward never reads the running statistics, so overwriting
        them keeps their version (autograd would otherwise refuse the backward)."""
        if self._buffers_in_flight is None:
            return
        pending, tensors = self._buffers_in_flight
        self._buffers_in_flight = None
        flat = pending.wait()
        offset = 0
        for t in tensors:
            with torch.autograd._unsafe_preserve_version_counter(t):
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    def _wrap(self, out, layout: Layout, data_nd: tuple, grad: bool):
        leaves, put_back = output_leaves(out)
        if len(leaves) != len(layout.out_specs):
            raise RuntimeError("sbp data-parallel fast path: the module's outputs changed shape")
        wrapped = []
        exits = layout.exits_on(env.get_rank(), data_nd)
        for t, spec, exit_ in zip(leaves, layout.out_specs, exits, strict=True):
            if exit_ is None:
                wrapped.append(t)
                continue
            local_shape, grad_spec = exit_
            if t.shape != local_shape:
                raise RuntimeError(
                    f"sbp data-parallel fast path: a local output has shape {tuple(t.shape)} "
                    f"where {local_shape} was expected; the module uses the batch size "
                    "in a way that is not separable: sbp.nn.data_parallel(module, fast=False)"
                )
            # (only a hookless reducer needs telling; a graph keeps no other alive)
            reducer = None if not grad or self._reducer.hooked else self._reducer
            wrapped.append(outputs.wrap(t, spec, grad_spec, data_nd, reducer, self))
        return put_back(wrapped)


# ---------------------------------------------------------------- public switches


def attach(module: torch.nn.Module, placement: Placement) -> None:
    """Give `module` the fast path (called by `module.to_global(P, broadcast)`)."""
    fast = module.__dict__.get(ATTR)
    if fast is not None:
        fast.placement = placement
        fast._layouts.clear()
        fast._groups.clear()
        return
    fast = DataParallel(module, placement)
    original = type(module).forward

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        fast = self.__dict__[ATTR]
        if torch.compiler.is_compiling():  # Dynamo traces this call, inlined in its caller's
            return _traced(self, original, args, kwargs)
        # torch.compile(model): Dynamo skips this frame (`_skip_frame`) with its callback set
        callback = _set_eval_frame(None)
        if callback is None:  # eager
            return fast(*args, **kwargs)
        try:
            backend = _leaving_backend(callback, fast)
            if backend is not None:  # the fast path, its local forward compiled by `backend`
                return _call_from_compiled(fast, args, kwargs, backend)
        finally:
            _set_eval_frame(callback)
        # one graph (fullgraph=True, torch.export): Dynamo traces it op by op
        return _traced(self, original, args, kwargs)

    _skip_frame(forward)
    module.__dict__[ATTR] = fast
    module.forward = types.MethodType(forward, module)
    module.zero_grad = types.MethodType(_zero_grad, module)
    if SETTLE_HOOK not in module.__dict__:
        module.__dict__[SETTLE_HOOK] = (
            module.register_state_dict_pre_hook(_settle_buffers),
            module.register_load_state_dict_pre_hook(_settle_buffers),
        )


SETTLE_HOOK = "_sbp_settle_buffers_hook"


def _zero_grad(module: torch.nn.Module, set_to_none: bool = True) -> None:
    """`module.zero_grad()` that drops the gradients waiting plain on its parameters as they
    are (`sbp.gradients.take_waiting`): torch's reads each, which would wrap it first."""
    if set_to_none and gradients.drop_waiting(list(module.parameters())):
        return  # (nothing left: torch's would read every `.grad` in Python)
    type(module).zero_grad(module, set_to_none)


# Backends of the torch.compile calls that ran a model with the fast path; a trace takes an
# index into this list as a constant (`_under_torch_compile`). Each torch.compile call makes
# its own backend object; equal ones (the same compiler and options: torch's wrappers
# compare so, under Dynamo's debug wrapper) share an entry, so a process compiling model
# after model keeps one per kind.
_COMPILE_BACKENDS: list = []


def _backend_index(backend: Any) -> int:
    inner = getattr(backend, "_torchdynamo_orig_backend", backend)
    for i, known in enumerate(_COMPILE_BACKENDS):
        if known is backend or getattr(known, "_torchdynamo_orig_backend", known) == inner:
            return i
    _COMPILE_BACKENDS.append(backend)
    return len(_COMPILE_BACKENDS) - 1


try:  # (torch's C module: importing torch._dynamo would cost every `import sbp` seconds)
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy
    from torch._C._dynamo.eval_frame import set_code_exec_strategy as _set_code_exec_strategy
    from torch._C._dynamo.eval_frame import set_eval_frame as _set_eval_frame
except ImportError:  # (without them Dynamo traces the model's call: `_traced`)

    def _set_eval_frame(callback: Any) -> None:
        return None

    _set_code_exec_strategy = None


def _skip_frame(forward: Callable) -> None:
    """Dynamo runs `forward`'s frame as it is, not traced, and still evaluates the frames it
    calls (what `torch._dynamo.skip` does). Traced, the call of a data-parallel model would
    cost a frame of guards on its inputs (Python checks for a global tensor) and a graph
    break on every step; skipped, it reads torch.compile's callback, whose backend then
    compiles the local forward (`_leaving_backend`)."""
    if _set_code_exec_strategy is not None:
        strategy = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT)
        _set_code_exec_strategy(forward.__code__, strategy)


def _leaving_backend(callback: Any, fast: DataParallel) -> int | None:
    """Where torch.compile's frame callback `callback` lets a model's call leave its graph:
    the index in `_COMPILE_BACKENDS` of the backend that compiles the local forward; None
    where the call must be traced in one graph (fullgraph=True, torch.export,
    error_on_graph_break) or the callback is not one this recognises (Dynamo's internals:
    the call is then traced as before the skip, `_traced`).

    `False` is Dynamo's run-only callback (no new compilation, as past a recompile limit):
    the backend of the model's last compiled call, if any."""
    if callback is False:
        return fast.backend
    convert = getattr(callback, "_torchdynamo_orig_backend", None)
    one_graph = getattr(getattr(convert, "_inner_convert", convert), "_one_graph", None)
    backend = getattr(convert, "_torchdynamo_orig_backend", None)
    if one_graph is not False or backend is None or getattr(convert, "_export", False):
        return None
    try:
        from torch._dynamo.utils import _get_error_on_graph_break

        if _get_error_on_graph_break():
            return None
    except ImportError:
        pass
    return _backend_index(backend)


def _traced(self: torch.nn.Module, original: Callable, args: tuple, kwargs: dict) -> Any:
    """A data-parallel model's call where Dynamo traces it: inlined in a compiled caller, or
    in one graph. Run eagerly (Dynamo declined the frame), the fast path."""
    fast = self.__dict__[ATTR]
    if torch.compiler.is_compiling():
        backend = _under_torch_compile(fast.number)
        if backend >= 0:  # leave the graph: the call runs as below, compiled inside
            return _call_from_compiled(fast, args, kwargs, backend)
        # one graph (fullgraph=True, torch.export): torch.compile traces it op by op
        fast.last_path = "traced"
        out = original(self, *args, **kwargs)
        shard_batch_norm.sync_statistics(fast.shard_batch_norms, fast.placement)
        return out
    return fast(*args, **kwargs)


def _under_torch_compile(number: int) -> int:
    """Run by Dynamo, for real, while it traces a model with the fast path (its result is a
    constant of the trace): which of `_COMPILE_BACKENDS` compiles the call, or -1 where the
    trace must stay one graph (fullgraph=True, error_on_graph_break, torch.export).

    `number` (the model's `DataParallel.number`) is unused here: Dynamo guards the trace on
    it, so a trace made for one model is not run for another of its class (one made with
    fullgraph=True would run op by op). It is a number, not the object, as torch 2.11
    passes only Python constants to a function whose result it takes as a constant.

    Traced op by op, the model's parameters are global tensors in the graph, each costing
    guards, wrapping and autograd work in Python on every step (~1.6x a compiled torch
    step on an H100, world of one). Leaving the graph, the call runs the fast path, which
    compiles the local forward with the same backend: plain tensors in the graph, as in
    compiled torch DDP (~1.1x)."""
    global _call_from_compiled
    try:  # (Dynamo internals: without them the trace stays one graph, as before)
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        if tx.one_graph or getattr(tx, "error_on_graph_break", False):
            return -1
        backend = tx.output.compiler_fn
    except Exception:
        return -1
    if backend is None:
        return -1
    if not hasattr(_call_from_compiled, "_torchdynamo_disable"):
        _call_from_compiled = torch._dynamo.disable(_call_from_compiled)
    return _backend_index(backend)


# Dynamo runs it for real while tracing and takes its result as a constant (what
# `torch._dynamo.assume_constant_result` marks; importing torch._dynamo to call that
# would cost every `import sbp` seconds)
_under_torch_compile._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _call_from_compiled(fast: DataParallel, args: tuple, kwargs: dict, backend: int) -> Any:
    """The call of a model under torch.compile, outside its graph: from a frame Dynamo skips
    (`_leaving_backend`), or, in a traced call, wrapped in `torch._dynamo.disable` before a
    trace reaches it (`_under_torch_compile`): Dynamo leaves the graph at its call, and the
    frames it runs are not traced."""
    fast.backend = backend
    return fast.call(args, kwargs, _COMPILE_BACKENDS[backend])


def _settle_buffers(module: torch.nn.Module, *args: Any) -> None:
    """state_dict and load_state_dict pre-hook: running statistics still being broadcast
    are written first (a load would otherwise be overwritten by them)."""
    fast = module.__dict__.get(ATTR)
    if fast is not None:
        fast.settle_buffers()


def detach_fast_path(module: torch.nn.Module) -> None:
    """Remove the fast path (the module's parameters are no longer all broadcast)."""
    fast = module.__dict__.pop(ATTR, None)
    if fast is not None:
        fast.settle_buffers()
        shard_batch_norm.remove(fast.shard_batch_norms)
        compiled_batch_norm.remove(fast.logical_batch_norms)
        module.__dict__.pop("forward", None)
        module.__dict__.pop("zero_grad", None)


def state(module: torch.nn.Module) -> DataParallel:
    """The fast path's state of `module` (a named error where it has none)."""
    if not isinstance(module, torch.nn.Module):
        raise InputTypeError(
            f"expected an nn.Module made global with module.to_global(placement, "
            f"sbp.broadcast), got {type(module).__name__}"
        )
    fast = module.__dict__.get(ATTR)
    if fast is None:
        raise PlacementError(
            f"{type(module).__name__} has no data-parallel fast path: "
            "call module.to_global(placement, sbp.broadcast) first"
        )
    return fast


def data_parallel(
    module: torch.nn.Module,
    *,
    fast: bool | None = None,
    batch_norm: str | None = None,
    bucket_mb: float | None = None,
    compile: bool | dict | None = None,
) -> torch.nn.Module:
    """Options of a module made global with `module.to_global(P, sbp.broadcast)`.

    fast: run the module on local shards when its check passes (default True);
    batch_norm: "global" (default) uses the statistics of the whole logical batch,
    "local" those of each rank's shard, as torch DDP without SyncBatchNorm;
    bucket_mb: gradient bucket size (default 25, as torch DDP);
    compile: True, or a dict of `torch.compile` options: the fast path runs the module's
    forward on local tensors through `torch.compile` (plain tensors, as compiled torch
    DDP), and everything around it eagerly; False (default) turns it off.
    """
    _check_options(fast, batch_norm, bucket_mb, compile)
    s = state(module)
    if compile is not None:
        if compile is False:
            s.compile_options = None
        else:
            s.compile_options = {} if compile is True else dict(compile)
        s._compiled, s._compile_declined = [], False
    if batch_norm is not None:
        s.batch_norm = batch_norm
        shard_batch_norm.remove(s.shard_batch_norms)
        compiled_batch_norm.remove(s.logical_batch_norms)
        s.logical_batch_norms, s._logical_for = [], None
        s.shard_batch_norms = shard_batch_norm.install(module) if batch_norm == "local" else []
    if fast is not None:
        s.enabled = bool(fast)
    if bucket_mb is not None:
        s.bucket_bytes = int(bucket_mb * 2**20)
        s._reducer_key = None
    return module


def _check_options(fast: Any, batch_norm: Any, bucket_mb: Any, compile: Any) -> None:
    """`data_parallel`'s options, all checked before any is applied (a bad one leaves the
    module as it was). Bools must be bools: `fast="no"` was taken as true."""
    if fast is not None and not isinstance(fast, bool):
        raise InputTypeError(f"sbp.nn.data_parallel: fast must be True or False, got {fast!r}")
    if batch_norm is not None and not isinstance(batch_norm, str):
        raise InputTypeError(
            f"sbp.nn.data_parallel: batch_norm must be 'global' or 'local', got {batch_norm!r}"
        )
    if batch_norm is not None and batch_norm not in ("global", "local"):
        raise InputValueError(
            f"sbp.nn.data_parallel: batch_norm must be 'global' or 'local', got {batch_norm!r}"
        )
    if bucket_mb is not None:
        if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)):
            raise InputTypeError(
                f"sbp.nn.data_parallel: bucket_mb must be a number of megabytes, got {bucket_mb!r}"
            )
        if not 0 < bucket_mb < float("inf"):
            raise InputValueError(
                f"sbp.nn.data_parallel: bucket_mb must be a positive, finite number of "
                f"megabytes (torch DDP's default is 25), got {bucket_mb!r}"
            )
    if compile is not None and not isinstance(compile, (bool, dict)):
        raise InputTypeError(
            f"sbp.nn.data_parallel: compile must be True, False or a dict of torch.compile "
            f"options, got {compile!r}"
        )
    if isinstance(compile, dict) and not all(isinstance(k, str) for k in compile):
        raise InputTypeError(
            f"sbp.nn.data_parallel: compile's options are torch.compile's keyword arguments "
            f"(str keys, such as {{'mode': 'max-autotune'}}), got {compile!r}"
        )


@contextlib.contextmanager
def no_sync(module: torch.nn.Module) -> Iterator[None]:
    """Accumulate gradients without reducing them (micro-batches), as torch DDP's `no_sync`:
    a backward inside leaves `.grad` as this rank's partial sums (whether the forward ran
    inside or not); the next backward outside reduces them with its own."""
    s = state(module)
    s.sync = False
    if s._reducer is not None:
        s._reducer.sync = False
    try:
        yield
    finally:
        s.sync = True
        if s._reducer is not None:
            s._reducer.sync = True
