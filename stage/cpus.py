"""Pin a mesh process to a CPU set, to emulate separate machines on one host (benchmarks).

`mesh stage --cpus 1` and `mesh serve --stage-cpus 0 1` pin each process, every thread it
has and every thread it will start (the engine thread and llama.cpp's OpenMP workers
inherit the mask), to its own cores. Pinned stages on disjoint sets need no CPU lock.
"""

from __future__ import annotations

import os
from pathlib import Path

from config.errors import MeshpipeError

HELP = ("pin this process and its engine threads to these CPUs, e.g. '1' or '0,2-3' (to emulate "
        "separate machines on one host; --threads then defaults to one per CPU)")


class CpuSetError(MeshpipeError, ValueError):
    """A CPU list that is malformed or names CPUs this process may not run on."""


def parse_cpus(text: str) -> frozenset[int]:
    """'0,2-3' -> {0, 2, 3}; every CPU must exist on this host. (Not only those this process
    may run on now: a stage spawned by a pinned `mesh serve` inherits its parent's set.)"""
    cpus: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise CpuSetError(f"bad CPU list {text!r}: expected numbers and ranges like 0,2-3")
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise CpuSetError(f"bad CPU range {part.strip()!r} in {text!r}")
        cpus.update(range(low, high + 1))
    host = set(range(os.cpu_count() or 1))
    if not cpus <= host:
        raise CpuSetError(f"CPUs {sorted(cpus - host)} do not exist here (this host has 0-{max(host)})")
    return frozenset(cpus)


def format_cpus(cpus: frozenset[int] | set[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def available_cpus() -> frozenset[int]:
    return frozenset(os.sched_getaffinity(0))


def pin(cpus: frozenset[int]) -> None:
    """Pin every thread of this process now; threads started later inherit the mask."""
    tasks = Path("/proc/self/task")
    tids = [int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except OSError as exc:  # e.g. a container's cpuset leaves these CPUs out
            raise CpuSetError(f"cannot pin to CPUs {format_cpus(cpus)}: {exc.strerror}") from None
