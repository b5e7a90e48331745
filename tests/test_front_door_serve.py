"""The front door on a real `mesh serve`: API keys through the real openai client and
`mesh status`, the bounded queue's 429, the request time limit, and a left stream's 499."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from mesh_server import mesh_serve, metric, wait_for

pytestmark = pytest.mark.mesh

HI: list = [{"role": "user", "content": "hi"}]
# two stages with 20 ms on every hop: about 40 ms a token, so a request lasts as long as a test needs
SLOW = ("--local-stages", "2", "--no-draft", "--wire-delay-ms", "20", "--lanes", "1", "--ctx-size", "512")


@pytest.fixture(scope="module")
def tiny(tiny_byte_package: Path) -> Path:
    return tiny_byte_package


def _client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def _status(cache: Path, url: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k != "MESHPIPE_API_KEY"}
    return subprocess.run([sys.executable, "-m", "mesh.cli", "status", "--url", f"{url}/v1", *args],
                          capture_output=True, text=True, timeout=60,
                          env={**clean, "MESHPIPE_CACHE": str(cache), **(env or {})})


def test_keys_guard_every_route_for_the_real_client_and_mesh_status(tiny: Path, tmp_path: Path):
    keyfile = tmp_path / "keys"
    keyfile.write_text("# the team's key\nfile-key\n")
    with mesh_serve(tmp_path, "--model", str(tiny), "--no-draft", "--api-key", "flag-key",
                    "--api-key-file", str(keyfile), "--ctx-size", "256") as (url, _):
        wrong = _client(url, "wrong-key")
        calls = [lambda c: c.chat.completions.create(model="tiny", messages=HI, max_tokens=2),
                 lambda c: c.completions.create(model="tiny", prompt="hi", max_tokens=2),
                 lambda c: list(c.chat.completions.create(model="tiny", messages=HI, max_tokens=2, stream=True)),
                 lambda c: list(c.completions.create(model="tiny", prompt="hi", max_tokens=2, stream=True)),
                 lambda c: c.models.list(), lambda c: c.models.retrieve("tiny")]
        for call in calls:
            with pytest.raises(openai.AuthenticationError) as refused:
                call(wrong)
            assert refused.value.status_code == 401
            assert refused.value.code == "invalid_api_key"
        for key in ("flag-key", "file-key"):
            for call in calls:
                call(_client(url, key))  # raises unless admitted
        good = _client(url, "file-key")
        usage = good.chat.completions.create(model="tiny", messages=HI, max_tokens=3).usage
        assert usage is not None
        assert usage.completion_tokens > 0
        assert len(list(good.completions.create(model="tiny", prompt="hi", max_tokens=3, stream=True))) > 1
        model = good.models.retrieve("tiny")
        assert (model.id, model.object, model.owned_by) == ("tiny", "model", "meshpipe")
        with pytest.raises(openai.NotFoundError):
            good.models.retrieve("gpt-4o")
        assert httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi"}).status_code == 401

        assert httpx.get(f"{url}/health").json() == {"ok": True}
        assert httpx.get(f"{url}/metrics").status_code == 401
        keyed = {"Authorization": "Bearer flag-key"}
        assert httpx.get(f"{url}/health", headers=keyed).json()["model"] == "tiny"
        assert "meshpipe_requests_total" in httpx.get(f"{url}/metrics", headers=keyed).text

        keyless = _status(tmp_path, url)
        assert keyless.returncode == 2
        assert "--api-key" in keyless.stderr
        assert "model: tiny" in _status(tmp_path, url, "--api-key", "flag-key").stdout
        assert "model: tiny" in _status(tmp_path, url, env={"MESHPIPE_API_KEY": "file-key"}).stdout


def test_an_open_public_address_is_warned_about(tiny: Path, tmp_path: Path):
    clean = {k: v for k, v in os.environ.items() if k != "MESHPIPE_API_KEY"}
    proc = subprocess.Popen([sys.executable, "-m", "mesh.cli", "serve", "--model", str(tiny), "--no-draft",
                             "--threads", "1", "--listen", "0.0.0.0:0"], stderr=subprocess.PIPE, text=True,
                            env={**clean, "MESHPIPE_CACHE": str(tmp_path)})
    try:
        assert proc.stderr is not None
        # said as soon as the port is bound, before the model loads
        warning = next(line for line in proc.stderr if "WARNING" in line or "serving" in line)
    finally:
        proc.terminate()
        proc.wait(30)
    assert "the API at 0.0.0.0:" in warning
    assert "needs no API key" in warning


class _Call(threading.Thread):
    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.status = 0
        self.text = ""

    def run(self) -> None:
        r = httpx.post(f"{self.url}/v1/completions", json=self.body, timeout=120)
        self.status, self.text = r.status_code, r.text


def test_beyond_the_lanes_and_the_queue_a_request_gets_429(tiny: Path, tmp_path: Path):
    with mesh_serve(tmp_path, "--model", str(tiny), *SLOW, "--max-queue", "2") as (url, _):
        long = {"model": "tiny", "prompt": "hi", "max_tokens": 120, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=long, timeout=120) as first:
            lines = first.iter_lines()
            assert next(line for line in lines if line).startswith("data: ")  # it holds the lane
            queued = [_Call(url, {"model": "tiny", "prompt": "hi", "max_tokens": 4, "ignore_eos": True})
                      for _ in range(2)]
            for call in queued:
                call.start()
            wait_for(lambda: metric(url, "meshpipe_queue_depth") == 2, timeout=30)
            fourth = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4},
                                timeout=30)
            assert fourth.status_code == 429, fourth.text
            assert int(fourth.headers["retry-after"]) >= 1
            assert fourth.json()["error"]["code"] == "rate_limit_exceeded"
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        for call in queued:
            call.join(120)
            assert call.status == 200, call.text
            assert json.loads(call.text)["usage"]["completion_tokens"] == 4
        assert metric(url, "meshpipe_queue_depth") == 0
        assert metric(url, "meshpipe_queue_wait_seconds_count") == 3
        assert metric(url, 'meshpipe_requests_total{endpoint="completions",status="429"}') == 1

        # a stream its client leaves is counted as such, not as a 200
        with httpx.stream("POST", f"{url}/v1/completions", json=long, timeout=60) as left:
            assert next(line for line in left.iter_lines() if line).startswith("data: ")
        wait_for(lambda: metric(url, 'meshpipe_requests_total{endpoint="completions",status="499"}') == 1, 30)


def test_a_request_past_its_time_limit_ends_clearly_and_frees_its_lane(tiny: Path, tmp_path: Path):
    with mesh_serve(tmp_path, "--model", str(tiny), *SLOW, "--request-timeout", "2") as (url, _):
        endless = {"model": "tiny", "prompt": "hi", "max_tokens": 400, "ignore_eos": True}
        started = time.monotonic()
        with httpx.stream("POST", f"{url}/v1/completions", json={**endless, "stream": True}, timeout=60) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line]
        assert 2 <= time.monotonic() - started < 15
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2][6:])["error"]
        assert error["code"] == "request_timeout"
        assert "--request-timeout" in error["message"]
        assert len(lines) > 3  # it streamed text before its time ran out

        client = _client(url, "none")
        with pytest.raises(openai.InternalServerError) as timed_out:
            client.completions.create(model="tiny", prompt="hi", max_tokens=400, extra_body={"ignore_eos": True})
        assert timed_out.value.status_code == 504
        # one lane on each of the two stages: the next request gets it only if both were freed
        started = time.monotonic()
        done = client.completions.create(model="tiny", prompt="hi", max_tokens=5, extra_body={"ignore_eos": True})
        assert done.usage is not None
        assert done.usage.completion_tokens == 5
        assert time.monotonic() - started < 2
        assert metric(url, "meshpipe_requests_in_flight") == 0
