"""Parameter and buffer slots: where a module keeps each global tensor and the local one a
local run puts there (`_Slots`), the way a global input enters the local graph
(`_EnterLocal`), and what a trial run changed, to put back (`_Undo`)."""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Iterator
from operator import attrgetter, is_
from typing import Any

import torch

from sbp import gradients, random
from sbp.counters import COUNTS
from sbp.layout import GlobalSpec
from sbp.tensor import GlobalTensor, from_local, watch


class _Undo:
    """What a trial run of the module changes, to put back: the buffers (BatchNorm's
    running statistics), global inputs the forward writes into (`x.sub_(1)`), and sbp's
    random stream (dropout)."""

    def __init__(self, buffers: list, inputs: list):
        """`inputs`: the call's global inputs, (path, tensor) (`Inputs.globals`)."""
        self.buffers = buffers
        self.saved = [b._local.clone() for b in buffers]
        # (a global tensor's version counts writes through sbp (the checking pass), its
        # local's those of the local run; an inference tensor has none, and no write of it
        # can be undone: none is allowed)
        self.inputs = [
            (a, (a._version, a._local._version), a._local.clone())
            for _, a in inputs
            if not a.is_inference()
        ]
        self.rng = dict(random._state)

    def __call__(self) -> None:
        for b, s in zip(self.buffers, self.saved, strict=True):
            b._local.copy_(s)
        for g, versions, saved in self.inputs:
            if (g._version, g._local._version) != versions:
                g._local.copy_(saved)
        random._state.update(self.rng)


class _EnterLocal(torch.autograd.Function):
    """A global input's local tensor; its gradient goes back as this rank's share."""

    @staticmethod
    def forward(ctx, g: GlobalTensor, grad_spec: GlobalSpec):
        ctx.grad_spec = grad_spec
        return g._local.view_as(g._local)

    @staticmethod
    def backward(ctx, grad):
        if torch.is_grad_enabled():  # create_graph: the gradient is differentiated too
            return from_local(grad.contiguous(), ctx.grad_spec, ctx.grad_spec.nd_sbp), None
        return GlobalTensor(grad.contiguous(), ctx.grad_spec), None


_SPEC, _LOCAL, _REQUIRES_GRAD = (
    attrgetter("_spec"),
    attrgetter("_local"),
    attrgetter("requires_grad"),
)
_LEAF_VERSIONS = itertools.count(1)


def _count_submodule(module: torch.nn.Module, name: str, submodule: Any) -> None:
    """torch's global registration hook: `COUNTS.submodules_set`."""
    COUNTS.submodules_set += 1


torch.nn.modules.module.register_module_module_registration_hook(_count_submodule)


