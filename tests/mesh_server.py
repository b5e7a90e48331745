"""Start `mesh serve` as a real process, with its cache in the test's temp dir."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx

from mesh.bench.local_server import free_port, local_serve

__all__ = ["free_port", "mesh_serve", "metric"]


@contextlib.contextmanager
def mesh_serve(cache: Path, *args: str, timeout: float = 180, env: dict[str, str] | None = None
               ) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Yield (base URL, process); one engine thread per stage keeps 2-core machines calm."""
    env = {"MESHPIPE_CACHE": str(cache), **(env or {})}
    with local_serve(["--threads", "1", *args], cache, env, timeout) as server:
        yield server.url, server.process


def metric(url: str, series: str) -> float:
    """The sum of the /metrics samples whose line starts with `series` (a name, or a name and labels)."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(series) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total
