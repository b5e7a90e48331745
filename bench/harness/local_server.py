"""Run `mesh serve` as a child process and wait until it answers /health (bench and tests)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil


@dataclass(frozen=True)
class LocalServer:
    url: str
    process: subprocess.Popen[bytes]
    log: Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def local_serve(args: list[str], log_dir: Path, env: dict[str, str] | None = None,
                timeout: float = 180, port: int | None = None) -> Iterator[LocalServer]:
    """`mesh serve` on loopback at `port` (a free one if None; the same one again is the same
    coordinator to its stages and its KV tier, as a restarted server is)."""
    port = port or free_port()
    log = log_dir / f"serve-{port}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mesh.cli", "serve", "--listen", f"127.0.0.1:{port}", *args],
            env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)  # one process group: stage children die with it
        server = LocalServer(f"http://127.0.0.1:{port}", proc, log)
        try:
            wait_healthy(server, timeout)
            yield server
        finally:
            stop(proc)


def stop(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_healthy(server: LocalServer, timeout: float) -> None:
    problem = unhealthy(server.url, server.process, server.log, timeout)
    if problem is not None:
        raise RuntimeError(f"mesh serve {problem}")


def unhealthy(url: str, process: subprocess.Popen[Any], log: Path, timeout: float) -> str | None:
    """None once `url`/health answers 200, else why not (the process ended, or time ran out),
    with the tail of its log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return f"exited early:\n{log.read_text(errors='replace')[-3000:]}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return None
        time.sleep(0.5)
    return f"not healthy after {timeout}s:\n{log.read_text(errors='replace')[-3000:]}"


def stage_pids(serve_pid: int) -> list[int]:
    """The `mesh stage` processes a `mesh serve` spawned, oldest first (pipeline order)."""
    kids = psutil.Process(serve_pid).children(recursive=True)
    return [k.pid for k in sorted(kids, key=lambda k: k.create_time()) if "stage" in k.cmdline()]
