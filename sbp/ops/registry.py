"""The rule registry and the dispatcher: strategy choice by boxing cost, cached on metadata.

A strategy rule returns 1-D candidates, each saying which SBP every global input
must have and which SBP every output gets. Candidates apply per hierarchy dim;
the engine tries every combination over the placement's dims, keeps the one
whose input conversions the boxing planner prices lowest, and caches the
choice (with the logical output shapes, found once on meta tensors) under the
op, the input specs and the non-float arguments, so per-step scalars such as a
learning rate never miss the cache. Ops with no rule fall back to broadcast.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sbp import env
from sbp.boxing import box, plan_specs
from sbp.boxing.executor import empty_local, local_device
from sbp.comm import functional, stats
from sbp.errors import IndexRangeError
from sbp.layout import GlobalSpec
from sbp.ops import converted, pricing
from sbp.ops.arguments import (  # noqa: F401 - note_optimizer_step: sbp.optim_step's
    PLAIN,
    flatten,
    flatten_outputs,
    note_optimizer_step,
    scan,
    unflatten,
    unflatten_outputs,
)
from sbp.ops.local_views import local_view, permuted_strides, view_wrappers
from sbp.ops.meta import NoMeta, outputs, outside_ranks_learn
from sbp.ops.writes import assign, is_inplace, is_view, mark_view, written
from sbp.ranges import known_range, written_args
from sbp.signature import SBP, broadcast, partial_sum, partials_to_broadcast, split
from sbp.tensor import GlobalTensor

CACHE_SIZE = 8192


class Dispatcher:
    """The dispatcher's state, on one object: the rules, what is derived from them per op,
    the decisions, the fallback warnings given, and the observers."""

    def __init__(self) -> None:
        self.rules: dict[Any, Callable] = {}  # op or overload packet -> rule (`register`)
        # (predicate, rule): ops with no rule of their own for which predicate(op) holds
        # take rule (torch's pointwise tag, say), in the order registered
        self.rules_when: list[tuple[Callable[[Any], bool], Any]] = []
        # the same, taken before the rule of an overload's packet (`aten.add.out` is not
        # `aten.add`)
        self.rules_first: list[tuple[Callable[[Any], bool], Any]] = []
        self.resolved: dict = {}  # op -> its rule, found once (`_resolve`)
        # List ops: their rule (`sbp.ops.optim.list_rule`, or their own) takes their
        # arguments as they are and checks them (no decision cache: a key over hundreds of
        # tensors would cost more than it saves; no single placement: a pipeline's stages
        # may share one list).
        self.list_ops: set = set()
        # (predicate, rule) of the list ops (`register_list_ops`: sbp.ops.optim's)
        self.list_ops_rule: tuple[Callable[[Any], bool], Callable] = (lambda func: False, None)
        # decisions by key (`scan`), least recently used first, at most CACHE_SIZE
        self.cache: OrderedDict = OrderedDict()
        self.warned: set[str] = set()  # ops whose fallback was warned about
        # Watchers of every op (the data-parallel fast path's checking pass): objects with
        # direct(func, decision), strategy(func, rule, global inputs, decision, what the
        # rule's check returned: an IndexLimit or None), custom(func, args) (true where it
        # takes that op as a whole: the ops its rule runs are then not watched), and
        # write(g, items, value) for `g[items] = value` (sbp.ops.setitem). The last one
        # added watches.
        self.observers: list = []

    @contextlib.contextmanager
    def watching(self, observer: Any) -> Any:
        """Inside, `observer` watches every op (see `observers`)."""
        self.observers.append(observer)
        try:
            yield observer
        finally:
            self.observers.remove(observer)


DISPATCHER = Dispatcher()
watching = DISPATCHER.watching
# The same objects under the module's names: the hot path reads a module global, not an
# attribute of one (and `registry.observers` is what watchers have used).
_rules, _rules_when, _rules_first = DISPATCHER.rules, DISPATCHER.rules_when, DISPATCHER.rules_first
_resolved, _list_ops, _cache = DISPATCHER.resolved, DISPATCHER.list_ops, DISPATCHER.cache
_warned, observers = DISPATCHER.warned, DISPATCHER.observers


@dataclass(frozen=True)
class Strategy:
    """One hierarchy dim's choice: an SBP per global input and per tensor output (flat order)."""

    inputs: tuple[SBP, ...]
    outputs: tuple[SBP, ...]


