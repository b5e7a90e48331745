"""`mesh serve`'s benchmark-only flags: `mesh bench` passes them to emulate separate machines
and slow links on one host.

They parse like any other flag but are left out of `mesh serve --help`, whose readers run a
mesh rather than measure one; docs/bench.md documents them.
"""

from __future__ import annotations

import argparse

BENCH_ONLY_FLAGS = ("--wire-delay-ms", "--wire-jitter-ms", "--relay-replies", "--stage-cpus")


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    # Every hop between stages, both ways: each stage learns the delay at Load and holds every
    # frame it sends this long.
    p.add_argument("--wire-delay-ms", type=float, default=0.0, metavar="MS", help=argparse.SUPPRESS)
    # A uniform draw in [-MS, +MS] added to each frame's emulated delay, seeded per link so runs
    # repeat; frames never overtake each other.
    p.add_argument("--wire-jitter-ms", type=float, default=0.0, metavar="MS", help=argparse.SUPPRESS)
    # The final stage's replies climb back through every stage instead of going straight to the
    # coordinator: the old path, kept to measure what direct return saves.
    p.add_argument("--relay-replies", action="store_true", help=argparse.SUPPRESS)
    # One CPU set per local stage, this process first (0 or 2-3): separate machines on one host.
    # Pinned stages take no CPU lock unless --cpu-lock names one, and one engine thread per CPU.
    p.add_argument("--stage-cpus", nargs="+", default=None, metavar="LIST", help=argparse.SUPPRESS)
