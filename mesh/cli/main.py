"""The `mesh` command line."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import sys

# llama.cpp's OpenMP workers spin after every decode (libgomp's default: 300,000 spins).
# Pipeline stages take turns on the same cores, so a long spin steals the CPU that the
# working stage needs (split-2 nearly doubled its decode speed with 2000 on 2 cores; one process
# alone is unchanged: BENCHMARKS.md, "Figures behind the code's choices"). libgomp reads this once, when
# it loads, so it must be set before llama_cpp is imported; stage children inherit it.
os.environ.setdefault("GOMP_SPINCOUNT", "2000")

from config.errors import MeshpipeError

# Errors a user can fix: every meshpipe error, and the OS's. They print as one line, never as
# a traceback.
USER_ERRORS: tuple[type[Exception], ...] = (MeshpipeError, OSError)

# Each command's module is imported only when it runs (or for --help): a stage daemon then
# never loads the HTTP server, the Hub client or the benchmark, which is memory it keeps.
COMMANDS = {"serve": "mesh.cli.serve", "stage": "mesh.cli.stage", "status": "mesh.cli.status",
            "package": "mesh.cli.package", "plan": "mesh.cli.plan", "bench": "bench.run"}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mesh", description="pipeline-parallel LLM serving mesh")
    parser.add_argument("--version", action="version", version=f"mesh {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        if command in (None, name):
            importlib.import_module(module).add_parser(sub)
    return parser


def _version() -> str:
    try:
        return importlib.metadata.version("meshpipe")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree never installed
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv and argv[0] in COMMANDS else None
    if argv == ["--version"]:
        command = ""  # no command module: importing them all (llama.cpp, uvicorn) takes seconds
    args = build_parser(command).parse_args(argv)
    try:
        return int(args.func(args))
    except USER_ERRORS as exc:
        print(f"mesh {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
