"""`mesh serve` as an operator meets it: where it listens, how it fails, how it stops, `mesh status`.

Signals go to the serve process alone, never to its group: that is what systemd, Docker and
`kill PID` do, and only then does an orphaned `mesh stage` show up.
"""

from __future__ import annotations

import importlib.metadata
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
from mesh_server import free_port, mesh_serve, wait_for

from bench.harness.local_server import LocalServer, stage_pids, stop, wait_healthy
from mesh.reports.health import Health, StageHealth

pytestmark = pytest.mark.mesh

GRACE = 4.0


@pytest.fixture(scope="module")
def tiny(tiny_byte_package: Path) -> Path:
    return tiny_byte_package


def _mesh(cache: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mesh.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "MESHPIPE_CACHE": str(cache)})


class Stream(threading.Thread):
    """One streaming completion, read on a thread: first chunk seen, and whether it ended properly."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.started, self.done = threading.Event(), False

    def run(self) -> None:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": self.max_tokens, "stream": True,
                "ignore_eos": True}
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    self.started.set()
                    self.done = self.done or line == "data: [DONE]"
        except httpx.HTTPError:
            pass  # a request cut off at the end of the grace period


def _alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _listening(process: psutil.Process) -> list[tuple[str, int]]:
    listening = []
    for c in process.net_connections("tcp"):
        if c.status == psutil.CONN_LISTEN:
            assert c.laddr, c  # a listening socket is bound to an address
            ip, port = c.laddr
            listening.append((ip, port))
    return listening


def _refused(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_sigterm_lets_short_requests_finish_cancels_long_ones_and_ends_every_stage(tiny, tmp_path):
    args = ("--model", str(tiny), "--local-stages", "2", "--no-draft", "--shutdown-grace", str(GRACE),
            "--wire-delay-ms", "20")  # about 40 ms a token: the long request outlives the grace
    with mesh_serve(tmp_path, *args) as (url, proc):
        stages = [psutil.Process(pid) for pid in stage_pids(proc.pid)]
        stage_ports = [port for s in stages for _, port in _listening(s)]
        assert len(stages) == 1
        assert stage_ports
        short, long = Stream(url, 30), Stream(url, 1000)  # 30 tokens take 1.2 s of wire alone
        for s in (long, short):
            s.start()
            assert s.started.wait(30)
        assert not short.done
        signalled = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        rc = proc.wait(GRACE + 10)
        took = time.monotonic() - signalled
        short.join(5)
        long.join(5)
        log = (tmp_path / f"serve-{url.rsplit(':', 1)[1]}.log").read_text()
        # checked before leaving the block, whose cleanup kills the whole process group
        assert not [s.pid for s in stages if _alive(s)], "a spawned mesh stage outlived mesh serve"
        assert all(_refused(port) for port in stage_ports)
    assert rc == 0, log[-3000:]
    assert GRACE - 0.5 < took < GRACE + 5, f"exit took {took:.1f}s"
    assert short.done
    assert not long.done
    assert "Exception in ASGI application" not in log


def test_a_taken_port_fails_at_once_and_builds_nothing(tiny, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        done = _mesh(tmp_path / "cache", "serve", "--model", str(tiny), "--local-stages", "2",
                     "--listen", f"127.0.0.1:{port}")
        took = time.monotonic() - started
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2
    assert took < 15
    assert lines == [f"mesh serve: error: cannot listen on 127.0.0.1:{port}: Address already in use"]
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.gguf"))


def _serve_alone(tmp_path: Path, url: str, *args: str) -> tuple[LocalServer, str]:
    """Start `mesh serve` with exactly these address flags; return it healthy, and its log."""
    log = tmp_path / f"serve-{len(list(tmp_path.glob('serve-*')))}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mesh.cli", "serve", "--threads", "1", *args],
                                env={**os.environ, "MESHPIPE_CACHE": str(tmp_path)}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    server = LocalServer(url, proc, log)
    wait_healthy(server, 120)
    time.sleep(0.3)  # the "serving" line follows the first answers by a hair
    return server, log.read_text()


def test_listen_flags_version_and_conflicts(tiny, tmp_path):
    model = ("--model", str(tiny), "--no-draft")
    port = free_port()
    server, log = _serve_alone(tmp_path, f"http://127.0.0.1:{port}", *model, "--listen", str(port))
    try:
        assert _listening(psutil.Process(server.process.pid)) == [("127.0.0.1", port)]
        assert f"serving tiny on http://127.0.0.1:{port}/v1" in log
    finally:
        stop(server.process)
    port = free_port()
    server, log = _serve_alone(tmp_path, f"http://localhost:{port}", *model, "--host", "localhost",
                               "--port", str(port))
    try:
        assert f":{port}/v1" in log
        assert "serving tiny" in log
    finally:
        stop(server.process)

    version = _mesh(tmp_path, "--version")
    assert version.stdout.strip() == f"mesh {importlib.metadata.version('meshpipe')}"
    clash = _mesh(tmp_path, "serve", "--listen", "127.0.0.1:1", "--port", "2")
    assert clash.returncode == 2
    assert clash.stderr.strip().startswith("mesh serve: error: ")
    assert len(clash.stderr.strip().splitlines()) == 1


def test_status_takes_the_printed_url_and_shows_live_stage_state(tiny, tmp_path):
    with mesh_serve(tmp_path, "--model", str(tiny), "--local-stages", "2", "--no-draft") as (url, proc):
        shown = _mesh(tmp_path, "status", "--url", f"{url}/v1/")
        assert shown.returncode == 0, shown.stderr
        assert "route: ok" in shown.stdout
        assert shown.stdout.count("READY") == 2

        def stage1() -> StageHealth:
            return Health.model_validate_json(httpx.get(f"{url}/health", timeout=10).content).stages[1]

        first = stage1().status_at
        time.sleep(2)  # past the Status cache
        assert stage1().status_at > first

        os.kill(stage_pids(proc.pid)[0], signal.SIGKILL)  # no request follows: the liveness pings tell
        wait_for(lambda: httpx.get(f"{url}/health", timeout=10).status_code == 503, timeout=10)
        wait_for(lambda: httpx.get(f"{url}/health", timeout=10).status_code == 200, timeout=30)
        healed = _mesh(tmp_path, "status", "--url", f"{url}/v1").stdout
        assert "recoveries: 1, 0 sessions resumed; last: " in healed
        assert healed.count("READY") == 2
