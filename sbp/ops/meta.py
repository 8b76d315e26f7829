"""Output metadata of an op on the logical inputs, found by running it on meta tensors.

Two things make that harder than it sounds:

- Many meta kernels are Python references wrapped in `torch._disable_dynamo`, whose
  first call imports `torch._dynamo` (about 4 s). Until something else imports
  dynamo, nothing is being compiled, so "disable dynamo for this function" means
  nothing: `skip_dynamo_import()` gives those wrappers a stand-in that calls the
  function straight, and hands over to the real `torch._dynamo.disable` once
  dynamo is loaded.
- Some ops have no meta kernel (`aten.equal`, `nonzero`, `masked_select`): their
  output depends on the data. `outputs` raises `NoMeta` for them; the registry
  then runs them on broadcast inputs (`sbp.ops.registry.run_data_dependent`).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.utils._pytree import tree_map

from sbp import comm, env
from sbp.tensor import GlobalTensor


class NoMeta(Exception):
    """The op's output metadata cannot be found without its data."""


class _DynamoDisableStandIn:
    """Stands in for `torch._dynamo.disable(fn)` while dynamo is not imported."""

    def __init__(self, fn, recursive: bool):
        self.fn, self.recursive = fn, recursive

    def __call__(self, *args, **kwargs):
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is not None and hasattr(dynamo, "disable"):
            real = dynamo.disable(self.fn, self.recursive, wrapping=False)
            self.fn.__dynamo_disable = real
            return real(*args, **kwargs)
        return self.fn(*args, **kwargs)


_installed: list[bool] = []


def _meta_modules() -> list:
    import torch._decomp
    import torch._decomp.decompositions
    import torch._prims
    import torch._refs
    import torch._refs.linalg
    import torch._refs.nn.functional
    import torch._refs.special

    return [
        torch._refs,
        torch._refs.linalg,
        torch._refs.nn.functional,
        torch._refs.special,
        torch._prims,
        torch._decomp.decompositions,
        sys.modules.get("torch._meta_registrations"),
    ]


def skip_dynamo_import() -> None:
    """Give every `_disable_dynamo` wrapper reachable from torch's meta kernels a stand-in."""
    if _installed:
        return
    _installed.append(True)
    if "torch._dynamo" in sys.modules:
        return
    import torch._compile
    from torch._decomp import global_decomposition_table

    inner_code = torch._compile._disable_dynamo(lambda: None).__code__
    roots: list = []
    for table in global_decomposition_table.values():
        roots.extend(table.values())
    for module in _meta_modules():
        if module is not None:
            roots.extend(v for v in vars(module).values() if callable(v))
    seen: set[int] = set()
    for f in roots:
        while f is not None and id(f) not in seen:
            seen.add(id(f))
            if getattr(f, "__code__", None) is inner_code:
                cells = dict(zip(f.__code__.co_freevars, f.__closure__ or (), strict=True))
                fn, recursive = cells["fn"].cell_contents, cells["recursive"].cell_contents
                if getattr(fn, "__dynamo_disable", None) is None:
                    fn.__dynamo_disable = _DynamoDisableStandIn(fn, recursive)
            f = getattr(f, "__wrapped__", None)


def _meta(a: Any) -> Any:
    if isinstance(a, GlobalTensor):
        return torch.empty(a.shape, dtype=a.dtype, device="meta")
    if isinstance(a, torch.Tensor):
        return a.to("meta")
    return a


def _returns_tensors(func) -> bool:
    schema = getattr(func, "_schema", None)
    return schema is None or any("Tensor" in str(r.type) for r in schema.returns)


_no_meta: set = set()


def outputs(func, args: tuple, kwargs: dict) -> tuple[list, Any]:
    """(shape, dtype) or None per flat output leaf, and the output tree; `NoMeta` if unknowable."""
    if not _returns_tensors(func):  # aten.equal, aten.is_same_size, ...: no tensor out
        n = len(func._schema.returns)
        return [None] * n, (None if n == 1 else (tuple, n))
    if func in _no_meta:
        raise NoMeta(str(func))
    skip_dynamo_import()
    try:
        out = func(*tree_map(_meta, args), **tree_map(_meta, kwargs))
    except (NotImplementedError, RuntimeError) as e:
        if "meta" not in str(e).lower():
            raise
        _no_meta.add(func)
        raise NoMeta(str(func)) from e
    leaves, tree = (
        (list(out), (type(out), len(out))) if isinstance(out, (list, tuple)) else ([out], None)
    )
    metas = [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else None for t in leaves]
    return metas, tree


_DTYPES = [getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)]


def outside_ranks_learn(P, metas: list, inside: bool) -> list:
    """Ranks outside `P` learn the output metadata from its first rank (every rank calls, SPMD)."""

    world = tuple(range(env.get_world_size()))
    if len(world) == P.size:
        return metas
    ints: list[int] = []
    for m in metas if inside else []:
        ints += [-1] if m is None else [len(m[0]), *m[0], _DTYPES.index(m[1])]
    rows = comm.exchange({}, world, ints, "a data-dependent op's output")
    row, out, i = rows[P.flat_ranks[0]], [], 0
    while i < len(row):
        if row[i] == -1:
            out.append(None)
            i += 1
            continue
        n = row[i]
        out.append((tuple(row[i + 1 : i + 1 + n]), _DTYPES[row[i + 1 + n]]))
        i += n + 2
    return out
