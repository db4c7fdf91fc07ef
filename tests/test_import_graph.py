"""The project's modules import one another without a cycle.

Every .py of the packages (zeropp/, megatron_lite/, data/, scripts/) and the entry point
pretrain_zeropp_gpt.py is parsed with ``ast``; each import, at the top of a module or inside a
function, becomes an edge of the module graph. Relative imports are resolved; in
``from pkg import name`` a ``name`` that is a submodule counts as importing that submodule.
Imports under ``if TYPE_CHECKING:`` never run, so they are left out. Importing ``a.b`` is an
edge to ``a.b`` only (not to the package ``a``), so a package ``__init__`` that re-exports its
submodules does not make every submodule's import of a sibling a cycle.

The graph also has floors (``FLOORS``): a module imports its own floor and those below, never
one above, and the project's code imports moved modules by their new paths only.
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


# The floors, bottom first ([Layers] in docs/architecture.md): a module may import modules of its
# own floor and of the floors below it. An entry names a module or a package (with everything
# in it); a module takes the floor of its longest entry. "zeropp" stands for the engine's core,
# the modules at zeropp's root that no other entry names; the package's own __init__ and the
# command shim zeropp/convert.py are its face, above everything in zeropp.
FLOORS = (
    # leaves: the config, the kernels, the facts every part shares, DeepSpeed's parameter
    # attributes, the execution options (they read the config only)
    ("zeropp.kernels", "zeropp.config", "zeropp.topology", "zeropp.flat_layout",
     "zeropp.residency", "zeropp.prefetch", "zeropp.unit_modules", "zeropp.loss_scaler",
     "zeropp.deepspeed_params", "zeropp.acceleration", "data"),
    ("zeropp.comm",),
    ("zeropp",),  # the core: units, the sharded model, the optimizer, offload, reports
    ("zeropp.checkpoints",),
    ("zeropp.engine",),
    ("zeropp.deepspeed_api",),
    ("zeropp.simulation", "zeropp.planning"),
    ("zeropp.__init__", "zeropp.convert"),
    ("megatron_lite",),
    ("scripts", "pretrain_zeropp_gpt"),
)
# Modules that moved into packages; zeropp/__init__.py keeps these old names working for users.
MOVED = {
    "zeropp.checkpoint": "zeropp.checkpoints.checkpoint",
    "zeropp.initialize": "zeropp.deepspeed_api.initialize",
    "zeropp.lr_schedules": "zeropp.deepspeed_api.lr_schedules",
    "zeropp.zero": "zeropp.deepspeed_api.zero",
    "zeropp.zero_to_fp32": "zeropp.checkpoints.zero_to_fp32",
}


def floor_of(module: str) -> int:
    name = "zeropp.__init__" if module == "zeropp" else module
    best, best_length = None, -1
    for index, entries in enumerate(FLOORS):
        for entry in entries:
            if (name == entry or name.startswith(entry + ".")) and len(entry) > best_length:
                best, best_length = index, len(entry)
    if best is None:
        raise AssertionError(f"{module} is on no floor: add it to FLOORS")
    return best


def arrows_up(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{module} -> {target}" for module, targets in graph.items()
                  for target in targets if floor_of(target) > floor_of(module))


def old_path_imports() -> list[str]:
    """Imports of a moved module by its old name, in the project's code (the aliases are for
    users: the graph, which reads files, would not see such an edge)."""
    found = []
    for module, path in project_modules().items():
        if module == "zeropp":
            continue
        for node in _imports(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif node.level == 0 and node.module == "zeropp":
                names = [f"zeropp.{alias.name}" for alias in node.names
                         if alias.name != "initialize"]  # zeropp.initialize, the function
            else:
                names = [node.module or ""] if node.level == 0 else []
            for name in names:
                old = next((old for old in MOVED if name == old or name.startswith(old + ".")), None)
                if old is not None:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name} (now {MOVED[old]})")
    return found


def test_the_graph_sees_the_project():
    graph = import_graph()
    assert "zeropp.engine" in graph and "pretrain_zeropp_gpt" in graph
    assert "zeropp.sharded_model" in graph["zeropp.engine"]
    # imported inside a function:
    assert "zeropp.config" in graph["zeropp.deepspeed_api.initialize"]
    # from zeropp.checkpoints import checkpoint (inside a method):
    assert "zeropp.checkpoints.checkpoint" in graph["zeropp.engine"]
    assert "zeropp.deepspeed_params.param_face" in graph["zeropp.unit"]


def test_floors_name_every_module_and_put_the_core_in_the_middle():
    for module in import_graph():
        floor_of(module)  # raises for a module on no floor
    assert floor_of("zeropp.unit") == floor_of("zeropp.sharded_model") == floor_of("zeropp.optimizer")
    assert floor_of("zeropp.unit") > floor_of("zeropp.deepspeed_params.param_face")
    assert floor_of("zeropp") > floor_of("zeropp.deepspeed_api.zero") > floor_of("zeropp.engine")
    assert floor_of("zeropp.comm.streams") < floor_of("zeropp.offload")
    assert floor_of("zeropp.planning.planner") > floor_of("zeropp.deepspeed_api.initialize")


def test_no_arrow_up():
    up = arrows_up(import_graph())
    assert not up, "imports of a floor above:\n" + "\n".join(up)


def test_arrow_finder_reports_an_import_from_above():
    graph = {"zeropp.unit": {"zeropp.engine", "zeropp.comm"}, "zeropp.engine": {"zeropp.unit"}}
    assert arrows_up(graph) == ["zeropp.unit -> zeropp.engine"]


def test_the_project_imports_moved_modules_by_their_new_paths():
    found = old_path_imports()
    assert not found, "old module paths (kept for users only):\n" + "\n".join(found)


def test_old_module_paths_still_import_for_users():
    import importlib

    import zeropp

    assert set(MOVED) == set(zeropp.MOVED_MODULES)
    for old, new in MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new)
    assert zeropp.checkpoint is importlib.import_module("zeropp.checkpoints.checkpoint")
    assert zeropp.zero.Init is importlib.import_module("zeropp.deepspeed_api.zero").Init
    assert callable(zeropp.initialize)  # the function, as deepspeed.initialize
    from zeropp.convert import from_deepspeed  # the shim of `python -m zeropp.convert`
    assert from_deepspeed is importlib.import_module("zeropp.checkpoints.convert").from_deepspeed


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
