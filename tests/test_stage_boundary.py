"""mesh/ uses only the stage/ modules DESIGN.md lists, and mesh/backend.py none at all.

The list is read from DESIGN.md's "What mesh/ may use of stage/", so the document and the rule
cannot drift apart: widening the boundary means saying so there.
"""

from __future__ import annotations

import re

from import_graph import ROOT, Import, project_imports, project_modules

SECTION = "### What mesh/ may use of stage/"


def _allowed() -> set[str]:
    """The stage modules named in DESIGN.md's section, as dotted names."""
    text = (ROOT / "DESIGN.md").read_text()
    assert SECTION in text, f"DESIGN.md has no section {SECTION!r}"
    body = text.split(SECTION, 1)[1]
    body = re.split(r"^#{1,3} ", body, maxsplit=1, flags=re.MULTILINE)[0]
    return {"stage." + name for name in re.findall(r"`stage/(\w+)\.py`", body)}


def _mesh_imports_of_stage() -> list[Import]:
    return [i for i in project_imports(project_modules())
            if i.source.split(".")[0] == "mesh" and i.target.split(".")[0] == "stage"]


def test_design_lists_stage_modules_that_exist() -> None:
    allowed = _allowed()
    assert allowed, "DESIGN.md's section lists no stage module"
    assert allowed <= set(project_modules()), f"listed but missing: {sorted(allowed - set(project_modules()))}"


def test_mesh_imports_only_the_listed_stage_modules() -> None:
    allowed = _allowed()
    # the package itself comes with any of its modules (its __init__ holds only a docstring)
    outside = [f"{i.source}:{i.line} imports {i.target}" for i in _mesh_imports_of_stage()
               if i.target not in allowed | {"stage"}]
    assert not outside, f"mesh/ imports stage modules that DESIGN.md ({SECTION}) does not list:\n" + "\n".join(outside)


def test_backend_imports_no_stage_module() -> None:
    found = {f"line {i.line}: {i.target}" for i in _mesh_imports_of_stage() if i.source == "mesh.backend"}
    assert not found, f"mesh/backend.py imports stage modules: {found}"
