"""Counts that caches over global tensors compare to know when to look again, on one object.

Each is written where the event happens and read by the caches that depend on it (the
data-parallel fast path's parameter slots, the optimizer step on locals). A cache keeps
the count it saw; an unchanged count means nothing it relies on was rebound.
"""

from __future__ import annotations


class Counters:
    """The counts (plain ints: incremented on hot paths)."""

    __slots__ = ("rebinds", "hooks_set", "replaced", "submodules_set")

    def __init__(self) -> None:
        # How many times a watched global tensor was rebound: its local tensor, spec, data
        # or class set (`GlobalTensor.__setattr__`), or the one-rank reducer whose leaf holds
        # its gradient (`_pending`, see sbp.data_parallel.waiting). (Not requires_grad: torch's C++
        # turns it off unseen, as `torch.detach_(p)` does, so the fast path reads it every
        # call.) A cache that checked hundreds of global tensors at one count need not read
        # them again while it holds: nothing else changes what they hold (in-place ops
        # write into the same local tensor). A cache watches what it keeps
        # (`sbp.tensor.watch`); others, such as the gradients sbp's reduction relabels on
        # every backward op by op, do not move the count.
        self.rebinds = 0
        # How many gradient hooks were registered on global tensors (sbp's own included)
        self.hooks_set = 0
        # How many parameters `module.to_global` replaced by new objects
        self.replaced = 0
        # How many submodules any module was given (`model.head = Linear(...)`,
        # `add_module`): the tables a fast path's slots read may then no longer be the
        # module's, though they still hold the same tensors (the old head's)
        self.submodules_set = 0


COUNTS = Counters()
