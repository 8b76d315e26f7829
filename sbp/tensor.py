"""`GlobalTensor`: one logical tensor spread over the ranks of a placement.

A wrapper subclass: its own shape, dtype and grad are logical; the data lives
in `_local`, this rank's part as the SBP signature says. Torch ops reach
`__torch_dispatch__` and go to the SBP rules in `sbp.ops`; conversions go
through the boxing engine inside autograd Functions, so gradients flow back
with the transposed conversion.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import itertools
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch._guards import TracingContext

from sbp import boxing, comm, env, gradients, trace
from sbp.boxing.executor import empty_local, local_device
from sbp.comm import agreement, stats
from sbp.errors import (
    DeviceMismatchError,
    InputTypeError,
    MetaMismatchError,
    PlacementError,
    SbpError,
    SbpSignatureError,
)
from sbp.layout import GlobalSpec, check_shape, logical_size_along
from sbp.placement import placement as Placement
from sbp.signature import NdSbp, broadcast, format_nd_sbp, normalize_nd_sbp, partials_to_broadcast


class GlobalTensor(torch.Tensor):
    """A logical tensor with a placement and an SBP signature (see docs/api.md)."""

    # Slots: every op reads `_local` and `_spec`, and every step the two waiting ones of
    # each parameter. A slot is read in the object itself; an attribute in `__dict__` is
    # a lookup in another table, most often out of the CPU's caches by then.
    __slots__ = ("_local", "_spec", "_waiting_grad", "_waiting_in", "_copy_of", "_watched")
    _local: torch.Tensor
    _spec: GlobalSpec
    _waiting_grad: torch.Tensor | None  # (a parameter's: see `grad`)
    _waiting_in: tuple | None  # (a parameter's on one rank: see `grad`)
    _copy_of: Any  # a view's CopyOf, where sbp had to copy it (sbp.ops.writes)
    _watched: bool  # a cache keeps what it holds: its rebinding counts (`REBINDS`)

    @staticmethod
    def __new__(cls, local: torch.Tensor, spec: GlobalSpec, requires_grad: bool = False):
        if torch.is_inference_mode_enabled() and not local.is_inference():
            # a view of a normal tensor under inference_mode is a normal tensor, as in torch
            # (an inference tensor cannot share its base's version counter); where sbp had
            # to copy the view's local tensor, see `sbp.ops.registry.view_wrappers`
            with torch.inference_mode(False):
                return cls(local, spec, requires_grad)
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            spec.shape,
            dtype=spec.dtype,
            device=local.device,
            requires_grad=requires_grad,
        )
        _SET_LOCAL(out, local)
        _SET_SPEC(out, spec)
        _SET_WAITING_GRAD(out, None)
        _SET_WAITING_IN(out, None)
        _SET_COPY_OF(out, None)
        _SET_WATCHED(out, False)
        return out

    def __setattr__(self, name: str, value: Any) -> None:
        """Counts a rebinding of a watched tensor (`REBINDS`), so that caches over global
        tensors (the data-parallel fast path's parameters, the optimizer's state) know when
        to look again. The waiting gradients, written for every parameter every step, are
        written around it (`object.__setattr__`)."""
        if name in _REBINDING and self._watched:
            REBINDS[0] += 1
        elif name == "_watched" and self._watched:
            return  # (watched for good: torch.utils.swap_tensors swaps this slot too)
        super().__setattr__(name, value)

    __torch_function__ = torch._C._disabled_torch_function_impl

    # ------------------------------------------------------------ torch.compile
    def __tensor_flatten__(self):
        """For tracing: the local tensor is the one inner tensor; the spec is the context, so
        Dynamo guards on placement, sbp and shape and recompiles when they change. Dynamo's
        guards call this twice per global input on every call of a compiled function, so
        the sizes are marked static only while a trace is being built."""
        if TracingContext.try_get() is not None:
            _static_sizes(self)
            _static_sizes(self._local)
        elif self._copy_of is not None:  # (a compiled call's input: read now)
            read_now(self)
        return ["_local"], (self._spec, self.requires_grad, self._copy_of is not None)

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        """A copied view (`sbp.ops.writes`) enters a traced graph without its base, which
        the compiled code never writes: it is marked so that a write into it raises."""
        spec, requires_grad, copied_view = ctx
        out = GlobalTensor(inner["_local"], spec, requires_grad=requires_grad)
        if copied_view:
            from sbp.ops.writes import CopyOf

            out._copy_of = CopyOf(None, None)
        return out

    def _stable_hash_for_caching(self) -> str:
        """AOT autograd's on-disk cache key. Ranks trace different graphs for the same layout
        (each holds its own part; B -> P keeps the value on one rank), and may share one
        cache directory, so the rank is part of the key. So is sbp's own source: the cache
        knows Dynamo's graph (`F.batch_norm` on global tensors) and not the rules that
        turned it into local ops and collectives, and would otherwise serve a graph traced
        by another version of sbp."""
        key = (
            f"{self._spec!r}|{self.requires_grad}|{self._local.device}|rank {env.get_rank()}"
            f"|sbp {_source_fingerprint()}"
        )
        return hashlib.blake2b(key.encode(), digest_size=16).hexdigest()

    def __coerce_tangent_metadata__(self):
        """A tangent that is a partial sum is made whole (the traced backward assumes so)."""
        whole = partials_to_broadcast(self._spec.nd_sbp)
        if whole == self._spec.nd_sbp:
            return self
        return self._rebox_for_tracing(None, whole)

    def __coerce_same_metadata_as_tangent__(self, ctx, expected_type=None):
        """A runtime gradient in another layout than the traced one is re-boxed to it."""
        if expected_type is not None:
            return None
        spec = ctx[0]
        return self._rebox_for_tracing(spec.placement, spec.nd_sbp)

    def _rebox_for_tracing(self, placement, nd_sbp):
        """A conversion torch's tracing asks for: the same on every rank, so not checked."""
        dst = boxing.target_spec(self._spec, placement, nd_sbp)
        if dst == self._spec:
            return self
        return _Box.apply(self, dst, _grad_nd_sbp(self._spec, None))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, name in written_args(func):  # a range learnt by to_global no longer holds
            a = args[i] if i < len(args) else kwargs.get(name)
            for t in a if type(a) is list or type(a) is tuple else (a,):
                if type(t) is GlobalTensor:
                    forget_range(t)
        return _dispatch(func, args, kwargs)

    # ------------------------------------------------------------ metadata
    @property
    def placement(self) -> Placement:
        return self._spec.placement

    @property
    def sbp(self) -> NdSbp:
        return self._spec.nd_sbp

    @property
    def is_global(self) -> bool:
        return True

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return (
            f"GlobalTensor(shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"placement={self.placement}, sbp={format_nd_sbp(self.sbp)}, local={self._local!r})"
        )

    __str__ = __repr__

    # ------------------------------------------------------------ conversions
    def to_local(self) -> torch.Tensor:
        """This rank's local tensor (autograd-aware; empty on ranks outside the placement).
        Local, so never communicating: a copied view whose base was written since is not
        taken again (`sbp.ops.writes.fresh`), as any op on it would."""
        return _ToLocal.apply(self)

    def to_global(
        self,
        placement: Placement | None = None,
        sbp: Any = None,
        *,
        grad_sbp: Any = None,
        shape: Any = None,
        sync_data: bool = True,
        check_meta: bool = True,
    ):
        """Re-box to another placement and/or sbp (None keeps the current one). `shape=`,
        which a local tensor's `to_global` takes, may be given: it must be the logical one;
        so may `sync_data` and `check_meta` (checked to be bools, else unused: a re-box moves
        the values it has, and ranks agree on it through `agreement.check_rebox`), so that a
        nest mixing local and global tensors takes them."""
        _check_options(sync_data, check_meta)
        if placement is not None and not isinstance(placement, Placement):
            raise PlacementError(
                f"to_global: placement must be an sbp.placement, got {placement!r}"
            )
        if shape is not None and check_shape(shape) != self._spec.shape:
            raise MetaMismatchError(
                f"to_global: shape={tuple(shape)} of a global tensor of shape "
                f"{self._spec.shape}; a re-box keeps the logical shape"
            )
        dst = boxing.target_spec(self._spec, placement, sbp)
        dst.placement.check_in_world(env.get_world_size())
        grad = _grad_nd_sbp(self._spec, grad_sbp)
        if dst == self._spec and (grad_sbp is None or not self.requires_grad):
            return self  # a no-op costs nothing, a partial tensor's included
        # (with grad_sbp given, even one equal to its sbp: the gradient is converted to it
        # here in backward, whatever layout its consumers send back: Megatron's "f")
        agreement.check_rebox(self._spec, dst, self.requires_grad, self._local)  # once per pair
        return _Box.apply(self, dst, grad)

    def register_hook(self, hook):
        """torch's; counted (`HOOKS_SET`): the data-parallel fast path's local gradients
        would pass a parameter's hooks by."""
        handle = super().register_hook(hook)
        HOOKS_SET[0] += 1
        return handle

    def register_post_accumulate_grad_hook(self, hook):
        """torch's; counted as `register_hook` is."""
        handle = super().register_post_accumulate_grad_hook(hook)
        HOOKS_SET[0] += 1
        return handle

    def requires_grad_(self, requires_grad: bool = True):
        """Turning on gradients of a leaf also makes its `.grad` end in the leaf's sbp."""
        super().requires_grad_(requires_grad)
        if requires_grad and self.is_leaf and not getattr(self, "_sbp_grad_hook", False):
            self._sbp_grad_hook = True
            self.register_post_accumulate_grad_hook(gradients.post_accumulate_hook)
        return self

    def backward(
        self,
        gradient: torch.Tensor | None = None,
        retain_graph: bool | None = None,
        create_graph: bool = False,
        inputs: Any = None,
    ) -> None:
        """torch's backward; `inputs` that are data-parallel fast-path parameters stand for
        the local leaves their gradients accumulate in (`sbp.gradients.local_leaves`)."""
        if inputs is not None:
            inputs = gradients.local_leaves(inputs)
        torch.Tensor.backward(self, gradient, retain_graph, create_graph, inputs)

    def contiguous(self, memory_format: torch.memory_format = torch.contiguous_format):
        """The wrapper always has the logical contiguous strides (so torch's own `contiguous`
        returns it unchanged); the local tensor of a transpose or slice does not: copy it then.
        Every rank must decide alike (a write into the result reaches the base or not), so
        size-1 and empty dims count too (`_dense_in_order`): a 1-row shard of a transpose is
        contiguous by torch's test, the other ranks' shards are not."""
        local = self._local
        if local.is_contiguous(memory_format=memory_format) and _dense_in_order(
            local, memory_format
        ):
            return self
        return self.clone(memory_format=memory_format)

    @property
    def grad(self) -> torch.Tensor | None:
        """torch's `.grad`; a gradient the data-parallel fast path left waiting, plain (on
        the parameter, or in its local leaf), is wrapped in first
        (`sbp.gradients.take_waiting`)."""
        if self._waiting_grad is not None or self._waiting_in is not None:
            gradients.take_waiting(self)
        return gradients.TORCH_GRAD.__get__(self)

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        gradients.TORCH_GRAD.__set__(self, value)
        if self._waiting_grad is not None:
            _SET_WAITING_GRAD(self, None)
        if self._waiting_in is not None:
            self._waiting_in[0].drop([self._waiting_in])

    @grad.deleter
    def grad(self) -> None:
        self.grad = None

    @property
    def data(self):
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        """`p.data = q` (what `Module.to(dtype)` / `.double()` do): take `q`'s local tensor and
        spec too, not only the wrapper's metadata."""
        if not isinstance(value, GlobalTensor):
            raise PlacementError(
                f"cannot set .data of a global tensor to a local {type(value).__name__}; "
                "make it global first (x.to_global(placement, sbp))"
            )
        torch._C.TensorBase.data.__set__(self, value)
        self._local, self._spec = value._local, value._spec

    def __setitem__(self, index: Any, value: Any) -> None:
        """Basic indexing writes each rank's part of the logical slice (see sbp.setitem)."""
        from sbp.setitem import number_as_global, setitem

        read_now(self)  # (a copied view writes itself whole into its base after)
        forget_range(self)  # every rank writes (SPMD), even where it holds no part
        if not setitem(self, index, value):
            super().__setitem__(index, number_as_global(self, value))

    def full_tensor(self) -> torch.Tensor:
        """The logical value as a plain tensor on every rank of the placement (a copied
        view already broadcast is taken again first where stale: `to_local` does not)."""
        read_now(self)
        return self.to_global(sbp=(broadcast,) * self.placement.ndim).to_local()

    def item(self):
        value = self.full_tensor()
        if env.get_rank() not in self.placement:
            raise PlacementError(
                f".item(): rank {env.get_rank()} is outside {self.placement} and holds no value"
            )
        return value.item()

    def tolist(self):
        return self.full_tensor().tolist()

    def numpy(self, *, force: bool = False):
        return self.full_tensor().detach().cpu().numpy()

    def storage(self):
        """A global tensor has no one storage: each rank holds its part. Serializers that
        read raw memory (safetensors, behind Hugging Face's `save_pretrained(d)`) ask for
        it; they get a named error saying what to save instead, on every rank."""
        raise InputTypeError(
            "GlobalTensor.storage(): a global tensor has no single storage (each rank holds "
            "its part): take t.to_local().storage() for this rank's, save plain tensors of "
            "the logical values (sbp.checkpoint.full_state_dict(model, rank=0); Hugging Face: "
            "model.save_pretrained(d, state_dict=sbp.checkpoint.full_state_dict(model, "
            "rank=0))), or save shards with sbp.checkpoint.save"
        )

    def __format__(self, spec: str) -> str:
        if self.dim() == 0:
            return format(self.item(), spec)
        return format(str(self), spec)

    # ------------------------------------------------------------ checkpoints (issue 11)
    # DCP's checkpointable protocol (torch.distributed._checkpointable, as DTensor has it),
    # pickling for torch.save/torch.load, and copy_ from a plain tensor (load_state_dict).
    # The logic is in sbp/checkpoint.py.
    def __create_write_items__(self, fqn: str, object: Any) -> list:
        from sbp import checkpoint

        return checkpoint.write_items(self, fqn)

    def __create_chunk_list__(self) -> list:
        from sbp import checkpoint

        return checkpoint.chunk_list(self)

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        return self._local

    def __reduce_ex__(self, protocol: int) -> tuple:
        from sbp import checkpoint

        return checkpoint.reduce_global_tensor(self)

    def copy_(self, src: torch.Tensor, non_blocking: bool = False):
        """A plain `src` (a 0-dim one too) is the logical value, the same on every rank: each rank
        copies its own part, no communication. So `model.load_state_dict(plain_sd)` works.
        A global `src` laid out alike is copied local to local without dispatch (compiled
        graphs write back every BatchNorm buffer so, ~150 per mobilenet_v2 step). A global
        `src` on another placement is moved to this one first, as OneFlow's copy_ and torch's
        across devices do."""
        recorded = torch.is_grad_enabled() and (self.requires_grad or src.requires_grad)
        placement = self._spec.placement
        if (
            type(src) is GlobalTensor
            and src._spec.placement is not placement  # (placement's == runs in Python)
            and src._spec.placement != placement
        ):
            src = src.to_global(placement=placement, sbp=self._spec.nd_sbp)
        if (
            type(src) is GlobalTensor
            and src._spec == self._spec
            and not recorded
            and self._copy_of is None  # (a copied view's write goes on to its base)
            and src._copy_of is None  # (a copied view is read through dispatch: `fresh`)
        ):
            local, other = self._local, src._local
            if (
                type(local) is torch.Tensor
                and type(other) is torch.Tensor
                and torch._C._len_torch_dispatch_stack() == 0
            ):
                local.copy_(other, non_blocking)
                return _written_here(self)
        if isinstance(src, torch.Tensor) and not isinstance(src, GlobalTensor):
            from sbp import checkpoint

            if not recorded:
                return _written_here(checkpoint.copy_plain_value(self, src, non_blocking))
        return super().copy_(src, non_blocking)


