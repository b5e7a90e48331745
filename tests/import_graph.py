"""The project's imports, read from its source with `ast`: nothing is imported, so the rules
about who may import whom are checked in milliseconds and without mlx or llama.cpp."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "mesh", "stage", "packages", "config", "proto", "bench")


@dataclass(frozen=True)
class Import:
    source: str  # the importing module, dotted
    target: str  # a project module it imports, dotted
    line: int
    deferred: bool  # inside a function: runs when called, not when `source` is imported


def project_modules(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Every module of the packages under `root`, by dotted name (a package by its own name)."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def project_imports(modules: dict[str, Path]) -> list[Import]:
    """Every import of a project module by a project module, at any depth of its source."""
    found = (imp for name, path in modules.items() for imp in _imports_of(name, path, modules))
    return list(dict.fromkeys(found))  # `from m import a, b` is one import of m


def _imports_of(name: str, path: Path, modules: dict[str, Path]) -> Iterator[Import]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node, deferred in _import_nodes(ast.parse(path.read_text(), str(path))):
        for target in _targets(node, package, modules):
            # importing a.b.c runs a and a.b first; the packages holding `name` are already running
            for ancestor in _with_ancestors(target):
                if ancestor in modules and ancestor != name and not name.startswith(ancestor + "."):
                    yield Import(name, ancestor, node.lineno, deferred)


def _import_nodes(tree: ast.Module) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Each import statement, and whether a function body holds it."""
    stack: list[tuple[ast.AST, bool]] = [(tree, False)]
    while stack:
        node, deferred = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, deferred
        inner = deferred or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        stack += [(child, inner) for child in ast.iter_child_nodes(node)]


def _targets(node: ast.Import | ast.ImportFrom, package: str, modules: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: `from . import x` in package p names p.x
        anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        base = ".".join([*anchor, *([base] if base else [])])
    # `from p import x` imports the module p.x when there is one, else the name x of p
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]


def _with_ancestors(target: str) -> list[str]:
    parts = target.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


@dataclass(frozen=True)
class Cycle:
    modules: frozenset[str]  # every module of one strongly connected group
    path: tuple[str, ...]  # one shortest loop through it, (a, b, ..., a)


def cycles(edges: dict[str, set[str]]) -> list[Cycle]:
    """The strongly connected groups of more than one module, each with a shortest loop."""
    return [Cycle(frozenset(group), tuple(_shortest_cycle(group, edges))) for group in _groups(edges) if len(group) > 1]


def _groups(edges: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components (Tarjan's algorithm; the graph is ~100 modules deep at most)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group: set[str] = set()
            while not group or v not in group:
                group.add(stack.pop())
            groups.append(group)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return groups


def _shortest_cycle(group: set[str], edges: dict[str, set[str]]) -> list[str]:
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth first inside the group, until an edge leads back to start
        nxt = []
        for v in frontier:
            for w in sorted(edges.get(v, set()) & group):
                if w == start:
                    return [*paths[v], start]
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{sorted(group)} is not strongly connected")
