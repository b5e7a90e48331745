"""One llama.cpp decode at a time among the mesh processes of one host.

ggml's CPU workers wait for each other at a barrier after every graph node, spinning, not
sleeping. Two engines computing at once on the same cores deschedule each other's workers
mid-barrier and both crawl: with two local stages of SmolLM2 on 2 cores, 8 streams used
about 2.8 times the CPU of the same decodes run one after another. Processes that name the
same lock file take turns instead. The lock is an flock, so a process that dies releases it.
`mesh serve --local-stages N` gives its stages one; `--cpu-lock` names one by hand.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


class CpuLock:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        os.close(self.fd)


HELP = ("a file shared with the other mesh processes on this host: their engines take turns on "
        "the cores instead of computing at once (for stages whose --threads cover all cores)")