@dataclass
class Call:
    """What a rule sees: the op, its arguments, and the specs of its global inputs."""

    func: Any
    args: tuple
    kwargs: dict
    specs: list[GlobalSpec]
    out_meta: list  # (shape, dtype) or None per flat output leaf

    @property
    def placement(self):
        return self.specs[0].placement

    def arg(self, i: int, name: str, default: Any = None) -> Any:
        """Positional argument `i`, else keyword `name`, else `default`."""
        if len(self.args) > i:
            return self.args[i]
        return self.kwargs.get(name, default)


@dataclass
class StrategyRule:
    """`candidates(call) -> [Strategy]`; optional `local_args(call, args, kwargs, rank, in_specs,
    out_specs)` fixes shape arguments for local tensors (marked `from_local_input` where they
    are what the op's caller computes on local tensors: the data-parallel fast path's local
    run, which passes them itself, needs no fix); optional `post(func, args, kwargs, outs,
    in_specs, out_specs)` fixes local results (a mean over a split dim, say); optional
    `check(func, args, kwargs)` raises, on every rank alike, for arguments that would fail
    one rank's kernel alone (the others would wait for it in their next collective), and
    returns what it checked, an `IndexLimit`, or None. A decision cannot skip it: such an
    op never takes the direct path. Optional `local(func, args, kwargs, in_specs)` runs the
    op on the local tensors instead of its aten kernel, where the rule's computation differs
    (a softmax over a split dim combines its normaliser over the ranks:
    `sbp.ops.class_split`)."""

    candidates: Callable[[Call], Sequence[Strategy]]
    local_args: Callable | None = None
    post: Callable | None = None
    check: Callable | None = None
    local: Callable | None = None


def split_leading_dims(call: Call, n_in: int, n_out: int, trailing: int = 2) -> list[Strategy]:
    """Candidates of an op on its last `trailing` dims taken whole (pooling's spatial dims,
    a matrix function's matrix): broadcast, or every tensor split alike along a dim before
    them."""
    ndim = len(call.specs[0].shape)
    cands = [Strategy((broadcast,) * n_in, (broadcast,) * n_out)]
    cands += [Strategy((split(d),) * n_in, (split(d),) * n_out) for d in range(ndim - trailing)]
    return cands


def split_except_dim(
    call: Call, dim_pos: int, n_in: int, n_out: int = 1, default: int | None = None
) -> list[Strategy]:
    """Candidates of an op that works along its `dim` argument only (softmax, glu, cumsum):
    broadcast, or every tensor split alike along any other dim."""
    ndim = len(call.specs[0].shape)
    dim = call.arg(dim_pos, "dim", default)
    dim = dim + ndim if dim < 0 else dim
    cands = [Strategy((broadcast,) * n_in, (broadcast,) * n_out)]
    for d in range(ndim):
        if d != dim:
            cands.append(Strategy((split(d),) * n_in, (split(d),) * n_out))
    return cands


@dataclass(frozen=True)
class IndexLimit:
    """What an index check found: op `op`'s argument `name`, a global index tensor, must lie
    in [0, limit)."""

    op: str
    name: str
    index: Any
    limit: int

    def check(self, index: Any = None) -> None:
        """Raise `IndexRangeError` where the known range of `index` (default: the one seen)
        leaves [0, limit); unknown ranges pass."""

        bounds = known_range(self.index if index is None else index)
        if bounds is not None and (bounds[0] < 0 or bounds[1] >= self.limit):
            bad = bounds[0] if bounds[0] < 0 else bounds[1]
            raise IndexRangeError(
                f"{self.op}: {self.name} holds index {bad}, outside [0, {self.limit}) (seen "
                f"when {self.name} was made global)"
            )


