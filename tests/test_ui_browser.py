"""The web page in a real browser: headless Chromium on one 3-stage mesh with an API key.

The page is opened once, the key typed into its form, and never reloaded: every figure the
tests wait for comes over the event stream. Screenshots are saved under the module's temp
dir, their paths printed (pytest -s shows them).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import struct
import time
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import httpx
import openai
import pytest
from browser import Page, browser, chromium
from mesh_server import mesh_serve, wait_for

from bench.harness.local_server import stage_pids
from mesh.cli.watch import CLEAR, WatchError, watch
from mesh.model.source import EMBEDDED_ID

pytestmark = pytest.mark.mesh

KEY = "page-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GRACE_S = 30
SHOWN_WITHIN_S = 5.0  # a change in the mesh is on the page within this long (a snapshot a second)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int, Path]]:
    tmp = tmp_path_factory.mktemp("ui-mesh")
    # a fixed window: the cost-aware one may stop drafting on a loaded machine, and the test needs drafts
    # a long grace: an event stream that held the server's stop would hold it that long
    with mesh_serve(tmp, "--local-stages", "3", "--lanes", "4", "--ctx-size", "512", "--draft-window", "4",
                    "--api-key", KEY, "--shutdown-grace", str(GRACE_S),
                    env={"MESHPIPE_TOKEN": "ui-test-token"}) as (url, proc):
        yield url, proc.pid, tmp


@pytest.fixture(scope="module")
def binary() -> str:
    """Chromium, or a skip: asked for first, so that no mesh starts for a browser there is not."""
    found = chromium()
    if found is None:
        pytest.skip("no chromium on this machine: `apt-get install chromium` (.ci/run does)")
    return found


@pytest.fixture(scope="module")
def page(binary: str, mesh: tuple[str, int, Path]) -> Iterator[Page]:
    url, _, tmp = mesh
    with browser(binary, tmp / "profile") as p:
        p.navigate(f"{url}/")  # redirects to /ui, which asks for the key: the stream needs it
        p.wait("!document.getElementById('key-form').hidden", 30)
        p.evaluate(f"document.getElementById('key-input').value = {json.dumps(KEY)};"
                   "document.getElementById('key-form').requestSubmit(); window.notReloaded = true")
        p.wait("document.body.dataset.updated", 30)
        yield p


def _shot(page: Page, tmp: Path, name: str) -> None:
    path = page.screenshot(tmp / f"{name}.png")
    print(f"screenshot: {path}")


def _updated(page: Page) -> float:
    return float(page.evaluate("document.body.dataset.updated"))


def _chat(url: str, prompt: str, tokens: int = 48) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    client.chat.completions.create(model=EMBEDDED_ID, messages=[{"role": "user", "content": prompt}],
                                   max_tokens=tokens, temperature=0, extra_body={"ignore_eos": True})


def test_the_page_shows_three_stages_with_their_layers_and_engines(binary, mesh, page):
    stages = page.wait("[...document.querySelectorAll('.stage')].map(s => [s.dataset.stage, "
                       "s.querySelector('.layers').textContent, s.querySelector('.engine').textContent, "
                       "s.querySelector('.params').textContent])", 10)
    assert [s[0] for s in stages] == ["0", "1", "2"]
    assert [s[2] for s in stages] == ["llama"] * 3
    assert all(re.fullmatch(r"\d+(\.\d)?M", s[3]) for s in stages)  # SmolLM2 is dense: one figure each
    bounds = [tuple(int(x) for x in s[1].strip("[)").split(",")) for s in stages]
    assert bounds[0][0] == 0
    assert all(a[1] == b[0] for a, b in pairwise(bounds))  # contiguous ranges
    assert bounds[-1][1] == int(page.evaluate("document.getElementById('model').textContent").split(", ")[1].split()[0])
    _shot(page, mesh[2], "stages")


def test_acceptance_updates_without_a_reload(binary, mesh, page):
    url = mesh[0]
    assert page.evaluate("document.querySelector('[data-proposer=draft]') === null")  # nothing proposed yet
    _chat(url, "Write a Python function that returns the sum of a list of numbers.")
    first = page.wait("document.querySelector('[data-proposer=draft]')?.textContent", SHOWN_WITHIN_S)
    _chat(url, "List the planets of the solar system in order, one per line.")
    wait_for(lambda: page.evaluate("document.querySelector('[data-proposer=draft]').textContent") != first,
             SHOWN_WITHIN_S)
    accept = page.evaluate("document.querySelector('[data-proposer=draft] .accept').textContent")
    assert accept.endswith("%")
    assert 0 < int(accept[:-1]) <= 100
    assert page.evaluate("window.notReloaded") is True  # the same document all along
    _shot(page, mesh[2], "acceptance")


def _abandoned_stream(url: str) -> None:
    """Open /ui/events, read its first event, then reset the connection: a client gone mid-stream."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(f"GET /ui/events HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
    got = b""
    while b"data: {" not in got:  # the headers may come first, alone
        chunk = sock.recv(65536)
        assert chunk, got
        got += chunk
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST, not FIN
    sock.close()