class _Slots:
    """Where the module keeps each parameter and buffer (a submodule's `_parameters` or
    `_buffers` table, and a name), the global tensor found there, and the local tensor a
    local run puts there instead: a leaf sharing a parameter's storage, a buffer's local.

    A model has hundreds of them and every call checks them, so the lists are parallel
    and the checks run as C loops (`map`)."""

    def __init__(self, found: list[tuple[dict, str, GlobalTensor, bool]]):
        self.tables = [table for table, _, _, _ in found]
        self.names = [name for _, name, _, _ in found]
        self.tensors = [t for _, _, t, _ in found]
        watch(self.tensors)
        self.specs = list(map(_SPEC, self.tensors))
        self.is_param = [is_param for _, _, _, is_param in found]
        self.params = list({id(t): t for _, _, t, is_param in found if is_param}.values())
        self.buffers = [t for _, _, t, is_param in found if not is_param]
        self.version = 0  # which making of the local leaves (unique over all _Slots)
        self.submodules_seen = COUNTS.submodules_set  # when the tables were found
        self._hooks_seen = -1  # `COUNTS.hooks_set` when the parameters' hooks were last read
        self._hooked: list = []  # the parameters with gradient hooks of the user's then
        self._locals: list = []  # each slot's local tensor when `local` was made
        self._trained: list = []  # each parameter's requires_grad then
        self._leaves: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id: (local, leaf)
        self.local: list = []  # per slot, what the local run puts there
        # `COUNTS.rebinds` when the specs were last found the same, and when `local` was
        # last found up to date: while it stays, no global tensor can differ (skip reading)
        self._specs_seen = COUNTS.rebinds
        self._refreshed = -1

    def unchanged(self) -> bool:
        """The same global tensors in the same places, with the same specs? (Module tables
        are written with no hook: they are read every call; a submodule set since may
        have replaced a table.)"""
        if self.submodules_seen != COUNTS.submodules_set:
            return False
        if not all(map(is_, map(dict.get, self.tables, self.names), self.tensors)):
            return False
        rebinds = COUNTS.rebinds
        if rebinds != self._specs_seen:
            if not all(map(is_, map(_SPEC, self.tensors), self.specs)):
                return False
            self._specs_seen = rebinds
        return True

    def hooked(self) -> bool:
        """Does a parameter hold a gradient hook of the user's (`p.register_hook`,
        `register_post_accumulate_grad_hook`)? The local run's gradients go to local leaves
        and would pass it by. (Read again when hooks were registered since; the hooked
        ones are read every call, so a removed hook lets the local runs back.)"""
        if self._hooks_seen != COUNTS.hooks_set:
            self._hooks_seen = COUNTS.hooks_set
            self._hooked = [p for p in self.params if gradients.has_user_hooks(p)]
        elif self._hooked:
            self._hooked = [p for p in self._hooked if gradients.has_user_hooks(p)]
        return bool(self._hooked)

    def same_as(self, found: list[tuple[dict, str, GlobalTensor, bool]]) -> bool:
        """Are these the slots `found` (the same tables, names and tensors, specs unchanged)?"""
        return (
            len(found) == len(self.tensors)
            and all(a is b for (a, _, _, _), b in zip(found, self.tables, strict=True))
            and [name for _, name, _, _ in found] == self.names
            and all(a is b for (_, _, a, _), b in zip(found, self.tensors, strict=True))
            and list(map(_SPEC, self.tensors)) == self.specs
        )

    def refresh(self) -> None:
        """Make a parameter's local leaf again when its local tensor or requires_grad changed.
        (requires_grad is read every call: torch's C++ can turn it off unseen, as
        `torch.detach_(p)` does.)"""
        with gradients.PLAIN_GETTERS():
            trained = list(map(_REQUIRES_GRAD, self.params))
        rebinds = COUNTS.rebinds
        if trained == self._trained and (
            rebinds == self._refreshed
            or (
                len(self.tensors) == len(self._locals)
                and all(map(is_, map(_LOCAL, self.tensors), self._locals))
            )
        ):
            self._refreshed = rebinds
            return
        locals_ = list(map(_LOCAL, self.tensors))
        leaves = {}
        for p, grad in zip(self.params, trained, strict=True):
            cached = self._leaves.get(id(p))
            if cached is not None and cached[0] is p._local and cached[1].requires_grad == grad:
                leaves[id(p)] = cached
            else:
                leaves[id(p)] = (p._local, p._local.detach().requires_grad_(grad))
        self._leaves, self._locals, self._trained = leaves, locals_, trained
        self.local = [
            leaves[id(t)][1] if is_param else local
            for t, local, is_param in zip(self.tensors, locals_, self.is_param, strict=True)
        ]
        self.version = next(_LEAF_VERSIONS)
        self._refreshed = rebinds

    def leaf(self, p: GlobalTensor) -> torch.Tensor:
        return self._leaves[id(p)][1]

    @contextlib.contextmanager
    def swapped(self, recurrent: list[torch.nn.RNNBase]) -> Iterator[None]:
        """The local tensors in the module's tables for the duration, and in the lists of
        weights that torch's recurrent layers pass (`_flat_weights`, kept beside the
        tables)."""
        for table, name, local in zip(self.tables, self.names, self.local, strict=True):
            table[name] = local
        flat = [(m, m._flat_weights, getattr(m, "_flat_weight_refs", None)) for m in recurrent]
        for m, weights, _ in flat:
            local = [self._leaves[id(w)][1] if id(w) in self._leaves else w for w in weights]
            m.__dict__["_flat_weights"] = local
            # (and the references torch compares with the tables: else its forward takes
            # the tables' leaves as new weights and flattens them, which on cuDNN moves them
            # into a new buffer, apart from the parameters' memory)
            m.__dict__["_flat_weight_refs"] = [None if w is None else weakref.ref(w) for w in local]
        try:
            yield
        finally:
            for table, name, t in zip(self.tables, self.names, self.tensors, strict=True):
                table[name] = t
            for m, weights, refs in flat:
                m.__dict__["_flat_weights"] = weights
                if refs is not None:
                    m.__dict__["_flat_weight_refs"] = refs
