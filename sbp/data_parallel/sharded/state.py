"""Sharded data parallelism's runtime for one module (`Sharding`): each unit's parameters
gathered before its forward (the next unit's gather already in flight), freed after it
(ZeRO-3) and gathered again in backward (the previous unit's in flight), or kept for
backward (ZeRO-2); their gradients reduce-scattered per unit as backward finishes with
it, in one order on every rank, landing in each parameter's `.grad` as its shard.

The data-parallel call pipeline (`sbp.data_parallel.call`) decides when a module runs on
local tensors; this module gives it the parameters those runs need:
- `checking()`: the checking pass sees each unit's parameters as broadcast global tensors
  while the unit runs, the sharded ones elsewhere (a use outside its unit moves them, so
  the check fails and the module runs op by op);
- `running()`: the local run sees each unit's parameters as the gathered whole tensors
  (outputs of `_Gathered`, whose backward hands their gradients back) while it runs,
  the root unit's for the whole call.
"""

from __future__ import annotations

import contextlib
import operator
from collections import deque
from collections.abc import Iterator

import torch

from sbp import comm, env, gradients
from sbp.comm import stats
from sbp.data_parallel.sharded.flat import FlatUnit
from sbp.data_parallel.sharded.units import Unit, units_of
from sbp.errors import InputValueError
from sbp.layout import GlobalSpec
from sbp.signature import broadcast, splits_to_partials
from sbp.tensor import GlobalTensor

_LOCAL = operator.attrgetter("_local")
GATHER = "sharded parameters"  # what sbp.comm_stats() names the gathers and reductions
_PLAIN = torch._C.DisableTorchFunction  # (sbp's own copies and collectives, not the module's ops)
PREFETCH = 2  # units whose gather is in flight while one computes (forward)
IN_FLIGHT = 1  # gradient reductions in flight at once, per stage


class _Token:
    """A saved tensor that is a view of a freed unit's gathered parameters (ZeRO-3)."""

    __slots__ = ("unit", "size", "stride", "offset")

    def __init__(self, unit: _UnitState, t: torch.Tensor):
        self.unit, self.size, self.stride, self.offset = (
            unit,
            t.size(),
            t.stride(),
            t.storage_offset(),
        )


class _UnitState:
    """One unit at run time: its flat layout, where its parameters sit in the module's
    tables, its gathered buffer (while alive), the gather in flight, and its gradient
    being collected."""

    def __init__(self, unit: Unit, flat: FlatUnit, places: list[list[tuple[dict, str]]]):
        self.unit, self.flat, self.places = unit, flat, places
        self.name = unit.name or "<root>"
        self.whole: torch.Tensor | None = None
        self.pending: comm.Pending | None = None  # its all-gather in flight
        self.leaves: list[torch.Tensor] = []
        self.grad: torch.Tensor | None = None  # (members, shard_len), collected
        # applications of `_Gathered` in forwards since the last backward's end, and how
        # many of them backward reached; parameters whose gradient a backward asked for
        self.applied = self.arrived = 0
        self.wanted: set[int] = set()
        self.alive = False  # its whole parameters held, by sbp or autograd (`_alive`)
        # this rank's flat shard, the all-gather's input: the parameters' local tensors are
        # views of it (`Sharding._adopt`), as FSDP2's sharded parameters are
        self.shard: torch.Tensor | None = None
        self.shard_views: list[torch.Tensor] = []
        self.packed = False  # backward will gather it again (a saved view was packed)
        self.at_once = False  # its gather completes when started (shared memory): no prefetch


class _Gathered(torch.autograd.Function):
    """A unit's whole parameters, from its shard leaves; backward hands their gradients to
    the unit (`Sharding._backward`), the leaves get none (their gradient is the unit's
    reduce-scattered one, set on the parameters)."""

    @staticmethod
    def forward(ctx, sharding: Sharding, state: _UnitState, *leaves: torch.Tensor):
        ctx.sharding, ctx.state, ctx.n = sharding, state, len(leaves)
        ctx.set_materialize_grads(False)
        return tuple(state.flat.views(state.whole))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        # (the leaves whose accumulation this backward runs: all of them, or the parameters
        # named by `backward(inputs=...)`)
        leaves = ctx.next_functions[len(ctx.next_functions) - ctx.n :]
        wanted = [
            i
            for i, (node, _) in enumerate(leaves)
            if node is not None and torch._C._will_engine_execute_node(node)
        ]
        ctx.sharding._backward(ctx.state, grads, wanted)
        return (None, None, *([None] * ctx.n))


