"""Separate network namespaces joined by a bridge: each stage daemon gets a host of its own.

The coordinator stays in the test's namespace on the bridge address (.1); stage i lives in
namespace i on .(i+1). Everything is created by `hosts()` and removed on exit.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Host:
    namespace: str
    address: str

    def command(self, *argv: str, hide: Path | None = None) -> list[str]:
        """argv run on this host; `hide` covers a directory with an empty tmpfs, as if the
        host had its own disk and could not read the coordinator's files."""
        if hide is None:
            return ["ip", "netns", "exec", self.namespace, *argv]
        script = 'mount -t tmpfs meshpipe-hidden "$0" && exec "$@"'
        return ["ip", "netns", "exec", self.namespace, "unshare", "--mount", "sh", "-c", script,
                str(hide), *argv]


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return f"the `{tool}` command ({package}) is not installed"
    probe = f"mpprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` is not permitted here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=True)
    return None


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True)


@contextlib.contextmanager
def hosts(count: int) -> Iterator[tuple[str, list[Host]]]:
    """Yield (the coordinator's bridge address, the hosts); tear everything down after."""
    tag = f"{os.getpid() % 10000}"
    subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
    bridge = f"mpbr{tag}"
    made: list[Host] = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{subnet}.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for i in range(count):
            host = Host(f"mp{tag}h{i}", f"{subnet}.{i + 2}")
            _ip("netns", "add", host.namespace)
            made.append(host)
            veth = f"mpv{tag}h{i}"
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", host.namespace)
            _ip("link", "set", veth, "master", bridge, "up")
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.namespace, "link", "set", "eth0", "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
        yield f"{subnet}.1", made
    finally:
        for host in made:
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


@contextlib.contextmanager
def stage_daemons(machines: list[Host], cache: Path, token: str | None, hide: Path | None = None,
                  extra: tuple[str, ...] = ()) -> Iterator[list[str]]:
    """`mesh stage` on each host with its own cache and `hide` out of sight, started with
    `extra` arguments; yields the control endpoints."""
    procs, endpoints = [], []
    env = {**os.environ, "MESHPIPE_TOKEN": token or ""}
    try:
        for i, host in enumerate(machines):
            cmd = host.command(sys.executable, "-m", "mesh.cli", "stage", "--listen",
                               f"{host.address}:0", "--cache-dir", str(cache / f"stage{i}"),
                               "--threads", "1", *extra, hide=hide)
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env, start_new_session=True)
            procs.append(proc)
            assert proc.stdout is not None
            line = proc.stdout.readline().decode().split()
            assert line[:1] == ["listening"], f"stage on {host.address} did not start"
            endpoints.append(line[1])
        yield endpoints
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(15)
