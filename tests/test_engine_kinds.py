"""One description per range engine (stage/engine_choice.py): nothing else compares engine names,
and what the rest of meshpipe reads of an engine comes from its EngineKind."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from stage.engine_choice import ENGINES, LLAMA, MLX, EngineChoiceError, engine_kind, resolve

ROOT = Path(__file__).resolve().parent.parent
# What runs in a mesh; the bench names its configurations by their engines, as labels.
PARTS = ("mesh", "stage", "packages", "config", "common", "proto")


def _compared_names(path: Path, root: Path = ROOT) -> list[str]:
    """`file:line` of every comparison with a string constant that is an engine's name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(isinstance(o, ast.Constant) and o.value in ENGINES for o in operands):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_no_module_but_the_engine_description_compares_engine_names() -> None:
    files = [f for part in PARTS for f in (ROOT / part).rglob("*.py") if f != ROOT / "stage" / "engine_choice.py"]
    assert len(files) > 80
    assert [hit for f in files for hit in _compared_names(f)] == []


def test_the_scan_finds_a_comparison_of_engine_names(tmp_path: Path) -> None:
    bad = tmp_path / "probe.py"
    bad.write_text('def f(e: str) -> bool:\n    return e == "mlx"\n\n\n'
                   'def g(e: str) -> bool:\n    return "llama" in (e,)\n')
    assert _compared_names(bad, tmp_path) == ["probe.py:2", "probe.py:6"]


def test_an_engine_name_is_its_description_and_an_unknown_one_is_a_clear_error() -> None:
    assert engine_kind("llama") is LLAMA
    assert engine_kind("mlx") is MLX
    assert engine_kind(None) is LLAMA  # a stage before its first Status reply
    assert engine_kind("") is LLAMA  # a Status from a stage older than engine names
    with pytest.raises(EngineChoiceError, match="unknown engine 'tpu': this meshpipe knows llama, mlx"):
        engine_kind("tpu")
    with pytest.raises(EngineChoiceError, match="unknown engine 'tpu'"):
        resolve("tpu")
    assert resolve("llama") == "llama"


def test_what_an_engine_reads_and_keeps_is_in_its_description() -> None:
    assert LLAMA.unreadable([("blk.0.attn_q.weight", "Q4_K")]) is None  # llama.cpp reads every type
    assert MLX.unreadable([("blk.0.attn_norm.weight", "F32"), ("blk.0.attn_q.weight", "Q4_K")]) == (
        "blk.0.attn_q.weight", "Q4_K")
    assert LLAMA.placeholders
    assert not MLX.placeholders
    assert LLAMA.numerics == ""
    assert "MLX stages" in MLX.numerics
