"""The ``elasticps`` package has no import cycles.

The import graph is built statically, with :mod:`ast`: no module of the
package is imported (or executed) by this test. Which imports count:

- **module-level imports and imports inside functions (both kinds)**: an
  edge ``a -> b`` for every ``import``/``from ... import`` in ``a`` that names
  a module ``b`` of the package, wherever it stands: at the top, under ``if``
  or ``try`` at module level, or inside a function or method (a lazy import
  runs too, only later). So a cycle hidden behind a lazy import fails too;
  :func:`test_the_checker_finds_a_cycle_through_a_lazy_import` checks that;
- **not** imports under ``if TYPE_CHECKING:``, which never run;
- ``from pkg import name`` is an edge to ``pkg.name`` when that is a module of
  the package, else to ``pkg``; relative imports are resolved;
- the implicit import of parent packages (``import a.b`` runs
  ``a/__init__.py``) is not an edge: every module would otherwise form a
  cycle with a package ``__init__`` that imports it.

A cycle the project accepts must be listed in :data:`KNOWN_CYCLES` with the
reason; there are none today.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

PACKAGE = "elasticps"
SOURCE = Path(__file__).resolve().parents[2] / "src" / PACKAGE

#: Accepted cycles (their sets of modules) -> why. Keep it empty if at all possible.
KNOWN_CYCLES: dict[frozenset[str], str] = {}

Graph = dict[str, set[str]]


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Module name -> file, for every ``.py`` file of the package under ``root``."""
    modules: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under ``node`` (functions included), except in
    ``if TYPE_CHECKING:`` bodies."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.orelse:
                yield from _imports_in(stmt)
        else:
            yield from _imports(child)


def _imports_in(stmt: ast.stmt) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(stmt, ast.Import | ast.ImportFrom):
        yield stmt
    else:
        yield from _imports(stmt)


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module of the package that importing ``name`` loads, or None if outside it."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path, package: str) -> Graph:
    """Module -> the modules of the package it imports (see the module docstring)."""
    modules = module_files(root, package)
    graph: Graph = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        here = name if is_package else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = here.split(".")
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{alias.name}" for alias in node.names]
            for target in targets:
                resolved = _resolve(target, modules)
                if resolved is not None and resolved != name:
                    graph[name].add(resolved)
    return graph


def cycles(graph: Graph) -> list[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def a_cycle_through(component: frozenset[str], graph: Graph) -> list[str]:
    """One cycle inside ``component``, as a path that returns to its start."""
    start = min(component)
    path = [start]
    seen = {start}
    node = start
    while True:
        succ = sorted(s for s in graph[node] if s in component)
        if start in succ and len(path) > 1:
            return [*path, start]
        fresh = [s for s in succ if s not in seen]
        node = fresh[0] if fresh else succ[0]
        if node in seen:
            return [*path[path.index(node) :], node]
        path.append(node)
        seen.add(node)


def test_the_package_has_no_import_cycles() -> None:
    graph = import_graph(SOURCE, PACKAGE)
    assert "elasticps.coord.store" in graph  # the graph covers the package
    found = cycles(graph)
    new = [c for c in found if c not in KNOWN_CYCLES]
    assert not new, "import cycles (module-level and lazy imports):\n" + "\n".join(
        " -> ".join(a_cycle_through(c, graph)) for c in new
    )
    gone = [c for c in KNOWN_CYCLES if c not in found]
    assert not gone, f"known cycles that no longer exist, remove them: {gone}"


# --- the checker itself ------------------------------------------------------


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_the_checker_finds_a_cycle_through_a_lazy_import(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from pkg import b\n",
            "b.py": "def f():\n    from pkg.sub import c\n",
            "sub/__init__.py": "",
            "sub/c.py": "from .. import a\n",
            "d.py": "import pkg.a\n",
        },
    )
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.sub.c"] == {"pkg.a"}
    assert cycles(graph) == [frozenset({"pkg.a", "pkg.b", "pkg.sub.c"})]
    assert a_cycle_through(cycles(graph)[0], graph) == ["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]


def test_the_checker_ignores_type_checking_imports_and_outside_modules(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "__init__.py": "from pkg import a\n",
            "a.py": (
                "import json\nfrom typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from pkg import b\nelse:\n    import os\n"
            ),
            "b.py": "import pkg.a\nfrom pkg.a import name\n",
        },
    )
    graph = import_graph(tmp_path, "pkg")
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": set(), "pkg.b": {"pkg.a"}}
    assert cycles(graph) == []
