"""The data-parallel fast path's gradient reducer: local leaves' gradients summed over the
ranks splitting the batch in buckets while backward runs, as torch DDP's reducer does; each
sum then waits, plain, for its parameter until `.grad` is read (`waiting`)."""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from itertools import repeat
from operator import attrgetter, is_

import torch

from sbp import comm
from sbp.comm import stats
from sbp.data_parallel.waiting import Waiting
from sbp.gradients import BUCKET_BYTES, BUCKETS, TORCH_GRAD, run_all

_GRAD = attrgetter("grad")

FIRST_BUCKET_BYTES = 2**20  # as torch DDP: a small first bucket starts communication early


class Reducer:
    """Sums local partial gradients of a fixed list of parameters over `ranks` while backward
    runs, as torch DDP's Reducer does, and leaves each parameter's `.grad` in its own sbp.

    The data-parallel fast path computes gradients on local leaves (`leaves[i]` stands for
    `params[i]` on this rank). Buckets are fixed once, in reverse parameter order (about
    the order backward makes gradients ready), so every rank builds the same buckets. A
    bucket is launched asynchronously as soon as it and every bucket before it are full:
    launching in bucket order keeps the collectives in the same order on every rank,
    whatever order gradients arrive in. At the end of backward the rest is launched and
    everything is waited for once. Parameters unused in this backward contribute zeros and
    a zero "used" count, so a gradient stays None only where it was unused on every rank.
    Summed gradients wait, plain, until `.grad` is read (`waiting.Waiting`).
    The counts ride in the buckets' buffers on the CPU. On a GPU they are summed apart, in
    one small CPU all-reduce at the end of backward: reading them back from the GPU would
    make the host wait for every bucket (torch DDP does not wait for the GPU either).
    Under `sync=False` (`no_sync`), gradients stay this rank's partial sums: `.grad`
    becomes a `partial_sum` tensor, reduced together with the next synchronised backward.
    """

    def __init__(
        self,
        params: list,
        leaves: list[torch.Tensor],
        ranks: tuple[int, ...],
        partial_nd: tuple,
        bucket_bytes: int = BUCKET_BYTES,
        first_bucket_bytes: int = FIRST_BUCKET_BYTES,
        counts_on_host: bool | None = None,
    ):
        self.params, self.leaves, self.ranks, self.partial_nd = params, leaves, ranks, partial_nd
        self.sync = True
        self.trace: list | None = None  # set to a list to record ("ready", i) / ("launch", b)
        self.on_finish: Callable[[], None] | None = None  # called once gradients are whole
        self._buckets = _plan_buckets(leaves, bucket_bytes, min(first_bucket_bytes, bucket_bytes))
        if counts_on_host is None:
            counts_on_host = bool(leaves) and leaves[0].device.type != "cpu"
        self.counts_on_host = counts_on_host
        self._where = {}
        # per bucket: its flat buffer, and the reference counts that mean nothing outside
        # the reducer holds it; per parameter: its slot in the buffer
        self._flat: list[torch.Tensor | None] = [None] * len(self._buckets)
        self._refs: list[tuple[int, int] | None] = [None] * len(self._buckets)
        self._slots: dict[int, torch.Tensor] = {}
        # per parameter: what holds its gradient where nothing waits for it (`_wait`)
        self._spares = [Waiting() for _ in params]
        for b, bucket in enumerate(self._buckets):
            offset = 0
            for i in bucket:
                self._where[i] = (b, offset)
                offset += leaves[i].numel()
        self._reset()
        self._partial_grads = False  # one rank: no_sync made partial .grads
        # On one rank nothing is summed, so nothing can overlap: instead of a hook per leaf,
        # one callback hands every gradient over at the end of backward (`backward_started`)
        self.hooked = len(ranks) > 1
        if self.hooked:
            for i, leaf in enumerate(leaves):
                leaf.register_post_accumulate_grad_hook(self._hook(i))
        else:
            self._claim_parameters()

    # ------------------------------------------------------------ one rank: leaves hold them
    def _claim_parameters(self) -> None:
        """One rank: each parameter's gradient will wait in its leaf's `.grad`, where
        autograd accumulates it (the `Waiting` in `p._pending` holds the claim `(self,
        leaf)`): after backward nothing moves, and an
        optimizer step on the leaves finds it there (`sbp.optim_step`). Gradients waiting
        in another reducer's leaves move to the parameter first; that reducer, no longer
        the only one holding its parameters' gradients, hands them over after backward."""
        self.exclusive = True  # every parameter's gradient waits in this reducer's leaves
        self.claims = [(self, leaf) for leaf in self.leaves]
        self.bases = [p._local for p in self.params]  # what each leaf shares storage with
        for i, (p, claim) in enumerate(zip(self.params, self.claims, strict=True)):
            pending = p._pending
            earlier = None if pending is None else pending.claim
            if earlier is not None and earlier[0] is not self:
                earlier[0].exclusive = False
                grad = earlier[0].take(earlier[1])
                if grad is not None:
                    self._wait(i, grad)
            pending = p._pending  # (`_wait` may have set one)
            waiting = None if pending is None else pending.grad
            if pending is not None:
                pending.grad = None  # (replaced: what it held goes on in the new one)
            # (counted as a rebinding: the optimizer's swap reads the claims)
            p._pending = Waiting(waiting, claim)

    def take(self, leaf: torch.Tensor) -> torch.Tensor | None:
        """The gradient waiting in `leaf` (one of this reducer's), taken out of it; None
        while a backward runs (what the leaf holds then is not summed yet)."""
        if self._queued:
            return None
        grad = TORCH_GRAD.__get__(leaf)
        if grad is not None:
            TORCH_GRAD.__set__(leaf, None)
        return grad

    def drop(self, claims: list) -> None:
        """zero_grad of the gradients waiting in the leaves of `claims` (this reducer's)."""
        if self._queued:
            return
        if self.holds_all(claims):
            run_all(map(TORCH_GRAD.__set__, self.leaves, repeat(None)))  # (in C)
            return
        for _, leaf in claims:
            TORCH_GRAD.__set__(leaf, None)

    def holds_all(self, claims: list) -> bool:
        """Are `claims` all of this reducer's, in order (in C loops)?"""
        return len(claims) == len(self.claims) and all(map(is_, claims, self.claims))

    def _empty_leaves(self, into: Callable[[int, torch.Tensor], None]) -> None:
        """Take each leaf's gradient out of it, giving it to `into(i, grad)`."""
        for i, leaf in enumerate(self.leaves):
            grad = TORCH_GRAD.__get__(leaf)
            if grad is not None:
                TORCH_GRAD.__set__(leaf, None)
                into(i, grad)

    def _reset(self) -> None:
        self._claimed = [False] * len(self._buckets)  # buffer checked free this backward
        self._filled: set[int] = set()
        self._missing = [len(b) for b in self._buckets]
        self._pending: list = [None] * len(self._buckets)
        self._used: list[list[int]] = [[] for _ in self._buckets]  # (counts_on_host)
        self._next = 0
        self._queued = False  # the end-of-backward call is queued

    def _queue_once(self, callback: Callable[[], None]) -> None:
        """Queue `callback` for the end of the running backward, once per backward."""
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(callback)

    def forward_started(self) -> None:
        """Called before each local forward. A backward that raised never ran its
        end-of-backward call: drop what it left, so the next backward starts afresh
        (a forward re-run inside a backward, by checkpointing, changes nothing)."""
        if self._queued and torch._C._current_graph_task_id() == -1:
            self._reset()
            for leaf in self.leaves:
                leaf.grad = None

    def backward_started(self) -> None:
        """Called when a backward enters the local graph (the module's outputs)."""
        if not self.hooked and not self._queued:
            if not all(map(is_, map(_GRAD, self.leaves), repeat(None))):
                # gradients still waiting in the leaves (no zero_grad since the last
                # backward) wait on their parameters: the leaves get this backward's alone
                self._empty_leaves(self._wait)
            self._queue_once(self._hand_over)

    def _hand_over(self) -> None:
        """One rank, after backward: each leaf's gradient is its parameter's. It stays in
        the leaf (`_claim_parameters`), unless under no_sync or where another reducer
        claimed the parameter since."""
        try:
            if self.sync and self._partial_grads:  # (no_sync ended: they are whole now)
                self._partial_grads = False
                for p in self.params:
                    grad = TORCH_GRAD.__get__(p)
                    if grad is not None and grad._spec.nd_sbp == self.partial_nd:
                        grad._spec = grad._spec._replace(nd_sbp=p._spec.nd_sbp)
            if not self.sync:
                self._empty_leaves(self._keep_partial)
            elif not self.exclusive:  # (else, the usual step, they stay in the leaves)
                self._empty_leaves(self._wait)
            elif not all(map(is_, map(TORCH_GRAD.__get__, self.params), repeat(None))):
                for i, (p, leaf) in enumerate(zip(self.params, self.leaves, strict=True)):
                    grad = TORCH_GRAD.__get__(leaf)  # (into the `.grad` held: see `_wait`)
                    if grad is not None and TORCH_GRAD.__get__(p) is not None:
                        TORCH_GRAD.__set__(leaf, None)
                        self._wait(i, grad)
        finally:
            self._queued = False
            if self.on_finish is not None:
                self.on_finish()

    def _hook(self, i: int):
        """Leaf i's post-accumulate hook. It outlives a reducer made anew (a parameter
        frozen: the other leaves are kept), and must return None then too."""
        ref = weakref.ref(self)

        def ready(leaf: torch.Tensor) -> None:
            reducer = ref()
            if reducer is not None:
                reducer._ready(i, leaf)

        return ready

    def _ready(self, i: int, leaf: torch.Tensor) -> None:
        grad, leaf.grad = leaf.grad, None
        if grad is None:  # (taken by another reducer's hook on a shared leaf)
            return
        if self.trace is not None:
            self.trace.append(("ready", i))
        if not self.sync:
            self._keep_partial(i, grad)
            return
        self._queue_once(self._finish)
        b, _ = self._where[i]
        self._slot(i).copy_(grad)
        self._filled.add(i)
        self._missing[b] -= 1
        while self._next < len(self._buckets) and self._missing[self._next] == 0:
            self._launch(self._next)

    def _slot(self, i: int) -> torch.Tensor:
        """Where parameter i's gradient goes in its bucket's flat buffer, shaped as the
        parameter."""
        b, _ = self._where[i]
        if not self._claimed[b]:
            self._claim(b)
        return self._slots[i]

    def _claim(self, b: int) -> None:
        """Keep bucket b's buffer from the last backward unless something outside the reducer
        still holds it (a `.grad` not released by `zero_grad()`, a view of one, a reference
        kept by the user): the gradients handed out are views of it. Else allocate anew."""
        self._claimed[b] = True
        members = self._buckets[b]
        flat = self._flat[b]
        if flat is not None:
            held = _held(flat, [self._slots[j] for j in members])
            if held is not None and held == self._refs[b]:
                return
        sizes = [self.leaves[j].numel() for j in members]
        first = self.leaves[members[0]]
        counts = 0 if self.counts_on_host else len(members)
        flat = torch.empty(sum(sizes) + counts, dtype=first.dtype, device=first.device)
        self._flat[b] = flat
        views = flat.split([*sizes, counts])
        for j, view in zip(members, views, strict=False):
            self._slots[j] = view.view(self.leaves[j].shape)
        del views, view
        self._refs[b] = _held(flat, [self._slots[j] for j in members])

    def _wait(self, i: int, grad: torch.Tensor) -> None:
        """Parameter i's summed gradient waits for it, plain, added to what waits already
        (`waiting.Waiting`; this reducer's spare one holds it where nothing waited); where it
        holds a `.grad` (`zero_grad(set_to_none=False)`, no_sync steps), it goes into that
        one at once, as torch accumulates: a reference kept to it sees this backward. A
        partial one from no_sync steps becomes whole: summed into `grad` already over
        ranks (`_launch`), on one rank added to it (another reducer's may be left)."""
        p = self.params[i]
        current = TORCH_GRAD.__get__(p)
        if current is not None:
            if current._spec.nd_sbp == self.partial_nd:
                if self.hooked:
                    current._local.copy_(grad)
                else:
                    current._local.add_(grad)
                current._spec = current._spec._replace(nd_sbp=p._spec.nd_sbp)
            else:
                current._local.add_(grad)
            return
        waiting = p._pending
        if waiting is None:
            spare = self._spares[i]  # (empty, and in no slot)
            spare.grad = grad
            object.__setattr__(p, "_pending", spare)  # (bookkeeping: not a rebinding)
        elif waiting.grad is None:
            waiting.grad = grad
        else:
            waiting.grad.add_(grad)

    def _launch(self, b: int) -> None:
        members = self._buckets[b]
        used = []
        for i in members:
            slot, g = self._slot(i), self.params[i].grad
            if g is not None and g._spec.nd_sbp == self.partial_nd:  # from no_sync steps
                earlier = g._local
                if i in self._filled:
                    slot.add_(earlier)
                else:
                    slot.copy_(earlier)
                self._filled.add(i)  # (`_wait` gives that `.grad` the sum)
            elif i not in self._filled:  # unused in this backward on this rank
                slot.zero_()
            used.append(1 if i in self._filled else 0)
        flat = self._flat[b]
        if self.counts_on_host:
            self._used[b] = used
        else:
            flat[flat.numel() - len(members) :].copy_(torch.tensor(used, dtype=flat.dtype))
        if self.trace is not None:
            self.trace.append(("launch", b))
        with stats.noted(BUCKETS, implicit=False, phase="backward"):
            self._pending[b] = comm.all_reduce_async(flat, "sum", self.ranks)
        self._next = b + 1

    def _finish(self) -> None:
        try:
            while self._next < len(self._buckets):
                self._launch(self._next)
            if self.counts_on_host:
                counts = torch.tensor([u for used in self._used for u in used], dtype=torch.int64)
                counts = comm.all_reduce(counts, "sum", self.ranks).tolist()
            for b, members in enumerate(self._buckets):
                flat = self._pending[b].wait()
                if flat is not self._flat[b]:  # (a staged collective gives a new tensor)
                    self._flat[b].copy_(flat)
                if self.counts_on_host:
                    used, counts = counts[: len(members)], counts[len(members) :]
                else:
                    used = flat[flat.numel() - len(members) :].tolist()
                for j, i in enumerate(members):
                    if used[j]:
                        self._wait(i, self._slots[i])
        finally:
            self._reset()
            if self.on_finish is not None:
                self.on_finish()

    def _keep_partial(self, i: int, grad: torch.Tensor) -> None:
        from sbp.tensor import GlobalTensor

        if not self.hooked:
            self._partial_grads = True
        p = self.params[i]
        if p.grad is None:
            spec = p._spec._replace(nd_sbp=self.partial_nd, dtype=grad.dtype)
            p.grad = GlobalTensor(grad.detach().clone(), spec)
        elif p.grad._spec.nd_sbp == self.partial_nd:
            p.grad._local.add_(grad)
        else:  # a whole gradient from before no_sync: a partial sum of it, in place
            held = p.grad
            share = held.to_global(sbp=self.partial_nd)  # (local: no communication)
            held._local.copy_(share._local).add_(grad)
            held._spec = share._spec


