"""What a candidate costs later: the guesses that let propagation resolve a partial sum once,
where it pays (docs/design.md, "Data flow of one op").

The boxing planner prices the conversions a candidate needs now. Three more are priced
here: the conversion an input's gradient will need on the way back (`gradient_plan`); in
backward, gathering again what a candidate leaves split after resolving a partial sum
(`gathered_again`); and in backward, reducing the partial outputs of a candidate that
carries a partial sum through (`reduced_later`), which the choice weighs as much as what
moves now (a tie goes to moving less now). All take a partial sum for a sum needed whole,
which a split in disguise is not: those are tracked (`mark_padded`) and left out.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

from sbp.boxing import plan_specs
from sbp.layout import GlobalSpec
from sbp.signature import broadcast

# Partial sums that are splits in disguise: a split input boxed to a partial sum (zeros
# around each rank's part; free, so a view merging a split dim into an outer one takes it:
# a sequence-first batch's (seq, batch) rows) and the partial outputs of ops on them. They
# are resolved into the split again where needed (a data-parallel batch stays split, its
# dropout masks those of the fast path's local run), so the pricing that takes a partial
# sum for a sum needed whole (`gradient_plan`, `gathered_again`) leaves them out. Weak:
# an entry goes with its tensor. Decisions on them are keyed apart (`dispatch`).
PADDED: dict[int, Any] = {}  # id(tensor) -> a weak reference to it (empty: none alive)


def mark_padded(outputs: list, _tree: Any = None) -> None:
    for t in outputs:
        spec = getattr(t, "_spec", None)
        if spec is not None and id(t) not in PADDED and any(s.is_partial for s in spec.nd_sbp):
            PADDED[id(t)] = weakref.ref(t, functools.partial(_unmark, id(t)))


def _unmark(key: int, _ref: Any = None) -> None:
    PADDED.pop(key, None)


def is_padded(t: Any) -> bool:
    ref = PADDED.get(id(t))
    return ref is not None and ref() is t


def gradient_plan(src: GlobalSpec, req: GlobalSpec) -> Any:
    """The plan of the gradient's way back through the conversion `src -> req`, or None
    where it is free. The gradient arrives laid out as `req` (a partial sum's gradient is
    whole) and must leave as `src` needs it: whole for a partial sum, as split for a split;
    a broadcast input takes it as it comes (partial sums included). So resolving a partial
    by a reduce-scatter, cheaper than an all-reduce at that op, is priced with the
    all-gather its gradient then needs: a partial is resolved where it pays, not where it
    is cheapest forward (issue 51)."""
    arriving = tuple(broadcast if s.is_partial else s for s in req.nd_sbp)
    needed = tuple(
        broadcast if s.is_partial else (a if s.is_broadcast else s)
        for s, a in zip(src.nd_sbp, arriving, strict=True)
    )
    if arriving == needed:
        return None
    return plan_specs(req._replace(nd_sbp=arriving), src._replace(nd_sbp=needed))


def gathered_again(specs: list[GlobalSpec], req: tuple, metas: list, combo: tuple) -> list:
    """Where a candidate in backward resolves an input's partial sum into a split (a
    reduce-scatter, cheaper than an all-reduce at this op), or resolves one beside a split
    it makes by slicing (on a dim where no input is split), the plans that gather its
    outputs split there back to whole: a gradient that is a sum of the ranks' parts flows
    on to the gradients of whole forward values (the residual stream of a
    tensor-parallel block), and the split would only move the other half of the
    all-reduce to a later op. Resolving straight to broadcast then costs as much and runs
    one collective, not two. Forward needs no such guess: the gradient's own conversion
    is priced (`gradient_plan`), and a partial there may be a split in disguise (a view
    merging a split dim into an outer one), which a data-parallel batch keeps split."""
    pairs = [
        (h, a, b)
        for s, r in zip(specs, req, strict=True)
        for h, (a, b) in enumerate(zip(s.nd_sbp, r.nd_sbp, strict=True))
    ]
    dims = {h for h, a, b in pairs if a.is_partial and b.is_split}
    P = specs[0].placement
    if any(a.is_partial and not b.is_partial for _, a, b in pairs):
        # (resolved to broadcast beside a split the candidate makes by slicing, on a dim
        # where no input is split: the resolved half is gathered back there too)
        dims |= {h for h in range(P.ndim) if not any(s.nd_sbp[h].is_split for s in specs)}
    if not dims:
        return []
    return _outputs_made_whole(
        P,
        metas,
        combo,
        lambda nd: (
            tuple(broadcast if h in dims and s.is_split else s for h, s in enumerate(nd))
            if any(nd[h].is_split for h in dims)
            else None
        ),
    )


def reduced_later(specs: list[GlobalSpec], req: tuple, metas: list, combo: tuple) -> list:
    """In backward, where an input is a partial sum along a hierarchy dim (a candidate
    carries it through, or resolves it), the plans that make the candidate's partial
    outputs whole along that dim: a gradient is, as a rule, needed whole later (see `gathered_again`), and a
    weight's is reduced in the buckets. Carried free, a partial went on to ops that
    resolved it worse (gathering activations instead), or spread to more outputs than it
    came in with (a LayerNorm's backward: its input's gradient and both weights'); priced,
    it goes through only where its outputs cost less to reduce than its input (the first
    LayerNorm, whose input needs no gradient: only its weights' gradients). A split this
    candidate makes by slicing, on a dim where no input is split, is gathered back in the
    same plan (a smaller reduction of a slice is no saving). Partial outputs made from
    splits alone (a contraction over a split dim) are left out: there the planner already
    prices the alternative, gathering."""
    # (an input partial as it is, carried or resolved here: resolved into a split and made
    # partial again by the op, it would be reduced twice; not a split boxed to a partial
    # here, which is a split in disguise, `mark_padded`)
    dims = {h for s in specs for h, a in enumerate(s.nd_sbp) if a.is_partial}
    if not dims:
        return []
    P = req[0].placement
    sliced = {
        h for h in range(P.ndim) if h not in dims and not any(s.nd_sbp[h].is_split for s in specs)
    }
    return _outputs_made_whole(
        P,
        metas,
        combo,
        lambda nd: (
            tuple(
                broadcast if (h in dims and s.is_partial) or (h in sliced and s.is_split) else s
                for h, s in enumerate(nd)
            )
            if any(nd[h].is_partial for h in dims)
            else None
        ),
    )


def _outputs_made_whole(P, metas: list, combo: tuple, whole_of: Callable) -> list:
    """The plans converting each output of a candidate (its nd sbp from `combo`) to
    `whole_of(nd)`, for the outputs where that is not None."""
    plans, k = [], 0
    for m in metas:
        if m is None:
            continue
        nd = tuple(c.outputs[k] for c in combo)
        k += 1
        whole = whole_of(nd)
        if whole is not None:
            plans.append(
                plan_specs(GlobalSpec(P, nd, m[0], m[1]), GlobalSpec(P, whole, m[0], m[1]))
            )
    return plans
