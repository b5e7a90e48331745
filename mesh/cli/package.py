"""`mesh package write|validate|inspect|materialize|publish|pull`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pydantic import ValidationError

from config.paths import cache_dir
from config.settings import UsageError
from config.validation import problem
from packages import architectures, hub
from packages.describe import describe, format_table, human_bytes
from packages.materialize import materialize_stage
from packages.publish import format_plan, plan_publish, publish
from packages.refs import HubRef, parse_hub_ref, parse_package_ref
from packages.speculative import WINDOW_POLICIES, WindowPolicy
from packages.validate import validate_package
from packages.writer import write_package


def add_parser(sub: argparse._SubParsersAction) -> None:
    pkg = sub.add_parser("package", help="write, validate and inspect layer packages")
    cmds = pkg.add_subparsers(dest="package_cmd", required=True)

    w = cmds.add_parser("write", help="split a GGUF into a layer package")
    w.add_argument("src", type=Path, help="source GGUF file")
    w.add_argument("out_dir", type=Path, help="package directory to create")
    w.add_argument("--model-id", help="model id recorded in the manifest (default: file stem)")
    w.add_argument("--draft", metavar="REF", help="declare a draft-model strategy: a local GGUF (copied "
                   "into draft/ with its sha256), hf://org/repo@rev/file.gguf or org/repo:QUANT")
    w.add_argument("--window-policy", choices=WINDOW_POLICIES, default="adaptive")
    w.add_argument("--initial-window", type=int, default=4)
    w.add_argument("--min-window", type=int, default=1)
    w.add_argument("--max-window", type=int, default=16)
    w.set_defaults(func=_write)

    v = cmds.add_parser("validate", help="check schema, sizes and sha256 of a package")
    v.add_argument("package", help="package directory or hf://org/name[@rev]")
    v.set_defaults(func=_validate)

    i = cmds.add_parser("inspect", help="summarize a package directory or a GGUF")
    i.add_argument("target", type=Path)
    i.set_defaults(func=_inspect)

    m = cmds.add_parser("materialize", help="build (or find cached) the stage GGUF for a range")
    m.add_argument("package", type=Path)
    m.add_argument("--range", required=True, type=layer_range, help="layers START:END, half-open")
    m.add_argument("--cache-dir", type=Path, default=cache_dir())
    m.add_argument("--mtp", action="store_true", help="a final range with the package's MTP layers after its own")
    m.set_defaults(func=_materialize)

    p = cmds.add_parser("publish", help="upload a package to the Hugging Face Hub (manifest last)")
    p.add_argument("package", type=Path, help="package directory")
    p.add_argument("--repo", required=True, help="target model repo, org/name")
    p.add_argument("--revision", default=None, help="branch to publish to (default: main)")
    p.add_argument("--private", action="store_true", help="create the repo private")
    p.add_argument("--dry-run", action="store_true", help="print the files, sizes and total; upload nothing")
    p.set_defaults(func=_publish)

    a = cmds.add_parser("architectures", help="list every architecture: split, one node only, or refused, and why")
    a.set_defaults(func=_architectures)

    pl = cmds.add_parser("pull", help="fetch a Hub package, or one layer range of it, into the HF cache")
    pl.add_argument("ref", help="hf://org/name[@rev]")
    pl.add_argument("--range", type=layer_range, default=None, help="only layers START:END (plus shared files)")
    pl.add_argument("--mtp", action="store_true",
                    help="with a final --range: the package's MTP layers too, for a final stage that drafts with them")
    pl.set_defaults(func=_pull)


def _write(args: argparse.Namespace) -> int:
    window = _window(args) if args.draft else None  # without --draft the window flags say nothing
    m = write_package(args.src, args.out_dir, model_id=args.model_id, draft=args.draft, window=window)
    total = sum(a.artifact_bytes for a in m.artifacts())
    print(f"{args.out_dir}: {m.architecture}, {m.layer_count} layers, {human_bytes(total)}")
    return 0


def _window(args: argparse.Namespace) -> WindowPolicy:
    """The draft's window from the flags, checked before minutes of splitting."""
    try:
        return WindowPolicy(policy=args.window_policy, initial=args.initial_window, min=args.min_window,
                            max=args.max_window)
    except ValidationError as exc:
        raise UsageError(f"--min-window/--initial-window/--max-window: {problem(exc)[1]}") from None


def _validate(args: argparse.Namespace) -> int:
    package = _local_package(args.package)
    m, sha = validate_package(package, progress=lambda s: print(s, file=sys.stderr))
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
    path = materialize_stage(args.package, manifest, sha, start, end, args.cache_dir, mtp=args.mtp)
    print(path)
    return 0


def _inspect(args: argparse.Namespace) -> int:
    print(format_table(describe(args.target)))
    return 0


def _architectures(args: argparse.Namespace) -> int:
    print(format_table(architectures.table()))
    return 0


def _publish(args: argparse.Namespace) -> int:
    plan = plan_publish(args.package, args.repo, args.revision, args.private)
    if args.dry_run:
        print(format_plan(plan))
        return 0
    ref = publish(plan, say=lambda s: print(s, file=sys.stderr))
    print(ref)
    return 0


def _pull(args: argparse.Namespace) -> int:
    ref = parse_hub_ref(args.ref)
    if args.mtp and args.range is None:
        raise UsageError("--mtp goes with --range: a whole package is pulled with its MTP layers already")
    if args.range is None:
        pkg = hub.fetch_package(ref)
    else:
        pkg = hub.fetch_range(ref, args.range[0], args.range[1], mtp=args.mtp)
    print(f"{pkg.ref} verified in {pkg.root}")
    return 0


def _local_package(text: str) -> Path:
    """A package ref as a directory on disk: Hub packages are fetched whole into the HF cache first."""
    ref = parse_package_ref(text)
    return hub.fetch_package(ref).root if isinstance(ref, HubRef) else ref