class Sharding:
    """The sharded parameters of one module: units, their gathers and gradient reductions.

    `params`: the module's sharded parameters (global tensors split along dim 0 on
    hierarchy dim `shard_dim`), in module order; `slots`: the module's `_Slots` (where each
    global tensor sits, and the local leaves); `names`: the units the user named, or None
    (`units.chosen`); `reshard`: free each unit's gathered parameters after its forward
    (ZeRO-3) or keep them for backward (ZeRO-2)."""

    def __init__(
        self,
        module: torch.nn.Module,
        params: list,
        slots,
        placement,
        shard_dim: int,
        names: list[str] | None,
        reshard: bool,
    ):
        self.placement, self.shard_dim, self.reshard = placement, shard_dim, reshard
        self.slots = slots
        me = env.get_rank()
        self.ranks = placement.ranks_varying(me, {shard_dim})
        where: dict[int, list[int]] = {}
        for i, t in enumerate(slots.tensors):
            where.setdefault(id(t), []).append(i)
        self.units: list[_UnitState] = []
        for unit in units_of(module, params, names):
            if not unit.params:
                continue
            dtypes = {p.dtype for p in unit.params}
            if len(dtypes) > 1:
                raise InputValueError(
                    f"sbp sharded data parallelism: unit {unit.name or '<root>'!r} holds "
                    f"parameters of dtypes {sorted(map(str, dtypes))}; one unit gathers one "
                    "dtype (name smaller units: sbp.nn.data_parallel(model, units=[...]))"
                )
            flat = FlatUnit(unit.params, placement, self.ranks, self.ranks.index(me))
            places = [
                [(slots.tables[i], slots.names[i]) for i in where[id(p)]] for p in unit.params
            ]
            self.units.append(_UnitState(unit, flat, places))
        self.root = next((u for u in self.units if u.unit.module is None), None)
        self.by_module = {id(u.unit.module): u for u in self.units if u.unit.module is not None}
        self.order = [u for u in self.units if u.unit.module is not None]  # forward order
        self.mode: str | None = None  # "check", "run" or None (hooks do nothing)
        self.sync = True
        self.trace: list | None = None  # set to a list to record events (tests)
        self._seen: list[_UnitState] = []  # this run's units in their forward order
        self._storages: dict[int, _UnitState] = {}  # gathered buffers packed as tokens
        self._queued = False
        self._launch_order: list[_UnitState] = []
        self._next = 0
        self.replicas: tuple[int, ...] = ()  # ranks holding the same shards (hybrid)
        self.partial_nd: tuple = ()  # a gradient not reduced yet (no_sync)
        self._scattering: deque = deque()  # (unit, Pending reduce-scatter), in launch order
        self._summing: deque = deque()  # (unit, Pending all-reduce over the replicas)
        self.gathered_now = self.gathered_peak = 0  # bytes of whole parameters alive
        self._hooks = [
            h
            for u in self.order
            for h in (
                u.unit.module.register_forward_pre_hook(self._pre_hook),
                u.unit.module.register_forward_hook(self._post_hook, always_call=True),
            )
        ]

    def remove(self) -> None:
        """Take the units' hooks off their modules (the module's slots changed)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def params(self) -> list:
        return [p for u in self.units for p in u.unit.params]

    # ------------------------------------------------------------ gathers
    def _event(self, what: str, u: _UnitState) -> None:
        if self.trace is not None:
            self.trace.append((what, u.name))

    def _prefetch(self, u: _UnitState | None, phase: str) -> None:
        """Start `u`'s gather ahead of its use, where it travels while others compute: not
        where it runs at once (shared memory on one host), which would only hold it longer.
        (`u.at_once` is the same on every rank: the same sizes, the same segment.)"""
        if u is not None and not u.at_once:
            self._start_gather(u, phase)

    def _start_gather(self, u: _UnitState, phase: str) -> None:
        """Start all-gathering `u`'s flat shards (nothing if whole or in flight)."""
        if u.whole is not None or u.pending is not None:
            return
        with _PLAIN():  # (not ops of the module: no check or local mode judges them)
            self._gather(u, phase)

    def _adopt(self, u: _UnitState) -> None:
        """Make `u`'s parameters' local tensors views of one flat shard (their values copied
        in), unless they are already: the optimizer then updates the all-gather's input in
        place, and no gather copies it in. A parameter rebound since (`p.data = ...`) is
        adopted again at the next gather."""
        params = u.unit.params
        if u.shard is not None and all(map(operator.is_, map(_LOCAL, params), u.shard_views)):
            return
        with _PLAIN():
            u.shard = u.flat.copy_in([p._local for p in params])
            u.shard_views = u.flat.shard_views(u.shard)
        for p, view in zip(params, u.shard_views, strict=True):
            p._local = view  # (a counted rebinding: the slots make their leaves again)

    def _gather(self, u: _UnitState, phase: str) -> None:
        flat = u.flat
        self._adopt(u)
        mine = u.shard
        out = mine.new_empty(len(self.ranks), flat.shard_len)
        self._event("gather", u)
        with stats.noted(GATHER, implicit=False, phase=phase):
            u.pending = comm.all_gather_async(out, mine, self.ranks)
        u.at_once = u.pending.work is None

    def _whole(self, u: _UnitState, phase: str) -> torch.Tensor:
        """`u`'s gathered parameters (one buffer), waiting for its gather (or running it)."""
        if u.whole is None:
            self._start_gather(u, phase)
            pending, u.pending = u.pending, None
            gathered = pending.wait()
            with _PLAIN():
                u.whole, _ = u.flat.copy_out(gathered)
            self._event("gathered", u)
            self._alive(u, True)
        return u.whole

    def _drop(self, u: _UnitState, kept: bool = False) -> None:
        """sbp lets go of `u`'s whole parameters; `kept`: autograd still holds them (saved
        for backward, ZeRO-2), until `u`'s backward."""
        u.whole = None
        self._alive(u, kept)

    def _alive(self, u: _UnitState, alive: bool) -> None:
        """Count `u`'s whole parameters as held (by sbp, or by autograd for backward) or
        not: `gathered_now` and its peak, for `memory_report`."""
        if u.alive != alive:
            u.alive = alive
            self.gathered_now += u.flat.gathered_bytes if alive else -u.flat.gathered_bytes
            self.gathered_peak = max(self.gathered_peak, self.gathered_now)

    def _settle_pending(self) -> None:
        """Wait for gathers prefetched but never used (every rank issued them alike)."""
        for u in self.units:
            if u.pending is not None:
                u.pending.wait()
                u.pending = None

    def _after(self, u: _UnitState, order: list[_UnitState], step: int) -> _UnitState | None:
        try:
            i = order.index(u) + step
        except ValueError:
            return None
        return order[i] if 0 <= i < len(order) else None

    # ------------------------------------------------------------ checking pass
    @contextlib.contextmanager
    def checking(self) -> Iterator[None]:
        """For the checking pass: each unit's parameters broadcast while it runs."""
        self.mode = "check"
        try:
            if self.root is not None:
                self._put(self.root, self._broadcast_views(self.root))
            yield
        finally:
            self.mode = None
            for u in self.units:
                self._put(u, u.unit.params)
                self._drop(u)
            self._settle_pending()

    def _broadcast_views(self, u: _UnitState) -> list[GlobalTensor]:
        views = u.flat.views(self._whole(u, "forward"))
        return [
            GlobalTensor(v, _broadcast_spec(p._spec))
            for v, p in zip(views, u.unit.params, strict=True)
        ]

    def _put(self, u: _UnitState, tensors: list) -> None:
        for places, t in zip(u.places, tensors, strict=True):
            for table, name in places:
                table[name] = t

    # ------------------------------------------------------------ local runs
    @contextlib.contextmanager
    def running(self, data_nd: tuple) -> Iterator[None]:
        """For a local run (inside the slots' swap): the root unit's whole parameters for
        the call, the others' while each runs; saved views of freed ones packed (ZeRO-3)."""
        self.mode = "run"
        self.replicas = self.placement.ranks_varying(
            env.get_rank(), {h for h, s in enumerate(data_nd) if s.is_split and h != self.shard_dim}
        )
        self.partial_nd = splits_to_partials(data_nd)
        self._seen = []
        expected = self.order
        self._settle_pending()  # (a backward prefetch no backward used: stale by now)
        for u in self.units:
            self._drop(u)  # (a run that raised, a frozen unit's backward: let them go)
            u.leaves = [self.slots.leaf(p) for p in u.unit.params]
        saved = (
            torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            if self.reshard and torch.is_grad_enabled()
            else contextlib.nullcontext()
        )
        try:
            if self.root is not None:
                self._put(self.root, self._enter(self.root))
            if expected:
                self._prefetch(expected[0], "forward")
            with saved:
                yield
            # the first unit backward gathers again, started while the loss is computed
            first = next((u for u in reversed(self._seen) if u.packed), None)
            if first is not None:
                self._settle_pending()
                self._prefetch(first, "backward")
        finally:
            self.mode = None
            if self._seen:
                self.order = self._seen + [u for u in self.order if u not in self._seen]
            if self.root is not None:  # (autograd keeps what backward needs)
                self._drop(self.root, kept=_outstanding(self.root) > 0)
            self._storages.clear()

    def _enter(self, u: _UnitState) -> list[torch.Tensor]:
        """`u`'s whole parameters for a local run, in autograd where they are trained."""
        self._whole(u, "forward")
        if torch.is_grad_enabled() and any(leaf.requires_grad for leaf in u.leaves):
            u.applied += 1
            return list(_Gathered.apply(self, u, *u.leaves))
        return u.flat.views(u.whole)

    def _pre_hook(self, module: torch.nn.Module, args) -> None:
        u = self.by_module.get(id(module))
        if u is None or self.mode is None:
            return
        if self.mode == "check":
            self._put(u, self._broadcast_views(u))
            return
        if u not in self._seen:
            self._seen.append(u)
            u.packed = False
        views = self._enter(u)
        self._put(u, views)
        for ahead in range(1, PREFETCH + 1):
            self._prefetch(self._after(u, self.order, ahead), "forward")
        if self.reshard:  # (ZeRO-3: every unit, the last too, as FSDP2 frees it)
            self._storages[u.whole.untyped_storage().data_ptr()] = u

    def _post_hook(self, module: torch.nn.Module, args, output) -> None:
        u = self.by_module.get(id(module))
        if u is None or self.mode is None:
            return
        if self.mode == "check":
            self._put(u, u.unit.params)
            self._drop(u)
            return
        self._put(u, u.leaves)
        packed = u.whole is not None and (
            self._storages.pop(u.whole.untyped_storage().data_ptr(), None) is not None
        )
        # ZeRO-3: saved views were packed; ZeRO-2: autograd keeps them
        self._drop(u, kept=torch.is_grad_enabled() and _outstanding(u) > 0 and not packed)
        self._event("freed", u)

    def _pack(self, t: torch.Tensor):
        if self._storages and t.layout == torch.strided:
            u = self._storages.get(t.untyped_storage().data_ptr())
            if u is not None:
                u.packed = True
                return _Token(u, t)
        return t

    def _unpack(self, saved):
        if type(saved) is not _Token:
            return saved
        u = saved.unit
        if torch.is_grad_enabled():  # (backward with create_graph=True)
            raise InputValueError(
                f"sbp sharded data parallelism: a double backward (create_graph=True) through "
                f"unit {u.name!r}, whose gathered parameters were freed after its forward: "
                "they would come back as constants; keep them instead with "
                "sbp.nn.data_parallel(model, reshard_after_forward=False)"
            )
        if u.whole is None:
            self._whole(u, "backward")
            previous = self._after(u, self.order, -1)
            if previous is not None and previous.packed and _outstanding(previous):
                self._prefetch(previous, "backward")
        return u.whole.as_strided(saved.size, saved.stride, saved.offset)

    # ------------------------------------------------------------ gradients
    def _backward(self, u: _UnitState, grads: tuple, wanted: list[int]) -> None:
        """A `_Gathered` of `u` reached in backward: collect its gradients; once the
        applications of the forwards since the last backward have all come, free the unit
        and reduce it (in order). Gradients of graphs kept from before (`retain_graph`)
        are reduced at the end of backward."""
        if not self._queued:
            self._queued = True
            self._launch_order = [u for u in reversed(self.order)]
            if self.root is not None:
                self._launch_order.append(self.root)
            self._next = 0
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        u.grad = u.flat.grads_in(list(grads), u.grad)
        u.wanted.update(wanted)
        u.arrived += 1
        self._event("grad", u)
        if _outstanding(u) == 0:
            self._drop(u)
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Launch, in the fixed order, the units whose gradients have all come; a unit no
        forward applied since the last backward (a kept graph's) waits for the end."""
        order = self._launch_order
        while self._next < len(order) and self.sync:
            u = order[self._next]
            if u.applied and _outstanding(u):
                return
            if u.applied:
                self._launch(u)
            self._next += 1

    def _launch(self, u: _UnitState) -> None:
        """Start reducing `u`'s gradients, with the partial sums `no_sync` left in `.grad`."""
        n = len(u.unit.params)
        for i, p in enumerate(u.unit.params):
            held = gradients.TORCH_GRAD.__get__(p)
            if held is not None and held._spec.nd_sbp == self.partial_nd:
                only = [held._local if j == i else None for j in range(n)]
                u.grad = u.flat.grads_in(only, u.grad)
                u.wanted.add(i)
                p.grad = None  # (the reduced sum replaces it)
        if u.grad is None:
            return
        grad, u.grad = u.grad, None
        wanted, u.wanted = u.wanted, set()
        out = grad.new_empty(u.flat.shard_len)
        self._event("reduce", u)
        self._complete(IN_FLIGHT - 1)  # (the older ones first: their buffers go)
        with stats.noted(GATHER, implicit=False, phase="backward"):
            pending = comm.reduce_scatter_async(out, grad, self.ranks)
        self._scattering.append((u, wanted, pending))

    def _complete(self, limit: int) -> None:
        """Finish reductions, oldest first, until at most `limit` are in flight per stage:
        the reduce-scatter, then (hybrid sharding) the all-reduce over the replicas. Each
        finished one sets its gradients and frees its buffers during backward."""
        while len(self._scattering) > limit:
            u, wanted, pending = self._scattering.popleft()
            out = pending.wait()
            if len(self.replicas) > 1:  # hybrid: the shard summed over the other replicas
                with stats.noted(GATHER, implicit=False, phase="backward"):
                    pending = comm.all_reduce_async(out, "sum", self.replicas)
                self._summing.append((u, wanted, pending))
            else:
                self._set_grads(u, wanted, out)
            self._complete_sums(limit)
        self._complete_sums(limit)

    def _complete_sums(self, limit: int) -> None:
        """`_complete`'s second stage: the all-reduces over the replicas."""
        while len(self._summing) > limit:
            u, wanted, pending = self._summing.popleft()
            self._set_grads(u, wanted, pending.wait())

    def _finish(self) -> None:
        """End of backward: launch what is left (in order), wait, and set the gradients;
        under `no_sync`, leave each gradient in `.grad` as this rank's partial sum."""
        try:
            for u in self._launch_order if self.sync else ():
                self._launch(u)  # (nothing where nothing waits: launched already)
            self._complete(0)
            if not self.sync:
                for u in self._launch_order:
                    self._keep_partial(u)
        finally:
            self._queued = False
            self._next = 0
            self._scattering.clear()
            self._summing.clear()
            for u in self.units:
                u.applied = u.arrived = 0
                self._drop(u)
            self._settle_pending()

    def _keep_partial(self, u: _UnitState) -> None:
        """`no_sync`: `u`'s gradients, unreduced, added to `.grad` as partial sums (whole
        tensors: this rank's share), reduced with the next synchronised backward's."""
        if u.grad is None:
            return
        _, views = u.flat.copy_out(u.grad)
        for i in sorted(u.wanted):
            p, g = u.unit.params[i], views[i]
            if not p.requires_grad:
                continue
            held = p.grad
            spec = p._spec._replace(nd_sbp=self.partial_nd)
            if held is None:
                p.grad = GlobalTensor(g, spec)
            elif held._spec.nd_sbp == self.partial_nd:
                held._local.add_(g)
            else:  # (a reduced gradient from before: its share, in place)
                p.grad = held.to_global(sbp=self.partial_nd) + GlobalTensor(g, spec)
        u.grad, u.wanted = None, set()

    def _set_grads(self, u: _UnitState, wanted: set[int], reduced: torch.Tensor) -> None:
        for i, (p, g) in enumerate(zip(u.unit.params, u.flat.shard_grads(reduced), strict=True)):
            if i not in wanted or not p.requires_grad:
                continue
            held = p.grad
            if held is None:
                p.grad = GlobalTensor(g, p._spec)
            elif held._spec == p._spec:
                held._local.add_(g)
            else:  # (another layout, set by the user or op by op: summed there)
                p.grad = held + GlobalTensor(g, p._spec)
        self._event("set", u)


def _outstanding(u: _UnitState) -> int:
    """Applications of `u`'s gather since the last backward whose gradients have not come."""
    return max(u.applied - u.arrived, 0)


def _broadcast_spec(spec: GlobalSpec) -> GlobalSpec:
    return spec._replace(nd_sbp=(broadcast,) * len(spec.nd_sbp))
