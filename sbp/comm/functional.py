"""Functional collectives for tracing (torch.compile): results are new tensors, not writes.

While Dynamo or AOT autograd traces, tensors are fake and an in-place collective
such as `dist.all_reduce(t)` leaves no node in the graph: the compiled program
would silently skip the communication. The `_c10d_functional` ops (what
DTensor and `torch.distributed._functional_collectives` emit) return their
result, followed by `wait_tensor`, so the graph keeps the collective and its
data dependencies. `sbp.comm.collectives` switches to these when `tracing()`;
the in-place contract of its wrappers is kept with a `copy_` of the result,
which functionalization turns into plain data flow.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch._guards import TracingContext

from sbp.comm import effect_order
from sbp.comm.groups import get_group

_ops = torch.ops._c10d_functional


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


def _name(ranks: tuple[int, ...]) -> str:
    return get_group(ranks).group_name


# While a conversion is traced (`noting`): the results of its collectives, so far
_noted: list[list[torch.Tensor]] = []


def _note(result: torch.Tensor) -> torch.Tensor:
    if _noted:
        _noted[-1].append(result)
    return result


@contextlib.contextmanager
def noting() -> Iterator[list[torch.Tensor]]:
    """The results of the collectives traced inside, in a list."""
    _noted.append([])
    try:
        yield _noted[-1]
    finally:
        _noted.pop()


def tied(out: torch.Tensor, results: list[torch.Tensor]) -> torch.Tensor:
    """`out`, made to depend on `results` (collectives' results, or an op's boxed inputs:
    `sbp.ops.registry`) where it is empty. A rank left an empty shard
    sends its data but uses nothing it receives: a graph that leaves its collectives
    unused drops them on this rank alone (AOT autograd's partitioner keeps only what the
    outputs need), and the other ranks wait for them. Empty, the tie costs nothing."""
    if out.numel() != 0 or not results:
        return out
    parts = [out.reshape(-1), *(r.reshape(-1)[:0].to(out.dtype) for r in results)]
    return torch.cat(parts).reshape(out.shape)


def all_reduce(tensor: torch.Tensor, op: str, ranks: tuple[int, ...]) -> torch.Tensor:
    return _note(_ops.wait_tensor(_ops.all_reduce(tensor, op, _name(ranks))))


# Defined on the dispatcher directly, not with `torch.library.custom_op`: a compiled graph
# calls it ~100 times a step, and custom_op's wrappers (autograd redispatch, a guard
# against Dynamo tracing the body) cost ~35 us a call on top of the ~15 us all-reduce.
# The op has no autograd kernel (one in Python costs ~13 us a call, also where no gradient
# is wanted): it runs inside sbp's rules, on local tensors below autograd, and where a
# gradient is needed an autograd function calls it (`sbp.ops.batch_norm._TableSum`).
_library = torch.library.Library("sbp", "FRAGMENT")
_library.define("small_all_reduce(Tensor tensor, str op, int[] ranks) -> Tensor")


def _small_all_reduce(tensor: torch.Tensor, op: str, ranks: list[int]) -> torch.Tensor:
    from sbp.comm import collectives

    return collectives.all_reduce(tensor.clone(), op, tuple(ranks))


_library.impl("small_all_reduce", _small_all_reduce, "CPU")
_library.impl("small_all_reduce", _small_all_reduce, "CUDA")  # (NCCL, eagerly)
# A collective: never dead code, never moved across another. Inductor removed it from the
# graph of a rank that uses nothing of its result (an empty shard's rows), and the other
# ranks waited for it. An ordered effect threads a token through every call (torch's
# `with_effects`): kept, in order, in the forward or backward graph it was traced in
# (`fx.node.has_side_effect` kept it too, but AOT's partitioner then ran a backward
# all-reduce of an empty shard in both graphs).
_library._register_effectful_op("sbp::small_all_reduce", torch._library.effects.EffectType.ORDERED)


@torch.library.register_fake("sbp::small_all_reduce")
def _(tensor: torch.Tensor, op: str, ranks: list[int]) -> torch.Tensor:
    effect_order.install()  # (traced: Inductor may lower the graph next)
    return torch.empty_like(tensor)


def small_all_reduce(tensor: torch.Tensor, op: str, ranks: list[int]) -> torch.Tensor:
    """A small all-reduce that a compiled program runs as an eager call: through shared
    memory between the ranks of one host (`sbp.comm.shm`, ~20 us), where gloo's functional
    collective costs ~0.4-4 ms. Logical BatchNorm makes ~100 of them per step. While
    tracing it is recorded as the op `sbp::small_all_reduce`, which returns its result,
    so the graph keeps it."""
    return _note(torch.ops.sbp.small_all_reduce.default(tensor, op, ranks))


def all_gather(input: torch.Tensor, ranks: tuple[int, ...]) -> torch.Tensor:
    """Equal-sized inputs of all ranks concatenated along dim 0."""
    return _note(_ops.wait_tensor(_ops.all_gather_into_tensor(input, len(ranks), _name(ranks))))


def reduce_scatter(input: torch.Tensor, op: str, ranks: tuple[int, ...]) -> torch.Tensor:
    return _note(_ops.wait_tensor(_ops.reduce_scatter_tensor(input, op, len(ranks), _name(ranks))))


def all_to_all(
    input: torch.Tensor,
    output_splits: Sequence[int],
    input_splits: Sequence[int],
    ranks: tuple[int, ...],
) -> torch.Tensor:
    out = _ops.all_to_all_single(input, list(output_splits), list(input_splits), _name(ranks))
    return _note(_ops.wait_tensor(out))


def broadcast(tensor: torch.Tensor, src: int, ranks: tuple[int, ...]) -> torch.Tensor:
    """`src` is a global rank; the op wants its index in the group (ascending ranks)."""
    return _note(_ops.wait_tensor(_ops.broadcast(tensor, sorted(ranks).index(src), _name(ranks))))
