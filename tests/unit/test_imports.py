"""Layering of Genie's modules: no import cycle among module-level imports, and no import of
Genie's own modules inside a function but the listed ones (each deferring a heavy or optional
dependency, or a known cycle still to be layered away).

The core is layered (docs/architecture: ``graph`` at the bottom, then ``device``, ``meta``, the
planner and plan cache, the backends and ``executor``, the tensor facade ``lazy_tensor``, then
``factories``, ``capture`` and ``export``), so every module can be imported and read on its own
and no function needs an import inside it only to dodge a cycle. This test parses every module of
the package (``ast``, nothing is imported) and fails on a cycle among imports at module level
(imports under ``if TYPE_CHECKING:`` and inside functions are not edges).
"""

from __future__ import annotations

import ast
from pathlib import Path

import genie

PKG = Path(genie.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _top_level_imports(stmts: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    out: list[ast.Import | ast.ImportFrom] = []
    for st in stmts:
        if isinstance(st, (ast.Import, ast.ImportFrom)):
            out.append(st)
        elif isinstance(st, ast.If):
            t = st.test
            if (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
                    isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"):
                continue  # typing only: never executed
            out += _top_level_imports(st.body) + _top_level_imports(st.orelse)
        elif isinstance(st, ast.Try):
            out += _top_level_imports(st.body)
            for h in st.handlers:
                out += _top_level_imports(h.body)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports at module level (parents of a submodule are
    not counted: importing ``genie.x`` runs ``genie/__init__`` first in any case)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        package = name if is_pkg else name.rpartition(".")[0]
        for st in _top_level_imports(ast.parse(path.read_text(), str(path)).body):
            if isinstance(st, ast.Import):
                targets = [a.name for a in st.names]
            else:
                if st.level:
                    base_parts = package.split(".")
                    base_parts = base_parts[:len(base_parts) - (st.level - 1)]
                    base = ".".join(base_parts + ([st.module] if st.module else []))
                else:
                    base = st.module or ""
                targets = [base] + [f"{base}.{a.name}" for a in st.names]
            for t in targets:
                if t in mods and t != name and not name.startswith(t + "."):
                    graph[name].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle (as a list of modules, first repeated last), or None; deterministic order."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, (
        "import cycle among genie's module-level imports: " + " -> ".join(cycle or []) +
        ". Move the shared types down (genie.graph, genie.device, genie.meta) instead of "
        "importing inside a function.")


def test_cycle_finder_sees_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_graph_has_the_core_edges() -> None:
    # the parser resolves relative imports: a sanity check that the test can fail
    g = import_graph()
    assert "genie.graph" in g["genie.planner"]
    assert "genie.executor" in g["genie.lazy_tensor"]
    assert "genie.meta" in g["genie.lazy_tensor"]


# --- imports inside functions ---------------------------------------------------------------------
#
# A function-level import of one of Genie's own modules is allowed only where it defers a heavy
# or optional dependency. Every one left is listed here, (module, function, imported module):
# reason. One dodges an import cycle (``_CYCLE``: a function on the wrong layer, to be moved
# down, issue 28); none may be added.
_DEFERS_ZMQ = "defers the remote client (pyzmq, msgpack: the optional 'remote' extra)"
_DEFERS_RAY = "defers the pool's server side and ray (the optional 'pool' extra)"
_PLUGINS = "registers the built-in passes/backends on first use (their modules import the registry)"
_CYCLE = ("cycle: the native replay imports genie.graphs, which asks the compiled backend "
          "(above it) for its compiler and agreement check; to move down (issue 28)")
ALLOWED_FUNCTION_IMPORTS: dict[tuple[str, str, str], str] = {
    ("genie", "_autoload", "genie.device"):
        "torch's backend autoload entry point: runs while genie/__init__ has not imported torch",
    ("genie.backends", "_load_builtin", "genie.backends.compiled"): _PLUGINS,
    ("genie.backends", "_load_builtin", "genie.backends.eager"): _PLUGINS,
    ("genie.backends.remote", "connect", "genie.remote.client"): _DEFERS_ZMQ,
    ("genie.backends.remote", "connect", "genie.remote.pool"): _DEFERS_RAY,
    ("genie.backends.remote", "connect", "genie.remote.placement"): _DEFERS_ZMQ,
    ("genie.backends.remote", "_upload_now", "genie.remote.protocol"): _DEFERS_ZMQ,
    ("genie.backends.remote", "fetch_values", "genie.remote.client"): _DEFERS_ZMQ,
    ("genie.backends.remote", "_run_split", "genie.remote.client"): _DEFERS_ZMQ,
    ("genie.backends.remote", "run", "genie.remote.client"): _DEFERS_ZMQ,
    ("genie.backends.remote", "run", "genie.remote.protocol"): _DEFERS_ZMQ,
    ("genie.device", "_native", "genie"): "the native module once genie/__init__ loaded it",
    ("genie.dynamo", "install", "genie.factories"): "defers torch._dynamo's backend setup",
    ("genie.dynamo", "install", "genie.lazy_tensor"): "defers torch._dynamo's backend setup",
    ("genie.graphs", "_first_run", "genie.backends.compiled"): _CYCLE,
    ("genie.passes", "optimize", "genie.passes.cse"): _PLUGINS,
    ("genie.passes", "optimize", "genie.passes.dce"): _PLUGINS,
    ("genie.passes.pipeline", "_load_builtin", "genie.passes.cse"): _PLUGINS,
    ("genie.passes.pipeline", "_load_builtin", "genie.passes.dce"): _PLUGINS,
    ("genie.passes.pipeline", "_load_builtin", "genie.passes.fold"): _PLUGINS,
    ("genie.passes.pipeline", "_load_builtin", "genie.passes.recompute"): _PLUGINS,
    ("genie.passes.pipeline", "_load_builtin", "genie.passes.split_foreach"): _PLUGINS,
    ("genie.remote.pool", "server_flags", "genie.remote.server"): _DEFERS_RAY,
    ("genie.remote.pool", "main", "genie.remote.server"): _DEFERS_RAY,
    ("genie.remote.pool", "__init__", "genie.remote.server"): _DEFERS_RAY,
}


def function_level_imports() -> set[tuple[str, str, str]]:
    """(module, function, imported module) for every import of one of the package's modules
    inside a function (a method counts under its own name; nested functions too)."""
    mods = _modules()
    out: set[tuple[str, str, str]] = set()
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        package = name if is_pkg else name.rpartition(".")[0]
        for fn in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for st in ast.walk(fn):
                if isinstance(st, ast.ImportFrom):
                    if st.level:
                        parts = package.split(".")
                        parts = parts[:len(parts) - (st.level - 1)]
                        base = ".".join(parts + ([st.module] if st.module else []))
                    else:
                        base = st.module or ""
                    targets = {f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                               for a in st.names}
                elif isinstance(st, ast.Import):
                    targets = {a.name for a in st.names}
                else:
                    continue
                out |= {(name, fn.name, t) for t in targets if t in mods}
    return out


def test_function_level_imports_only_where_listed() -> None:
    found = function_level_imports()
    new = sorted(found - ALLOWED_FUNCTION_IMPORTS.keys())
    assert not new, (
        "imports of genie's own modules inside functions: " + ", ".join(
            f"{f} in {m} imports {t}" for m, f, t in new) + ". Import at module level; if that "
        "makes a cycle, move the shared code down a layer (docs/architecture.md). Only a heavy "
        "or optional dependency may be deferred: then list it in ALLOWED_FUNCTION_IMPORTS with "
        "its reason.")
    gone = sorted(ALLOWED_FUNCTION_IMPORTS.keys() - found)
    assert not gone, f"no longer imported inside a function: remove from the table: {gone}"


def test_function_level_import_counter_sees_one() -> None:
    # a sanity check that the test can fail: a plugin registration that stays deferred
    assert ("genie.backends", "_load_builtin", "genie.backends.eager") in function_level_imports()
