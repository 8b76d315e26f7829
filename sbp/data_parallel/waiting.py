"""Gradients waiting for their parameters: the fast path's side of `GlobalTensor._pending`.

The fast path's reducer (`reducer.Reducer`) leaves each summed gradient, this rank's local
part of it, plain, rather than in a new global tensor per parameter and backward. An
optimizer step on locals takes it as it is (`local_grad`, `waiting_grads`) and `zero_grad`
drops it (`drop_waiting`, `optim_step`), so a training step wraps no gradient at all: for
mobilenet_v2, ~160 wrappers made, assigned and freed, ~8 us each on this project's CPU.

A parameter whose gradient waits holds a `Waiting` in its `_pending` slot: `GlobalTensor`'s
`.grad` calls its `take` when read and its `drop` when set. It holds the plain gradient
(`grad`), and on one rank the claim of a reducer whose local leaf's `.grad` is the
parameter's gradient, where autograd accumulated it (`claim`: `(reducer, leaf)`, see
`reducer.Reducer._claim_parameters`): nothing moves after backward, and the optimizer steps
on the leaves. A `Waiting` with a claim stays for good (a new claim replaces it, counted as
a rebinding: the optimizer's swap caches the claims); one without leaves when emptied.
"""

from __future__ import annotations

from itertools import compress, repeat
from operator import attrgetter, is_

import torch

from sbp.gradients import PLAIN_GETTERS, TORCH_GRAD, run_all

PENDING = attrgetter("_pending")  # a global tensor's pending gradient's owner, or None
_PENDING_GRAD = attrgetter("_pending.grad")  # (raises where `_pending` is None)


class Waiting:
    """A parameter's gradient waiting, plain (`grad`) and/or in the leaf of `claim`."""

    __slots__ = ("grad", "claim")

    def __init__(self, grad: torch.Tensor | None = None, claim: tuple | None = None):
        self.grad = grad  # this rank's local part of the summed gradient, or None
        self.claim = claim  # (one-rank Reducer, local leaf), or None

    def take(self, p: torch.Tensor) -> None:
        """Wrap the gradient waiting for global parameter `p` into its `.grad` (or add it to
        the one there): `GlobalTensor.grad` calls this when read. One waiting in a claimed
        leaf is taken from there too (not while a backward runs: see `Reducer.take`)."""
        grad, claim = self.grad, self.claim
        if claim is not None:
            held = claim[0].take(claim[1])
            if held is not None:
                grad = held if grad is None else grad.add_(held)
        if grad is None:
            return
        self.grad = None
        if claim is None:
            object.__setattr__(p, "_pending", None)  # (bookkeeping: not a rebinding)
        current = TORCH_GRAD.__get__(p)
        if current is None:
            spec = p._spec if grad.dtype == p._spec.dtype else p._spec._replace(dtype=grad.dtype)
            TORCH_GRAD.__set__(p, type(p)(grad, spec))  # (a GlobalTensor: params are)
        else:
            current._local.add_(grad)

    def drop(self, p: torch.Tensor) -> None:
        """`p.grad` was set: what waited is dropped (torch's `.grad` holds the new one)."""
        if self.grad is not None:
            self.grad = None
            if self.claim is None:
                object.__setattr__(p, "_pending", None)
        if self.claim is not None:
            self.claim[0].drop([self.claim])


def waiting_grads(params: list) -> list:
    """The gradient waiting plain for each of global `params`, or None (in C loops)."""
    try:
        return list(map(_PENDING_GRAD, params))  # (the usual: every one waits)
    except AttributeError:
        return list(map(getattr, map(PENDING, params), repeat("grad"), repeat(None)))


def claims(params: list) -> list:
    """Each of global `params`' claim, `(one-rank Reducer, leaf)`, or None (in C loops)."""
    return list(map(getattr, map(PENDING, params), repeat("claim"), repeat(None)))


def local_grad(p: torch.Tensor) -> torch.Tensor | None:
    """The local tensor of global `p.grad`, without wrapping a gradient waiting plain for
    `p` (one waiting in a leaf is wrapped: the leaf is the optimizer's local then)."""
    waiting = p._pending
    if waiting is None:
        grad = TORCH_GRAD.__get__(p)
        return None if grad is None else grad._local
    if TORCH_GRAD.__get__(p) is None and waiting.claim is None:
        return waiting.grad
    waiting.take(p)
    grad = TORCH_GRAD.__get__(p)
    return None if grad is None else grad._local


def drop_waiting(params: list) -> bool:
    """`zero_grad` of the waiting gradients of `params` (plain tensors have none); then, has
    none of `params` a `.grad` left? A `zero_grad(set_to_none=True)` then has nothing more
    to do: torch's would read every `.grad` in Python."""
    pending = list(map(getattr, params, repeat("_pending"), repeat(None)))
    if all(map(is_, pending, repeat(None))):  # (nothing waits: op by op, or all taken)
        with PLAIN_GETTERS():
            return all(map(is_, map(TORCH_GRAD.__get__, params), repeat(None)))
    held = list(map(getattr, pending, repeat("claim"), repeat(None)))
    if all(map(is_, held, repeat(None))):
        # (several ranks: every owner holds a plain gradient, and goes; in C loops)
        run_all(map(setattr, filter(None, pending), repeat("grad"), repeat(None)))
        run_all(
            map(object.__setattr__, compress(params, pending), repeat("_pending"), repeat(None))
        )
    else:
        waiting = list(map(getattr, pending, repeat("grad"), repeat(None)))
        for p, owner, grad in zip(params, pending, waiting, strict=True):
            if grad is not None:
                owner.grad = None
                if owner.claim is None:
                    object.__setattr__(p, "_pending", None)
    first = held[0][0] if held and held[0] is not None else None
    if first is not None and first.holds_all(held):
        first.drop(held)  # (the usual: one reducer's claims, all of them)
    elif not all(map(is_, held, repeat(None))):
        by_reducer: dict = {}  # {one-rank Reducer: its claims among params}
        for claim in filter(None, held):
            by_reducer.setdefault(claim[0], []).append(claim)
        for reducer, own in by_reducer.items():
            reducer.drop(own)
    with PLAIN_GETTERS():
        return all(map(is_, map(TORCH_GRAD.__get__, params), repeat(None)))
