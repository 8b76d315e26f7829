"""Layouts at module boundaries: tensor parallelism stated per module, as Megatron and
DTensor users write it.

`sbp.nn.parallelize(model, plan, placement)` takes a plan keyed by module names
(`model.named_modules()`; `"*"` matches one name part, as in `"blocks.*.fc1"`) whose
values say how each `Linear` or `Embedding` is laid out:

- `ColwiseParallel()`: a Linear's weight and bias `split(0)` (its output features), an
  Embedding's weight `split(1)`; the input is taken broadcast and, in backward, its
  gradient is reduced to broadcast here (Megatron's "f").
- `RowwiseParallel(output=sbp.broadcast)`: a Linear's weight `split(1)` (its input
  features), its bias broadcast; the partial output is reduced here, in forward, to
  `output` (Megatron's "g"; `sbp.split(1)` for sequence-first activations reduce-scatters
  instead, as sequence parallelism does), and its gradient arrives in that layout.

The conversions are written as `to_global` at the module boundaries, so a plan's model
communicates what Megatron does (2 all-reduces per MLP block forward, 2 backward) and
runs under `sbp.strict()`. Parameters are converted from what each rank holds: a plain
module's whole tensors (equal on every rank, as `module.to_global(P, sbp.broadcast)`
takes them) or a global module's parameters; the parameters and buffers the plan does
not name become broadcast. Make the optimizer afterwards.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch

from sbp.errors import InputTypeError, InputValueError
from sbp.placement import placement as Placement
from sbp.signature import SBP, broadcast, split
from sbp.tensor import GlobalTensor


class ColwiseParallel:
    """Output features split over the placement; the input broadcast, its gradient
    reduced to broadcast here in backward."""

    def weight_sbp(self, module: torch.nn.Module) -> dict[str, SBP]:
        if isinstance(module, torch.nn.Embedding):
            return {"weight": split(1)}
        return {"weight": split(0), "bias": split(0)}

    def prepare_input(self, x: Any, tp_dim: int) -> Any:
        """Broadcast along `tp_dim` (a sequence-split input is gathered); its gradient goes
        back in the input's own layout there (reduced, or reduce-scattered)."""
        if not isinstance(x, GlobalTensor):
            return x
        own = x.sbp[tp_dim]
        if own.is_partial:
            raise InputTypeError(
                f"ColwiseParallel: an input partial along hierarchy dim {tp_dim}; reduce it "
                "first (RowwiseParallel's output does)"
            )
        nd = _on_dim(x.sbp, tp_dim, broadcast)
        if nd == x.sbp and not x.requires_grad:
            return x
        return x.to_global(sbp=nd, grad_sbp=x.sbp) if x.requires_grad else x.to_global(sbp=nd)

    def prepare_output(self, y: Any, tp_dim: int) -> Any:
        return y

    def __repr__(self) -> str:
        return "ColwiseParallel()"


class RowwiseParallel:
    """Input features split over the placement; the partial output reduced here to
    `output` (broadcast by default), its gradient taken in that layout."""

    def __init__(self, output: SBP = broadcast):
        if not isinstance(output, SBP) or output.is_partial:
            raise InputTypeError(
                f"RowwiseParallel: output must be sbp.broadcast or sbp.split(d), got {output!r}"
            )
        self.output = output

    def weight_sbp(self, module: torch.nn.Module) -> dict[str, SBP]:
        if isinstance(module, torch.nn.Embedding):
            raise InputTypeError(
                "RowwiseParallel of an Embedding (its vocabulary split) has no rule yet; "
                "use ColwiseParallel (its embedding dim split)"
            )
        return {"weight": split(1), "bias": broadcast}

    def prepare_input(self, x: Any, tp_dim: int) -> Any:
        return x

    def prepare_output(self, y: Any, tp_dim: int) -> Any:
        """The partial sum reduced (or reduce-scattered) to `output` along `tp_dim`; its
        gradient goes back whole there (gathered from a split output)."""
        if isinstance(y, GlobalTensor):
            nd = _on_dim(y.sbp, tp_dim, self.output)
            return y.to_global(sbp=nd, grad_sbp=_on_dim(y.sbp, tp_dim, broadcast))
        return y

    def __repr__(self) -> str:
        return f"RowwiseParallel(output={self.output!r})"


