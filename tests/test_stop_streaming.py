"""Stop strings through a real `mesh serve` (issue 28): a 300-character stop string no longer
holds the stream back, and the text still ends exactly where the string appears."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest
from mesh_server import mesh_serve

from mesh.model.source import EMBEDDED_ID

pytestmark = pytest.mark.mesh

PROMPT = "Once upon a time, in a small village by the sea,"
LONG_STOP = "x" * 300


@pytest.fixture(scope="module")
def server(serve_cache):
    with mesh_serve(serve_cache, "--local-stages", "2", "--no-draft", "--lanes", "2", "--ctx-size", "1024") as (url, _):
        yield url


def _stream(url: str, **body: Any) -> tuple[float, float, list[str], str | None]:
    """Seconds to the first chunk with text and to the end, the texts, and the finish reason."""
    request = {"model": EMBEDDED_ID, "prompt": PROMPT, "temperature": 0, "stream": True, **body}
    started, first, texts, reason = time.perf_counter(), None, [], None
    with httpx.stream("POST", f"{url}/v1/completions", json=request, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            if choice["text"]:
                first = first if first is not None else time.perf_counter() - started
                texts.append(choice["text"])
            reason = choice["finish_reason"] or reason
    assert first is not None
    return first, time.perf_counter() - started, texts, reason


def test_a_long_stop_string_does_not_delay_the_first_text(server):
    _stream(server, max_tokens=4)  # warm: the prefix cache holds the prompt for every run after
    plain = min(_stream(server, max_tokens=48, ignore_eos=True)[0] for _ in range(2))
    runs = [_stream(server, max_tokens=48, ignore_eos=True, stop=[LONG_STOP]) for _ in range(2)]
    first = min(r[0] for r in runs)
    for _, _, texts, _ in runs:
        assert len(texts) > 24  # token by token, not one chunk at the end
        assert "x" * 300 not in "".join(texts)
    # generous: the first text once waited for all 48 tokens, 16 times the first's wait here
    assert first < 2 * plain + 0.5, (first, plain)
    assert first < min(total for _, total, _, _ in runs) / 4, (first, runs)


def test_a_long_stop_string_stops_exactly_where_it_appears(server):
    _, _, texts, reason = _stream(server, max_tokens=120, ignore_eos=True)
    whole = "".join(texts)
    assert reason == "length"
    assert len(whole) > 200
    stop = whole[40:340]  # greedy: the same request writes the same text, so this will appear
    cut = whole.find(stop)
    _, _, texts, reason = _stream(server, max_tokens=120, ignore_eos=True, stop=[stop])
    assert "".join(texts) == whole[:cut]
    assert reason == "stop"
    assert len(texts) > 3  # the 40 characters before it streamed as they came (they once came as one)
    body = httpx.post(f"{server}/v1/completions", timeout=120, json={
        "model": EMBEDDED_ID, "prompt": PROMPT, "temperature": 0, "max_tokens": 120, "ignore_eos": True,
        "stop": ["never written", stop]}).json()
    assert body["choices"][0]["text"] == whole[:cut]
    assert body["choices"][0]["finish_reason"] == "stop"
