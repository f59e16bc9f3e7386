"""The import layout, read from the source (``ast``: every import, at the top of a module or
inside a function, ``TYPE_CHECKING`` blocks included): no import circle among the project's
modules, ``unnorm/`` on torch and the standard library alone, ``analysis/`` without the
plugins, and the training stack layered (``plugins.distributed`` and ``plugins.precision``
at the bottom, then ``plugins.checkpoints``, then ``plugins.fsdp``; the loop and the run
skeleton above them, never imported by them)."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("plugins", "unnorm", "analysis", "scripts")  # scripts/ import each other by file name
# what each module of the training stack may import from plugins (nothing above it)
LAYERS = {
    "plugins.distributed": set(),
    "plugins.precision": set(),
    "plugins.checkpoints": {"plugins.distributed"},
    "plugins.fsdp": {"plugins.distributed", "plugins.precision"},
}


def module_files(root: Path) -> dict[str, Path]:
    """Every project module under ``root``: dotted name -> file (a package is its
    ``__init__.py``)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """``(imported name, line)`` for every import in the module ``name``, relative ones
    resolved; a name is the module it loads (a submodule where ``from package import x``
    names one), else what it names outside the project."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            for alias in node.names:
                submodule = f"{module}.{alias.name}"
                found.append((submodule if submodule in modules else module, node.lineno))
    if name.startswith("scripts."):  # a script imports a script beside it by its file name
        found = [(f"scripts.{target}" if f"scripts.{target}" in modules else target, line)
                 for target, line in found]
    return found


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """The project's modules, each with the project modules it imports (and the line)."""
    modules = module_files(root)
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, {})
        for target, line in imports(name, path, modules):
            while target and target not in modules:  # ``import a.b.c``: the deepest module there
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.setdefault(target, line)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The import circles: each strongly connected group of modules (Tarjan), as a cycle
    through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_through(group, graph) for group in groups]


def _cycle_through(group: list[str], graph: dict[str, dict[str, int]]) -> list[str]:
    """One circle within a strongly connected ``group``, from its first module back to it."""
    start, path, seen = group[0], [group[0]], {group[0]}
    while True:
        target = next(t for t in sorted(graph[path[-1]]) if t in group and (t == start or t not in seen))
        if target == start:
            return path + [start]
        path.append(target)
        seen.add(target)


def describe(cycle: list[str], graph: dict[str, dict[str, int]], root: Path) -> str:
    modules = module_files(root)
    return " -> ".join(f"{a} ({modules[a].relative_to(root)}:{graph[a][b]})"
                       for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_no_import_circle():
    graph = import_graph(REPO)
    assert {"plugins.training", "plugins.loop", "unnorm", "analysis.runs", "scripts.train"} <= set(graph)
    assert "plugins.distributed" in graph["plugins.fsdp"], "the graph misses a plain import"
    assert "plugins.fsdp" in graph["plugins.training"]
    found = cycles(graph)
    assert not found, "import circles:\n" + "\n".join(describe(c, graph, REPO) for c in found)


def test_the_check_finds_a_circle_made_by_an_import_inside_a_function(tmp_path):
    """The check itself: ``a`` imports ``b`` at its top, ``b`` imports ``a`` in a function
    (what a lazy import hides at import time), ``c`` only ``b``."""
    package = tmp_path / "plugins"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from plugins.b import g\n")
    (package / "b.py").write_text("def g():\n    from . import a\n    return a\n")
    (package / "c.py").write_text("import plugins.b\n")
    graph = import_graph(tmp_path)
    assert graph["plugins.c"] == {"plugins.b": 1}
    assert cycles(graph) == [["plugins.a", "plugins.b", "plugins.a"]]


def test_unnorm_imports_torch_and_the_standard_library_only():
    modules = module_files(REPO)
    allowed = set(sys.stdlib_module_names) | {"torch", "unnorm"}
    offenders = [f"{path.relative_to(REPO)}:{line} imports {target}"
                 for name, path in modules.items() if name.split(".")[0] == "unnorm"
                 for target, line in imports(name, path, modules)
                 if target.split(".")[0] not in allowed]
    assert not offenders, "\n".join(offenders)


def test_analysis_imports_no_plugin():
    """``analysis/`` reads runs and features: no plugin (their models, frameworks, trainers),
    not even inside a function (``tests/test_analysis_layout.py`` checks what importing it
    loads)."""
    graph = import_graph(REPO)
    offenders = [f"{name} imports {target}" for name, edges in graph.items()
                 if name.split(".")[0] == "analysis" for target in edges
                 if target.split(".")[0] == "plugins"]
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("module", sorted(LAYERS))
def test_the_training_stack_imports_nothing_above_it(module):
    graph = import_graph(REPO)
    above = {target for target in graph[module] if target.split(".")[0] == "plugins"}
    assert above <= LAYERS[module], f"{module} imports {sorted(above - LAYERS[module])}"
