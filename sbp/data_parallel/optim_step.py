"""An optimizer over global parameters steps on their local tensors.

When a param group's parameters, gradients and state tensors are all broadcast, each
rank's local tensor is the whole logical tensor, so whatever update an optimizer computes
on the locals is the logical update, the same on every rank. For an optimizer whose
update reads each element alone (`ELEMENTWISE`: SGD, Adam, AdamW and the like), split
parameters (tensor-parallel weights) step on their locals too, where each one's gradient
and state are laid out as it is: each local update is the local part of the logical one.
Stepping on them skips what each list op on global tensors costs: torch's handling of
hundreds of subclass arguments plus sbp's list rule, ~0.3 ms per op for mobilenet_v2's
158 parameters on CPU, three ops per SGD step. And torch picks its kernels (foreach, fused) as it does for plain tensors.

An optimizer's first step runs on the global tensors, through the list rules
(`sbp.ops.optim`), and `install` (a global step pre-hook) gives the optimizer a `step`
and a `zero_grad` of its own. Every later step puts, for each group that qualifies, the
locals in `group["params"]` (their `.grad` the gradients' locals, or the plain
gradients the data-parallel fast path left waiting: `sbp.data_parallel.waiting`; on one
rank the locals are the fast path's leaves, which hold the gradients already) and, in
the optimizer's state, each local's state under it (its global tensors' locals; where
every entry is a swapped parameter's, the step sees a state of the locals alone, kept
from step to step); steps; and puts everything back, also when the step raises: state the step made or
replaced comes back global (0-dim numbers such as step counts stay plain, as torch makes
them), and gradients a step hook set or dropped on the locals become the parameters'. A
group with a tensor laid out otherwise (a split parameter of another optimizer, a
`no_sync` partial gradient), a differentiable group, a step given a closure (it runs
backward) and a step being traced run on the global tensors as before. Step hooks registered on the optimizer
see the locals. What a group's swap needs is kept from one step to the next
(`_GroupSwap`) while its parameters and state tensors stay the same objects.

(Formerly `sbp/optim_step.py`, which re-exports the names used from there.)
"""

from __future__ import annotations

import sys
import types
from collections import defaultdict
from itertools import chain, repeat
from operator import attrgetter, is_
from typing import Any

import torch

from sbp import env, optim_agreement
from sbp.counters import COUNTS
from sbp.data_parallel.waiting import claims, drop_waiting, local_grad, waiting_grads
from sbp.errors import PlacementError
from sbp.gradients import PLAIN_GETTERS, TORCH_GRAD, run_all
from sbp.ops.optim import _LOCAL, _ND_SBP, _PLACEMENT, _SPEC, _all_are
from sbp.ops.registry import note_optimizer_step
from sbp.signature import broadcast, normalize_nd_sbp
from sbp.tensor import GlobalTensor, watch

_GLOBAL_STEP = "_sbp_global_step"  # the optimizer's step before `install`
_CHOSE_FOREACH = "_sbp_chose_foreach"  # a group's foreach=None made True for the step
_GRAD = attrgetter("grad")
_KEPT = "_sbp_group_swaps"  # {id(param group): its _GroupSwap}
_LOCAL_STATE = "_sbp_local_state"  # (the _GroupSwaps, their locals' state, its _entries)
_ENTRIES = "_sbp_state_entries"  # (the state, its _entries after the last local step)
_NO_STATE: dict = {}  # (a parameter's state before its first step; never handed out)
_ZERO_GRAD = "_sbp_zero_grad"  # the optimizer's zero_grad before `install`
_REPLACED_SEEN = "_sbp_replaced_seen"  # `COUNTS.replaced` when `repoint` last looked
_STATE_SEEN = "_sbp_state_seen"  # the state dict last looked at for plain tensors