def _held(flat: torch.Tensor, slots: list[torch.Tensor]) -> tuple[int, int] | None:
    """References to a bucket buffer: tensors sharing its storage, and references to its slots
    (the reducer's own, plus a `.grad` wrapping one, or a name the user keeps)."""
    if not hasattr(torch._C, "_storage_Use_Count"):  # (private: if it goes, never reuse)
        return None
    shared = torch._C._storage_Use_Count(flat.untyped_storage()._cdata)
    return shared, sum(sys.getrefcount(s) for s in slots)


def _plan_buckets(leaves: list, bucket_bytes: int, first_bucket_bytes: int) -> list[list[int]]:
    """Indices of `leaves` per bucket: reverse order, one dtype and device per bucket."""
    buckets: list[list[int]] = []
    sizes: list[int] = []
    open_by_kind: dict = {}
    for i in reversed(range(len(leaves))):
        leaf = leaves[i]
        kind = (leaf.dtype, leaf.device)
        nbytes = leaf.numel() * leaf.element_size()
        b = open_by_kind.get(kind)
        cap = first_bucket_bytes if len(buckets) == 0 or b == 0 else bucket_bytes
        if b is None or (sizes[b] + nbytes > cap and buckets[b]):
            buckets.append([])
            sizes.append(0)
            b = open_by_kind[kind] = len(buckets) - 1
        buckets[b].append(i)
        sizes[b] += nbytes
    return buckets
