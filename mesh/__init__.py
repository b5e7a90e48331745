"""The coordinator and CLI: `mesh serve`, `mesh stage`, `mesh package …`, `mesh status`, `mesh bench`.

meshpipe installs its parts as top-level packages (`config`, `common`, `packages`, `stage`,
`proto`, `bench` beside `mesh`; DESIGN.md §1 says why they keep those names). A module of the
same name earlier on `sys.path` (a `config.py` in the directory `python -m mesh.cli` runs
from, another distribution's `common`) would be imported in their place and fail somewhere
deep; so the first import of `mesh` checks where each would come from, without importing it,
and names the one that stands in the way.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

PARTS = ("config", "common", "packages", "stage", "proto", "bench")


class ShadowedPartError(ImportError):
    """Another module stands where one of meshpipe's parts should be imported from."""


def shadowing(root: Path) -> list[tuple[str, str]]:
    """(part, where it would be imported from) for each part of meshpipe found outside `root`."""
    found = []
    for part in PARTS:
        spec = importlib.util.find_spec(part)
        where = spec.origin or next(iter(spec.submodule_search_locations or ()), None) if spec else None
        if where is not None and not Path(where).resolve().is_relative_to(root):
            found.append((part, str(where)))
    return found


if stray := shadowing(Path(__file__).resolve().parent.parent):
    raise ShadowedPartError("meshpipe's parts are shadowed: " + "; ".join(
        f"'{part}' would be imported from {where}" for part, where in stray)
        + " (rename that module, or run from another directory)")
