"""Each part of the project imports only the parts below it (DESIGN.md §1, RULES.md).

The parts, lowest first. A module may import its own part and any part listed before it, never
one after: so a reader can learn the tree from the bottom up, and a part can be tested, moved or
replaced without the ones above it. Imports inside functions and under TYPE_CHECKING count too.
Which stage/ modules mesh/ may use is narrower still (tests/test_stage_boundary.py).
"""

from __future__ import annotations

from import_graph import project_imports, project_modules

LAYERS: tuple[str, ...] = (
    "config",  # the errors every part raises, and the TOML config
    "proto",  # the wire: generated messages and the protocol version
    "common",  # what both sides speak: ids, sampling, token sequences, the task scope
    "packages",  # layer packages: manifests, GGUF slicing, the Hub
    "stage",  # the stage node: engines, frames, transport, control
    "mesh.model",  # the model as stage 0 knows it: package source, tokenizer, chat template
    "mesh.constraints",  # structured output: grammars and masks
    "mesh.reports",  # records and counters the mesh reports: /health, the snapshot, hop timings
    "mesh.backend",  # the contract between the HTTP API and the mesh
    "mesh.speculative",  # proposers and window controllers, below the generate loop
    "mesh.serving",  # one request's way through stage 0: admission, record, loop, pipeline
    "mesh.routing",  # the route and its repair: plan, claim, load, link, heal
    "mesh.coordinator",  # stage 0: wires routing, serving and speculation into a Backend
    "mesh.observe",  # reads the running coordinator: metrics, readings, the page's sampler
    "mesh.ui",  # the live page's files (no Python but its package marker)
    "mesh.api",  # the OpenAI-compatible HTTP API
    "mesh.cli",  # the `mesh` command
    "bench.harness",  # what every benchmark builds on: setup, rows, the baseline, servers, the client
    "bench.scenarios",  # one module per `mesh bench --scenarios` name
    "bench",  # `mesh bench`'s runner and the standalone measurements: drive the mesh from outside
)

# Imports that break the order, each with the reason it is tolerated. Empty: keep it so.
ALLOWED: frozenset[tuple[str, str]] = frozenset()


def part_of(module: str) -> str:
    """The longest layer name that is `module` or a package above it."""
    found = [layer for layer in LAYERS if module == layer or module.startswith(layer + ".")]
    return max(found, key=len) if found else module.split(".")[0]


def test_every_module_belongs_to_a_part() -> None:
    loose = sorted(m for m in project_modules() if part_of(m) not in LAYERS and m != "mesh")
    assert not loose, f"modules in no part of LAYERS (add the part, in its place): {loose}"


def test_no_part_imports_one_above_it() -> None:
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    upward = []
    for imp in project_imports(project_modules()):
        source, target = part_of(imp.source), part_of(imp.target)
        if imp.target == "mesh" or source not in rank or target not in rank:
            continue  # the mesh package itself holds only a docstring
        if rank[target] > rank[source] and (imp.source, imp.target) not in ALLOWED:
            upward.append(f"{imp.source}:{imp.line} ({source}) imports {imp.target} ({target})")
    assert not upward, "imports that run upward:\n" + "\n".join(upward)


def test_the_allowances_are_still_needed() -> None:
    edges = {(i.source, i.target) for i in project_imports(project_modules())}
    assert edges >= ALLOWED, f"ALLOWED lists imports that are gone, remove them: {sorted(ALLOWED - edges)}"


def test_no_scenario_imports_another() -> None:
    """What two scenarios share lives in bench/harness/, so each scenario reads on its own."""
    crossing = [f"{i.source}:{i.line} imports {i.target}" for i in project_imports(project_modules())
                if part_of(i.source) == part_of(i.target) == "bench.scenarios"
                and "bench.scenarios" not in (i.source, i.target)]
    assert not crossing, "scenarios importing scenarios:\n" + "\n".join(crossing)
