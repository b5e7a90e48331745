"""No import cycles among the project's modules (common, mesh, stage, packages, config, proto,
bench).

An import inside a function counts as much as one at the top of the module. Deferring an import
only hides a cycle from Python's import machinery: the two modules still cannot be understood,
tested or moved one without the other. That is how the two cycles this test was written against
lived on: `bench/run.py` imported its scenarios inside `_run` while they imported its
harness, and `stage/engine_choice.py` imports the MLX engine inside `open_engine` while the
engine imported its tensor-type check. An import under `if TYPE_CHECKING:` counts too: the types
are part of what a module means. A deferred import that points down the graph (to keep mlx out of
a llama.cpp stage, or a subcommand out of `mesh --help`) is fine; only a loop is refused.
"""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

from import_graph import Cycle, Import, cycles, project_imports, project_modules

# Cycles tolerated until the change that removes them merges, each as the set of modules of its
# strongly connected group. None today. An entry that matches no cycle any more fails the test,
# so it goes with the cycle.
KNOWN_CYCLES: frozenset[frozenset[str]] = frozenset()


def _edges(imports: list[Import]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for imp in imports:
        edges.setdefault(imp.source, set()).add(imp.target)
    return edges


def _describe(cycle: Cycle, imports: list[Import]) -> str:
    where = {(i.source, i.target): i for i in sorted(imports, key=lambda i: -i.line)}  # its first line
    hops = [where[(a, b)] for a, b in pairwise(cycle.path)]
    others = sorted(cycle.modules - set(cycle.path))
    return " -> ".join(cycle.path) + " (" + ", ".join(
        f"{h.source}:{h.line}{' in a function' if h.deferred else ''}" for h in hops) + ")" + (
        f"; tangled with {', '.join(others)}" if others else "")


def test_the_project_has_no_import_cycle() -> None:
    imports = project_imports(project_modules())
    found = cycles(_edges(imports))
    new = [_describe(c, imports) for c in found if c.modules not in KNOWN_CYCLES]
    assert not new, "import cycles:\n" + "\n".join(new)
    gone = KNOWN_CYCLES - {c.modules for c in found}
    assert not gone, f"KNOWN_CYCLES lists cycles that are gone, remove them: {[sorted(g) for g in gone]}"


def test_a_cycle_through_a_function_level_import_is_found(tmp_path: Path) -> None:
    """The reader sees an import in a function body, and a cycle through it is named."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "choice.py").write_text("def open_it():\n    from pkg.engine import Engine\n    return Engine()\n")
    (pkg / "engine.py").write_text("from pkg.choice import open_it\n\nclass Engine: ...\n")
    (pkg / "leaf.py").write_text("from . import engine\n")
    imports = project_imports(project_modules(tmp_path, ("pkg",)))
    assert Import("pkg.choice", "pkg.engine", 2, deferred=True) in imports
    assert Import("pkg.leaf", "pkg.engine", 1, deferred=False) in imports  # relative, `from . import m`
    assert cycles(_edges(imports)) == [Cycle(frozenset({"pkg.choice", "pkg.engine"}),
                                             ("pkg.choice", "pkg.engine", "pkg.choice"))]