def test_the_stream_survives_clients_that_disconnect(binary, mesh, page):
    url = mesh[0]
    for _ in range(5):
        _abandoned_stream(url)
    with httpx.stream("GET", f"{url}/ui/events", headers=AUTH, timeout=10) as r:
        events = [line for line, _ in zip(r.iter_lines(), range(6), strict=False) if line.startswith("data: ")]
    assert len(events) >= 2  # a second event: the stream goes on for the others
    before = _updated(page)
    wait_for(lambda: _updated(page) > before, SHOWN_WITHIN_S)  # and the page's own still updates
    assert "Traceback" not in next(mesh[2].glob("serve-*.log")).read_text()


def test_a_killed_stage_shows_in_the_timeline_and_as_replaced(binary, mesh, page):
    url, pid, tmp = mesh
    victim = stage_pids(pid)[1]  # the final stage
    os.kill(victim, signal.SIGKILL)
    page.wait("!!document.querySelector('.stage.REBUILDING, .stage.UNREACHABLE, .stage.BROKEN') && "
              "document.getElementById('heal-state').className === 'bad'", 15)  # down, visibly
    wait_for(lambda: httpx.get(f"{url}/health", headers=AUTH, timeout=5).json()["recoveries"] == 1, 60)
    healed = time.monotonic()
    cause = page.wait("document.querySelector('#timeline .recovery .cause')?.textContent", SHOWN_WITHIN_S)
    assert "exited" in cause or "lost" in cause
    replaced = page.wait("[...document.querySelectorAll('.stage .replaced')].map(e => e.textContent)",
                         SHOWN_WITHIN_S)
    print(f"recovery on the page {time.monotonic() - healed:.1f}s after /health had it")
    assert any(text.startswith("replaced 127.0.0.1:") for text in replaced)
    assert page.evaluate("document.getElementById('heal-state').className") == "ok"
    _shot(page, tmp, "healed")


def test_status_watch_redraws_from_the_same_snapshot(mesh):
    url = mesh[0]
    with pytest.raises(WatchError, match="needs an API key"):
        watch(url, "not-the-key", frames=1)
    screens: list[str] = []
    watch(url, KEY, frames=2, write=screens.append)
    assert len(screens) == 2
    assert all(s.startswith(CLEAR) for s in screens)
    table = [line.split() for line in screens[-1].splitlines() if line[:1].isdigit()]
    assert [row[0] for row in table] == ["0", "1", "2"]
    assert "replaced" in screens[-1]  # the recovery before this test
    assert "recoveries: 1," in screens[-1]


def test_a_stop_signal_ends_the_open_streams_at_once(mesh):
    """Last: it stops the module's server. An event stream never ends by itself; the server's
    first SIGTERM ends it, or the stop would wait out the whole grace period."""
    url, pid, _ = mesh
    with httpx.stream("GET", f"{url}/ui/events", headers=AUTH, timeout=GRACE_S) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        os.kill(pid, signal.SIGTERM)
        signalled = time.monotonic()
        for _ in lines:
            pass
    assert time.monotonic() - signalled < GRACE_S / 3
