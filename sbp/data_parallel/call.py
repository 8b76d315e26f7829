"""The data-parallel call pipeline: `DataParallel.call`, one module's layouts, checks,
first-run verdict and local runs."""

from __future__ import annotations

import contextlib
import copy
import itertools
import warnings
from collections import OrderedDict
from typing import Any

import torch

from sbp import comm, env, gradients, local_constants, stand_ins
from sbp.comm import arrival
from sbp.counters import COUNTS
from sbp.data_parallel import (
    compiled_batch_norm,
    outputs,
    recomputation,
    row_wise_calls,
    shard_batch_norm,
    torch_compile,
)
from sbp.data_parallel.buffers import BufferBroadcast
from sbp.data_parallel.by_name import (
    BATCH_NORMS,
    SPECIAL_MODULES,
    _by_name_replaced,
    _forwards_replaced,
    _within,
)
from sbp.data_parallel.check import _called_by_name, _Check, _Depth, _WholeCalls
from sbp.data_parallel.inputs import _PLAIN_VALUES, Inputs, _numbers_blanked
from sbp.data_parallel.layout import Layout, _share_spec
from sbp.data_parallel.local_run import _local_forward, _LocalOps, _Run
from sbp.data_parallel.output_leaves import output_leaves
from sbp.data_parallel.reducer import Reducer
from sbp.data_parallel.sharded.state import Sharding
from sbp.data_parallel.slots import _EnterLocal, _Slots, _Undo
from sbp.errors import CommTimeoutError, IndexRangeError, LabelRangeError, MetaMismatchError
from sbp.layout import GlobalSpec
from sbp.ops import batch_norm, registry
from sbp.placement import placement as Placement
from sbp.signature import broadcast, split, splits_to_partials
from sbp.tensor import GlobalTensor, read_now

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


_NUMBERS = itertools.count()  # of DataParallel objects


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


def _shard_dim(nd: tuple) -> int | None:
    """The hierarchy dim along which a sharded parameter (`split(0)` there, broadcast on
    the others) is split, or None for any other layout."""
    dims = [h for h, s in enumerate(nd) if not s.is_broadcast]
    if len(dims) != 1 or not nd[dims[0]].is_split or nd[dims[0]].dim != 0:
        return None
    return dims[0]