def _written_here(g: GlobalTensor) -> GlobalTensor:
    """After a write into `g`'s local tensor outside the dispatcher: what an in-place op
    through it does (`sbp.ops.writes.written`, and autograd's version)."""
    from sbp.ops.writes import written

    torch.autograd.graph.increment_version(g)
    forget_range(g)
    return written(g)


# Each memory format's dims, innermost first (contiguous: the last dim first)
_INNERMOST_FIRST = {torch.channels_last: (1, 3, 2, 0), torch.channels_last_3d: (1, 4, 3, 2, 0)}


def _dense_in_order(t: torch.Tensor, memory_format: torch.memory_format) -> bool:
    """Are `t`'s strides those of a dense tensor in the format's order, size-1 and empty
    dims included (torch's `is_contiguous` skips them: their strides vary with the shape)?
    Shards of one global tensor differ in size only, so this answers alike on every rank."""
    shape = t.shape
    if all(n > 1 for n in shape):
        return True  # (torch's test, passed, read every dim)
    order = _INNERMOST_FIRST.get(memory_format, range(t.dim() - 1, -1, -1))
    expected = 1
    for d in order:
        if t.stride(d) != expected:
            return False
        expected *= max(shape[d], 1)
    return True


# How many gradient hooks were registered on global tensors (sbp's own included)
HOOKS_SET = [0]


