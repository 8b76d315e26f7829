"""The data-parallel package's internal layering (docs/design.md, Data parallelism): each
module imports only modules listed after it, so its imports form no circle."""

import ast
import pathlib

import sbp

PACKAGE = pathlib.Path(sbp.__file__).parent / "data_parallel"

# top first: a module may import (at module level) only modules after it
LAYERS = [
    "memory",
    "api",
    "call",
    "sharded",
    "sharded.state",
    "sharded.flat",
    "sharded.units",
    "torch_compile",
    "compiled_batch_norm",
    "check",
    "local_run",
    "families",
    "families.attention",
    "families.batch_norm",
    "families.dropout",
    "families.embedding_bag",
    "families.losses",
    "families.recurrent",
    "families.sdpa",
    "batch_rows",
    "outputs",
    "shard_batch_norm",
    "row_wise_calls",
    "recomputation",
    "output_leaves",
    "reducer",
    "buffers",
    "slots",
    "inputs",
    "layout",
    "by_name",
    "names_replaced",
    "optim_step",
    "waiting",
]


def _imports(path: pathlib.Path) -> set[str]:
    """The package's modules `path` imports outside `if TYPE_CHECKING:` blocks."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If):  # (TYPE_CHECKING: annotations only)
            continue
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            if name.startswith("sbp.data_parallel."):
                found.add(name.removeprefix("sbp.data_parallel."))
    return found & set(LAYERS)


def test_the_data_parallel_modules_import_down_only():
    modules = {
        ".".join(p.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__"): p
        for p in PACKAGE.rglob("*.py")
        if p.name != "__init__.py" or p.parent != PACKAGE
    }
    assert sorted(modules) == sorted(LAYERS)
    for name, path in modules.items():
        below = set(LAYERS[LAYERS.index(name) + 1 :])
        imported = _imports(path) - {name}  # (a package naming its own modules)
        assert imported <= below, (name, imported - below)
