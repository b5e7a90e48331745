"""The `mesh` command line."""

from __future__ import annotations

import argparse
import os
import sys

# llama.cpp's OpenMP workers spin after every decode (libgomp's default: 300,000 spins).
# Pipeline stages take turns on the same cores, so a long spin steals the CPU that the
# working stage needs: split-2 decoded SmolLM2 at 57-65 tok/s with the default and at about
# 106 with 2000, on 2 cores; one process alone is unchanged. libgomp reads this once, when
# it loads, so it must be set before llama_cpp is imported; stage children inherit it.
os.environ.setdefault("GOMP_SPINCOUNT", "2000")

from config.settings import ConfigError
from mesh import bench, package_cli, serve_cli, stage_cli, status_cli
from mesh.planner import PlanError
from mesh.route import RouteError
from packages.errors import PackageError

# Errors a user can fix; they print as one line, never as a traceback.
USER_ERRORS: tuple[type[Exception], ...] = (PackageError, RouteError, PlanError, ConfigError, OSError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mesh", description="pipeline-parallel LLM serving mesh")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_cli.add_parser(sub)
    stage_cli.add_parser(sub)
    status_cli.add_parser(sub)
    package_cli.add_parser(sub)
    bench.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except USER_ERRORS as exc:
        print(f"mesh: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
