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
import importlib
import importlib.metadata
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch._guards import TracingContext

from sbp import boxing, env, gradients, stand_ins, tensor_parts
from sbp.boxing import box
from sbp.comm import agreement, failure, stats
from sbp.counters import COUNTS
from sbp.errors import (
    InputTypeError,
    MetaMismatchError,
    PlacementError,
    SbpError,
)
from sbp.layout import GlobalSpec, check_shape
from sbp.placement import placement as Placement
from sbp.ranges import (  # noqa: F401 - COPIED_VIEWS ... learn_range: sbp.tensor's names before
    COPIED_VIEWS,
    forget_range,
    global_writes,
    known_range,
    learn_range,
    written_args,
)
from sbp.signature import NdSbp, broadcast, format_nd_sbp, normalize_nd_sbp, partials_to_broadcast


class GlobalTensor(torch.Tensor):
    """A logical tensor with a placement and an SBP signature (see docs/api.md)."""

    # Slots: every op reads `_local` and `_spec`, and every step `_pending` of each
    # parameter. A slot is read in the object itself; an attribute in `__dict__` is a
    # lookup in another table, most often out of the CPU's caches by then.
    __slots__ = ("_local", "_spec", "_pending", "_copy_of", "_watched")
    _local: torch.Tensor
    _spec: GlobalSpec
    _pending: Any  # the owner of a gradient held for it elsewhere, or None: see `grad`
    _copy_of: Any  # a view's CopyOf, where sbp had to copy it (sbp.ops.writes)
    _watched: bool  # a cache keeps what it holds: its rebinding counts (`COUNTS.rebinds`)

    @staticmethod
    def __new__(
        cls,
        local: torch.Tensor,
        spec: GlobalSpec,
        requires_grad: bool = False,
        strides: tuple[int, ...] | None = None,
    ):
        if torch.is_inference_mode_enabled() and not local.is_inference():
            # a view of a normal tensor under inference_mode is a normal tensor, as in torch
            # (an inference tensor cannot share its base's version counter); where sbp had
            # to copy the view's local tensor, see `sbp.ops.local_views.view_wrappers`
            with torch.inference_mode(False):
                return cls(local, spec, requires_grad, strides)
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            spec.shape,
            strides=strides,
            dtype=spec.dtype,
            device=local.device,
            requires_grad=requires_grad,
        )
        _SET_LOCAL(out, local)
        _SET_SPEC(out, spec)
        _SET_PENDING(out, None)
        _SET_COPY_OF(out, None)
        _SET_WATCHED(out, False)
        return out

    def __setattr__(self, name: str, value: Any) -> None:
        """Counts a rebinding of a watched tensor (`COUNTS.rebinds`), so that caches over global
        tensors (the data-parallel fast path's parameters, the optimizer's state) know when
        to look again. A pending gradient's owner, where written for every parameter every
        step, is written around it (`object.__setattr__`)."""
        if name in _REBINDING and self._watched:
            COUNTS.rebinds += 1
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
        # (a transpose's wrapper keeps its permuted strides: `local_views.permuted_strides`)
        strides = None if outer_stride is None else tuple(outer_stride)
        out = GlobalTensor(inner["_local"], spec, requires_grad, strides)
        if copied_view:
            out._copy_of = ops.writes.CopyOf(None, None)
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
        return _Box.apply(self, dst, grad_nd_sbp(self._spec, None))

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

    @failure.user_call(over=lambda self, *args: self._spec.placement)
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
        try:
            dst, grad = self._rebox_target(placement, sbp, grad_sbp, shape, sync_data, check_meta)
        except SbpError as e:  # (the others go on into the re-box: they raise there too)
            within = {*self._spec.placement.flat_ranks}
            if isinstance(placement, Placement):
                within.update(placement.flat_ranks)
            agreement.announce(e, tuple(sorted(within)))
            raise
        if dst == self._spec and (grad_sbp is None or not self.requires_grad):
            return self  # a no-op costs nothing, a partial tensor's included
        # (with grad_sbp given, even one equal to its sbp: the gradient is converted to it
        # here in backward, whatever layout its consumers send back: Megatron's "f")
        agreement.check_rebox(self._spec, dst, self.requires_grad, self._local)  # once per pair
        return _Box.apply(self, dst, grad)

    def _rebox_target(self, placement, sbp, grad_sbp, shape, sync_data, check_meta):
        """`to_global`'s arguments checked: the target spec and the gradient's nd_sbp."""
        check_options(sync_data, check_meta)
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
        return dst, grad_nd_sbp(self._spec, grad_sbp)

    def register_hook(self, hook):
        """torch's; counted (`COUNTS.hooks_set`): the data-parallel fast path's local gradients
        would pass a parameter's hooks by."""
        handle = super().register_hook(hook)
        COUNTS.hooks_set += 1
        return handle

    def register_post_accumulate_grad_hook(self, hook):
        """torch's; counted as `register_hook` is."""
        handle = super().register_post_accumulate_grad_hook(hook)
        COUNTS.hooks_set += 1
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
        """torch's backward; `inputs` whose gradients autograd makes in stand-ins are
        replaced by them (`sbp.stand_ins`: the data-parallel fast path's local leaves). A
        backward that raises leaves no gradient buckets behind (`gradients.abandon`)."""
        if inputs is not None:
            inputs = stand_ins.replace(inputs)
        try:
            torch.Tensor.backward(self, gradient, retain_graph, create_graph, inputs)
        except BaseException:
            gradients.abandon()  # (the gradient buckets it filled: no flush ran)
            raise

    def contiguous(self, memory_format: torch.memory_format = torch.contiguous_format):
        """The wrapper has the logical contiguous strides, except a transpose's or permute's,
        which has torch's (`sbp.ops.local_views.permuted_strides`); the local tensor of a
        transpose or slice is not contiguous: copy it then (and where the wrapper's strides
        are a transpose's, so that the result is contiguous as torch's is). Every rank must
        decide alike (a write into the result reaches the base or not), so size-1 and empty
        dims count too (`_dense_in_order`): a 1-row shard of a transpose is contiguous by
        torch's test, the other ranks' shards are not."""
        local = self._local
        if (
            local.is_contiguous(memory_format=memory_format)
            and _dense_in_order(local, memory_format)
            and (memory_format is not torch.contiguous_format or _WRAPPER_CONTIGUOUS(self))
        ):
            return self
        return self.clone(memory_format=memory_format)

    @property
    def grad(self) -> torch.Tensor | None:
        """torch's `.grad`; a gradient held for this tensor elsewhere (the data-parallel
        fast path's, plain: `sbp.data_parallel.waiting`) is taken in first: its owner,
        in `_pending`, provides `take(tensor)`, and `drop(tensor)` for a `.grad` set."""
        if self._pending is not None:
            self._pending.take(self)
        return gradients.TORCH_GRAD.__get__(self)

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        gradients.TORCH_GRAD.__set__(self, value)
        if self._pending is not None:
            self._pending.drop(self)

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
        """Basic indexing writes each rank's part of the logical slice (see sbp.ops.setitem)."""
        read_now(self)  # (a copied view writes itself whole into its base after)
        forget_range(self)  # every rank writes (SPMD), even where it holds no part
        if not ops.setitem.setitem(self, index, value):
            super().__setitem__(index, ops.setitem.number_as_global(self, value))

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
    # The logic is in sbp/tensor_parts.py; the pickling's in sbp/checkpoint.py, given there.
    def __create_write_items__(self, fqn: str, object: Any) -> list:
        return tensor_parts.write_items(self, fqn)

    def __create_chunk_list__(self) -> list:
        return tensor_parts.chunk_list(self)

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        return self._local

    def __reduce_ex__(self, protocol: int) -> tuple:
        return tensor_parts.pickled(self)

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
            if not recorded:
                return _written_here(tensor_parts.copy_plain_value(self, src, non_blocking))
        return super().copy_(src, non_blocking)


