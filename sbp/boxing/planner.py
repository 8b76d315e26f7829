"""The boxing planner: (source spec) -> (target spec) as a `Plan` of primitive steps. Pure code.

On one placement a plan changes one hierarchy dim at a time; each such step is
a collective (or local work) among the ranks that differ only on that dim.
That is exact only when no later hierarchy dim splits the same tensor dim (the
later split would sub-divide what this dim moves) and no later dim holds a
different partial reduction (the logical value reduces the last hierarchy dim
first). Among the orders of valid steps, Dijkstra picks the one that sends the
fewest bytes from the busiest rank; reducing every dim to broadcast and then
slicing is always valid, so a plan never costs more than going through
broadcast.

Between placements, partial dims are reduced on the source, every target rank
receives the pieces of its block by point-to-point transfers from the source
ranks that hold them (spread over replicas, a rank's own data copied locally),
and target partial dims are made locally.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from sbp.comm import cost
from sbp.layout import GlobalSpec, balanced_sizes, elements_per_index, strided_of, unflattened
from sbp.signature import SBP, NdSbp, broadcast, format_nd_sbp, partials_to_broadcast, short

Box = tuple[tuple[int, int], ...]

COLLECTIVE = {
    ("S", "B"): "all_gather",
    ("S", "S"): "all_to_all",
    ("P", "B"): "all_reduce",
    ("P", "S"): "all_to_all+reduce",
    ("B", "S"): "local slice",
    ("B", "P"): "local",
    ("S", "P"): "local",
}


def _kind(s: SBP) -> str:
    return "S" if s.is_split else "P" if s.is_partial else "B"


def _elem_size(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class Transfer:
    """A piece (`box` in logical coordinates) sent from rank `src` to rank `dst`."""

    src: int
    dst: int
    box: Box


@dataclass(frozen=True)
class Step:
    """One primitive: a group step on hierarchy dim `hdim`, or a point-to-point move."""

    before: GlobalSpec
    after: GlobalSpec
    hdim: int | None = None
    transfers: tuple[Transfer, ...] = ()
    view: bool = False  # a local reshape between a strided split's two views (no hdim)
    sent: dict = field(default_factory=dict, compare=False, hash=False)
    recv: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def collective(self) -> str:
        if self.view:
            return "local view"
        if self.hdim is None:
            return "send/recv"
        a, b = self.before.nd_sbp[self.hdim], self.after.nd_sbp[self.hdim]
        return COLLECTIVE[(_kind(a), _kind(b))]

    @property
    def max_sent(self) -> int:
        return max(self.sent.values(), default=0)

    def __str__(self) -> str:
        if self.view:
            what = f"view {tuple(self.before.shape)} as {tuple(self.after.shape)}"
        elif self.hdim is None:
            what = (
                f"move {self.before.placement.type}{list(self.before.placement.flat_ranks)} "
                f"{format_nd_sbp(self.before.nd_sbp)} -> {self.after.placement.type}"
                f"{list(self.after.placement.flat_ranks)} {format_nd_sbp(self.after.nd_sbp)}"
            )
        else:
            a, b = self.before.nd_sbp[self.hdim], self.after.nd_sbp[self.hdim]
            what = f"hierarchy dim {self.hdim}: {short(a)} -> {short(b)}"
        return f"{what:<48} {self.collective:<18} max sent/rank {self.max_sent} B"


@dataclass(frozen=True)
class Plan:
    src: GlobalSpec
    dst: GlobalSpec
    steps: tuple[Step, ...]

    def bytes_sent(self, rank: int) -> int:
        return sum(s.sent.get(rank, 0) for s in self.steps)

    def bytes_received(self, rank: int) -> int:
        return sum(s.recv.get(rank, 0) for s in self.steps)

    @property
    def cost(self) -> int:
        """Bytes sent by the busiest rank, summed over steps (what the planner minimises)."""
        return sum(s.max_sent for s in self.steps)

    @property
    def collectives(self) -> list[str]:
        return [s.collective for s in self.steps if not s.collective.startswith("local")]

    def __str__(self) -> str:
        src, dst = self.src, self.dst
        head = (
            f"Plan {src.placement.type}{src.placement.ranks} {format_nd_sbp(src.nd_sbp)} -> "
            f"{dst.placement.type}{dst.placement.ranks} {format_nd_sbp(dst.nd_sbp)}, "
            f"shape {tuple(src.shape)} {src.dtype}"
        )
        lines = [head]
        if not self.steps:
            lines.append("  (no step: the layouts are equal)")
        for i, step in enumerate(self.steps, 1):
            lines.append(f"  {i}. {step}")
        ranks = sorted(set(src.placement.flat_ranks) | set(dst.placement.flat_ranks))
        per_rank = ", ".join(f"{r}: {self.bytes_sent(r)}/{self.bytes_received(r)}" for r in ranks)
        lines.append(f"  bytes sent/received per rank: {per_rank}")
        return "\n".join(lines)


# ---------------------------------------------------------------- same placement


def step_is_valid(state: NdSbp, h: int, b: SBP) -> bool:
    """Can hierarchy dim `h` go from `state[h]` to `b` by one group step? (See module doc.)"""
    a = state[h]
    later = state[h + 1 :]
    if a == b:
        return False
    for s in (a, b):
        if s.is_split and any(t.is_split and t.dim == s.dim for t in later):
            return False
    if a.is_partial and b.is_partial:
        return False
    partial = a if a.is_partial else b if b.is_partial else None
    if partial is not None and any(t.is_partial and t.op != partial.op for t in later):
        return False
    return True


def _group_step(before: GlobalSpec, h: int, b: SBP) -> Step:
    after = before._replace(nd_sbp=before.nd_sbp[:h] + (b,) + before.nd_sbp[h + 1 :])
    es = _elem_size(before.dtype)
    a = before.nd_sbp[h]
    kind = (_kind(a), _kind(b))
    sent: dict[int, int] = {}
    recv: dict[int, int] = {}
    placement = before.placement
    if kind in {("S", "B"), ("S", "S"), ("P", "B"), ("P", "S")}:
        for rank in placement.flat_ranks:
            group = placement.group_ranks(rank, h)
            n, me = len(group), group.index(rank)
            shapes = [before.local_shape(r) for r in group]
            mine = shapes[me]
            if kind == ("S", "B"):
                pad = max(s[a.dim] for s in shapes) * elements_per_index(mine, a.dim) * es
                sent[rank] = cost.all_gather_bytes(n, pad)
                recv[rank] = sent[rank]
            elif kind == ("P", "B"):
                sent[rank] = recv[rank] = cost.all_reduce_bytes(n, math.prod(mine) * es)
            else:
                d = b.dim
                parts = balanced_sizes(mine[d], n)
                rest = elements_per_index(mine, d)
                sent[rank] = cost.all_to_all_bytes([p * rest * es for p in parts], me)
                recv[rank] = sum(
                    parts[me] * elements_per_index(s, d) * es
                    for i, s in enumerate(shapes)
                    if i != me
                )
    return Step(before, after, hdim=h, sent=sent, recv=recv)


def _same_placement_steps(src: GlobalSpec, dst_sbp: NdSbp) -> tuple[Step, ...]:
    """Cheapest valid sequence of group steps from `src.nd_sbp` to `dst_sbp` (Dijkstra)."""
    if src.nd_sbp == dst_sbp:
        return ()
    k = len(dst_sbp)
    options = [tuple(dict.fromkeys((src.nd_sbp[h], dst_sbp[h], broadcast))) for h in range(k)]
    counter = itertools.count()
    frontier = [(0, 0, next(counter), src.nd_sbp, ())]
    best: dict[NdSbp, tuple[int, int]] = {src.nd_sbp: (0, 0)}
    while frontier:
        c, nsteps, _, state, steps = heapq.heappop(frontier)
        if state == dst_sbp:
            return steps
        if best.get(state, (c, nsteps)) < (c, nsteps):
            continue
        spec = src._replace(nd_sbp=state)
        for h in range(k):
            for b in options[h]:
                if not step_is_valid(state, h, b):
                    continue
                step = _group_step(spec, h, b)
                nxt = step.after.nd_sbp
                key = (c + step.max_sent, nsteps + 1)
                if key < best.get(nxt, (float("inf"), 0)):
                    best[nxt] = key
                    heapq.heappush(frontier, (*key, next(counter), nxt, (*steps, step)))
    raise AssertionError(f"no boxing path {src.nd_sbp} -> {dst_sbp}")  # unreachable: via B


# ---------------------------------------------------------------- placement change


def _box_of(spec: GlobalSpec, rank: int) -> Box:
    return tuple(spec.ranges(rank))


def _intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    if any(lo >= hi for lo, hi in out):
        return None
    return out


def _transfer_step(src: GlobalSpec, dst: GlobalSpec) -> Step:
    """Point-to-point move of a partial-free layout to another placement."""
    holders: dict[Box, list[int]] = {}
    for r in src.placement.flat_ranks:
        holders.setdefault(_box_of(src, r), []).append(r)
    es = _elem_size(src.dtype)
    transfers, sent, recv = [], {}, {}
    if math.prod(src.shape) > 0:
        for i, r in enumerate(dst.placement.flat_ranks):
            need = _box_of(dst, r)
            for box, replicas in holders.items():
                piece = _intersect(box, need)
                if piece is None:
                    continue
                s = r if r in replicas else replicas[i % len(replicas)]
                transfers.append(Transfer(s, r, piece))
                if s != r:
                    nbytes = math.prod([hi - lo for lo, hi in piece]) * es
                    sent[s] = sent.get(s, 0) + nbytes
                    recv[r] = recv.get(r, 0) + nbytes
    return Step(src, dst, hdim=None, transfers=tuple(transfers), sent=sent, recv=recv)


@lru_cache(maxsize=4096)
def plan_specs(src: GlobalSpec, dst: GlobalSpec) -> Plan:
    """The cheapest plan from `src` to `dst` (same logical shape and dtype). Cached."""
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"boxing keeps the logical shape: {src.shape} vs {dst.shape}")
    if strided_of(src.nd_sbp) is not None or strided_of(dst.nd_sbp) is not None:
        return Plan(src, dst, _strided_steps(src, dst))
    if src.placement == dst.placement:
        return Plan(src, dst, _same_placement_steps(src, dst.nd_sbp))
    mid_src = src._replace(nd_sbp=partials_to_broadcast(src.nd_sbp))
    mid_dst = dst._replace(nd_sbp=partials_to_broadcast(dst.nd_sbp))
    steps = list(_same_placement_steps(src, mid_src.nd_sbp))
    steps.append(_transfer_step(mid_src, mid_dst))
    steps += _same_placement_steps(mid_dst, dst.nd_sbp)
    return Plan(src, dst, tuple(steps))


# ---------------------------------------------------------------- strided splits


def _strided_steps(src: GlobalSpec, dst: GlobalSpec) -> tuple[Step, ...]:
    """A strided split is converted on the unflattened tensor, where it is a plain split
    (`sbp.layout.unflattened`): view, the group steps there, view back. A split of the
    same dim that is not one of whole blocks, another strided split, or a placement change
    goes through broadcast on that hierarchy dim first."""
    a, b = strided_of(src.nd_sbp), strided_of(dst.nd_sbp)
    if src.placement != dst.placement or (a is not None and b is not None and a != b):
        mid = _plain(src) if a is not None else _plain(dst)
        return plan_specs(src, mid).steps + plan_specs(mid, dst).steps
    st = a if a is not None else b
    for spec in (src, dst):
        if strided_of(spec.nd_sbp) is None and not _whole_blocks(spec, st):
            mid = spec._replace(
                nd_sbp=tuple(
                    broadcast if s.is_split and s.dim == st.dim else s for s in spec.nd_sbp
                )
            )
            return plan_specs(src, mid).steps + plan_specs(mid, dst).steps
    u_src, u_dst = unflattened(src, st), unflattened(dst, st)
    steps = _same_placement_steps(u_src, u_dst.nd_sbp)
    if not steps:
        return ()
    return (
        Step(src, u_src, view=True),
        *steps,
        Step(u_dst, dst, view=True),
    )


def _plain(spec: GlobalSpec) -> GlobalSpec:
    return spec._replace(nd_sbp=tuple(broadcast if s.is_strided else s for s in spec.nd_sbp))


def _whole_blocks(spec: GlobalSpec, st) -> bool:
    """Does every rank's part of `st.dim` in plain `spec` consist of whole blocks, the same
    as the unflattened layout's split of the blocks gives?"""
    if not any(s.is_split and s.dim == st.dim for s in spec.nd_sbp):
        return True
    u = unflattened(spec, st)
    k = st.inner
    return all(
        spec.ranges(r)[st.dim] == tuple(x * k for x in u.ranges(r)[st.dim])
        for r in spec.placement.flat_ranks
    )
