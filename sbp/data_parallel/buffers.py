"""The per-shard running statistics' broadcast (`batch_norm="local"`): each rank's differ,
the first rank's are kept, as torch DDP does (it broadcasts buffers)."""

from __future__ import annotations

import torch

from sbp import comm


class BufferBroadcast:
    """The broadcast of one module's running statistics in flight, until settled.

    When a backward follows, the copy runs while it does: it is settled (`settle`) when
    the gradients are, or at the module's next call, state_dict or load_state_dict,
    whichever comes first. Until then another rank's running statistics are still its own
    shard's (torch DDP leaves them so until its next forward)."""

    __slots__ = ("_in_flight",)

    def __init__(self) -> None:
        self._in_flight: tuple | None = None  # (Pending, buffers)

    def start(self, tensors: list[torch.Tensor], group: tuple[int, ...]) -> None:
        """Broadcast `tensors` from `group`'s first rank to the others (one flat copy)."""
        self.settle()
        flat = torch.cat([t.reshape(-1) for t in tensors])
        self._in_flight = (comm.broadcast_async(flat, group[0], group), tensors)

    def settle(self) -> None:
        """Wait for the running statistics' broadcast and write them into the buffers.

        Train-mode BatchNorm's backward never reads the running statistics, so overwriting
        them keeps their version (autograd would otherwise refuse the backward)."""
        if self._in_flight is None:
            return
        pending, tensors = self._in_flight
        self._in_flight = None
        flat = pending.wait()
        offset = 0
        for t in tensors:
            with torch.autograd._unsafe_preserve_version_counter(t):
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
