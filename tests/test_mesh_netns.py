"""The mesh across hosts: stage daemons in their own network namespaces, reached over a bridge."""

from __future__ import annotations

import httpx
import openai
import pytest
from chat_reference import PROMPTS, chat
from mesh_server import mesh_serve
from netns import hosts, stage_daemons, unavailable

pytestmark = [pytest.mark.mesh,
              pytest.mark.skipif(bool(unavailable()), reason=f"{unavailable()}")]
TOKEN = "netns-test-token"


@pytest.mark.parametrize("stages", [2, 3])
def test_stages_on_separate_hosts_match_unsplit_model(tmp_path, expected_texts, stages):
    packages = tmp_path / "packages"  # where `mesh serve` keeps the embedded package
    packages.mkdir()
    with hosts(stages - 1) as (coordinator_address, machines), \
            stage_daemons(machines, tmp_path, TOKEN, hide=packages) as endpoints:
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