class DataParallel:
    """The fast path's state for one module (see `sbp.data_parallel`'s docstring)."""

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
        # sharded parameters (split(0) on one hierarchy dim): their units and gathers
        self._sharding: Sharding | None = None
        self.reshard_after_forward = True  # ZeRO-3 (False: ZeRO-2)
        self.units: list[str] | None = None  # the gathering units named by the user
        self._special: list[torch.nn.Module] = []  # BatchNorm and dropout submodules
        self._recurrent: list[torch.nn.RNNBase] = []  # LSTM, GRU and RNN submodules
        self._checkpointable: list[torch.nn.Module] = []  # (attribute gradient_checkpointing)
        self._dropouts: list[torch.nn.Module] = []  # the dropout ones
        self._reducer: Reducer | None = None
        self._reducer_key: tuple | None = None
        self._buffers = BufferBroadcast()  # per-shard statistics in flight: _broadcast_buffers
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
        # outputs are `outputs.FastPathOutput`s (their losses run on local tensors)
        # until one is passed to a compiled function
        self.twins = True
        stand_ins.OWNERS.add(self)  # (a backward's inputs=[parameters]: local_leaves)

    def __deepcopy__(self, memo: dict) -> DataParallel:
        """`copy.deepcopy` of the module: the copy gets a fresh fast path with the same
        settings. The layouts, local leaves, reducer and compiled forwards belong to the
        original's tensors (copied, the copy's backward filled the original's gradients)."""
        module = copy.deepcopy(self._module_ref, memo)
        fresh = memo[id(self)] = DataParallel(module, self.placement)
        fresh._original = copy.deepcopy(self._original, memo)
        fresh.enabled, fresh.batch_norm, fresh.sync = self.enabled, self.batch_norm, self.sync
        fresh.bucket_bytes = self.bucket_bytes
        fresh.reshard_after_forward, fresh.units = self.reshard_after_forward, self.units
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
        inputs = Inputs(args, kwargs, self.placement)
        key, data_nd = self._layout_key(inputs)
        if key is None:
            return self._per_op(args, kwargs, backend)
        why = self._per_op_reason()
        if why is not None:
            self._warn_once(f"runs op by op {why}")
            return self._per_op(args, kwargs, backend)
        layout = self._layouts.get(key)
        if layout is None:
            self._note_new_numbers(key)
            layout = self._layouts[key] = self._check(inputs, data_nd)
            if len(self._layouts) > LAYOUTS:
                self._layouts.popitem(last=False)
            if not layout.ok:
                self._warn_once(f"runs op by op: {layout.reason}")
        else:
            self._layouts.move_to_end(key)
        if layout.empty_part:
            backend = None
        if not layout.ok or (
            backend is not None
            and torch_compile.local_compile_declined(self, layout, data_nd) is not None
        ):
            return self._per_op(args, kwargs, backend)
        for path, limit in layout.index_inputs:  # (as the ops checked them op by op)
            limit.check(inputs.at(path))
        self.last_path = "fast" if self._sharding is None else "sharded"
        if layout.tried:
            return self._run_local(inputs, layout, data_nd, backend)
        try:
            return self._first_local_run(inputs, layout, data_nd, backend)
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

    def _first_local_run(self, inputs: Inputs, layout: Layout, data_nd: tuple, backend=None):
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
        undo = _Undo(self._slots.buffers, inputs.globals)
        eager = self._eager(backend)
        grad = torch.is_grad_enabled()
        watch = recomputation.Recomputation() if eager and grad else None
        why, error, statistics = "", None, []
        try:
            with watch or contextlib.nullcontext():
                out = self._run_local(inputs, layout, data_nd, backend, statistics)
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
        return self._per_op(inputs.args, inputs.kwargs, backend)

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
        forward = (
            self._original
            if backend is None
            else torch_compile.compiled_with(self, {"backend": backend})
        )
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

    def _layout_key(self, inputs: Inputs) -> tuple[tuple | None, tuple]:
        """A hashable key of the call's layout, or None when it is not a data-parallel call:
        global inputs on the placement, split or broadcast, others plain values (`Inputs`).
        The hierarchy dims along which some input is split on dim 0 hold the batch; an input
        split on another dim is split along those only (a recurrent state passed back in is
        split on its dim 1)."""
        if inputs.key is None:
            return None, ()
        data, other = inputs.data, inputs.other
        if not data or not other <= data:
            if other:  # (a sequence-first batch, split on dim 1: worth saying, it is slow)
                self._warn_once(
                    "runs op by op: the fast path takes a batch split on dim 0, and its inputs "
                    "are split on other dims only, or along other placement dims (pass the "
                    "batch first, and transpose it inside the forward if need be)",
                    stacklevel=CALLER + 1,  # (from a helper of call)
                )
            return None, ()
        if self._sharding is not None and self._sharding.shard_dim not in data:
            # (parameters split where the batch is not: each gradient would be summed
            # over ranks holding the same samples)
            self._warn_once(
                "runs op by op: its parameters are split along a placement dim the batch "
                "is not split along",
                stacklevel=CALLER + 1,
            )
            return None, ()
        # (each BatchNorm and dropout module's own mode: one may differ from the model's)
        modes = tuple(m.training for m in self._special)
        key = (
            self._module_ref.training,
            modes,
            torch.is_grad_enabled(),
            tuple(inputs.kwargs),
            *inputs.key,
        )
        data_nd = tuple(split(0) if h in data else broadcast for h in range(self.placement.ndim))
        return key, data_nd

    def _params_broadcast(self) -> bool:
        """Are the module's parameters and buffers still the ones seen last time, broadcast
        (parameters may be sharded: split(0) along one hierarchy dim, broadcast on the
        others)?"""
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
        found, sharded, shard_dims = [], [], set()
        for sub in self._module_ref.modules():
            for is_param, table in ((True, sub._parameters), (False, sub._buffers)):
                for name, t in table.items():
                    if t is None:
                        continue
                    if not (isinstance(t, GlobalTensor) and t._spec.placement == self.placement):
                        return False
                    if t._spec.nd_sbp != allb:
                        dim = _shard_dim(t._spec.nd_sbp) if is_param else None
                        if dim is None:
                            return False
                        shard_dims.add(dim)
                        sharded.append(t)
                    found.append((table, name, t, is_param))
        if len(shard_dims) > 1:  # (split along two hierarchy dims: op by op)
            return False
        if old is not None and old.same_as(found):  # (a submodule set elsewhere)
            old.submodules_seen = COUNTS.submodules_set
            self._slots = old
            return True
        self._slots = _Slots(found)
        try:
            self._shard(sharded, shard_dims)
        except BaseException:
            self._slots = None  # (never local runs taking sharded parameters as whole)
            raise
        if old is None or old.names != self._slots.names or old.specs != self._slots.specs:
            # Other tensors (a new head for fine-tuning, a resized embedding): the layouts
            # checked with the old ones may expect other outputs; check them again
            self._layouts.clear()
        return True

    def _shard(self, sharded: list, shard_dims: set | None = None) -> None:
        """The sharded parameters' runtime (`sharded.Sharding`) for the slots found, or
        None where every parameter is broadcast; again with the options changed."""
        if self._sharding is not None:
            self._sharding.remove()
            self._sharding = None
        if shard_dims is None:
            shard_dims = {_shard_dim(p._spec.nd_sbp) for p in sharded}
        if sharded:
            seen: dict[int, GlobalTensor] = {id(p): p for p in sharded}
            self._sharding = Sharding(
                self._module_ref,
                list(seen.values()),
                self._slots,
                self.placement,
                shard_dims.pop(),
                self.units,
                self.reshard_after_forward,
            )
            self._sharding.sync = self.sync  # (made inside no_sync: it applies)

    # ------------------------------------------------------------ checking pass
    def _check(self, inputs: Inputs, data_nd) -> Layout:
        """Run the module op by op, watching every op, without lasting effects."""
        buffers = self._slots.buffers
        undo = _Undo(buffers, inputs.globals)
        sizes = inputs.batch_sizes(data_nd)
        empty_part = any(size < len(self.group(data_nd)) for size in sizes)
        check = _Check(data_nd, sizes[0] if sizes and not empty_part else None)
        left = None  # the buffers as the forward left them
        registry.observers.append(check)
        try:
            counted = _forwards_replaced(self._special, lambda m, f: _within(_Depth(check), f))
            modes = torch._C._len_torch_function_stack() + 1  # (with _WholeCalls)
            by_name = _by_name_replaced(_called_by_name(check, modes))
            row_wise = row_wise_calls.unjudged(check, sizes[0] if sizes else None)
            sharded = self._sharding.checking() if self._sharding else contextlib.nullcontext()
            with torch.no_grad(), counted, by_name, row_wise, _WholeCalls(check), sharded:
                out = self._original(*inputs.args, **inputs.kwargs)
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
            index_inputs=check.indexed_inputs(inputs.globals),
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
            sharded = set(map(id, self._sharding.params())) if self._sharding else set()
            trained = [p for p in slots.params if p.requires_grad and id(p) not in sharded]
            self._reducer = Reducer(
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
        self, inputs: Inputs, layout: Layout, data_nd: tuple, backend=None, statistics=None
    ):
        """Run the forward on local tensors. Per-shard running statistics are then
        broadcast from the first rank, or, given a `statistics` list, put in it (a first
        run: a collective must not start before every rank's verdict)."""
        grad = torch.is_grad_enabled()
        self._prepare_reducer(data_nd)
        run = _Run(self, layout, data_nd)
        compiled = torch_compile.compiled_forward(self, run, layout, backend)

        def enter(a):
            read_now(a)  # (a copied view of a base written since: taken again)
            if grad and a.requires_grad:
                return _EnterLocal.apply(a, _share_spec(a._spec, data_nd))
            # (compiled: a new alias, as tracing the global input outside marked its local
            # tensor's sizes static, and the local graph's batch size may become dynamic)
            return a._local if compiled is None else a._local.detach()

        largs, lkwargs = inputs.mapped(enter)
        bn_calls = len(layout.bn_counts)  # the BatchNorm calls the run intercepts
        if compiled is not None:
            # the modules' own forwards, traced: per-shard BatchNorm, torch's dropout
            forward, local_ops = compiled, contextlib.nullcontext()
            if len(run.group) > 1 and self.batch_norm == "local":
                run.to_sync = [t._local for t in shard_batch_norm.running_statistics(self._special)]
            elif len(run.group) > 1 and layout.bn_counts:
                local_ops = torch_compile.logical_batch_norm(self, run.group)
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
        sharded = self._sharding.running(data_nd) if self._sharding else contextlib.nullcontext()
        with self._slots.swapped(self._recurrent), sharded, local_constants.suspended(), local_ops:
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

    def local_leaves(self, tensors: list) -> list:
        """`tensors` with each of the module's parameters replaced by its local leaf, where
        the local graph accumulates its gradient (a loss's `backward(inputs=...)`)."""
        leaves = map(self._leaf_of, tensors)
        return [t if leaf is None else leaf for t, leaf in zip(tensors, leaves, strict=True)]

    def leaf_grad_spec(self, p: torch.Tensor) -> GlobalSpec | None:
        """See `sbp.stand_ins.grad_spec`."""
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
        """Per-shard statistics differ per rank: keep the first rank's (`BufferBroadcast`)."""
        self._buffers.start(tensors, self.group(data_nd))

    def settle_buffers(self) -> None:
        """Write the running statistics being broadcast into the buffers, if any."""
        self._buffers.settle()

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