def indices_within(index: tuple[int, str], size: Callable[[list], int]) -> Callable:
    """A `check` (see StrategyRule) for an op that picks by an index tensor (embedding,
    gather): where `to_global` learnt the logical index tensor's range (`known_range`: no
    collective, every rank knows it alike), an index outside [0, size(schema args)) raises
    `IndexRangeError` on every rank. Otherwise only the rank holding the bad index would
    raise (torch's kernel), and the others wait for it until the timeout. Indices made by
    ops, or on a GPU, have no known range: the kernel is left to find them. Returns the
    `IndexLimit` checked (for the data-parallel fast path's checking pass), or None."""
    pos, name = index

    def check(func, args: tuple, kwargs: dict) -> IndexLimit | None:
        full = schema_args(func, args, kwargs)
        if not isinstance(full[pos], GlobalTensor):
            return None
        found = IndexLimit(func.overloadpacket.__name__, name, full[pos], size(full))
        found.check()
        return found

    return check


def schema_args(func, args: tuple, kwargs: dict) -> list:
    """An op's arguments in schema order: keyword ones moved into place, absent ones None."""
    names = [a.name for a in func._schema.arguments]
    out = list(args) + [None] * (len(names) - len(args))
    for i, name in enumerate(names[len(args) :], start=len(args)):
        out[i] = kwargs.get(name)
    return out


def register(*ops: Any) -> Callable:
    """Decorator: `fn(func, args, kwargs)` handles the given aten ops (overloads or packets)."""

    def deco(fn):
        for op in ops:
            _rules[op] = fn
        return fn

    return deco


def register_strategy(
    *ops: Any,
    local_args: Callable | None = None,
    post: Callable | None = None,
    check: Callable | None = None,
    local: Callable | None = None,
):
    """Decorator for a candidates function: the op runs through the strategy engine."""

    def deco(candidates):
        rule = StrategyRule(candidates, local_args, post, check, local)
        for op in ops:
            _rules[op] = rule
        return candidates

    return deco


def register_when(predicate: Callable[[Any], bool], strategy: bool = False, first: bool = False):
    """Decorator for a rule, `fn(func, args, kwargs)` (or with `strategy`, a candidates
    function): ops with no rule of their own for which `predicate(op)` holds run by it (a
    class of ops torch tags, where a list would miss some). With `first`, also ops whose
    packet has a rule."""

    def deco(fn):
        rules = _rules_first if first else _rules_when
        rules.append((predicate, StrategyRule(fn) if strategy else fn))
        return fn

    return deco


def register_list_ops(predicate: Callable[[Any], bool], rule: Callable) -> None:
    """Ops for which `predicate(op)` holds are list ops, run by `rule` unless they have
    their own (see `Dispatcher.list_ops`)."""
    DISPATCHER.list_ops_rule = (predicate, rule)


def _reuses(func) -> bool:
    """May `func` take and keep converted values (`sbp.ops.converted`)? Not for ops that
    write an argument or return views, nor while an observer watches (the data-parallel
    fast path's checking pass behaves as before)."""
    return not (observers or is_view(func) or is_inplace(func) or _writes_any(func))


def _writes_any(func) -> bool:
    """Does `func` write any argument?"""
    return bool(written_args(func))


def _resolve(func):
    """The rule of `func` (a StrategyRule or a function), looked up once per op."""
    rule = _resolved.get(func)
    if rule is None:
        is_list_op, list_rule = DISPATCHER.list_ops_rule
        rule = _rules.get(func)
        if rule is None:
            rule = next((r for applies, r in _rules_first if applies(func)), None)
        if rule is None:
            rule = _rules.get(func.overloadpacket)
        if rule is None:
            rule = next((r for applies, r in _rules_when if applies(func)), None)
        if rule is None:
            rule = list_rule if is_list_op(func) else _FALLBACK
        if is_list_op(func):
            _list_ops.add(func)
        _resolved[func] = rule
    return rule