# How many times a watched global tensor was rebound: its local tensor, spec, data or class
# set (`GlobalTensor.__setattr__`), or the one-rank reducer whose leaf holds its gradient
# (`_waiting_in`, see sbp.gradients). (Not requires_grad: torch's C++ turns it off unseen,
# as `torch.detach_(p)` does, so the fast path reads it every call.) A
# cache that checked hundreds of global tensors at one count need not read them again
# while it holds: nothing else changes what they hold (in-place ops write into the same
# local tensor). A cache watches what it keeps (`watch`); others, such as the gradients
# sbp's reduction relabels on every backward op by op, do not move the count.
REBINDS = [0]
_REBINDING = frozenset(["_local", "_spec", "data", "__class__", "__dict__", "_waiting_in"])
_SET_LOCAL = GlobalTensor._local.__set__
_SET_SPEC = GlobalTensor._spec.__set__
_SET_WAITING_GRAD = GlobalTensor._waiting_grad.__set__
_SET_WAITING_IN = GlobalTensor._waiting_in.__set__
_SET_COPY_OF = GlobalTensor._copy_of.__set__
_SET_WATCHED = GlobalTensor._watched.__set__

try:  # (torch's C module: importing torch._dynamo would cost every `import sbp` seconds)
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy
    from torch._C._dynamo.eval_frame import set_code_exec_strategy as _set_code_exec_strategy
except ImportError:
    pass
