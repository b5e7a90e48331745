"""With resuming off, a stage process that dies mid-request fails it fast, new ones get 503,
and the mesh heals (tests/test_heal.py: with it on, the request goes on)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from mesh_server import mesh_serve, wait_for
from openai.types.chat import ChatCompletionMessageParam

from bench.harness.local_server import stage_pids
from mesh.model.source import EMBEDDED_ID

pytestmark = pytest.mark.mesh

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a long story about a dragon."}]


@pytest.fixture(scope="module")
def unresumed(serve_cache: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """One mesh for both victims (each test's kill is healed before the next one starts), in the
    session's cache: a fresh one makes the draft and the package again first."""
    with mesh_serve(serve_cache, "--local-stages", "3", "--resume-timeout", "0") as served:
        yield served


@pytest.mark.parametrize("victim", [0, 1], ids=["middle-stage", "final-stage"])
def test_killed_stage_fails_request_then_route_rebuilds(unresumed, victim):
    url, proc = unresumed
    # the route the previous test's kill left is rebuilt, and its stages' processes are gone
    wait_for(lambda: httpx.get(f"{url}/health").status_code == 200 and len(stage_pids(proc.pid)) == 2, 60)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=30)
    stages = stage_pids(proc.pid)
    assert len(stages) == 2
    stream = client.chat.completions.create(model=EMBEDDED_ID, messages=MESSAGES,
                                            max_tokens=1500, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    killed_at = 0.0

    def read_and_kill_at_the_fifth_chunk() -> None:
        nonlocal killed_at
        for received, _chunk in enumerate(stream, 1):
            if received == 5:
                os.kill(stages[victim], signal.SIGKILL)
                killed_at = time.monotonic()

    with pytest.raises(openai.APIError, match=r"mesh unavailable|stage"):
        read_and_kill_at_the_fifth_chunk()
    assert killed_at, "the stream must have run until the kill"
    assert time.monotonic() - killed_at < 5, "the in-flight request must fail within seconds"

    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model=EMBEDDED_ID, messages=MESSAGES, max_tokens=4)
    assert refused.value.status_code == 503
    assert "mesh unavailable" in str(refused.value)

    wait_for(lambda: httpx.get(f"{url}/health").status_code == 200, timeout=120)
    assert psutil.Process(proc.pid).is_running()
    new_stages = stage_pids(proc.pid)
    assert len(new_stages) == 2
    assert not set(new_stages) & set(stages)
    again = client.chat.completions.create(model=EMBEDDED_ID, messages=MESSAGES, max_tokens=8,
                                           temperature=0)
    assert again.usage is not None
    assert again.usage.completion_tokens == 8


def test_client_disconnect_frees_the_session_on_every_stage(serve_cache):
    """One KV lane per stage: unless a dropped stream frees its session everywhere, the next
    request would wait for admission at stage 0 or find no free lane at stage 1."""
    with mesh_serve(serve_cache, "--local-stages", "2", "--lanes", "1") as (url, _):
        body = {"model": EMBEDDED_ID, "messages": MESSAGES, "max_tokens": 1000, "stream": True,
                "ignore_eos": True}
        for _ in range(3):
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as r:
                lines = r.iter_lines()
                assert sum(1 for _, line in zip(range(6), lines, strict=False) if line) > 0
            # leaving the block drops the connection mid-stream
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=30)
        done = client.chat.completions.create(model=EMBEDDED_ID, messages=MESSAGES, max_tokens=8)
        assert done.usage is not None
        assert done.usage.completion_tokens > 0
