"""meshpipe's parts keep their top-level names (DESIGN.md §1); a module that shadows one is
named at the first import of `mesh`, not left to fail somewhere deep."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import mesh

ROOT = Path(mesh.__file__).resolve().parent.parent


def test_every_part_is_found_in_meshpipe_s_own_tree() -> None:
    assert mesh.shadowing(ROOT) == []


def test_a_part_found_elsewhere_is_named_with_where_it_is() -> None:
    # seen from another root, every part is somewhere else
    found = dict(mesh.shadowing(ROOT / "tests"))
    assert set(found) == set(mesh.PARTS)
    assert found["config"] == str(ROOT / "config" / "__init__.py")


@pytest.mark.mesh
def test_a_config_py_where_the_mesh_runs_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.py").write_text("SETTING = 1\n")
    done = subprocess.run([sys.executable, "-m", "mesh.cli", "--help"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == (
        f"mesh.ShadowedPartError: meshpipe's parts are shadowed: 'config' would be imported from "
        f"{tmp_path / 'config.py'} (rename that module, or run from another directory)")