else:
    # Dynamo never traces sbp's dispatch. Reached from the eager part of a compiled function
    # (after a graph break: `loss.backward()` making its gradient of ones), Dynamo would
    # break the graph at the wrapper's allocation in `__new__` and resume on a half-made
    # tensor ("GlobalTensor has no attribute '_local'").
    # So for the wrapper's making: AOT autograd's backward rebuilds its global tensors
    # (`__tensor_unflatten__`) while a compiled function's frame callback is still on.
    for _code in (
        GlobalTensor.__torch_dispatch__.__func__.__code__,
        GlobalTensor.__new__.__code__,
        GlobalTensor.__tensor_unflatten__.__code__,
    ):
        _set_code_exec_strategy(_code, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))


def watch(tensors: Iterable) -> None:
    """From now on, count the rebindings of these global tensors (others in `tensors` are
    passed over): a cache is about to keep what they hold."""
    for t in tensors:
        if isinstance(t, GlobalTensor):
            _SET_WATCHED(t, True)


@functools.cache
def _source_fingerprint() -> str:
    """A digest of every Python file of the sbp package, taken when sbp is imported (~2 ms):
    the code that traces is the code loaded then, whatever the files hold later. Where the
    files cannot be listed (a zip import), the installed version stands in."""
    root = Path(__file__).parent
    files = sorted(root.rglob("*.py"))
    if not files:
        try:
            return f"version {importlib.metadata.version('sbp')}"
        except importlib.metadata.PackageNotFoundError:
            return "version unknown"
    digest = hashlib.blake2b(digest_size=16)
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


_source_fingerprint()


def _static_sizes(t: torch.Tensor) -> None:
    """Keep Dynamo from tracing sizes as symbols: layouts are plain ints, and a changed
    spec (the flatten context) recompiles anyway. Without this, a local size that varies
    between calls (split, then broadcast) would become symbolic in the next graph."""
    if getattr(t, "_dynamo_static_indices", None) is None:
        t._dynamo_static_indices = set(range(t.dim()))


def read_now(g: GlobalTensor) -> GlobalTensor:
    """`g`, where it is a copied view whose base was written since, taken again first
    (`sbp.ops.writes.fresh`): for the reads of its local tensor that bypass the dispatcher,
    which does this for every input. (It may communicate: every rank reads alike. Not
    for `to_local` and `repr`, which never do.)"""
    if g._copy_of is not None:
        from sbp.ops.writes import fresh

        fresh(g)
    return g


def _dispatch(func, args, kwargs):
    """First call: bind sbp.ops.dispatch here (a per-op import statement costs ~0.6 us)."""
    global _dispatch
    from sbp.ops import dispatch

    _dispatch = dispatch
    return dispatch(func, args, kwargs)


def _grad_nd_sbp(src: GlobalSpec, grad_sbp: Any) -> NdSbp:
    """Sbp of the gradient sent back to `src`: its own, a partial one made broadcast."""
    if grad_sbp is not None:
        return normalize_nd_sbp(grad_sbp, src.placement.ndim, len(src.shape))
    return partials_to_broadcast(src.nd_sbp)


def box(local: torch.Tensor, src: GlobalSpec, dst: GlobalSpec) -> torch.Tensor:
    """Run the cached plan from `src` to `dst` on this rank's local tensor."""
    plan = boxing.plan_specs(src, dst)
    if not stats.watching():
        return boxing.execute(plan, local)
    source, target = format_nd_sbp(src.nd_sbp), format_nd_sbp(dst.nd_sbp)
    trace.check_conversion(source, target, plan.collectives)
    with stats.converting(f"{source} -> {target}"):
        return boxing.execute(plan, local)


def _as_global_grad(grad: torch.Tensor, spec: GlobalSpec) -> GlobalTensor:
    if isinstance(grad, GlobalTensor):
        return grad
    return GlobalTensor(grad, spec)


class _Box(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g: GlobalTensor, dst: GlobalSpec, grad_nd: NdSbp):
        ctx.src, ctx.dst, ctx.grad_nd = g._spec, dst, grad_nd
        with stats.noted("to_global", implicit=False):
            return GlobalTensor(box(read_now(g)._local, g._spec, dst), dst)

    @staticmethod
    def backward(ctx, grad):
        grad = _as_global_grad(grad, ctx.dst)
        target = ctx.src._replace(nd_sbp=ctx.grad_nd)
        if torch.is_grad_enabled():  # create_graph: the re-box differentiable in turn
            return rebox_differentiably(grad, target), None, None
        with stats.noted("to_global", implicit=False):
            return GlobalTensor(box(grad._local, grad._spec, target), target), None, None


def rebox_differentiably(g: GlobalTensor, target: GlobalSpec) -> GlobalTensor:
    """`g` re-boxed to `target` as an op autograd records (a gradient's conversion in a
    backward with create_graph: a gradient penalty differentiates it again), its own
    gradient coming back in `g`'s layout."""
    if g._spec == target:
        return g
    return _Box.apply(g, target, g._spec.nd_sbp)


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g: GlobalTensor):
        ctx.spec = g._spec
        return g._local.detach()

    @staticmethod
    def backward(ctx, grad):
        if torch.is_grad_enabled():  # create_graph
            return from_local(grad.contiguous(), ctx.spec, ctx.spec.nd_sbp)
        return GlobalTensor(grad.contiguous(), ctx.spec)


def to_local_differentiably(g: GlobalTensor) -> torch.Tensor:
    """`g`'s local tensor as an op autograd records (see `rebox_differentiably`)."""
    return _ToLocal.apply(g)


def from_local(x: torch.Tensor, spec: GlobalSpec, grad_nd: NdSbp) -> GlobalTensor:
    """`x`, this rank's local tensor of `spec`, as a global tensor, differentiably (no
    checks, no communication): its gradient comes back to `x` laid out as `grad_nd`."""
    return _FromLocal.apply(x, spec, grad_nd)


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, spec: GlobalSpec, grad_nd: NdSbp):
        ctx.spec, ctx.grad_nd = spec, grad_nd
        # (a conjugated or negated view is resolved: sbp's kernels would read it as stored)
        return GlobalTensor(x.detach().resolve_conj().resolve_neg(), spec)

    @staticmethod
    def backward(ctx, grad):
        grad = _as_global_grad(grad, ctx.spec)
        target = ctx.spec._replace(nd_sbp=ctx.grad_nd)
        if torch.is_grad_enabled():  # create_graph
            return _ToLocal.apply(rebox_differentiably(grad, target)), None, None
        return box(grad._local, grad._spec, target), None, None


# ---------------------------------------------------------------- local -> global