def _written_here(g: GlobalTensor) -> GlobalTensor:
    """After a write into `g`'s local tensor outside the dispatcher: what an in-place op
    through it does (`sbp.ops.writes.written`, and autograd's version)."""
    torch.autograd.graph.increment_version(g)
    forget_range(g)
    return ops.writes.written(g)


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


# (what counts as a rebinding: `sbp.counters.Counters.rebinds`)
_REBINDING = frozenset(["_local", "_spec", "data", "__class__", "__dict__", "_pending"])
_WRAPPER_CONTIGUOUS = torch._C.TensorBase.is_contiguous  # (the wrapper's strides, logical)
_SET_LOCAL = GlobalTensor._local.__set__
_SET_SPEC = GlobalTensor._spec.__set__
_SET_PENDING = GlobalTensor._pending.__set__
_SET_COPY_OF = GlobalTensor._copy_of.__set__
_SET_WATCHED = GlobalTensor._watched.__set__


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
        ops.writes.fresh(g)
    return g


def _dispatch(func, args, kwargs):
    """First call: bind `sbp.ops.registry.dispatch` here (`sbp.ops` may be half-imported
    when this module is: see the end of this module)."""
    global _dispatch
    _dispatch = ops.registry.dispatch
    return _dispatch(func, args, kwargs)


def grad_nd_sbp(src: GlobalSpec, grad_sbp: Any) -> NdSbp:
    """Sbp of the gradient sent back to `src`: its own, a partial one made broadcast."""
    if grad_sbp is not None:
        return normalize_nd_sbp(grad_sbp, src.placement.ndim, len(src.shape))
    return partials_to_broadcast(src.nd_sbp)


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


def check_options(sync_data: Any, check_meta: Any) -> None:
    """`to_global`'s flags are bools: a string such as "no" is true and was taken so."""
    for name, value in (("sync_data", sync_data), ("check_meta", check_meta)):
        if not isinstance(value, bool):
            raise InputTypeError(f"to_global: {name} must be True or False, got {value!r}")


# Names that moved out of this module (they build on GlobalTensor, so importing them here
# would close a cycle): `from sbp.tensor import module_to_global` still finds them.
_MOVED = {
    "to_global": "sbp.local_to_global",
    "local_to_global": "sbp.local_to_global",
    "locals_to_global": "sbp.local_to_global",
    "unsupported_kind": "sbp.local_to_global",
    "module_to_global": "sbp.module_global",
}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# The one two-way pair of sbp's layers (docs/design.md): the rules in `sbp.ops` build on
# GlobalTensor (ops modules import it at their top), and GlobalTensor's dispatch, writes and
# `g[i] = v` run them. Imported last, and as the package (its modules are read when called),
# so that whichever of the two is imported first, each finds what it needs of the other:
# imported first, this module has defined every name the ops modules take from it; imported
# from inside `sbp.ops`' own import, it takes the half-made package, read only when called.
from sbp import ops  # noqa: E402