# Ops whose output is a new view of the input's local tensor in the same layout: run at
# once. Autograd detaches every parameter's gradient as it stores it (AccumulateGrad), so a
# compiled step makes one such call per parameter.
_SAME_LAYOUT_VIEWS = frozenset((torch.ops.aten.detach.default, torch.ops.aten.alias.default))


def dispatch(func, args: tuple, kwargs: dict) -> Any:
    out = _dispatch_op(func, args, kwargs)
    if pricing.PADDED and any(pricing.is_padded(a) for a in flatten(args, kwargs)[0]):
        pricing.mark_padded(*flatten_outputs(out))  # (whatever ran it: views, custom rules)
    return out


def _dispatch_op(func, args: tuple, kwargs: dict) -> Any:
    if func in _SAME_LAYOUT_VIEWS:
        g = args[0]
        out = GlobalTensor(func._op(g._local), g._spec)
        if g._copy_of is not None:  # a view of a copy: writes go on up
            mark_view(func, args, kwargs, [out], False, False)
        return out
    rule = _resolved.get(func)
    if rule is None:
        rule = _resolve(func)  # (a list op joins _list_ops: its rule checks its arguments)
    if func in _list_ops:
        if observers:
            observers[-1].custom(func, args)
        return rule(func, args, kwargs)
    flat, tree = flatten(args, kwargs)
    if converted.any_kept() and type(rule) is StrategyRule and _reuses(func):
        flat = converted.at_hand(flat, GlobalTensor)
    key, gpos = scan(func, flat, tree)
    padded = bool(pricing.PADDED) and any(pricing.is_padded(flat[i]) for i in gpos)
    if padded:
        key = (key, "padded")
    if torch._C._current_autograd_node() is not None:  # backward decides otherwise
        key = (key, "backward")
    d = _cache.get(key)
    if d is not None:
        _cache.move_to_end(key)  # least recently used goes first
    if d is not None and d.direct is not None:
        if observers:
            observers[-1].direct(func, d)
        # Cached and nothing to move: run the aten kernel on the locals (func._op skips
        # OpOverload.__call__) and wrap; ~6 us less per op than the general path.
        GT = GlobalTensor
        local = [a._local if type(a) is GT else a for a in flat]
        if d.direct_inplace:
            _unshare_sources(local)
        copied = False
        if tree is PLAIN:
            out = func._op(*local)
        else:
            largs, lkwargs = unflatten(local, tree)
            if d.direct_size is not None:  # views: the local size, fixed by the output spec
                largs = (largs[0], d.direct_size, *largs[2:])
                out, copied = local_view(func, largs, lkwargs)
            else:
                out = func._op(*largs, **lkwargs)
        if d.direct_inplace:
            return written(flat[0])
        strides = None
        if d.view:
            strides = permuted_strides(func, flat if tree is PLAIN else largs, flat[0])
        if copied:
            with view_wrappers(flat[0]):
                out = GT(out, d.direct, False, strides)
        else:
            out = GT(out, d.direct, False, strides)
        if copied or (d.view and flat[0]._copy_of is not None):  # writes go on to the base
            mark_view(func, *unflatten(flat, tree), [out], False, copied)
        return out
    if type(rule) is StrategyRule:
        if rule is _FALLBACK:
            _warn_fallback(func)
        return run_strategy(rule, func, flat, tree, key, gpos, padded)
    if observers and observers[-1].custom(func, args):
        watcher = observers.pop()  # it takes the op as a whole: not the ops its rule runs
        try:
            out = rule(func, args, kwargs)
        finally:
            observers.append(watcher)
    else:
        out = rule(func, args, kwargs)
    if is_inplace(func) and type(args[0]) is GlobalTensor:
        written(args[0])  # (a view sbp had to copy passes the write on to its base)
    return out


def _wrapped(global_type, leaves: list, specs: list) -> list:
    """The output leaves made global where they have a spec."""
    return [
        global_type(t, s) if s is not None and isinstance(t, torch.Tensor) else t
        for t, s in zip(leaves, specs, strict=True)
    ]


