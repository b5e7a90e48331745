"""The mesh across hosts: stage daemons in their own network namespaces, reached over a bridge."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from chat_reference import PROMPTS, chat
from mesh_server import mesh_serve
from netns import Host, hosts, unavailable

pytestmark = [pytest.mark.mesh,
              pytest.mark.skipif(bool(unavailable()), reason=f"{unavailable()}")]
TOKEN = "netns-test-token"


@contextlib.contextmanager
def stage_daemons(machines: list[Host], cache: Path, hide: Path) -> Iterator[list[str]]:
    """`mesh stage` on each host with its own cache and `hide` out of sight; yields the
    control endpoints."""
    procs, endpoints = [], []
    env = {**os.environ, "MESHPIPE_TOKEN": TOKEN}
    try:
        for i, host in enumerate(machines):
            cmd = host.command(sys.executable, "-m", "mesh.cli", "stage", "--listen",
                               f"{host.address}:0", "--cache-dir", str(cache / f"stage{i}"),
                               "--threads", "1", hide=hide)
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


@pytest.mark.parametrize("stages", [2, 3])
def test_stages_on_separate_hosts_match_unsplit_model(tmp_path, expected_texts, stages):
    packages = tmp_path / "packages"  # where `mesh serve` keeps the embedded package
    packages.mkdir()
    with hosts(stages - 1) as (coordinator_address, machines), \
            stage_daemons(machines, tmp_path, hide=packages) as endpoints:
        peers = [arg for e in endpoints for arg in ("--peer", e)]
        with mesh_serve(tmp_path, *peers, "--token", TOKEN,
                        "--advertise", coordinator_address) as (url, _):
            health = httpx.get(f"{url}/health").json()
            assert [s["endpoint"] for s in health["stages"][1:]] == endpoints
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            for prompt in PROMPTS[:2]:
                assert chat(client, prompt) == expected_texts[prompt]
                assert chat(client, prompt, stream=True) == expected_texts[prompt]
        # the stages could not see the coordinator's package, so each fetched its own range
        # over the bridge: its manifest and artifacts sit in its own cache
        for i in range(stages - 1):
            fetched = list((tmp_path / f"stage{i}" / "packages").rglob("*.gguf"))
            assert fetched
            assert len(fetched) < len(list(packages.rglob("*.gguf")))
