"""sbp's import graph: every module imports on its own, and the one cycle is documented.

docs/design.md ("Layers") says imports point down, except for one two-way pair:
`sbp.tensor` (the GlobalTensor type) and `sbp.ops` (the rules its dispatch runs, which build
on it). These tests hold the code to that:

- each module of sbp imports on its own, before any other sbp module, in a fresh
  interpreter (forked from one that has imported what sbp imports of other packages, torch's
  modules above all, so each costs a fraction of a second), without `sbp/__init__.py` having run first: so the pair works whichever side
  is imported first;
- read from the source (ast), the modules' top-level imports form one cycle only, and it
  is that pair: with `sbp.ops.*` taken as one node, the only strongly connected set is
  {`sbp.tensor`, `sbp.ops`};
- no module in `sbp/ops` imports `sbp.tensor` inside a function (they import it at the
  top: the pair is explicit), nor any other sbp module;
- imports inside functions that close a cycle the top-level imports do not show (a hidden
  cycle) are counted, and the count may only go down (`HIDDEN_CYCLE_CEILING`).
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "sbp"

# Function-level imports that close a cycle of sbp modules (see `_hidden_cycle_imports`).
# Each is listed in the test's failure message; lower this when one goes, never raise it.
HIDDEN_CYCLE_CEILING = 0


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(module: str, path: Path, modules: dict) -> tuple[set[str], list[tuple[str, int]]]:
    """(sbp modules imported at the top level, [(sbp module, line)] imported inside
    functions), `if TYPE_CHECKING:` blocks left out. `from pkg import name` counts as an
    import of `pkg.name` where that is a module, else of `pkg`."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    top: set[str] = set()
    inner: list[tuple[str, int]] = []

    def targets(node: ast.Import | ast.ImportFrom) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names if a.name in modules]
        base = node.module or ""
        if node.level:
            parts = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join(parts + ([node.module] if node.module else []))
        found = []
        for a in node.names:
            full = f"{base}.{a.name}"
            if full in modules:
                found.append(full)
            elif base in modules:
                found.append(base)
        return found

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for t in targets(child):
                    if t != module:
                        if in_function:
                            inner.append((t, child.lineno))
                        else:
                            top.add(t)
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for sub in child.orelse:
                    visit(ast.Module(body=[sub], type_ignores=[]), in_function)
            else:
                function = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                visit(child, in_function or function)

    visit(ast.parse(path.read_text()), False)
    return top, inner


def _graph() -> tuple[dict[str, set[str]], dict[str, list[tuple[str, int]]]]:
    modules = _modules()
    top, inner = {}, {}
    for name, path in modules.items():
        top[name], inner[name] = _imports(name, path, modules)
    return top, inner


def _collapse(name: str) -> str:
    """`sbp.ops.registry` -> `sbp.ops`: the rules are one side of the pair."""
    return "sbp.ops" if name.startswith("sbp.ops.") else name


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected sets of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.add(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(part)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = {start}, [start]
    while todo:
        v = todo.pop()
        if v == goal:
            return True
        for w in graph.get(v, ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return False


def _hidden_cycle_imports() -> list[str]:
    """Imports inside functions from a module that the imported one reaches back to through
    top-level imports (the pair taken as one node): a cycle the top-level graph hides."""
    top, inner = _graph()
    collapsed: dict[str, set[str]] = {}
    for v, ws in top.items():
        collapsed.setdefault(_collapse(v), set()).update(_collapse(w) for w in ws)
    pair = {"sbp.tensor", "sbp.ops"}
    hidden = []
    for v, found in inner.items():
        for w, line in found:
            a, b = _collapse(v), _collapse(w)
            if a == b or {a, b} <= pair:
                continue  # within one node
            if _reaches(collapsed, b, a):
                hidden.append(f"{v}:{line} -> {w}")
    return hidden


def test_top_level_imports_have_one_cycle_the_documented_pair():
    top, _ = _graph()
    collapsed: dict[str, set[str]] = {}
    for v, ws in top.items():
        collapsed.setdefault(_collapse(v), set()).update(_collapse(w) for w in ws if w)
    for v in collapsed:
        collapsed[v].discard(v)
    assert _cycles(collapsed) == [{"sbp.tensor", "sbp.ops"}]
    # and the pair is a real one at the top level: each side imports the other there
    assert "sbp.ops" in top["sbp.tensor"]
    assert any("sbp.tensor" in top[m] for m in top if m.startswith("sbp.ops."))


def _ops_imports_inside_functions() -> list[tuple[str, int, str]]:
    """(module, line, imported sbp module) of each import inside a function in sbp/ops."""
    _, inner = _graph()
    return [
        (m, line, target)
        for m, imports in inner.items()
        if m == "sbp.ops" or m.startswith("sbp.ops.")
        for target, line in imports
    ]


def test_no_function_level_import_of_sbp_tensor_in_ops():
    found = _ops_imports_inside_functions()
    assert [f"{m}:{line}" for m, line, target in found if target == "sbp.tensor"] == []


def test_ops_import_sbp_modules_at_the_top_only():
    """Stronger than the above: an ops module's sbp imports are all at its top."""
    assert [f"{m}:{line} -> {t}" for m, line, t in _ops_imports_inside_functions()] == []


def test_hidden_cycles_do_not_grow():
    hidden = _hidden_cycle_imports()
    assert len(hidden) <= HIDDEN_CYCLE_CEILING, "\n".join(hidden)


_CHILDREN = textwrap.dedent(
    """
    import importlib, importlib.util, os, sys, traceback, types

    root, names = sys.argv[1], sys.argv[2:]

    # What sbp imports of other packages (torch's modules above all), imported here once:
    # a probe child imports sbp and names them.
    read, write = os.pipe()
    if os.fork() == 0:
        before = set(sys.modules)
        import sbp
        new = [m for m in sys.modules if m not in before and m.split(".")[0] != "sbp"]
        os.write(write, "\\n".join(new).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        others = f.read().split()
    os.wait()
    for m in others:
        try:
            importlib.import_module(m)
        except BaseException:
            pass

    def child(name):
        if name != "sbp":  # sbp/__init__.py not run first: the module's own imports only
            package = types.ModuleType("sbp")
            package.__path__ = [os.path.join(root, "sbp")]
            sys.modules["sbp"] = package
        try:
            importlib.import_module(name)
        except BaseException:
            sys.stderr.write(f"--- {name}\\n{traceback.format_exc()}")
            sys.stderr.flush()
            os._exit(1)
        os._exit(0)

    if importlib.util.find_spec("cupy") is None:  # (an optional dependency: the cuda extra)
        names.remove("sbp.kernels.cupy_launcher")
    failed, running, todo = [], {}, list(names)
    while todo or running:
        while todo and len(running) < 2:
            name = todo.pop(0)
            pid = os.fork()
            if pid == 0:
                child(name)
            running[pid] = name
        pid, status = os.wait()
        if status != 0:
            failed.append(running[pid])
        del running[pid]
    print("FAILED", *failed)
    """
)


def test_each_module_imports_on_its_own_in_a_fresh_interpreter():
    """Each module first, alone, forked from an interpreter that imported no sbp module."""
    names = sorted(_modules())
    done = subprocess.run(
        [sys.executable, "-c", _CHILDREN, str(ROOT), *names],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-5000:]
    assert done.stdout.split() == ["FAILED"], done.stderr[-5000:]