# ---------------------------------------------------------------- the strategy engine


def _outputs_on_meta(func, args, kwargs):
    return outputs(func, args, kwargs)


@dataclass(frozen=True)
class Decision:
    in_specs: tuple[GlobalSpec, ...]
    out_specs: tuple[GlobalSpec | None, ...]
    out_tree: Any
    inside: bool  # this rank holds data of the placement
    empty_here: list | None  # this rank's outputs when all are empty (some kernels reject those)
    # The one output's spec when the op runs straight on the local tensors: no boxing, no
    # local_args/post, one tensor output (in place only where it keeps the layout), data
    # here. The hot path of most ops.
    direct: GlobalSpec | None = None
    direct_size: list | None = None  # the size argument of a view op on this rank
    direct_inplace: bool = False  # writes its first argument, whose layout stays (an optimizer's)
    write_back: bool = False  # in place, but no candidate keeps the layout: re-box, copy in
    view: bool = False  # returns views of its first argument (sbp.ops.writes)
    pads: bool = False  # partial outputs are splits in disguise (`pricing`)


def _per_dim_candidates(func, candidates: list, self_spec: GlobalSpec) -> tuple[list, bool]:
    """The candidates for each hierarchy dim, and whether the op must write its result back.

    An in-place op keeps its input's layout, as torch keeps the tensor it writes: only the
    candidates that take and give the input's own sbp on a dim qualify there. Where a dim
    has none (`p.exp_()` on a partial sum), the op runs on all candidates and its result is
    re-boxed to the input's layout and copied in (`Decision.write_back`).
    """
    n = self_spec.placement.ndim
    if not is_inplace(func):
        return [candidates] * n, False
    keeping = [
        [c for c in candidates if c.inputs[0] == s and c.outputs[0] == s] for s in self_spec.nd_sbp
    ]
    if all(keeping):
        return keeping, False
    return [candidates] * n, True


def _sums_stay_sums(candidate: Strategy, specs: list[GlobalSpec], metas: list) -> bool:
    """Does a candidate giving a partial sum give one of a dtype the parts add up in? A
    float partial sum cast to integers (`sum(dtype=torch.long)`, `int_out.copy_(p)`), or
    anything cast to bool, rounds each part: the rounded parts do not add up to the
    rounded sum. (Casts keep partial max and min: they are monotone.)"""
    dtypes = [m[1] for m in metas if m is not None]
    floats = any(
        x == partial_sum and (s.dtype.is_floating_point or s.dtype.is_complex)
        for x, s in zip(candidate.inputs, specs, strict=True)
    )
    return not any(
        x == partial_sum
        and (d == torch.bool or (floats and not (d.is_floating_point or d.is_complex)))
        for x, d in zip(candidate.outputs, dtypes, strict=True)
    )


