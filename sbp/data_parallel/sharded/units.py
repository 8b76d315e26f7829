"""Which submodules are gathered as one (the units of sharded data parallelism).

A unit's sharded parameters are all-gathered together before its forward and their
gradients reduce-scattered together after its backward, as one FSDP2 `fully_shard`
group. The policy, documented in docs/sharded_data_parallel.md:
- the user names them (`sbp.nn.data_parallel(model, units=["blocks.0", ...])`), or
- walking down from the root, the children of every `nn.Sequential`, `nn.ModuleList` and
  `nn.ModuleDict` met (the repeated blocks of a model: a transformer's layers, a conv
  net's stages) that hold parameters become units, without looking inside a unit;
  a model with no such container takes its direct children holding parameters.
Everything else (embeddings beside the blocks, a final norm, a head) is the root unit,
gathered for the whole call. A parameter held by modules in two units (tied weights) or
outside its unit is the root's too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sbp.errors import InputValueError

CONTAINERS = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)


@dataclass
class Unit:
    """One gathering unit: its name ("" for the root), its module (None for the root) and
    the sharded parameters it gathers, in module order."""

    name: str
    module: torch.nn.Module | None
    params: list = field(default_factory=list)


def _holds_params(m: torch.nn.Module) -> bool:
    return next(m.parameters(), None) is not None


def chosen(root: torch.nn.Module) -> list[str]:
    """The unit names the default policy picks (module docstring)."""
    names: list[str] = []

    def walk(m: torch.nn.Module, prefix: str) -> bool:
        found = False
        for name, child in m.named_children():
            path = f"{prefix}{name}"
            if isinstance(m, CONTAINERS) and _holds_params(child):
                names.append(path)
                found = True
            elif walk(child, path + "."):
                found = True
        return found

    if not walk(root, ""):
        names = [name for name, child in root.named_children() if _holds_params(child)]
    return names


def units_of(root: torch.nn.Module, sharded: list, names: list[str] | None) -> list[Unit]:
    """The root unit first, then one `Unit` per name (the default policy's where `names` is
    None), each with the sharded parameters (`sharded`, global tensors) only it holds."""
    modules = dict(root.named_modules())
    if names is None:
        names = chosen(root)
    for n in names:
        if n not in modules or n == "":
            raise InputValueError(
                f"sbp.nn.data_parallel: units names {n!r}, which is not a submodule of "
                f"{type(root).__name__} (names as in model.named_modules())"
            )
        if type(modules[n]).forward is torch.nn.Module.forward:
            raise InputValueError(
                f"sbp.nn.data_parallel: units names {n!r}, a {type(modules[n]).__name__} "
                "with no forward of its own (never called): name its children"
            )
    nested = [(a, b) for a in names for b in names if a != b and b.startswith(a + ".")]
    if nested:
        raise InputValueError(
            f"sbp.nn.data_parallel: units {nested[0][1]!r} lies inside {nested[0][0]!r}; "
            "name units that do not nest"
        )
    owner: dict[int, str] = {}  # id(param): the one unit holding it, or "" (the root)
    for path, m in root.named_modules():
        unit = next((n for n in names if path == n or path.startswith(n + ".")), "")
        for p in m._parameters.values():
            if p is None:
                continue
            seen = owner.get(id(p), unit)
            owner[id(p)] = unit if seen == unit else ""
    units = [Unit("", None)] + [Unit(n, modules[n]) for n in names]
    by_name = {u.name: u for u in units}
    placed: set[int] = set()
    for p in sharded:
        if id(p) not in placed:
            placed.add(id(p))
            by_name[owner.get(id(p), "")].params.append(p)
    return [u for u in units if u.params or u.module is None]
