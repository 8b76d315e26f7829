"""Keep ordered effectful ops (sbp's traced collectives) in program order under Inductor.

Every rank must issue its collectives in the same order. `sbp::all_reduce` and the other
ops of `sbp.comm.functional` are ordered effects: AOT autograd threads a token through
their calls, and Inductor's `with_effects` lowering records an ordering edge from each call to the one before. In
torch 2.11 to 2.14 that edge is keyed by the new kernel's *buffer* name while the
scheduler reads it back by *operation* name (pytorch/pytorch#189209), so the edge is lost.
Inductor's peak-memory reordering is then free to move a call whose input does not depend
on the previous one (a table of zeros on a rank with an empty shard) ahead of it. Ranks
whose graphs differ (uneven or empty shards) then pair up different calls, and tables of
one shape add up silently wrong.

`install()` wraps the lowering so the edge is keyed by the operation's name, as the
upstream fix does; where the lowering already does so, the wrapper changes nothing.
"""

from __future__ import annotations

from typing import Any

_installed = False


def install() -> None:
    """Wrap Inductor's `with_effects` lowering once (imported lazily: Inductor is heavy)."""
    global _installed
    if _installed:
        return
    _installed = True
    import torch
    from torch._inductor import lowering
    from torch._inductor.virtualized import V

    target = torch.ops.higher_order.with_effects
    lower = lowering.lowerings.get(target)
    if lower is None:
        return

    def with_effects_in_order(*args: Any, **kwargs: Any) -> Any:
        graph = V.graph
        first = len(graph.operations)
        result = lower(*args, **kwargs)
        edges = getattr(graph, "additional_star_deps", None)
        if edges is not None:
            for op in graph.operations[first:]:
                buffer_name, op_name = op.get_name(), op.get_operation_name()
                if buffer_name != op_name and buffer_name in edges:
                    edges[op_name] |= edges.pop(buffer_name)
        return result

    lowering.lowerings[target] = with_effects_in_order