Style = ColwiseParallel | RowwiseParallel


def parallelize(
    module: torch.nn.Module, plan: dict[str, Style], placement: Placement, tp_dim: int = -1
) -> torch.nn.Module:
    """Lay out the modules `plan` names (see the module's docstring); return `module`.

    On an n-D placement the styles apply along hierarchy dim `tp_dim` (the last by
    default) and the parameters are broadcast along the others: data parallel there
    when the batch is split along them (DP x TP), their gradients reduced in buckets."""
    if not isinstance(module, torch.nn.Module):
        raise InputTypeError(f"parallelize: module must be a torch.nn.Module, got {module!r}")
    if not isinstance(placement, Placement):
        raise InputTypeError(f"parallelize: placement must be an sbp.placement, got {placement!r}")
    if not isinstance(tp_dim, int) or not -placement.ndim <= tp_dim < placement.ndim:
        raise InputValueError(
            f"parallelize: tp_dim={tp_dim!r} is not a hierarchy dim of {placement}"
        )
    tp_dim %= placement.ndim
    if not isinstance(plan, dict):
        raise InputTypeError(f"parallelize: plan must be a dict of names to styles, got {plan!r}")
    named = dict(module.named_modules())
    for pattern, style in plan.items():
        if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
            raise InputTypeError(
                f"parallelize: plan[{pattern!r}] must be ColwiseParallel() or "
                f"RowwiseParallel(), got {style!r}"
            )
        matches = [n for n in named if n and fnmatch.fnmatchcase(n, pattern)]
        if not matches:
            raise InputValueError(f"parallelize: plan names {pattern!r}, which no module matches")
        for name in matches:
            _lay_out(named[name], style, placement, name, tp_dim)
    _the_rest_broadcast(module, placement)
    return module


def _the_rest_broadcast(module: torch.nn.Module, P: Placement) -> None:
    """Plain parameters and buffers the plan did not lay out (LayerNorm's, an embedding's
    outside the plan) become broadcast on `P`, as `module.to_global(P, sbp.broadcast)`
    takes them: every rank's whole tensor."""
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None and not isinstance(p, GlobalTensor):
                g = p.detach().to_global(P, (broadcast,) * P.ndim)
                m._parameters[name] = torch.nn.Parameter(g, requires_grad=p.requires_grad)
        for name, b in list(m._buffers.items()):
            if b is not None and not isinstance(b, GlobalTensor):
                m._buffers[name] = b.to_global(P, (broadcast,) * P.ndim)


def _on_dim(nd: tuple, dim: int, s: SBP) -> tuple:
    return tuple(s if h == dim else x for h, x in enumerate(nd))


def _lay_out(m: torch.nn.Module, style: Style, P: Placement, name: str, tp_dim: int) -> None:
    if not isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
        raise InputTypeError(
            f"parallelize: {name!r} is a {type(m).__name__}; ColwiseParallel and "
            "RowwiseParallel lay out Linear and Embedding modules"
        )
    for pname, s in style.weight_sbp(m).items():
        p = getattr(m, pname)
        if p is None:
            continue
        nd = _on_dim((broadcast,) * P.ndim, tp_dim, s)
        if isinstance(p, GlobalTensor):
            g = p.detach().to_global(P, nd)
        else:
            g = p.detach().to_global(P, (broadcast,) * P.ndim).to_global(sbp=nd)  # (whole)
        setattr(m, pname, torch.nn.Parameter(g, requires_grad=p.requires_grad))
    m.register_forward_pre_hook(
        lambda _m, args: tuple(style.prepare_input(a, tp_dim) for a in args)
    )
    m.register_forward_hook(lambda _m, _args, out: style.prepare_output(out, tp_dim))
