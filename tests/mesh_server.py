"""Start `mesh serve` as a real process, with its cache in the test's temp dir."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from bench.harness.local_server import free_port, local_serve

__all__ = ["free_port", "mesh_serve", "metric", "running_stage", "stage_daemon", "wait_for"]


@contextlib.contextmanager
def mesh_serve(cache: Path, *args: str, timeout: float = 180, env: dict[str, str] | None = None,
               threads: int | None = 1, port: int | None = None) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Yield (base URL, process); one engine thread per stage keeps 2-core machines calm, and
    `threads=None` runs `mesh serve`'s default (every core), where the exactness tests run. The
    model is cut on parameters unless `args` say `--cut-on`: a re-cut on measured time loads
    every stage twice, which a test that is not about it need not wait for. For the same
    reason there is no start-up warm-up unless `args` say `--warm-up`."""
    env = {"MESHPIPE_CACHE": str(cache), **(env or {})}
    cut = () if "--cut-on" in args else ("--cut-on", "parameters")
    warm = () if "--warm-up" in args else ("--no-warm-up",)
    args = tuple(a for a in args if a != "--warm-up")
    thread_args = () if threads is None else ("--threads", str(threads))
    with local_serve([*thread_args, *cut, *warm, *args], cache, env, timeout, port) as server:
        yield server.url, server.process


def stage_daemon(cache: Path, token: str, *args: str, listen: str = "127.0.0.1:0"
                 ) -> tuple[subprocess.Popen[bytes], str]:
    """A `mesh stage` on loopback, as an operator starts one on another machine: (process, HOST:PORT)."""
    proc = subprocess.Popen([sys.executable, "-m", "mesh.cli", "stage", "--listen", listen,
                             "--cache-dir", str(cache), "--threads", "1", *args],
                            stdout=subprocess.PIPE, env={**os.environ, "MESHPIPE_TOKEN": token})
    assert proc.stdout is not None
    line = proc.stdout.readline().decode().strip()
    assert line.startswith("listening "), line
    return proc, line.split()[1]


@contextlib.contextmanager
def running_stage(cache: Path, token: str, *args: str) -> Iterator[str]:
    """A `mesh stage` daemon for the block's length: its HOST:PORT, ended with SIGTERM (SIGKILL
    after 10 s)."""
    proc, at = stage_daemon(cache, token, *args)
    try:
        yield at
    finally:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        proc.kill()


def metric(url: str, series: str) -> float:
    """The sum of the /metrics samples whose line starts with `series` (a name, or a name and labels)."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(series) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for(predicate: Callable[[], bool], timeout: float) -> float:
    """Seconds until `predicate()` held, polled every 0.1 s; TimeoutError past `timeout`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.1)
    raise TimeoutError(f"condition not met within {timeout}s")