def _decide(
    rule: StrategyRule,
    func,
    args,
    kwargs,
    specs: list[GlobalSpec],
    grads: Sequence[bool],
    padded: bool = False,
) -> Decision:
    """The cheapest candidate: the conversions its inputs need, for the inputs that
    require grad, the conversions their gradients will need on the way back, and in
    backward, the later reductions of the partial outputs it carries (`sbp.ops.pricing`)."""
    metas, tree = _outputs_on_meta(func, args, kwargs)
    call = Call(func, args, kwargs, specs, metas)
    candidates = [c for c in rule.candidates(call) if _sums_stay_sums(c, specs, metas)]
    per_dim, write_back = _per_dim_candidates(func, candidates, specs[0])
    P = specs[0].placement
    backward = torch._C._current_autograd_node() is not None  # (noted in the cache key)
    strided = any(s.is_strided for c in candidates for s in c.outputs)
    best, best_cost = None, None
    for combo in itertools.product(*per_dim):
        if strided and not _one_strided_kind(combo):
            continue
        req = tuple(
            s._replace(nd_sbp=tuple(c.inputs[j] for c in combo)) for j, s in enumerate(specs)
        )
        plans = [plan_specs(s, r) for s, r in zip(specs, req, strict=True) if s != r]
        plans += [
            p
            for s, r, g in zip(specs, req, grads, strict=True)
            if g and not padded and s != r and (p := pricing.gradient_plan(s, r)) is not None
        ]
        later = []
        if backward and not padded:
            plans += pricing.gathered_again(specs, req, metas, combo)
            later = pricing.reduced_later(specs, req, metas, combo)
        now = sum(p.cost for p in plans)  # (a tie in all goes to less now, as before)
        cost = (now + sum(p.cost for p in later), now, sum(len(p.steps) for p in plans))
        if best_cost is None or cost < best_cost:
            best, best_cost = (combo, req), cost
    if best is None:
        raise AssertionError(f"{func}: the rule gave no candidate")
    combo, req = best
    pads = padded or any(
        (a.is_split or a.is_strided) and b.is_partial
        for s, r in zip(specs, req, strict=True)
        for a, b in zip(s.nd_sbp, r.nd_sbp, strict=True)
    )
    outs, k = [], 0
    for m in metas:
        if m is None:
            outs.append(None)
            continue
        nd = tuple(c.outputs[k] for c in combo)
        outs.append(GlobalSpec(P, nd, m[0], m[1]))
        k += 1
    me = env.get_rank()
    inside = me in P
    empty_here = _empty_outputs(outs, me) if inside else None
    direct = direct_size = None
    sized = getattr(rule.local_args, "size_from_output", False)
    if (
        inside
        and empty_here is None
        and tree is None
        and len(outs) == 1
        and outs[0] is not None
        and (rule.local_args is None or sized)
        and rule.post is None
        and rule.check is None
        and rule.local is None
        and not pads
        and (not is_inplace(func) or outs[0] == specs[0])
        and tuple(specs) == req
        and getattr(func, "_pyobj_dispatcher", None) is None
        and rule is not _FALLBACK  # the fallback counts every call in comm stats
    ):
        direct = outs[0]
        direct_size = list(outs[0].local_shape(me)) if sized else None
    inplace = direct is not None and is_inplace(func)
    return Decision(
        req,
        tuple(outs),
        tree,
        inside,
        empty_here,
        direct,
        direct_size,
        inplace,
        write_back,
        is_view(func),
        pads,
    )


def _one_strided_kind(combo: tuple) -> bool:
    """Does each output hold at most one kind of strided split (a signature means the
    layout of one unflattened tensor: `sbp.layout.unflattened`)?"""
    for k in range(len(combo[0].outputs)):
        kinds = {c.outputs[k] for c in combo if c.outputs[k].is_strided}
        if len(kinds) > 1:
            return False
    return True


def decision_for(
    rule: StrategyRule, func, args, kwargs, key, specs, grads, padded=False
) -> Decision:
    d = _cache.get(key)
    if d is None:
        d = _decide(rule, func, args, kwargs, specs, grads, padded)
        _cache[key] = d
        if len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)  # the least recently used (hits move to the end)
    return d


def run_strategy(
    rule: StrategyRule, func, flat: list, tree: tuple, key: tuple, gpos: list, padded=False
) -> Any:
    """Run `func` by its strategy rule: decide (cached), box the inputs that must move (a
    conversion kept from an earlier use of the same value is taken instead:
    `sbp.ops.converted`), run on the locals, wrap the outputs. While a trace or strict mode
    watches (`sbp.trace`), the collectives inside are noted as `func`'s."""
    if stats.watching():
        with stats.cause(str(func), implicit=True):
            return _run_strategy(rule, func, flat, tree, key, gpos, padded)
    return _run_strategy(rule, func, flat, tree, key, gpos, padded)


