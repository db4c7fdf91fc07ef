"""The project's modules import one another without a cycle.

Every .py of the packages (zeropp/, megatron_lite/, data/, scripts/) and the entry point
pretrain_zeropp_gpt.py is parsed with ``ast``; each import, at the top of a module or inside a
function, becomes an edge of the module graph. Relative imports are resolved; in
``from pkg import name`` a ``name`` that is a submodule counts as importing that submodule.
Imports under ``if TYPE_CHECKING:`` never run, so they are left out. Importing ``a.b`` is an
edge to ``a.b`` only (not to the package ``a``), so a package ``__init__`` that re-exports its
submodules does not make every submodule's import of a sibling a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("zeropp", "megatron_lite", "data", "scripts")
ENTRY_POINTS = ("pretrain_zeropp_gpt.py",)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            modules[_module_name(path)] = path
    for entry in ENTRY_POINTS:
        modules[_module_name(ROOT / entry)] = ROOT / entry
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST):
    """Every Import / ImportFrom node, in source order, except under ``if TYPE_CHECKING:``."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
        return
    if isinstance(node, ast.If) and _is_type_checking(node.test):
        children = node.orelse
    else:
        children = list(ast.iter_child_nodes(node))
    for child in children:
        yield from _imports(child)


def _resolve_base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    if node.level > 1:
        package = package[: len(package) - (node.level - 1)]
    if node.module:
        package = package + node.module.split(".")
    return ".".join(package)


def _nearest_project_module(name: str, modules: dict[str, Path]) -> str | None:
    """``a.b.c`` itself if it is ours, else its nearest enclosing module that is ours."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _imports(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _resolve_base(module, is_package, node)
                for alias in node.names:
                    submodule = f"{base}.{alias.name}" if base else alias.name
                    targets.append(submodule if submodule in modules else base)
            for target in targets:
                found = _nearest_project_module(target, modules)
                if found is not None and found != module:
                    graph[module].add(found)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = [0]

    def connect(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                connect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)

    cycles = []
    for component in components:
        members = set(component)
        start = component[0]
        # Shortest path from start back to start inside the component (breadth first).
        parents: dict[str, str] = {}
        frontier = [start]
        while frontier and start not in parents:
            following = []
            for node in frontier:
                for succ in sorted(graph[node] & members):
                    if succ not in parents:
                        parents[succ] = node
                        following.append(succ)
            frontier = following
        path = [start]
        node = parents[start]
        while node != start:
            path.append(node)
            node = parents[node]
        path.append(start)
        path.reverse()
        cycles.append(path)
    return cycles


def test_the_graph_sees_the_project():
    graph = import_graph()
    assert "zeropp.engine" in graph and "pretrain_zeropp_gpt" in graph
    assert "zeropp.sharded_model" in graph["zeropp.engine"]
    assert "zeropp.config" in graph["zeropp.initialize"]  # imported inside a function
    assert "zeropp.checkpoint" in graph["zeropp.engine"]  # from zeropp import checkpoint


def test_relative_and_submodule_imports_resolve():
    modules = {"p": ROOT / "p/__init__.py", "p.a": ROOT / "p/a.py", "p.b": ROOT / "p/b.py"}
    tree = ast.parse("from . import b\nfrom .b import thing\n")
    bases = [_resolve_base("p.a", False, node) for node in _imports(tree)]
    assert bases == ["p", "p.b"]
    assert _nearest_project_module("p.b.thing", modules) == "p.b"


def test_cycle_finder_reports_a_loop():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    cycles = find_cycles(import_graph())
    listing = "\n".join(" -> ".join(cycle) for cycle in cycles)
    assert not cycles, f"import cycles:\n{listing}"
