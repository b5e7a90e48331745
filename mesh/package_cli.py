"""`mesh package write|validate|inspect`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from config.paths import cache_dir
from packages.describe import describe, format_table, human_bytes
from packages.materialize import materialize_stage
from packages.validate import validate_package
from packages.writer import write_package


def add_parser(sub: argparse._SubParsersAction) -> None:
    pkg = sub.add_parser("package", help="write, validate and inspect layer packages")
    cmds = pkg.add_subparsers(dest="package_cmd", required=True)

    w = cmds.add_parser("write", help="split a GGUF into a layer package")
    w.add_argument("src", type=Path, help="source GGUF file")
    w.add_argument("out_dir", type=Path, help="package directory to create")
    w.add_argument("--model-id", help="model id recorded in the manifest (default: file stem)")
    w.set_defaults(func=_write)

    v = cmds.add_parser("validate", help="check schema, sizes and sha256 of a package")
    v.add_argument("package", type=Path)
    v.set_defaults(func=_validate)

    i = cmds.add_parser("inspect", help="summarize a package directory or a GGUF")
    i.add_argument("target", type=Path)
    i.set_defaults(func=_inspect)

    m = cmds.add_parser("materialize", help="build (or find cached) the stage GGUF for a range")
    m.add_argument("package", type=Path)
    m.add_argument("--range", required=True, type=layer_range, help="layers START:END, half-open")
    m.add_argument("--cache-dir", type=Path, default=cache_dir())
    m.set_defaults(func=_materialize)


def _write(args: argparse.Namespace) -> int:
    m = write_package(args.src, args.out_dir, model_id=args.model_id)
    total = sum(a.artifact_bytes for a in m.artifacts())
    print(f"{args.out_dir}: {m.architecture}, {m.layer_count} layers, {human_bytes(total)}")
    return 0


def _validate(args: argparse.Namespace) -> int:
    m, sha = validate_package(args.package, progress=lambda s: print(s, file=sys.stderr))
    print(f"ok: {m.model_id} ({m.layer_count} layers, {len(m.artifacts())} artifacts), "
          f"manifest sha256 {sha}")
    return 0


def layer_range(text: str) -> tuple[int, int]:
    start, sep, end = text.partition(":")
    if not sep or not start.isdigit() or not end.isdigit():
        raise argparse.ArgumentTypeError(f"expected START:END, got {text!r}")
    return int(start), int(end)


def _materialize(args: argparse.Namespace) -> int:
    manifest, sha = validate_package(args.package)
    start, end = args.range
    path = materialize_stage(args.package, manifest, sha, start, end, args.cache_dir)
    print(path)
    return 0


def _inspect(args: argparse.Namespace) -> int:
    print(format_table(describe(args.target)))
    return 0