def _run_strategy(
    rule: StrategyRule, func, flat: list, tree: tuple, key: tuple, gpos: list, padded: bool
) -> Any:
    d = _cache.get(key)
    if d is None:
        args, kwargs = unflatten(flat, tree)
        try:
            specs = [flat[i]._spec for i in gpos]
            grads = [flat[i].requires_grad for i in gpos]
            d = decision_for(rule, func, args, kwargs, key, specs, grads, padded)
        except NoMeta:
            return run_data_dependent(func, flat, tree, gpos)
    checked = None if rule.check is None else rule.check(func, *unflatten(flat, tree))
    if observers:
        observers[-1].strategy(func, rule, [flat[i] for i in gpos], d, checked)
    inplace = is_inplace(func)
    inside = d.inside
    copied = False
    local_flat = list(flat)
    reuse = None  # (decided at the first input that moves)
    for i, req in zip(gpos, d.in_specs, strict=True):
        g = flat[i]
        if g._spec == req:
            local_flat[i] = g._local
            continue
        if reuse is None:  # kept conversions (sbp.ops.converted), not where one is written
            reuse = _reuses(func)
        local_flat[i] = converted.convert(g, req, box) if reuse else box(g._local, g._spec, req)
    if d.write_back:  # the op writes a copy (boxing may hand back a view of the input)
        local_flat[gpos[0]] = local_flat[gpos[0]].clone()
    elif inplace:
        _unshare_sources(local_flat)
    if inside:
        leaves = (
            None
            # (a rule's own local computation runs also on an empty shard: it may take
            # part in collectives)
            if inplace or d.empty_here is None or rule.local is not None
            else [  # (made afresh, not cloned: while tracing they must be fake tensors)
                None if t is None else torch.empty(t.shape, dtype=t.dtype, device=t.device)
                for t in d.empty_here
            ]
        )
        if leaves is None:
            largs, lkwargs = unflatten(local_flat, tree)
            if rule.local_args is not None:
                largs, lkwargs = rule.local_args(
                    func, largs, lkwargs, env.get_rank(), d.in_specs, d.out_specs
                )
            if rule.local is not None:
                out = rule.local(func, largs, lkwargs, d.in_specs)
            elif getattr(rule.local_args, "size_from_output", False):
                out, copied = local_view(func, largs, lkwargs)
            else:
                out = func(*largs, **lkwargs)
            leaves, _ = flatten_outputs(out, d.out_tree)
            if rule.post is not None:
                args, kwargs = unflatten(flat, tree)
                leaves = rule.post(func, args, kwargs, leaves, d.in_specs, d.out_specs)
    else:
        leaves = [None if s is None else empty_local(s) for s in d.out_specs]
    if inplace:
        self_ = flat[gpos[0]]
        if d.write_back:
            assign(self_, local_flat[gpos[0]], d.out_specs[0])
        return written(self_)  # (the op wrote into its local tensor: the layout is the input's)
    if not d.view:
        wrapped = _wrapped(GlobalTensor, leaves, d.out_specs)
        if d.pads:
            pricing.mark_padded(wrapped)
        return unflatten_outputs(wrapped, d.out_tree)
    with view_wrappers(flat[gpos[0]]):
        wrapped = _wrapped(GlobalTensor, leaves, d.out_specs)
    if d.pads:
        pricing.mark_padded(wrapped)
    args, kwargs = unflatten(flat, tree)
    mark_view(func, args, kwargs, wrapped, d.in_specs[0] != flat[gpos[0]]._spec, copied)
    return unflatten_outputs(wrapped, d.out_tree)


def run_data_dependent(func, flat: list, tree: Any, gpos: list[int]) -> Any:
    """An op whose output shape depends on the data: run it on broadcast inputs, every output
    broadcast, shapes taken from the result (one small exchange tells ranks outside)."""
    P = flat[gpos[0]]._spec.placement
    nd = (broadcast,) * P.ndim
    inside = env.get_rank() in P
    local = list(flat)
    for i in gpos:
        local[i] = rebox(flat[i], nd)._local
    if inside:
        args, kwargs = unflatten(local, tree)
        out = func(*args, **kwargs)
    else:
        out = None
    is_seq = isinstance(out, (list, tuple))
    leaves = list(out) if is_seq else [out]
    metas = [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else None for t in leaves]
    metas = outside_ranks_learn(P, metas, inside)
    if not inside:
        leaves = [None if m is None else empty_local(GlobalSpec(P, nd, m[0], m[1])) for m in metas]
        is_seq = len(leaves) != 1
    wrapped = [
        GlobalTensor(t, GlobalSpec(P, nd, m[0], m[1])) if m is not None else t
        for t, m in zip(leaves, metas, strict=True)
    ]
    if not is_seq:
        return wrapped[0]
    return type(out)(wrapped) if out is not None else tuple(wrapped)


