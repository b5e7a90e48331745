"""The house rules RULES.md states, held by a test: no function over 60 lines, none in mesh/
or stage/ over 7 parameters (dataclass constructors are not written), no class over 15 methods."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("common", "config", "packages", "stage", "mesh", "bench")
FEW_PARAMETERS = ("mesh", "stage")  # issue 55: one typed value across the engine boundary, not eleven arguments


def _functions_and_classes(part: str, root: Path) -> Iterator[tuple[Path, ast.AST]]:
    for path in sorted((root / part).rglob("*.py")):
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                yield path.relative_to(root), node


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = node.args
    return len([x for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")])


def _broken(part: str, root: Path = ROOT) -> list[str]:
    bad = []
    for path, node in _functions_and_classes(part, root):
        if isinstance(node, ast.ClassDef):
            methods = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body)
            bad += [f"{path}:{node.lineno} class {node.name}: {methods} methods"] if methods > 15 else []
            continue
        assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        lines = (node.end_lineno or node.lineno) - node.lineno + 1
        bad += [f"{path}:{node.lineno} {node.name}: {lines} lines"] if lines > 60 else []
        if part in FEW_PARAMETERS and _parameters(node) > 7:
            bad.append(f"{path}:{node.lineno} {node.name}: {_parameters(node)} parameters")
    return bad


def test_no_function_is_too_long_or_takes_too_many_parameters_and_no_class_has_too_many_methods() -> None:
    assert [b for part in PARTS for b in _broken(part)] == []


def test_the_check_finds_what_it_names(tmp_path: Path) -> None:
    (tmp_path / "mesh").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(60))
    (tmp_path / "mesh" / "probe.py").write_text(f"def long(a, b, c, d, e, f, g, h):\n{body}\n\n\nclass Many:\n"
                                                + "".join(f"    def m{i}(self): ...\n" for i in range(16)))
    assert _broken("mesh", tmp_path) == ["mesh/probe.py:1 long: 61 lines", "mesh/probe.py:1 long: 8 parameters",
                                         "mesh/probe.py:64 class Many: 16 methods"]
