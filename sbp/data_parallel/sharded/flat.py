"""One unit's parameters as one flat buffer per rank (FSDP2's copy-in / all-gather /
copy-out): where each parameter's rows sit in every rank's flat shard and in the
gathered whole, so one all-gather brings a unit's parameters and one reduce-scatter
takes back their gradients. Pure index arithmetic over logical shapes; uneven dim 0
(7 rows over 2 ranks) pads each rank's flat shard to the longest, never the tensors."""

from __future__ import annotations

from math import prod

import torch

from sbp.layout import local_ranges
from sbp.placement import placement as Placement


class FlatUnit:
    """The flat layout of `params` (global tensors split along dim 0 on hierarchy dim
    `shard_dim` of `placement`, the same nd-sbp and dtype) over `ranks`, the ranks that
    hold one copy of them between them (in placement order; this rank is `ranks[me]`)."""

    def __init__(self, params: list, placement: Placement, ranks: tuple[int, ...], me: int):
        self.params, self.ranks, self.me = params, ranks, me
        spec = params[0]._spec
        self.dtype, self.device = spec.dtype, params[0]._local.device
        self.shapes = [tuple(p._spec.shape) for p in params]
        self.numels = [prod(s) for s in self.shapes]
        self.rows = [prod(s[1:]) for s in self.shapes]  # elements per row of dim 0
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]  # in the whole
        self.total = sum(self.numels)
        # (the whole parameters' bytes, counted each time a unit is gathered or freed)
        self.gathered_bytes = self.total * torch.empty((), dtype=self.dtype).element_size()
        # per member k: each parameter's [start, stop) rows, and offset in k's flat shard
        self.row_ranges: list[list[tuple[int, int]]] = []
        self.shard_offsets: list[list[int]] = []
        longest = 0
        for r in ranks:
            coord = placement.coord(r)
            spans = [
                local_ranges(p._spec.shape, placement.hierarchy, p._spec.nd_sbp, coord)[0]
                for p in params
            ]
            offs, at = [], 0
            for (a, b), row in zip(spans, self.rows, strict=True):
                offs.append(at)
                at += (b - a) * row
            self.row_ranges.append(spans)
            self.shard_offsets.append(offs)
            longest = max(longest, at)
        self.shard_len = longest  # each member's flat shard, padded to the longest

    def local_shapes(self, k: int) -> list[tuple[int, ...]]:
        return [(b - a, *s[1:]) for (a, b), s in zip(self.row_ranges[k], self.shapes, strict=True)]

    def copy_in(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """This rank's flat shard of `shards` (its local tensors), padded."""
        flat = torch.empty(self.shard_len, dtype=self.dtype, device=self.device)
        at = 0
        for t in shards:
            n = t.numel()
            flat[at : at + n].view(t.shape).copy_(t)
            at += n
        if at < self.shard_len:
            flat[at:].zero_()
        return flat

    def copy_out(self, gathered: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The whole parameters from the gathered flat shards (`(members, shard_len)`): one
        buffer, and each parameter as a view of it."""
        whole = torch.empty(self.total, dtype=self.dtype, device=self.device)
        views = self.views(whole)
        for k, (spans, offs) in enumerate(zip(self.row_ranges, self.shard_offsets, strict=True)):
            chunk = gathered[k]
            for view, (a, b), off, row in zip(views, spans, offs, self.rows, strict=True):
                n = (b - a) * row
                if n:
                    view.view(-1)[a * row : b * row].copy_(chunk[off : off + n])
        return whole, views

    def views(self, whole: torch.Tensor) -> list[torch.Tensor]:
        return [
            whole[o : o + n].view(s)
            for o, n, s in zip(self.offsets, self.numels, self.shapes, strict=True)
        ]

    def grads_in(self, grads: list[torch.Tensor | None], into: torch.Tensor | None) -> torch.Tensor:
        """Whole gradients laid out as the members' flat shards (`(members, shard_len)`),
        added to `into` where given (accumulating), else a new buffer; None adds nothing."""
        fresh = into is None
        if fresh:
            into = torch.empty(
                len(self.ranks), self.shard_len, dtype=self.dtype, device=self.device
            )
        for k, (spans, offs) in enumerate(zip(self.row_ranges, self.shard_offsets, strict=True)):
            chunk = into[k]
            at = 0
            for g, (a, b), off, row in zip(grads, spans, offs, self.rows, strict=True):
                n = (b - a) * row
                at = off + n
                if not n:
                    continue
                slot = chunk[off:at]
                if g is None:
                    if fresh:
                        slot.zero_()
                elif fresh:
                    slot.copy_(g.reshape(-1)[a * row : b * row])
                else:
                    slot.add_(g.reshape(-1)[a * row : b * row])
            if fresh and at < self.shard_len:
                chunk[at:].zero_()  # (padding)
        return into

    def shard_grads(self, reduced: torch.Tensor) -> list[torch.Tensor]:
        """This rank's gradient of each parameter, views of its reduced flat shard."""
        return self.shard_views(reduced)

    def shard_views(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """This rank's part of each parameter, views of its flat shard (`shard_len`)."""
        return [
            shard[off : off + prod(s)].view(s)
            for off, s in zip(self.shard_offsets[self.me], self.local_shapes(self.me), strict=True)
        ]
