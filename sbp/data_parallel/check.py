"""The checking pass: every op of a module's first call per layout, judged batch-separable
or not (`_Check`), with the torch functions taken whole (`_WholeCalls`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from sbp.data_parallel import families
from sbp.data_parallel.batch_rows import moved_to
from sbp.data_parallel.by_name import _ATTENTION, _DROPOUT, _unrouted
from sbp.data_parallel.inputs import _all_of
from sbp.layout import GlobalSpec
from sbp.ops import registry
from sbp.ops.basic import like, new_alloc, same_layout
from sbp.ops.conversions import to_copy
from sbp.ops.decomposed import composite_definition
from sbp.ops.out_variants import out_variant
from sbp.signature import is_all_broadcast
from sbp.tensor import GlobalTensor

aten = torch.ops.aten


class _Check:
    """Watches every op of the checking pass (see `sbp.ops.registry.observers`)."""

    # (a dtype or device conversion keeps the layout: autocast and `.float()` convert; a new
    # tensor of the input's shape takes its layout, and one of another shape is a constant)
    SAME_LAYOUT = (same_layout, like, new_alloc, to_copy)
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

    def indexed_inputs(self, inputs: list) -> list:
        """(position or keyword, limit) of each module input that an op checked as an index
        tensor, itself or a view of all of it (`ids.view(-1, n)`): the local run checks the
        input's known range against the limit on every call, as the op did here, so that a
        bad index raises on every rank, not in one rank's kernel alone. `inputs`: the module's
        global inputs, (path, tensor) (`Inputs.globals`)."""
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
        family = families.JUDGES.get(func)
        if family is None:
            self._fail(f"{func} has its own global semantics")
            return None
        return family.judge(self, func, args)

    def whole_call(self, kind, func, args: tuple, kwargs: dict) -> Any:
        """A torch function that is row-wise in the batch (`families.WHOLE_CALLS`: multi-head
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
      composite whose `bernoulli_` the check sees (`families.sdpa`);
    - `F.multi_head_attention_forward`, torch's recurrent functions (`torch.lstm`, ...) and
      `F.embedding_bag` are taken as a whole (`_Check.whole_call`);
    - a fill is noted (`_Check.fill_made`)."""

    def __init__(self, check: _Check):
        super().__init__()
        self.check = check

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        watched = families.WATCHES.get(_unrouted(func))
        if watched is not None:
            watched.watch(self.check, args, kwargs)
        kind = families.WHOLE_CALLS.get(func)
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
