"""Mends two places where torch mishandles ordered effectful ops: sbp's traced collectives.

`sbp::all_reduce` and the other ops of `sbp.comm.functional` are ordered effects: AOT
autograd threads a token through their calls, so every rank's graph keeps each one, in
program order. Two steps after tracing lose that (torch 2.11 to 2.14):

- **Inductor's order.** The `with_effects` lowering records an ordering edge from each
  call to the one before, keyed by the new kernel's *buffer* name; the scheduler reads it
  back by *operation* name (pytorch/pytorch#189209), so the edge is lost. Inductor's
  peak-memory reordering then moved a call whose input depends on nothing (a table of
  zeros on a rank with an empty shard) ahead of the one before, on that rank alone, and
  the ranks summed different tables, silently. The wrapped lowering keys the edge by the
  operation's name, as the upstream fix does.
- **Activation checkpointing.** The partitioner saves an effectful op's outputs for
  backward, except inside a checkpointed region, where it recomputes the op in backward
  from a saved token that is None at run time (`AssertionError: expected all
  tensors_saved_with_vc_check to be Tensors`). A collective must run once anyway (all
  ranks in the same place): sbp's ops are saved there too, as pytorch/pytorch#196956
  proposes for ordered effects.

`install()` applies both, once, when an sbp collective is first traced. Where torch
already behaves, the wrappers change nothing.
"""

from __future__ import annotations

from typing import Any

_installed = False


def install() -> None:
    """Wrap the two steps (imported lazily: Inductor and the partitioner are heavy)."""
    global _installed
    if not _installed:
        _installed = True
        _order_inductor_effects()
        _save_collectives_in_checkpoints()


def _order_inductor_effects() -> None:
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


def _save_collectives_in_checkpoints() -> None:
    from torch._functorch import partitioners
    from torch.utils.checkpoint import CheckpointPolicy

    force_save = getattr(partitioners, "force_save_effectful_ops", None)
    if force_save is None:
        return

    def force_save_with_sbp_collectives(joint_module: Any) -> None:
        for node in joint_module.graph.nodes:
            if _is_sbp_collective(node) and partitioners.must_recompute(node):
                node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        force_save(joint_module)

    partitioners.force_save_effectful_ops = force_save_with_sbp_collectives


def _is_sbp_collective(node: Any) -> bool:
    """A `with_effects(token, sbp::<collective>, ...)` node of a joint graph."""
    import torch

    if node.op != "call_function" or node.target is not torch.ops.higher_order.with_effects:
        return False
    op = node.args[1] if len(node.args) > 1 else None
    return getattr(op, "namespace", None) == "sbp"