def prefer_foreach(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global step pre-hook: a param group of global tensors left to torch's choice
    (foreach=None) steps with foreach kernels, one list op per update instead of one op
    per tensor; put back after the step (`restore_foreach`), so state_dict keeps the
    user's choice.

    On CPU torch chooses per-tensor loops. On global tensors each op of those costs ~10 us
    of dispatch (474 ops per mobilenet_v2 SGD step); on their locals the list ops are
    still ~30% faster. They compute the same elementwise updates (ASGD's up to float32
    rounding: its foreach loop computes with its eta as a float32 tensor)."""
    for group in optimizer.param_groups:
        _prefer_foreach(group)


def restore_foreach(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global step post-hook: undo `prefer_foreach`."""
    for group in optimizer.param_groups:
        _restore_foreach(group)


def _prefer_foreach(group: dict) -> None:
    if (
        "foreach" in group
        and group["foreach"] is None
        and not group.get("fused")
        and not group.get("differentiable")
        # (torch's foreach step refuses a tensor lr unless capturable; its loop takes one)
        and not (isinstance(group.get("lr"), torch.Tensor) and not group.get("capturable"))
        and group["params"]
        and all(map(is_, map(type, group["params"]), repeat(GlobalTensor)))
        and _one_placement(group["params"])  # (a list op takes one: stages of a pipeline)
    ):
        group["foreach"] = True
        group[_CHOSE_FOREACH] = True


def _one_placement(params: list) -> bool:
    return _all_are(map(_PLACEMENT, map(_SPEC, params)), params[0]._spec.placement)


def _restore_foreach(group: dict) -> None:
    if group.pop(_CHOSE_FOREACH, False):
        group["foreach"] = None


def repoint(optimizer: torch.optim.Optimizer) -> None:
    """Point the optimizer's groups at the global parameters that `module.to_global` put in
    place of the plain ones it holds (an optimizer made before `to_global` would step the
    plain ones, which nothing uses any more: the model would silently not train). Looked
    for only when parameters were replaced since the last look. State kept for a replaced
    parameter (steps taken before `to_global`) cannot follow it: `PlacementError`."""
    if (
        torch.compiler.is_compiling()
        or optimizer.__dict__.get(_REPLACED_SEEN, 0) == COUNTS.replaced
    ):
        return  # (a compiled step: its eager pre-hook run pointed the groups already)
    for group in optimizer.param_groups:
        params = group["params"]
        for i, p in enumerate(params):
            new = p.__dict__.get("_sbp_replaced_by")
            while new is not None and "_sbp_replaced_by" in new.__dict__:
                new = new.__dict__["_sbp_replaced_by"]
            if new is None:
                continue
            if optimizer.state.get(p):
                raise PlacementError(
                    f"{type(optimizer).__name__} holds state for a parameter that "
                    "module.to_global has since replaced by a global one; make the "
                    "optimizer (or load its state) after to_global"
                )
            params[i] = new
    optimizer.__dict__[_REPLACED_SEEN] = COUNTS.replaced


def install(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global step pre-hook: an optimizer with global parameters steps on locals from its
    next step (this one creates the state).

    The new `step` is a method of the instance that calls the one found there (torch's,
    or an LR scheduler's wrapper of it, whose mark it carries), so schedulers made before
    or after still see the optimizer step."""
    repoint(optimizer)
    # (one look per group: a group qualifies only if all its params are global, and this
    # runs before every step of every optimizer, plain torch ones too)
    if not any(
        g["params"] and type(g["params"][0]) is GlobalTensor for g in optimizer.param_groups
    ):
        return
    note_optimizer_step(id(optimizer), sys._getframe(1))  # (torch's frame running the step)
    if optimizer.__dict__.get(_STATE_SEEN) is not optimizer.state:  # (load_state_dict: anew)
        _plain_state_made_global(optimizer)
        optimizer.__dict__[_STATE_SEEN] = optimizer.state
    if _GLOBAL_STEP in optimizer.__dict__:
        return  # (its `_step` compared the settings before putting the locals in)
    optim_agreement.check(optimizer)
    global_step = optimizer.step

    def step(self, *args: Any, **kwargs: Any) -> Any:
        return _step(self, *args, **kwargs)

    if hasattr(global_step, "_wrapped_by_lr_sched"):  # (it says the optimizer stepped)
        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.__dict__[_GLOBAL_STEP] = global_step
    optimizer.step = types.MethodType(step, optimizer)
    optimizer.__dict__[_ZERO_GRAD] = optimizer.zero_grad
    optimizer.zero_grad = types.MethodType(_zero_grad, optimizer)


@torch.no_grad()
def _plain_state_made_global(optimizer: torch.optim.Optimizer) -> None:
    """A plain state tensor of a global parameter's shape is its logical value, laid out
    as the parameter: as `model.load_state_dict` takes plain tensors, so an optimizer
    loads the `state_dict` of a one-process optimizer (torch's load moves each tensor to
    its parameter's device only, leaving it plain). 0-dim numbers (step counts) stay
    plain, as torch makes them."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state.get(p)
            if type(p) is not GlobalTensor or not st:
                continue
            for key, value in st.items():
                if type(value) is torch.Tensor and value.dim() and value.shape == p.shape:
                    st[key] = torch.zeros_like(p, dtype=value.dtype).copy_(value)


def _zero_grad(optimizer: torch.optim.Optimizer, set_to_none: bool = True) -> None:
    """zero_grad that drops waiting gradients as they are, plain: reading them,
    as torch's zero_grad does, would wrap each in a global tensor only to drop it."""
    if set_to_none:
        cleared = [drop_waiting(g["params"]) for g in optimizer.param_groups]
        if all(cleared):
            return  # (the usual step: every gradient was waiting)
    optimizer.__dict__[_ZERO_GRAD](set_to_none)


def _step(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
    global_step = optimizer.__dict__[_GLOBAL_STEP]
    optim_agreement.check(optimizer)
    if args or kwargs.get("closure") is not None or torch.compiler.is_compiling():
        return global_step(*args, **kwargs)
    swap = _Swap.make(optimizer)
    if swap is None:
        return global_step(*args, **kwargs)
    try:
        return global_step(*args, **kwargs)
    finally:
        swap.undo()


class _Swap:
    """The locals put in an optimizer's qualifying groups and state for one step."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        groups: list,
        state: dict,
        local_state: dict | None,
        same_entries: bool,
    ):
        self.optimizer = optimizer
        self.same_entries = same_entries  # the state's entries as after the last step
        # [(the group's _GroupSwap, its params list as found, each local's .grad for the
        # step, whether the swap put it there: not where the locals are leaves holding it)]
        self.groups = groups
        # the optimizer's state, and the locals' state it holds for the step (None: the
        # locals' entries were added to the optimizer's own state)
        self.state, self.local_state = state, local_state

    @staticmethod
    def make(optimizer: torch.optim.Optimizer) -> _Swap | None:
        state = optimizer.state
        kept = optimizer.__dict__.setdefault(_KEPT, {})
        same_entries = _same_entries(optimizer, state)
        groups = []
        for g in optimizer.param_groups:
            swap = kept.get(id(g))
            if swap is None or not swap.fits(g, state, same_entries):
                swap = kept[id(g)] = _GroupSwap.of(g, state, type(optimizer) in ELEMENTWISE)
            given = None if swap is None else swap.grads()
            if given is not None:
                groups.append((swap, g["params"], *given))
        if not groups:
            return None
        try:
            for swap, _, given, put in groups:
                if put:
                    run_all(map(TORCH_GRAD.__set__, swap.locals_, given))
        except RuntimeError:  # a gradient torch refuses for its parameter (dtype, shape)
            for swap, _, _, put in groups:
                if put:
                    run_all(map(TORCH_GRAD.__set__, swap.locals_, repeat(None)))
            return None
        local_state = None
        if len(state) == sum(len(swap.inserts) for swap, *_ in groups):
            # Every state entry is a swapped parameter's: the step sees a state of the
            # locals only, one kept from step to step (no per-step re-keying)
            local_state = _local_state(optimizer, [swap for swap, *_ in groups])
            optimizer.state = local_state
        for swap, *_ in groups:
            if local_state is None:
                # The state of a local is kept under it in the optimizer's own state for
                # the step, so whatever else the step does to the state stays.
                state.update(swap.inserts)
            _prefer_foreach(swap.group)  # (while its params are global)
            swap.group["params"] = list(swap.locals_)
        return _Swap(optimizer, groups, state, local_state, same_entries)

    def undo(self) -> None:
        state, local_state = self.state, self.local_state
        kept = self.optimizer.__dict__[_KEPT]
        entries = self.optimizer.__dict__.pop(_ENTRIES, None)
        unchanged = True
        intact = False
        if local_state is not None:
            self.optimizer.state = state
            intact = _intact(self.optimizer, local_state)
            expected = sum(len(swap.inserts) for swap, *_ in self.groups)
            if len(local_state) != expected:  # (entries the step added: kept below)
                self.optimizer.__dict__.pop(_LOCAL_STATE, None)
                _keep_others(local_state, self.groups, state)
        for swap, params, given, put in self.groups:
            g = swap.group
            g["params"] = params
            _restore_foreach(g)  # (the post-hook did, unless the step raised)
            if put:  # (else the locals are leaves: their gradients are the parameters')
                now = list(map(_GRAD, swap.locals_))
                if not all(map(is_, now, given)):  # (a step hook set or dropped gradients)
                    _grads_back(swap.params, now, given)
                run_all(map(TORCH_GRAD.__set__, swap.locals_, repeat(None)))
            if intact:
                stepped = swap.local_sts
            elif local_state is None:
                stepped = list(map(state.pop, swap.locals_, repeat(None)))
            else:
                stepped = list(map(local_state.get, swap.locals_))
            if not swap.unchanged(stepped):
                unchanged = False
                kept.pop(id(g), None)
                self.optimizer.__dict__.pop(_LOCAL_STATE, None)
                swap.put_back(stepped, state)
        if unchanged and self.same_entries:
            self.optimizer.__dict__[_ENTRIES] = entries  # (the state's entries stayed)
        elif unchanged:
            self.optimizer.__dict__[_ENTRIES] = (state, _entries(state))


def _same_entries(optimizer: torch.optim.Optimizer, state: dict) -> bool:
    """Does `state` hold the same keys and values (the same objects) as after the last step
    on locals? The group swaps then need not look each parameter's state up again (in C
    loops, without hashing: each lookup of a tensor calls torch's `__hash__` in Python)."""
    kept = optimizer.__dict__.get(_ENTRIES)
    return kept is not None and kept[0] is state and _same_as(state, kept[1])


def _entries(d: dict) -> tuple[list, list]:
    """`d`'s keys and values, to tell later whether it still maps the same keys to the same
    objects (`_same_as`)."""
    return list(d), list(d.values())


def _same_as(d: dict, entries: tuple[list, list]) -> bool:
    """Does `d` map the same keys to the same objects as when `entries` were taken? (C
    loops over the dict's own order, without hashing a key.)"""
    keys, values = entries
    return len(d) == len(keys) and all(map(is_, d, keys)) and all(map(is_, d.values(), values))


def _local_state(optimizer: torch.optim.Optimizer, swaps: list) -> defaultdict:
    """The optimizer's state for a step on the locals of `swaps`: each local's state under
    it, kept while the group swaps are the same (a step that changes it drops it)."""
    kept = optimizer.__dict__.get(_LOCAL_STATE)
    if kept is not None and len(kept[0]) == len(swaps) and all(map(is_, kept[0], swaps)):
        return kept[1]
    local_state: defaultdict = defaultdict(dict)
    for swap in swaps:
        local_state.update(swap.inserts)
    optimizer.__dict__[_LOCAL_STATE] = (swaps, local_state, _entries(local_state))
    return local_state


def _intact(optimizer: torch.optim.Optimizer, local_state: dict) -> bool:
    """Does the locals' state still map the same keys to the same dicts after the step (it
    updated them in place, the usual)? Then each local's state is the one given to it."""
    kept = optimizer.__dict__.get(_LOCAL_STATE)
    return kept is not None and kept[1] is local_state and _same_as(local_state, kept[2])


def _keep_others(local_state: dict, groups: list, state: dict) -> None:
    """Entries a step put in the locals' state under other keys go to the optimizer's."""
    ours = {id(t) for swap, *_ in groups for t in swap.locals_}
    for k, v in local_state.items():
        if id(k) not in ours:
            state[k] = v


class _GroupSwap:
    """A qualifying param group's locals and their state, made once and kept from step to
    step: a later step checks, in C loops, that the group holds the same parameters with
    the same specs and locals, and the state the same tensors, and reuses the rest. Making
    it anew costs ~5 us per parameter, mostly dictionaries of locals for the state."""

    def __init__(self, group: dict, sts: list[dict], whole: tuple, layouts: list | None = None):
        params = group["params"]
        watch(params)
        watch(chain.from_iterable(map(dict.values, sts)))
        self.rebinds = COUNTS.rebinds  # (`COUNTS.rebinds` when all below was last found so)
        self.group, self.params, self.whole = group, list(params), whole
        self.layouts = layouts  # each parameter's nd_sbp where not all are whole
        self.specs = list(map(_SPEC, params))
        self.bases = list(map(_LOCAL, params))
        # Where every gradient waits in a leaf of one one-rank reducer (the data-parallel
        # fast path's, sharing storage with the parameter's local), the step runs on those
        # leaves and finds the gradients there: `held` their claims (else None each)
        self.claims = claims(params)
        reducer = self.claims[0][0] if self.claims[0] is not None else None
        self.held = reducer is not None and (
            reducer.exclusive
            and reducer.holds_all(self.claims)
            and all(map(is_, self.bases, reducer.bases))
        )
        self.mixed = not self.held and any(c is not None for c in self.claims)
        self.locals_ = [leaf for _, leaf in self.claims] if self.held else self.bases
        self.sts = sts
        self.keys = list(chain.from_iterable(sts))
        self.values = list(chain.from_iterable(map(dict.values, sts)))
        self.value_locals = list(map(getattr, self.values, repeat("_local"), self.values))
        self.value_specs = list(map(getattr, self.values, repeat("_spec"), repeat(None)))
        # the state a step on a local sees: its tensors' locals (None: no state yet)
        self.local_sts = [
            None
            if st is _NO_STATE
            else {k: v._local if type(v) is GlobalTensor else v for k, v in st.items()}
            for st in sts
        ]
        self.inserts = [
            (local, st)
            for local, st in zip(self.locals_, self.local_sts, strict=True)
            if st is not None
        ]
        self.local_keys = list(chain.from_iterable(filter(None, self.local_sts)))
        self.local_values = list(
            chain.from_iterable(map(dict.values, filter(None, self.local_sts)))
        )

    @staticmethod
    def of(group: dict, state: dict, elementwise: bool = False) -> _GroupSwap | None:
        """The group's swap when every parameter and state tensor of the group is broadcast
        global on one placement that holds this rank (so each local is the whole tensor),
        or, for an optimizer whose update is elementwise (`ELEMENTWISE`), when each
        parameter's state tensors are laid out as it is, split or broadcast (each local
        update is then the local part of the logical one: tensor-parallel weights);
        else None. A differentiable group stays global (its update is part of an autograd
        graph of the global tensors)."""
        params = group["params"]
        if not params or group.get("differentiable") or type(params[0]) is not GlobalTensor:
            return None
        placement = params[0]._spec.placement
        whole = normalize_nd_sbp((broadcast,) * placement.ndim, placement.ndim)  # (interned)
        if env.get_rank() not in placement:
            return None
        layouts = None
        if not _all_whole(params, whole, placement):
            if not (elementwise and _no_partials(params, placement)):
                return None
            layouts = list(map(_ND_SBP, map(_SPEC, params)))
        sts = list(map(state.get, params, repeat(_NO_STATE)))
        if layouts is not None:
            alike = all(map(_state_laid_out_as, params, sts))
            return _GroupSwap(group, sts, whole, layouts) if alike else None
        held = [
            v
            for v in chain.from_iterable(map(dict.values, sts))
            if isinstance(v, torch.Tensor) and type(v) is not torch.Tensor
        ]  # (plain tensors in the state are numbers such as step counts)
        return _GroupSwap(group, sts, whole) if _all_whole(held, whole, placement) else None

    def fits(self, group: dict, state: dict, same_entries: bool = False) -> bool:
        """Still this group, its parameters, their specs, locals and state tensors?
        (`same_entries`: the state maps every key to the same dict as after the last step.)"""
        params = group["params"]
        rebinds = COUNTS.rebinds
        rebound = rebinds != self.rebinds  # (else the same tensors hold what they held)
        if not (
            group is self.group
            and not group.get("differentiable")
            and len(params) == len(self.params)
            and all(map(is_, params, self.params))
            and not (rebound and not self._same_tensors(params))
            and (not self.held or self.claims[0][0].exclusive)
        ):
            return False
        sts = self.sts
        if not same_entries and not all(map(is_, map(state.get, params, repeat(_NO_STATE)), sts)):
            return False
        values = list(chain.from_iterable(map(dict.values, sts)))
        if not (
            len(values) == len(self.values)
            and all(map(is_, values, self.values))
            and all(map(is_, chain.from_iterable(sts), self.keys))
            and not (rebound and not self._same_values(values))
        ):
            return False
        self.rebinds = rebinds
        return True

    def _same_tensors(self, params: list) -> bool:
        """The parameters hold the same specs and locals, and the same reducers' claims?"""
        return (
            all(map(is_, map(_SPEC, params), self.specs))
            and all(map(is_, map(_LOCAL, params), self.bases))
            and all(map(is_, claims(params), self.claims))
        )

    def _same_values(self, values: list) -> bool:
        """The state's tensors hold the same locals and specs (plain values: themselves)?"""
        return all(
            map(is_, map(getattr, values, repeat("_local"), values), self.value_locals)
        ) and all(map(is_, map(getattr, values, repeat("_spec"), repeat(None)), self.value_specs))

    def grads(self) -> tuple[list | None, bool] | None:
        """The local of each parameter's gradient, and whether it must be put on the
        locals; None unless all are whole. Where the locals are leaves holding them
        already, None and False: a step that sets or drops a leaf's gradient then sets or
        drops its parameter's, with nothing to copy back."""
        with PLAIN_GETTERS():
            raw = list(map(TORCH_GRAD.__get__, self.params))
        if all(map(is_, raw, repeat(None))) and not self.mixed:  # (the usual: all waiting)
            if not self.held:
                return waiting_grads(self.params), True
            if all(map(is_, waiting_grads(self.params), repeat(None))):
                return None, False
        placement = self.specs[0].placement
        if self.layouts is not None:
            if not all(map(_laid_out, raw, self.layouts, repeat(placement))):
                return None
        elif not _all_whole([g for g in raw if g is not None], self.whole, placement):
            return None
        return list(map(local_grad, self.params)), True

    def unchanged(self, stepped: list) -> bool:
        """Did the step update the state only in place (the usual step)?"""
        if not all(map(is_, stepped, self.local_sts)):
            return False
        dicts = list(filter(None, stepped))
        values = list(chain.from_iterable(map(dict.values, dicts)))
        return (
            len(values) == len(self.local_values)
            and all(map(is_, values, self.local_values))
            and all(map(is_, chain.from_iterable(dicts), self.local_keys))
        )

    def put_back(self, stepped: list, state: dict) -> None:
        """Write what the step changed in the locals' state into the global state."""
        for p, st, new in zip(self.params, self.sts, stepped, strict=True):
            if new is None:
                continue
            if st is _NO_STATE:
                st = state[p]
            elif len(new) == len(st) and all(map(_is_local_of, new.values(), st.values())):
                continue  # (updated in place)
            _put_back(p, new, st)


def _is_local_of(v: Any, old: Any) -> bool:
    return v is old or (type(old) is GlobalTensor and old._local is v)


def _grads_back(params: list, now: list, given: list) -> None:
    """Gradients a step hook changed on the locals, made the parameters' gradients."""
    for p, grad, before in zip(params, now, given, strict=True):
        if grad is before:
            continue
        p.grad = None if grad is None else _whole_like(p, grad)


def _put_back(p: GlobalTensor, stepped: dict, st: dict) -> None:
    """Write a parameter's state after a local step into its global state: a local of a
    global tensor it had stays that tensor (updated in place); a new tensor in place of a
    global one, or a new tensor that is not a number (0-dim, as torch's step counts),
    becomes global."""
    for k, v in stepped.items():
        old = st.get(k)
        if _is_local_of(v, old):
            continue
        if type(v) is torch.Tensor and (
            type(old) is GlobalTensor or (old is None and v.dim() > 0 and v.device == p.device)
        ):
            v = _whole_like(p, v)
        st[k] = v
    for k in [k for k in st if k not in stepped]:
        del st[k]


def _whole_like(p: GlobalTensor, local: torch.Tensor) -> GlobalTensor:
    """`local` as a global tensor laid out as `p`: broadcast, it is the whole tensor; a
    split parameter's new state (an elementwise optimizer's) is its local's shape."""
    if tuple(local.shape) == tuple(p._local.shape):
        return GlobalTensor(local, p._spec._replace(dtype=local.dtype))
    if any(not s.is_broadcast for s in p._spec.nd_sbp):
        raise PlacementError(
            f"an optimizer step made a state tensor of shape {tuple(local.shape)} for a "
            f"parameter laid out as {p._spec.nd_sbp} whose local is {tuple(p._local.shape)}"
        )
    return GlobalTensor(local, p._spec._replace(shape=tuple(local.shape), dtype=local.dtype))


# Optimizers whose update of each element reads that element alone (of the parameter, its
# gradient and its state) and numbers: stepped on the locals of split parameters too.
# Exact types: a subclass may compute otherwise (Adafactor's factored moments do not).
ELEMENTWISE = frozenset(
    {
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adagrad,
        torch.optim.Adadelta,
        torch.optim.Adamax,
        torch.optim.ASGD,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.RMSprop,
        torch.optim.Rprop,
    }
)


def _no_partials(params: list, placement) -> bool:
    """Every parameter global on `placement`, laid out by splits and broadcasts only."""
    return all(
        type(p) is GlobalTensor
        and p._spec.placement == placement
        and all(s.is_split or s.is_broadcast for s in p._spec.nd_sbp)
        for p in params
    )


def _state_laid_out_as(p: GlobalTensor, st: dict) -> bool:
    """Is each global tensor in `p`'s state laid out as `p` (same shape, placement and
    signature)? (Plain ones are numbers such as step counts.)"""
    spec = p._spec
    for v in st.values():
        if type(v) is GlobalTensor:
            s = v._spec
            if s.nd_sbp != spec.nd_sbp or s.placement != spec.placement or s.shape != spec.shape:
                return False
        elif isinstance(v, torch.Tensor) and type(v) is not torch.Tensor:
            return False  # (another tensor subclass)
    return True


def _laid_out(grad: Any, nd_sbp: tuple, placement) -> bool:
    """A gradient that is None, or global and laid out as its parameter."""
    return grad is None or (
        type(grad) is GlobalTensor
        and grad._spec.nd_sbp == nd_sbp
        and grad._spec.placement == placement
    )


def _all_whole(tensors: list, whole: tuple, placement) -> bool:
    """Every tensor global, with signature `whole`, on `placement` (C loops: an optimizer
    has hundreds of them, sharing their nd_sbp and placement objects)."""
    if not all(map(is_, map(type, tensors), repeat(GlobalTensor))):
        return False
    specs = list(map(_SPEC, tensors))
    return _all_are(map(_ND_SBP, specs), whole) and _all_are(map(_PLACEMENT, specs), placement)
