"""planner/'s import graph has no cycle: no module reaches, through any import statement in it
(at the top or inside a function), a module that reaches it back. A cycle is two modules that
can only be read, tested and changed together."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

PLANNER = Path(__file__).resolve().parents[1] / "planner"


def _module(path: Path, root: Path) -> str:
    name = ".".join(path.relative_to(root.parent).with_suffix("").parts)
    return name.removesuffix(".__init__")


def _imports(path: Path, name: str) -> set[str]:
    """Every module named by an import statement anywhere in ``path``, relative ones resolved;
    ``from a import b`` names ``a`` and, where it is a module, ``a.b``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


def import_graph(root: Path = PLANNER) -> nx.DiGraph:
    modules = {_module(p, root): p for p in root.rglob("*.py")}
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for name, path in modules.items():
        graph.add_edges_from((name, target) for target in _imports(path, name) if target in modules and target != name)
    return graph


def cycles(graph: nx.DiGraph) -> list[list[str]]:
    return sorted(sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1)


def test_the_graph_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    graph = import_graph()
    assert graph.number_of_nodes() > 80
    # planner.api imports the search and the cost model inside its functions only
    assert graph.has_edge("planner.api", "planner.search.suggest")
    assert graph.has_edge("planner.api", "planner.cost.estimate")
    # A cycle closed by a lazy import and a relative one is found.
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from . import c\n")
    (pkg / "c.py").write_text("def g():\n    import pkg.a\n")
    assert cycles(import_graph(pkg)) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_planner_has_no_import_cycle() -> None:
    found = cycles(import_graph())
    assert found == [], f"import cycles: {found}"