_DTYPES = sorted(
    {v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=lambda d: str(d)
)


def _meta_row(
    x: torch.Tensor,
    P: Placement,
    sbp: Any,
    shape: Any,
    check_meta: bool,
    data_hash: int | None = None,
) -> tuple[dict, list[int]]:
    """What this rank tells the others about `x` in `to_global`'s metadata exchange.

    With `check_meta`, ranks first agree on placement, sbp, dtype and device type;
    running over the whole world (every rank calls `to_global`, SPMD) also catches
    ranks that disagree on the placement itself, and tells ranks outside the
    placement the logical shape and dtype: their own tensor's are ignored (OneFlow's rule).
    Placement ranks must also agree on `requires_grad` and, given `data_hash` (broadcast
    without sync_data), on their data.
    """
    me = env.get_rank()
    description = {}
    if check_meta:
        description = {
            "placement": repr(P),
            "sbp": format_nd_sbp(normalize_nd_sbp(sbp, P.ndim)),
            "device type": x.device.type if me in P else P.type,
            "shape=": None if shape is None else tuple(shape),
        }
    extra = [int(x.requires_grad), data_hash or 0] if check_meta else []
    bounds = _local_bounds(x)
    mine = [1, _DTYPES.index(x.dtype), x.dim(), *x.shape, *extra, *bounds] if me in P else [0]
    return description, mine


BOUNDED_NUMEL = 2**20  # integer tensors up to this size report their range (labels, token ids)


def _local_bounds(x: torch.Tensor) -> list[int]:
    """[min, max] of a small nonempty integer tensor, else []: with every rank's, the logical
    tensor's range is known, so a loss can see that no label is `ignore_index` without a
    collective (see `known_range`).

    CPU tensors only: reading a GPU tensor's range waits for the GPU (a host sync every
    batch, which stops the host queueing work ahead). There the loss all-reduces its
    divisor instead, which a GPU backend queues without waiting."""
    if x.device.type == "cpu" and x.dtype in _BOUNDED_DTYPES and 0 < x.numel() <= BOUNDED_NUMEL:
        lo, hi = torch.aminmax(x)
        return [int(lo), int(hi)]
    return []


_BOUNDED_DTYPES = {torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64}


def known_range(g: GlobalTensor) -> tuple[int, int] | None:
    """The logical tensor's (min, max), when `to_global` learnt it and no rank wrote it since.

    Writes through global tensors run on every rank (SPMD) and forget the range there
    (`forget_range`), so every rank decides alike. A rank's local tensor written on its own
    (its version moved) is an error: the other ranks cannot know."""
    recorded = g.__dict__.get("_bounds")
    if recorded is None:
        return None
    lo, hi, local, version, writes = recorded
    if g._local is not local or global_writes(local) != writes:
        return None  # replaced, or written through another global tensor on its storage
    if local._version != version:
        raise MetaMismatchError(
            f"the local tensor of a global {g.dtype} tensor was written on rank "
            f"{env.get_rank()} alone after to_global; write through the global tensor, or "
            "make the new local data global again (to_global)"
        )
    return lo, hi


def forget_range(g: GlobalTensor) -> None:
    """`g` is written on every rank. Global tensors sharing its storage (`g.detach()`,
    `g.data`, views) hold ranges too, and copied views of them must be taken again: a
    count per storage tells them (`global_writes`)."""
    g.__dict__.pop("_bounds", None)
    if g.dtype in _BOUNDED_DTYPES or COPIED_VIEWS[0]:
        key = _storage_key(g._local)
        _global_writes[key] = _global_writes.get(key, 0) + 1


def global_writes(local: torch.Tensor) -> int:
    """Writes through global tensors into `local`'s storage so far (counted for integer
    tensors, and for every tensor once a copied view was made or a conversion kept:
    `COPIED_VIEWS`)."""
    return _global_writes.get(_storage_key(local), 0)


# writes through global tensors per storage of integer local tensors (the ones with ranges),
# and of every local tensor once sbp made a copied view (sbp.ops.writes.CopyOf) or kept a
# conversion for reuse (sbp.ops.converted)
_global_writes: dict[int, int] = {}
COPIED_VIEWS = [False]


def _storage_key(local: torch.Tensor) -> int:
    return local.untyped_storage()._cdata


def learn_range(g: GlobalTensor, logical: torch.Tensor) -> None:
    """`logical` is `g`'s logical value, the same on every rank (`sbp.tensor`'s checked
    data): its range is then known alike everywhere, as `to_global`'s is."""
    bounds = _local_bounds(logical)
    if bounds:
        _record_range(g, (bounds[0], bounds[1]))


def _record_range(g: GlobalTensor, bounds: tuple[int, int]) -> None:
    local = g._local
    g._bounds = (*bounds, local, local._version, global_writes(local))


_mutable: dict = {}


def written_args(func) -> tuple[tuple[int, str], ...]:
    """(position, name) of each argument the aten op writes (cached: this runs on every op)."""
    w = _mutable.get(func)
    if w is None:
        w = _mutable[func] = tuple(
            (i, a.name)
            for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
    return w


def _read_rows(
    rows: list[tuple[int, ...]], P: Placement, sbp: Any, check_meta: bool
) -> tuple[dict[int, tuple[int, ...]], torch.dtype, tuple[int, int] | None]:
    """Every placement rank's local shape, the dtype and the logical range (integer tensors),
    from every world rank's row."""
    inside = {r: row for r, row in enumerate(rows) if row[0] == 1}
    dtypes = {r: _DTYPES[row[1]] for r, row in inside.items()}
    if check_meta and len(set(dtypes.values())) > 1:
        per_rank = ", ".join(f"rank {r}: {str(d)!r}" for r, d in dtypes.items())
        raise MetaMismatchError(f"ranks disagree on to_global: dtype differs ({per_rank})")
    if check_meta:
        _check_agreement({r: row[3 + row[2] :] for r, row in inside.items()}, P, sbp)
    shapes = {r: tuple(row[3 : 3 + row[2]]) for r, row in inside.items()}
    return shapes, dtypes[P.flat_ranks[0]], _global_bounds(inside, 2 if check_meta else 0)


def _global_bounds(inside: dict[int, tuple[int, ...]], n_extra: int) -> tuple[int, int] | None:
    """The range over every placement rank's reported [min, max] (empty ranks report none)."""
    bounds = [row[3 + row[2] + n_extra :] for row in inside.values()]
    if not bounds or any(len(b) not in (0, 2) for b in bounds):
        return None
    reported = [b for b in bounds if b]
    sizes = [math.prod(row[3 : 3 + row[2]]) for row in inside.values()]
    if not reported or len(reported) != sum(1 for n in sizes if n > 0):
        return None  # a nonempty rank without a range (too large to scan)
    return min(b[0] for b in reported), max(b[1] for b in reported)


def _exchange_rows(
    descriptions: list[dict], mine: list[list[int]], error: Exception | None
) -> list[list[tuple[int, ...]]]:
    """One metadata exchange over the world for several tensors: per tensor, every rank's row."""
    world = tuple(range(env.get_world_size()))
    if len(mine) == 1:
        return [comm.exchange(descriptions[0], world, mine[0], "to_global", error=error)]
    description = {f"{k} (tensor {i})": v for i, d in enumerate(descriptions) for k, v in d.items()}
    ints = [len(mine)] + [v for row in mine for v in (len(row), *row)]
    out: list[list[tuple[int, ...]]] = [[] for _ in mine]
    for packed in comm.exchange(description, world, ints, "to_global", error=error):
        if packed[0] != len(mine):
            raise MetaMismatchError(
                f"ranks disagree on to_global: {packed[0]} and {len(mine)} tensors in the nest"
            )
        at = 1
        for i in range(len(mine)):
            n = packed[at]
            out[i].append(tuple(packed[at + 1 : at + 1 + n]))
            at += 1 + n
    return out


def _check_agreement(extra: dict[int, tuple[int, ...]], P: Placement, sbp: Any) -> None:
    """Placement ranks agree on requires_grad, and on data along broadcast hierarchy dims."""
    grads = {r: bool(e[0]) for r, e in extra.items()}
    if len(set(grads.values())) > 1:
        raise MetaMismatchError(
            f"to_global: ranks disagree on requires_grad of the local tensor: {grads}"
        )
    nd = normalize_nd_sbp(sbp, P.ndim)
    for h, s in enumerate(nd):
        if not s.is_broadcast:
            continue
        for r in P.flat_ranks:
            group = P.group_ranks(r, h)
            if len({extra[q][1] for q in group}) > 1:
                raise MetaMismatchError(
                    f"to_global(sync_data=False): sbp is broadcast but the local data of ranks "
                    f"{list(group)} differ; pass sync_data=True to take rank {group[0]}'s value"
                )


@functools.lru_cache(maxsize=256)
def _agreed_layout(
    ordered: tuple[tuple[int, ...], ...], P: Placement, nd: NdSbp, shape: tuple[int, ...] | None
) -> tuple[NdSbp, tuple[int, ...]]:
    """The sbp (split dims normalised) and logical shape that every placement rank's local
    shape (`ordered`, in flat rank order) fits, checked against the balanced layout.

    Cached: a training loop passes batches of the same shapes step after step, and the
    check walks every rank's layout (a failed check raises and is not cached)."""
    if shape is not None:
        logical = shape
    elif any(s.is_split for s in nd):
        if len({len(s) for s in ordered}) != 1:
            raise MetaMismatchError(
                f"to_global: ranks {list(P.flat_ranks)} pass local tensors of different ndim: "
                f"{list(ordered)}"
            )
        nd = normalize_nd_sbp(nd, P.ndim, len(ordered[0]))
        logical = tuple(
            logical_size_along([s[d] for s in ordered], P.hierarchy, nd, d)
            for d in range(len(ordered[0]))
        )
    else:
        logical = ordered[0]
    nd = normalize_nd_sbp(nd, P.ndim, len(logical))
    spec = GlobalSpec(P, nd, logical, None)
    expected = [spec.local_shape(r) for r in P.flat_ranks]
    if list(ordered) != expected:
        raise MetaMismatchError(
            f"to_global: local shapes {list(ordered)} of ranks {list(P.flat_ranks)} are not the "
            f"balanced split of logical shape {spec.shape} by sbp {format_nd_sbp(spec.nd_sbp)} "
            f"(expected {expected})"
        )
    return nd, logical


def _sync_broadcast_dims(x: torch.Tensor, P: Placement, nd: NdSbp) -> torch.Tensor:
    """Copy the first rank's value along every broadcast hierarchy dim."""
    me = env.get_rank()
    for h, s in enumerate(nd):
        if s.is_broadcast and P.hierarchy[h] > 1:
            group = P.group_ranks(me, h)
            x = comm.broadcast(
                x.detach().clone(memory_format=torch.contiguous_format), group[0], group
            )
    return x


def local_to_global(
    x: torch.Tensor,
    placement: Placement,
    sbp: Any,
    *,
    shape: Any = None,
    sync_data: bool = True,
    check_meta: bool = True,
    grad_sbp: Any = None,
) -> GlobalTensor:
    """`x` is this rank's local tensor; make the global tensor it is a part of (see docs/api.md).

    Every rank of the world calls this (SPMD); ranks outside `placement` pass any
    tensor of the right dtype and get a metadata-only global tensor. A bad argument on
    any rank raises on every rank (with `check_meta`). With `check_meta` and
    `sync_data=False`, a broadcast tensor's data is hashed and compared (about 1 GB/s);
    with `check_meta=False` nothing is checked: equal data is trusted.
    """
    return locals_to_global([x], placement, sbp, shape, sync_data, check_meta, grad_sbp)[0]


def locals_to_global(
    xs: list[torch.Tensor],
    placement: Placement,
    sbp: Any,
    shape: Any = None,
    sync_data: bool = True,
    check_meta: bool = True,
    grad_sbp: Any = None,
) -> list[GlobalTensor]:
    """`local_to_global` of several tensors with one metadata exchange (a batch's inputs and
    labels: each exchange is a collective, ~0.5-4 ms on a busy host)."""
    try:
        _check_options(sync_data, check_meta)
        errors = [_bad_input(x, placement, sbp, shape) for x in xs]
        if grad_sbp is not None and isinstance(placement, Placement):
            normalize_nd_sbp(grad_sbp, placement.ndim)
    except SbpError as e:
        errors = [e]
    bad = next((e for e in errors if e is not None), None)
    if bad is not None:  # every rank raises it at once, not only this one
        if check_meta is not False:
            agreement.raise_everywhere(bad)
        raise bad
    me = env.get_rank()
    inside = me in placement
    if shape is not None:
        shape = check_shape(shape)
    error = next((e for e in (_device_error(x, placement) for x in xs) if e is not None), None)
    nd = normalize_nd_sbp(sbp, placement.ndim)
    splits = any(s.is_split for s in nd)
    world = env.get_world_size()
    # (in a world of one there is no other rank to agree with: the local tensor is the
    # logical one, and the exchange would only read back this rank's own row)
    if world > 1 and (check_meta or (splits and shape is None) or placement.size < world):
        rows = []
        for x in xs:
            checksum = None
            if check_meta and not sync_data and inside and error is None:
                if any(s.is_broadcast for s in nd):
                    checksum = agreement.data_hash(x)
            rows.append(_meta_row(x, placement, sbp, shape, check_meta, checksum))
        exchanged = _exchange_rows([d for d, _ in rows], [m for _, m in rows], error)
        metas = [_read_rows(r, placement, sbp, check_meta) for r in exchanged]
    elif error is not None:
        raise error
    else:  # trusted; in a world of one, this rank's range is the logical tensor's
        metas = [
            (None, x.dtype, tuple(_local_bounds(x)) or None if world == 1 else None) for x in xs
        ]
    return [
        _local_to_global(x, placement, sbp, shape, sync_data, grad_sbp, *meta)
        for x, meta in zip(xs, metas, strict=True)
    ]


def _device_error(x: torch.Tensor, placement: Placement) -> SbpError | None:
    """What is wrong with the device of this rank's local tensor (ranks outside: nothing)."""
    me = env.get_rank()
    if me not in placement:
        return None
    if x.device.type != placement.type:
        return DeviceMismatchError(
            f"to_global: the local tensor is on {x.device} but the placement type is "
            f"{placement.type!r}; move it first (x.to({placement.type!r}))"
        )
    if placement.type == "cuda" and x.device != local_device("cuda"):
        return DeviceMismatchError(
            f"to_global: the local tensor is on {x.device}; a cuda placement keeps rank "
            f"{me}'s data on {local_device('cuda')} (cuda:LOCAL_RANK)"
        )
    return None


def _local_to_global(
    x: torch.Tensor,
    placement: Placement,
    sbp: Any,
    shape: Any,
    sync_data: bool,
    grad_sbp: Any,
    shapes: dict[int, tuple[int, ...]] | None,
    dtype: torch.dtype,
    bounds: tuple[int, int] | None,
) -> GlobalTensor:
    """The global tensor, once every rank's local shape is known (or trusted)."""
    me = env.get_rank()
    inside = me in placement
    if shapes is not None:
        ordered = tuple(shapes[r] for r in placement.flat_ranks)
        nd, logical = _agreed_layout(
            ordered, placement, normalize_nd_sbp(sbp, placement.ndim), shape
        )
    else:
        logical = shape if shape is not None else tuple(x.shape)
        nd = normalize_nd_sbp(sbp, placement.ndim, len(logical))
    spec = GlobalSpec(placement, nd, tuple(logical), dtype)
    if shapes is None and inside and tuple(x.shape) != spec.local_shape(me):
        raise MetaMismatchError(
            f"to_global: local shape {tuple(x.shape)} on rank {me} does not match shape="
            f"{spec.shape} with sbp {format_nd_sbp(nd)} (expected {spec.local_shape(me)})"
        )
    if inside:
        data = _sync_broadcast_dims(x, placement, nd) if sync_data else x
    else:
        data = empty_local(spec)
    grad_nd = _grad_nd_sbp(spec, grad_sbp)
    if x.requires_grad and torch.is_grad_enabled():
        if data is not x:
            data = _Reattach.apply(x, data)
        return _FromLocal.apply(data, spec, grad_nd)
    out = GlobalTensor(data.detach(), spec)
    if bounds is not None:
        _record_range(out, bounds)
    return out


def unsupported_kind(x: torch.Tensor) -> str | None:
    """What kind of tensor `x` is where global tensors cannot hold it, and the way out; None
    for a dense tensor. A global tensor is a dense tensor split by rows of its logical shape:
    a nested tensor has no one shape (torch's own error was 'NestedTensorImpl doesn't
    support sizes'), and a quantized one would be made global silently, its scale and zero
    point left out of every op's rule."""
    if x.is_nested:
        return (
            "a nested tensor (torch.nested); global tensors are dense: pass "
            "x.to_padded_tensor(0), or each of x.unbind() on its own"
        )
    if x.layout != torch.strided:
        return f"a {x.layout} tensor; global tensors are dense: pass x.to_dense()"
    if x.is_quantized:
        return (
            f"a quantized tensor ({x.dtype}); global tensors hold plain dtypes: pass "
            "x.dequantize(), and quantize the global result's local tensors if needed"
        )
    return None


def _check_options(sync_data: Any, check_meta: Any) -> None:
    """`to_global`'s flags are bools: a string such as "no" is true and was taken so."""
    for name, value in (("sync_data", sync_data), ("check_meta", check_meta)):
        if not isinstance(value, bool):
            raise InputTypeError(f"to_global: {name} must be True or False, got {value!r}")


def _bad_input(x: Any, placement: Any, sbp: Any, shape: Any) -> SbpError | None:
    """What is wrong with this rank's arguments to `to_global`, found without communication."""
    if not isinstance(x, torch.Tensor):
        return InputTypeError(
            f"to_global: expected a torch.Tensor (or a dict/list/tuple of them), got "
            f"{type(x).__name__}; make it one first (torch.as_tensor(x))"
        )
    kind = unsupported_kind(x)
    if kind is not None:
        return InputTypeError(f"to_global: x is {kind}")
    if placement is None:
        return PlacementError(
            "to_global: a local tensor needs placement= (an sbp.placement, such as "
            "sbp.placement.all('cpu')); placement=None keeps a global tensor's own"
        )
    if not isinstance(placement, Placement):
        return PlacementError(f"to_global: placement must be an sbp.placement, got {placement!r}")
    if sbp is None:
        return SbpSignatureError(
            "to_global: a local tensor needs sbp= (sbp.split(d), sbp.broadcast or "
            "sbp.partial_sum); sbp=None keeps a global tensor's own"
        )
    try:
        placement.check_in_world(env.get_world_size())
        local_device(placement.type)  # a cuda placement with no GPU
        ndim = x.dim() if env.get_rank() in placement else None
        normalize_nd_sbp(sbp, placement.ndim, ndim)
        if shape is not None:
            check_shape(shape)
    except SbpError as e:
        return e
    return None


class _Reattach(torch.autograd.Function):
    """Use synced data in forward while the gradient still reaches the caller's tensor."""

    @staticmethod
    def forward(ctx, x, data):
        ctx.shape = x.shape
        return data.detach()

    @staticmethod
    def backward(ctx, grad):
        if grad.shape != ctx.shape:  # ranks outside the placement: nothing flows back
            grad = grad.new_zeros(ctx.shape)
        return grad, None


def to_global(obj: Any, placement: Placement | None = None, sbp: Any = None, **kwargs: Any) -> Any:
    """`sbp.to_global`: a tensor, a GlobalTensor (re-box), or nested dict/list/tuple of them.

    In a dict/list/tuple, leaves that are not tensors (ints, strings, None) pass through
    unchanged; anything else given alone (a numpy array, a number) is an `InputTypeError`
    on every rank.
    """
    unknown = sorted(set(kwargs) - _LOCAL_OPTIONS)
    if unknown:
        raise InputTypeError(
            f"to_global: unknown keyword argument(s) {', '.join(unknown)}; it takes placement=, "
            "sbp=, shape=, sync_data=, check_meta= and grad_sbp= (a global tensor's re-box: "
            "shape= and grad_sbp=)"
        )
    if not isinstance(obj, (torch.Tensor, Mapping, list, tuple)):
        if placement is None or sbp is None:
            raise InputTypeError(f"to_global: expected a torch.Tensor, got {type(obj).__name__}")
        return local_to_global(obj, placement, sbp, **kwargs)
    return _tree_to_global(obj, placement, sbp, **kwargs)


_LOCAL_OPTIONS = frozenset(("shape", "sync_data", "check_meta", "grad_sbp"))


def _tree_to_global(obj: Any, placement: Any, sbp: Any, **kwargs: Any) -> Any:
    def rebox(t: GlobalTensor) -> GlobalTensor:
        return t.to_global(placement, sbp, **kwargs)

    local = [t for t in _leaves(obj) if not isinstance(t, GlobalTensor)]
    if len(local) > 1 and placement is not None and sbp is not None:
        done = iter(locals_to_global(local, placement, sbp, **kwargs))  # one exchange
        return _rebuild(obj, rebox, lambda t: next(done))
    return _rebuild(obj, rebox, _one_to_global(placement, sbp, kwargs))


def _one_to_global(placement: Any, sbp: Any, kwargs: dict):
    def convert(t: torch.Tensor) -> GlobalTensor:
        # (a missing placement= or sbp= is `_bad_input`'s: raised on every rank at once)
        return local_to_global(t, placement, sbp, **kwargs)

    return convert


def _leaves(obj: Any) -> list[torch.Tensor]:
    """The tensors of a nest of dicts, lists and tuples, in `_rebuild`'s order."""
    out: list[torch.Tensor] = []
    _rebuild(obj, out.append, out.append)
    return out


def _rebuild(obj: Any, on_global, on_local) -> Any:
    """The nest with each GlobalTensor replaced by `on_global(t)`, each tensor by `on_local(t)`."""
    if isinstance(obj, GlobalTensor):
        return on_global(obj)
    if isinstance(obj, torch.Tensor):
        return on_local(obj)
    if isinstance(obj, Mapping):
        return type(obj)((k, _rebuild(v, on_global, on_local)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_rebuild(v, on_global, on_local) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_rebuild(v, on_global, on_local) for v in obj)
    return obj


# How many parameters `module.to_global` replaced by new objects (`_converted_parameter`)
REPLACED = [0]


def _converted_parameter(p: torch.Tensor, value: GlobalTensor) -> torch.nn.Parameter:
    """The parameter holding `value`: `p` itself where it was global already (`p.data =`,
    as OneFlow re-boxes: an optimizer holding it steps the new layout, as after torch's
    `module.to`), else a new one, which `p` names (`_sbp_replaced_by`): a plain tensor
    cannot become a global one in place, and an optimizer made before is pointed at it at
    its next step (`sbp.optim_step.repoint`)."""
    if isinstance(p, GlobalTensor):
        p.data = value
        return p
    new = torch.nn.Parameter(value, requires_grad=p.requires_grad)
    p._sbp_replaced_by = new
    REPLACED[0] += 1
    return new


def module_to_global(module: torch.nn.Module, placement: Placement, sbp: Any, **kwargs: Any):
    """`module.to_global`: every parameter and buffer becomes global, in place; returns `module`.

    Values are synced from the placement's first rank (`sync_data=True`), so ranks
    that initialised differently start equal. Shared parameters stay shared. On an
    already-global module, parameters and buffers are re-boxed to `placement`/`sbp`.
    """
    unknown = sorted(set(kwargs) - _LOCAL_OPTIONS)
    if unknown:
        raise InputTypeError(
            f"module.to_global: unknown keyword argument(s) {', '.join(unknown)}; it takes "
            "placement, sbp, shape=, sync_data=, check_meta= and grad_sbp="
        )
    bad = None
    for t in itertools.chain(module.parameters(), module.buffers()):
        if bad is None and not isinstance(t, GlobalTensor):
            bad = _bad_input(t, placement, sbp, kwargs.get("shape"))
    if bad is not None:  # nothing converted yet: the module stays as it was
        if kwargs.get("check_meta", True):
            agreement.raise_everywhere(bad, "module.to_global")
        raise bad
    done: dict[int, Any] = {}
    nd = normalize_nd_sbp(sbp, placement.ndim)
    whole = (broadcast,) * placement.ndim

    def convert(t: torch.Tensor) -> GlobalTensor:
        if isinstance(t, GlobalTensor):  # already global: re-box, as OneFlow does
            return t.detach().to_global(placement, sbp)
        # Each rank holds the user's whole model: it is the logical one, synced as a
        # broadcast, and then each rank keeps its part (split) or share (partial). Taken
        # as each rank's shard, as a tensor's `to_global` would, `split(0)` would make
        # every weight rank-count times as long (docs/api.md "Global modules").
        value = local_to_global(t.detach(), placement, whole, **kwargs)
        return value if nd == whole else value.to_global(placement, nd)

    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is None:
                continue
            if id(p) not in done:
                done[id(p)] = _converted_parameter(p, convert(p))
            sub._parameters[name] = done[id(p)]
        for name, b in list(sub._buffers.items()):
            if b is None:
                continue
            if id(b) not in done:
                done[id(b)] = convert(b)
            sub._buffers[name] = done[id(b)]
    return module