def _unshare_sources(local: list) -> None:
    """An in-place op's other tensors that share the written local tensor's storage (other
    views of it: `y[1:].mul_(y[:-1])`) are copied first. torch's overlap check runs on each
    rank's local views, whose layouts differ by rank (a 1-row shard is contiguous, the
    others are not), so it raised on some ranks only and the others went on to wait for
    them; copied, the op reads the sources as they were before the write, on every rank."""
    dest = local[0]
    if not isinstance(dest, torch.Tensor) or len(local) < 2 or functional.tracing(dest):
        return  # (a traced graph is functional: nothing is written in place there)
    storage = _storage_of(dest)
    if storage is None:
        return
    for i in range(1, len(local)):
        t = local[i]
        if (
            isinstance(t, torch.Tensor)
            and t is not dest
            and t.numel()
            and _storage_of(t) == storage
        ):
            local[i] = t.clone()


def _storage_of(t: torch.Tensor) -> int | None:
    """Which storage `t` views (its StorageImpl: views share it; fake ones have one too)."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # (a functional tensor has none to show)
        return None


def rebox(g, nd_sbp) -> Any:
    """`g` converted to `nd_sbp` on its placement, outside autograd (for use inside rules)."""
    return rebox_to(g, g._spec._replace(nd_sbp=tuple(nd_sbp)))


def rebox_to(g, spec: GlobalSpec) -> Any:
    """`g` converted to `spec` (its own placement, shape and dtype), as `rebox`."""
    if spec == g._spec:
        return g
    return GlobalTensor(box(g._local, g._spec, spec), spec)


def without_partials(g, keep: bool = False) -> Any:
    """`g` with every partial hierarchy dim reduced to broadcast. With `keep`, the
    conversion is kept with `g` for later uses of the same value (`sbp.ops.converted`), as
    an op's boxed inputs are, but not while an observer watches."""
    spec = g._spec._replace(nd_sbp=partials_to_broadcast(g._spec.nd_sbp))
    if not keep or observers or spec == g._spec:
        return rebox_to(g, spec)
    return GlobalTensor(converted.convert(g, spec, box), spec)


def _empty_outputs(out_specs: list, rank: int) -> list | None:
    """Uneven splits leave some ranks empty shards, which some kernels reject; when every
    output of this rank is empty, there is nothing to compute."""

    shapes = [None if s is None else s.local_shape(rank) for s in out_specs]
    if any(sh is not None and 0 not in sh for sh in shapes) or all(sh is None for sh in shapes):
        return None
    device = local_device(out_specs[0].placement.type) if out_specs[0] else None
    return [
        None if s is None else torch.empty(sh, dtype=s.dtype, device=device)
        for s, sh in zip(out_specs, shapes, strict=True)
    ]


# ---------------------------------------------------------------- fallback


def _warn_fallback(func) -> None:
    """Ops with no rule run on broadcast inputs: warn once per op, count every call apart."""
    name = str(func)
    if name not in _warned:
        _warned.add(name)
        warnings.warn(f"sbp: no SBP rule for {name}; running it on broadcast inputs", stacklevel=4)
    stats.record_fallback(name)


def _all_broadcast(call: Call) -> list[Strategy]:
    n_out = sum(m is not None for m in call.out_meta)
    return [Strategy((broadcast,) * len(call.specs), (broadcast,) * n_out)]


_FALLBACK = StrategyRule(_all_broadcast)
