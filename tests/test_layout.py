"""DESIGN.md §1's layout table and the tree agree: every module is named in its folder's row,
every module a row names exists, and every package folder has a row. A module moved, added or
removed without a word in the layout fails here (as `mesh/api/run.py` once stayed listed)."""

from __future__ import annotations

import re
from pathlib import Path

from import_graph import PACKAGES, ROOT, project_modules

SECTION = "## 1. Layout"


def _rows() -> dict[str, set[str]]:
    """Each row's folder (e.g. `mesh/serving`) and the `*.py` names its text gives."""
    text = (ROOT / "DESIGN.md").read_text()
    assert SECTION in text, f"DESIGN.md has no section {SECTION!r}"
    body = re.split(r"^#{1,3} ", text.split(SECTION, 1)[1], maxsplit=1, flags=re.MULTILINE)[0]
    rows: dict[str, set[str]] = {}
    for folder, what in re.findall(r"^\| `([\w/]+)/` \| (.*) \|$", body, flags=re.MULTILINE):
        rows[folder] = set(re.findall(r"`([\w]+\.py)`", what))
    return rows


def _folders() -> dict[str, set[str]]:
    """Each package folder of the project and its modules' file names (`__init__.py` aside)."""
    found: dict[str, set[str]] = {}
    for path in project_modules().values():
        folder = path.parent.relative_to(ROOT).as_posix()
        names = found.setdefault(folder, set())
        if path.name != "__init__.py":
            names.add(path.name)
    return found


def test_every_package_folder_has_a_row() -> None:
    missing = sorted(set(_folders()) - set(_rows()))
    assert not missing, f"DESIGN.md §1 has no row for: {missing}"


def test_every_module_is_named_in_its_row() -> None:
    rows = _rows()
    unnamed = sorted(f"{folder}/{name}" for folder, names in _folders().items()
                     for name in names - rows.get(folder, set()))
    assert not unnamed, f"modules DESIGN.md §1 does not name: {unnamed}"


def test_every_module_named_exists() -> None:
    ghosts = sorted(f"{folder}/{name}" for folder, names in _rows().items()
                    if folder.split("/")[0] in PACKAGES or Path(ROOT / folder / "__init__.py").exists()
                    for name in names if not (ROOT / folder / name).exists())
    assert not ghosts, f"DESIGN.md §1 names modules that do not exist: {ghosts}"
