"""torch.compile glue: a data-parallel model's call leaving a compiled graph to run the
fast path, whose local forward the same backend compiles; the local forward compiled
(`data_parallel(compile=...)`, or a compiled model's backend), with logical BatchNorm."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from sbp import env
from sbp.data_parallel import compiled_batch_norm, shard_batch_norm
from sbp.data_parallel.by_name import BATCH_NORMS

if TYPE_CHECKING:
    from sbp.data_parallel.call import DataParallel
    from sbp.data_parallel.layout import Layout
    from sbp.data_parallel.local_run import _Run

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


def _traced(
    fast: DataParallel, self: torch.nn.Module, original: Callable, args: tuple, kwargs: dict
) -> Any:
    """A data-parallel model's call where Dynamo traces it: inlined in a compiled caller, or
    in one graph. Run eagerly (Dynamo declined the frame), the fast path."""
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


# ---------------------------------------------------------------- the local forward compiled


def compiled_forward(fast: DataParallel, run: _Run, layout: Layout, backend=None):
    """The module's forward compiled for local tensors (`data_parallel(module,
    compile=...)`, or the backend of a torch.compile'd model), or None where this call
    runs it eagerly: compiling it off, or where the eager run must intercept
    BatchNorm calls (`local_compile_declined`) or compute a loss inside the forward
    over the logical batch (a compiled model that returns its loss and more could not
    run op by op either: torch's backward makes the unused outputs' zero gradients
    plain tensors, which AOT autograd refuses for global outputs)."""
    options = fast.compile_options
    if layout.empty_part:
        return None
    if options is None:
        if backend is None:
            return None
        options = {"backend": backend}
    # (a call from torch.compile was checked in `call`, which ran it op by op if declined)
    why = None if backend is not None else local_compile_declined(fast, layout, run.data_nd)
    if why is None and layout.losses:
        why = "it computes a loss over the logical batch"
    if why is not None:
        if not fast._compile_declined:
            fast._compile_declined = True
            warnings.warn(
                f"sbp: {type(fast._module_ref).__name__} runs its local forward eagerly, "
                f"not compiled: {why}",
                stacklevel=4,
            )
        return None
    return compiled_with(fast, options)


def local_compile_declined(fast: DataParallel, layout: Layout, data_nd: tuple) -> str | None:
    """Why the local forward cannot be compiled for this layout, or None: F.batch_norm
    outside BatchNorm modules, which the eager run intercepts per call, or logical
    BatchNorm over several ranks (the ranks splitting the batch, by `data_nd`) in a
    BatchNorm module with a forward of its own (`compiled_batch_norm` replaces
    torch's)."""
    if fast._sharding is not None:
        return "sharded parameters (gathered in module hooks, around each unit's forward)"
    # (what the checking pass recorded, not module.training: a BatchNorm submodule
    # may be in train mode inside a model in eval mode, as when adapting statistics)
    if not layout.bn_counts:
        return None
    if not layout.in_modules:
        return "F.batch_norm called outside BatchNorm modules"
    if fast.batch_norm == "global" and len(fast.group(data_nd)) > 1:
        if not all(
            shard_batch_norm.torch_forward(m) for m in fast._special if isinstance(m, BATCH_NORMS)
        ):
            return "logical BatchNorm over several ranks in a module with its own forward"
    return None


@contextlib.contextmanager
def logical_batch_norm(fast: DataParallel, group: tuple[int, ...]) -> Iterator[None]:
    """While a compiled local forward runs: its BatchNorm modules compute the logical
    batch's statistics over `group` (`compiled_batch_norm`)."""
    if fast._logical_for is not fast._special:  # (installed for the modules found now)
        compiled_batch_norm.remove(fast.logical_batch_norms)
        fast.logical_batch_norms = compiled_batch_norm.install(fast._module_ref, fast._bn_groups)
        fast._logical_for = fast._special
    groups = fast._bn_groups
    groups.ranks, groups.index = group, group.index(env.get_rank())
    try:
        yield
    finally:
        groups.ranks = None


def compiled_with(fast: DataParallel, options: dict) -> Callable:
    """The module's own forward under torch.compile with `options`, made once per
    options: it compiles for local tensors (the fast path) and for global ones (op by
    op) alike, each with its own guards. A few are kept: a model under torch.compile
    with `data_parallel(compile=...)` too may switch between two."""
    for known, compiled in fast._compiled:
        if known == options:
            return compiled
    original = fast._original

    # (a frame of sbp's own: torch.compile of a torch.nn method compiles a wrapper
    # frame shared by every such method, and shares its recompile limit with them)
    def forward(*args, **kwargs):
        return original(*args, **kwargs)

    compiled = torch.compile(forward, **options)
    fast._compiled = [*fast._compiled[-3:], (dict(options), compiled)]
    return compiled
