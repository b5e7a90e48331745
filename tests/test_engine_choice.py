"""`--engine auto|llama|mlx`: what each resolves to, and the refusals (issue 17)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from stage import engine_choice
from stage.engine_choice import EngineChoiceError, resolve


@pytest.mark.parametrize(("apple", "installed", "engine"), [
    (True, True, "mlx"), (True, False, "llama"), (False, True, "llama"), (False, False, "llama")])
def test_auto_is_mlx_only_on_apple_silicon_with_mlx(monkeypatch, apple, installed, engine):
    monkeypatch.setattr(engine_choice, "apple_silicon", lambda: apple)
    monkeypatch.setattr(engine_choice, "mlx_installed", lambda: installed)
    assert resolve("auto") == engine
    assert resolve("llama") == "llama"


def test_mlx_without_mlx_names_the_install(monkeypatch):
    monkeypatch.setattr(engine_choice, "package_installed", lambda _: False)
    with pytest.raises(EngineChoiceError, match=r"--engine mlx needs the mlx package: pip install 'meshpipe\[mlx\]'"):
        resolve("mlx")


def test_an_unknown_engine_lists_the_choices():
    with pytest.raises(EngineChoiceError, match="unknown engine 'cuda': choose one of auto, llama, mlx"):
        resolve("cuda")


@pytest.mark.mesh  # starts `mesh serve`, which refuses the flags and exits
def test_serve_wants_one_engine_or_one_per_local_stage():
    run = subprocess.run([sys.executable, "-m", "mesh.cli", "serve", "--local-stages", "3", "--engine", "llama", "mlx"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "--engine wants one engine, or one per local stage (3), got 2" in run.stderr
