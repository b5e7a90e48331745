"""A real HAProxy in front of coordinators, run from deploy/haproxy.cfg as shipped: only the
address it binds and the coordinators it lists are replaced."""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from mesh_server import free_port, wait_for

SHIPPED = Path(__file__).resolve().parents[1] / "deploy" / "haproxy.cfg"


def config_for(backends: list[str], port: int) -> str:
    """The shipped configuration, binding 127.0.0.1:`port`, balancing over `backends` (URLs)."""
    text = SHIPPED.read_text()
    text, binds = re.subn(r"(?m)^(\s*bind )\S+", rf"\g<1>127.0.0.1:{port}", text)
    servers = "\n".join(f"    server coordinator{i} {url.removeprefix('http://')} check"
                        for i, url in enumerate(backends, 1))
    text, listed = re.subn(r"(?m)^(\s*server .*\n?)+", servers + "\n", text)
    assert (binds, listed) == (1, 1), "deploy/haproxy.cfg changed shape: update tests/haproxy.py"
    return text


@contextlib.contextmanager
def haproxy(backends: list[str], workdir: Path) -> Iterator[str]:
    """HAProxy on a free loopback port in front of `backends`; yields its base URL once every
    backend passes its health check."""
    binary = shutil.which("haproxy")
    if binary is None:
        pytest.skip("needs haproxy: apt-get install haproxy")
    port = free_port()
    cfg = workdir / "haproxy.cfg"
    cfg.write_text(config_for(backends, port))
    log = (workdir / "haproxy.log").open("wb")
    proc = subprocess.Popen([binary, "-db", "-f", str(cfg)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _healthy(url), timeout=20)
        yield url
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
        proc.kill()
        log.close()


def _healthy(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    return False
