"""The data-parallel path's public switches: attach and detach, `state`, `data_parallel`
options, `no_sync`."""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Iterator
from typing import Any

import torch

from sbp.data_parallel import compiled_batch_norm, shard_batch_norm, torch_compile
from sbp.data_parallel.call import DataParallel
from sbp.data_parallel.sharded.units import units_of
from sbp.data_parallel.torch_compile import _leaving_backend, _set_eval_frame, _skip_frame, _traced
from sbp.data_parallel.waiting import drop_waiting
from sbp.errors import InputTypeError, InputValueError, PlacementError
from sbp.placement import placement as Placement

ATTR = "_sbp_data_parallel"


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
            return _traced(fast, self, original, args, kwargs)
        # torch.compile(model): Dynamo skips this frame (`_skip_frame`) with its callback set
        callback = _set_eval_frame(None)
        if callback is None:  # eager
            return fast(*args, **kwargs)
        try:
            backend = _leaving_backend(callback, fast)
            if backend is not None:  # the fast path, its local forward compiled by `backend`
                # (`torch_compile`'s, which a trace may have wrapped in Dynamo's disable)
                return torch_compile._call_from_compiled(fast, args, kwargs, backend)
        finally:
            _set_eval_frame(callback)
        # one graph (fullgraph=True, torch.export): Dynamo traces it op by op
        return _traced(fast, self, original, args, kwargs)

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
    are (`waiting.drop_waiting`): torch's reads each, which would wrap it first."""
    if set_to_none and drop_waiting(list(module.parameters())):
        return  # (nothing left: torch's would read every `.grad` in Python)
    type(module).zero_grad(module, set_to_none)


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
    reshard_after_forward: bool | None = None,
    units: list[str] | str | None = None,
) -> torch.nn.Module:
    """Options of a module made global with `module.to_global(P, sbp.broadcast)`.

    fast: run the module on local shards when its check passes (default True);
    batch_norm: "global" (default) uses the statistics of the whole logical batch,
    "local" those of each rank's shard, as torch DDP without SyncBatchNorm;
    bucket_mb: gradient bucket size (default 25, as torch DDP);
    compile: True, or a dict of `torch.compile` options: the fast path runs the module's
    forward on local tensors through `torch.compile` (plain tensors, as compiled torch
    DDP), and everything around it eagerly; False (default) turns it off.
    For parameters sharded along dim 0 (`module.to_global(P, sbp.split(0))`, sharded data
    parallelism, docs/sharded_data_parallel.md): reshard_after_forward: True (default,
    ZeRO-3) frees each unit's gathered parameters after its forward and gathers them
    again in backward, False (ZeRO-2) keeps them until backward; units: the names of the
    submodules gathered as one (as `model.named_modules()` names them), or "auto"
    (default) for `sbp.data_parallel.sharded.units.chosen`'s.
    """
    _check_options(fast, batch_norm, bucket_mb, compile)
    _check_sharding_options(module, reshard_after_forward, units)
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
    if reshard_after_forward is not None or units is not None:
        if reshard_after_forward is not None:
            s.reshard_after_forward = reshard_after_forward
        if units is not None:
            s.units = None if units == "auto" else list(units)
        s._layouts.clear()  # (what a check allows depends on the units)
        s._numbers_seen.clear()  # (checked again for the options, not for new numbers)
        if s._sharding is not None:
            s._shard(s._sharding.params())
    return module


def _check_sharding_options(
    module: torch.nn.Module, reshard_after_forward: Any, units: Any
) -> None:
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise InputTypeError(
            "sbp.nn.data_parallel: reshard_after_forward must be True or False, got "
            f"{reshard_after_forward!r}"
        )
    if units is None or units == "auto":
        return
    if isinstance(units, str) or not all(isinstance(n, str) for n in units):
        raise InputTypeError(
            "sbp.nn.data_parallel: units must be a list of submodule names (as "
            f"model.named_modules() names them) or 'auto', got {units!r}"
        )
    units_of(module, [], list(units))  # (names that are no submodule, or nest: raised)


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
    for holder in (s._reducer, s._sharding):
        if holder is not None:
            holder.sync = False
    try:
        yield
    finally:
        s.sync = True
        for holder in (s._reducer, s._sharding):
            if holder is not None:
                holder.sync = True
