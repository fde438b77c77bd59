"""The house's import graph, read with `ast` (nothing is imported): circles and imports that climb.

`import_graph(roots)` maps every module of the given packages to the backplane modules it imports,
each edge tagged with where the import sits: at module level ("module"), under `if TYPE_CHECKING:`
("typing") or inside a function ("lazy"). `import_cycles(graph, kinds)` lists the circles among
edges of those kinds; `climbing_imports(graph, floor)` lists every import out of the package
`floor` (the contracts) into a package above it, whatever its kind. tests/test_layering.py holds
backplane to both, and plants violations to show the checks can fail.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    kind: str  # "module", "typing" or "lazy"
    line: int


def module_name(path: Path, root: Path, package: str) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def import_graph(roots: Iterable[tuple[Path, str]]) -> dict[str, list[Edge]]:
    """Every module under each (folder, import name) root -> its imports of modules in the graph."""
    files = {module_name(p, root, pkg): p for root, pkg in roots for p in sorted(Path(root).rglob("*.py"))}
    graph: dict[str, list[Edge]] = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = [Edge(name, _known(t, files), kind, line) for t, kind, line in _imports(tree, package)]
        graph[name] = [e for e in edges if e.target and e.target != name]
    return graph


def _known(target: str, files: dict) -> str:
    """The nearest module of the graph that `target` names (a module, or a name inside one)."""
    while target and target not in files:
        target = target.rpartition(".")[0]
    return target


def _imports(tree: ast.Module, package: str):
    def walk(nodes, kind):
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from walk(node.body, "lazy")
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                yield from walk(node.body, "typing")
                yield from walk(node.orelse, kind)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    yield alias.name, kind, node.lineno
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(node, package)
                for alias in node.names:
                    yield f"{base}.{alias.name}", kind, node.lineno
            else:
                yield from walk(ast.iter_child_nodes(node), kind)

    yield from walk(tree.body, "module")


def _absolute(node: ast.ImportFrom, package: str) -> str:
    if not node.level:
        return node.module or ""
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_cycles(graph: dict[str, list[Edge]], kinds: tuple[str, ...] = ("module",)) -> list[list[str]]:
    """The strongly connected groups of more than one module over edges of `kinds` (Tarjan)."""
    succ = {m: sorted({e.target for e in edges if e.kind in kinds}) for m, edges in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in succ.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for module in sorted(succ):
        if module not in index:
            visit(module)
    return cycles


def climbing_imports(graph: dict[str, list[Edge]], floor: str) -> list[str]:
    """One line per import from a module of package `floor` to a module outside it (any kind)."""
    inside = lambda m: m == floor or m.startswith(floor + ".")  # noqa: E731
    return [f"{e.source}:{e.line} imports {e.target} ({e.kind})"
            for m, edges in sorted(graph.items()) if inside(m) for e in edges
            if not inside(e.target) and e.target.startswith(floor.split(".")[0])]
