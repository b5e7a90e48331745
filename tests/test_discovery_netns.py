"""LAN discovery across hosts: stages in their own network namespaces announce themselves by
mDNS over the bridge, and `mesh serve --discover` on a further host builds its route from them."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from chat_reference import PROMPTS, chat
from netns import Host, hosts, stage_daemons, unavailable

from bench.harness.local_server import LocalServer, stop, wait_healthy
from proto.announcement import SERVICE_TYPE

pytestmark = [pytest.mark.mesh,
              pytest.mark.skipif(bool(unavailable()), reason=f"{unavailable()}")]
TOKEN = "discovery-test-token"
# Every raw TXT record heard on the segment, as Python reprs of the bytes on the wire.
RAW_TXT = f"""
import time, zeroconf
zc = zeroconf.Zeroconf(ip_version=zeroconf.IPVersion.V4Only)
names = set()
browser = zeroconf.ServiceBrowser(zc, {SERVICE_TYPE!r}, handlers=[lambda **kw: names.add(kw["name"])])
time.sleep(3)
print([zc.get_service_info({SERVICE_TYPE!r}, n, timeout=2000).text for n in sorted(names)])
zc.close()
"""


@contextlib.contextmanager
def serve_on(host: Host, cache: Path, *args: str) -> Iterator[LocalServer]:
    """`mesh serve` on `host`, its HTTP API on the host's bridge address (reachable from here)."""
    url, log = f"http://{host.address}:9337", cache / "serve.log"
    env = {**os.environ, "MESHPIPE_CACHE": str(cache)}
    cmd = host.command(sys.executable, "-m", "mesh.cli", "serve", "--listen", f"{host.address}:9337",
                       "--threads", "1", "--advertise", host.address, *args)
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        server = LocalServer(url, proc, log)
        try:
            wait_healthy(server, 240)
            yield server
        finally:
            stop(proc)


def test_discovered_stages_build_a_split_3_route_equal_to_the_unsplit_model(tmp_path, expected_texts):
    packages = tmp_path / "packages"  # the coordinator's; the stages cannot see it
    packages.mkdir()
    with hosts(4) as (_, machines), \
            stage_daemons(machines[:2], tmp_path / "ours", TOKEN, packages, ("--announce",)) as ours, \
            stage_daemons(machines[2:3], tmp_path / "theirs", "another-mesh", packages, ("--announce",)) as theirs:
        coordinator = machines[3]
        listed = subprocess.run(coordinator.command(sys.executable, "-m", "mesh.cli", "status", "--discover",
                                                    "--discover-seconds", "3"),
                                capture_output=True, text=True, timeout=60, check=True).stdout
        # every stage announced itself across the bridge (multicast reaches the other namespaces)
        for endpoint in [*ours, *theirs]:
            assert f"{endpoint}  llama" in listed, listed
        raw = subprocess.run(coordinator.command(sys.executable, "-c", RAW_TXT), capture_output=True,
                             text=True, timeout=60, check=True).stdout
        assert raw.count("control=") == 3, raw
        assert TOKEN not in raw  # the token never goes on the LAN
        assert "another-mesh" not in raw
        with serve_on(coordinator, tmp_path, "--discover", "--discover-seconds", "3", "--token", TOKEN) as server:
            health = httpx.get(f"{server.url}/health").json()
            # stage 0 is the coordinator; then the stages that took the token, by address
            assert [s["endpoint"] for s in health["stages"][1:]] == ours
            said = server.log.read_text()
            assert f"discovery: 2 stage(s) found on the LAN: {', '.join(ours)}; 1 skipped" in said
            assert f"discovery: skipped {theirs[0]}: wrong mesh token" in said
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
            assert chat(client, PROMPTS[0]) == expected_texts[PROMPTS[0]]
            assert chat(client, PROMPTS[1], stream=True) == expected_texts[PROMPTS[1]]
