"""Collectives while tracing (torch.compile): ordered ops that return their results.

While Dynamo or AOT autograd traces, tensors are fake and an in-place collective such as
`dist.all_reduce(t)` leaves no node in the graph: the compiled program would silently
skip the communication. So while `tracing()`, `sbp.comm.collectives` records each
collective as an op of sbp's (`sbp::all_reduce`, `sbp::all_gather`, `sbp::reduce_scatter`,
`sbp::all_to_all`, `sbp::broadcast`) that returns its result; the wrappers keep their
in-place contract with a `copy_`, which functionalization turns into data flow. When
the graph runs, each op calls the eager wrapper: shared memory between the ranks of one
host for small CPU tensors (~20 us, where gloo takes ~0.4-4 ms), else torch.distributed.

Each op is an ordered effect: AOT autograd threads a token through the calls, so every
rank's graph keeps each one (none is dead code on a rank that uses nothing of its
result), in program order, in the forward or backward graph it was traced in. torch's
own functional collectives (`_c10d_functional`, what DTensor emits) are pure ops: on a
rank whose shard is empty a collective's input is a constant, and AOT's partitioner moved
a backward all-reduce into that rank's forward graph and recomputed the forward one in
its backward, so the ranks paired different collectives and hung.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._guards import TracingContext

from sbp.comm import torch_effects


def tracing(t: torch.Tensor | None = None) -> bool:
    """Is a graph being traced (Dynamo, AOT autograd) or is `t` a fake tensor?"""
    if torch.compiler.is_compiling():
        return True
    if (
        (t is None or type(t) is torch.Tensor)
        and torch._C._len_torch_dispatch_stack() == 0
        and TracingContext.try_get() is None
    ):
        return False  # eager, no mode active: answered without torch's search for a fake mode
    from torch._guards import detect_fake_mode

    if t is None:
        return detect_fake_mode() is not None
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t) or detect_fake_mode(t) is not None


# Defined on the dispatcher directly, not with `torch.library.custom_op`: a compiled graph
# calls them ~100 times a step (logical BatchNorm), and custom_op's wrappers (autograd
# redispatch, a guard against Dynamo tracing the body) cost ~35 us a call on top of a
# ~15 us all-reduce. They have no autograd kernel (one in Python costs ~13 us a call, also
# where no gradient is wanted): they run inside sbp's rules, on local tensors below
# autograd, and where a gradient is needed an autograd function calls them
# (`sbp.ops.batch_norm._TableSum`).
_library = torch.library.Library("sbp", "FRAGMENT")


def _collective(schema: str, run: Callable, result: Callable) -> torch._ops.OpOverload:
    """Define the ordered op `sbp::<schema>` and return it: `run` is its eager body,
    `result(*args)` a new tensor shaped and strided as `run`'s result (for fake tensors
    while tracing: Inductor checks the strides)."""
    name = schema.split("(")[0]
    _library.define(schema)
    for device in ("CPU", "CUDA"):
        _library.impl(name, run, device)
    _library._register_effectful_op(f"sbp::{name}", torch._library.effects.EffectType.ORDERED)

    def fake(*args):
        torch_effects.install()  # (traced: the partitioner and Inductor come next)
        return result(*args)

    torch.library.register_fake(f"sbp::{name}", fake, lib=_library)
    return getattr(torch.ops.sbp, name).default


# `sbp.comm.collectives`' wrappers by name, the ops' eager bodies: it imports this module
# (to record its calls while tracing) and gives them here at its import (`bind`).
_WRAPPERS: dict[str, Callable] = {}


def bind(**wrappers: Callable) -> None:
    """Give the ops the wrappers their eager bodies call. `sbp.comm.collectives` does, at
    its import; the `sbp.comm` package imports it first, so no op runs unbound."""
    _WRAPPERS.update(wrappers)


def _same(t: torch.Tensor, *_) -> torch.Tensor:
    return torch.empty_like(t)  # (as t.clone(): the same strides)


def _gathered(t: torch.Tensor, ranks: list[int]) -> torch.Tensor:
    return t.new_empty(t.numel() * len(ranks))


def _scattered(t: torch.Tensor, op: str, ranks: list[int]) -> torch.Tensor:
    return t.new_empty(t.numel() // len(ranks))


def _exchanged(t: torch.Tensor, output_splits: list, input_splits: list, ranks) -> torch.Tensor:
    return t.new_empty((sum(output_splits), *t.shape[1:]))


# `tensor` reduced over `ranks` with `op` (sum, max, min)
all_reduce = _collective(
    "all_reduce(Tensor tensor, str op, int[] ranks) -> Tensor",
    lambda t, op, ranks: _WRAPPERS["all_reduce"](t.clone(), op, tuple(ranks)),
    _same,
)

# every rank's `input`, flat, concatenated in the order of `ranks`
all_gather = _collective(
    "all_gather(Tensor input, int[] ranks) -> Tensor",
    lambda t, ranks: _WRAPPERS["all_gather"](_gathered(t, ranks), t, tuple(ranks)),
    _gathered,
)

# this rank's chunk (flat) of `input` (equal chunks along dim 0), reduced
reduce_scatter = _collective(
    "reduce_scatter(Tensor input, str op, int[] ranks) -> Tensor",
    lambda t, op, ranks: _WRAPPERS["reduce_scatter"](_scattered(t, op, ranks), t, op, tuple(ranks)),
    _scattered,
)

# chunk i of `input` (dim 0, `input_splits`) sent to ranks[i]; what came back
all_to_all = _collective(
    "all_to_all(Tensor input, SymInt[] output_splits, SymInt[] input_splits, int[] ranks) "
    "-> Tensor",
    lambda t, out_splits, in_splits, ranks: _WRAPPERS["all_to_all"](
        _exchanged(t, out_splits, in_splits, ranks), t, out_splits, in_splits, tuple(ranks)
    ),
    _exchanged,
)

# global rank `src`'s `tensor` on every rank of `ranks`
broadcast = _collective(
    "broadcast(Tensor tensor, int src, int[] ranks) -> Tensor",
    lambda t, src, ranks: _WRAPPERS["broadcast"](t.clone(), src, tuple(ranks)),
    _same,
)
