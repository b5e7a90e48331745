"""`mesh serve --local-stages N` over loopback, driven by the real openai client."""

from __future__ import annotations

import concurrent.futures
import re
import time

import httpx
import openai
import pytest
from chat_reference import PROMPTS
from chat_reference import chat as _chat
from mesh_server import mesh_serve, metric
from openai.types.chat import ChatCompletionMessageParam

from bench.harness.breakdown import measure
from mesh.cli.main import main
from mesh.model.source import EMBEDDED_ID
from mesh.reports.health import Health
from mesh.routing.keeper import STATUS_TTL

pytestmark = pytest.mark.mesh


@pytest.mark.parametrize("stages", [2, 3])
def test_split_serving_matches_unsplit_model(serve_cache, expected_texts, stages):
    with mesh_serve(serve_cache, "--local-stages", str(stages)) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        health = httpx.get(f"{url}/health").json()
        assert len(health["stages"]) == stages
        for prompt in PROMPTS[:2]:
            assert _chat(client, prompt) == expected_texts[prompt]
            assert _chat(client, prompt, stream=True) == expected_texts[prompt]


@pytest.fixture(scope="module")
def two_stage(serve_cache):
    # no draft: whether the controller speculates depends on timings, and a verify frame's
    # rows are a window per session, so the micro-batch counts below would depend on them too
    with mesh_serve(serve_cache, "--local-stages", "2", "--lanes", "8", "--ctx-size", "512",
                    "--cut-on", "measured", "--no-draft") as s:
        yield s


DECODE_ROWS_AT_0 = 'meshpipe_hop_batch_rows_total{kind="decode",stage="0"}'
DECODES = 'meshpipe_frames_total{kind="decode"}'


def test_eight_concurrent_streams_match_solo_runs_in_micro_batches(two_stage, serve_cache, expected_texts, capsys):
    """Two stages with their own cores (no CPU lock): the 8 sessions go in two groups of 4.
    Every stage calibrated its range at Load, on lanes these sessions then use: their output
    is still the unsplit model's, and `mesh status` shows each stage's time per decode,
    predicted from that calibration and measured from the hop timings."""
    url, _ = two_stage
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
    rows, frames = metric(url, DECODE_ROWS_AT_0), metric(url, DECODES)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda p: _chat(client, p, stream=True), prompts))
    assert outs == [expected_texts[p] for p in prompts]
    # each decode frame counts the rows of the stage-0 decode that ran it: at most a group's 4
    rows, frames = metric(url, DECODE_ROWS_AT_0) - rows, metric(url, DECODES) - frames
    assert frames > 8
    assert rows / frames <= 4
    time.sleep(STATUS_TTL)  # /health asks the stages again
    stages = Health.model_validate_json(httpx.get(f"{url}/health").content).stages
    assert all(s.busy_s is not None and s.busy_s > 0 for s in stages)
    assert all(s.predicted_ms is not None and s.predicted_ms > 0 for s in stages)  # Load reported a calibration
    assert all(s.measured_ms is not None and s.measured_ms > 0 for s in stages)
    assert stages[1].link_ms is not None
    log = (serve_cache / f"serve-{url.rsplit(':', 1)[1]}.log").read_text()
    assert re.search(r"calibrated: [\d.]+, [\d.]+ ms a decode", log)  # both stages' Load calibrations
    assert "plan (measured time)" in log or "re-cut" not in log  # a re-cut cuts on them
    assert main(["status", "--url", url]) == 0
    table = capsys.readouterr().out.splitlines()
    assert "decode predicted" in table[-3]
    assert [row.count(" ms") for row in table[-2:]] == [2, 3]  # stage 0 has no link of its own


def test_bad_requests_get_openai_errors_and_server_survives(two_stage, expected_texts):
    url, _ = two_stage
    chat = f"{url}/v1/chat/completions"
    bad_json = httpx.post(chat, content=b"{not json", headers={"content-type": "application/json"})
    assert bad_json.status_code == 400
    assert bad_json.json()["error"]["type"] == "invalid_request_error"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    msgs: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError, match=r"model_not_found|does not exist"):
        client.chat.completions.create(model="no-such-model", messages=msgs)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model=EMBEDDED_ID, messages=msgs, max_tokens=-5)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.chat.completions.create(model=EMBEDDED_ID, max_tokens=8,
                                       messages=[{"role": "user", "content": "word " * 600}])
    missing = httpx.post(chat, json={"model": EMBEDDED_ID})
    assert missing.status_code == 400
    assert "messages" in missing.text
    assert _chat(client, PROMPTS[0]) == expected_texts[PROMPTS[0]]
    metrics = httpx.get(f"{url}/metrics").text
    assert 'meshpipe_requests_total{endpoint="chat",status="400"}' in metrics


def test_completions_endpoint_and_stop_strings(two_stage):
    url, _ = two_stage
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    r = client.completions.create(model=EMBEDDED_ID, prompt="One, two, three,", max_tokens=12,
                                  temperature=0)
    assert r.choices[0].text
    assert r.usage is not None
    assert r.usage.completion_tokens > 0
    models = client.models.list()
    assert [m.id for m in models.data] == [EMBEDDED_ID]
    full = r.choices[0].text
    word = full.strip().split()[0]
    cut = client.completions.create(model=EMBEDDED_ID, prompt="One, two, three,", max_tokens=12,
                                    temperature=0, stop=[word])
    assert cut.choices[0].finish_reason == "stop"
    assert word not in cut.choices[0].text


def test_every_frame_reports_where_its_time_went(two_stage):
    """/metrics sums each stage's queue/compute/codec/sample and the wire, per frame."""
    url, _ = two_stage
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    made = []

    def run() -> int:
        r = client.chat.completions.create(model=EMBEDDED_ID, max_tokens=12, temperature=0,
                                           messages=[{"role": "user", "content": "Count to ten."}],
                                           extra_body={"ignore_eos": True})
        assert r.usage is not None
        made.append(r.usage.completion_tokens)
        return r.usage.completion_tokens

    parts = dict(measure(url, 1, run))
    frames = parts["prefill frames"] + parts.get("decode frames", 0) + parts.get("verify frames", 0)
    assert made == [12]
    assert parts["prefill frames"] == 1
    assert frames <= 12
    ms = {what.removesuffix(" (ms/frame)"): value for what, value in parts.items()}
    kind = "verify" if "verify frames" in parts else "decode"
    assert ms[f"{kind}: stage 0 compute"] > 0
    assert ms[f"{kind}: stage 1 compute"] > 0
    assert ms[f"{kind}: stage 1 sample"] > 0
    assert f"{kind}: stage 0 sample" not in ms
    assert ms[f"{kind}: wire, round trip less the stages"] > 0
    assert ms[f"{kind}: pipeline"] >= ms[f"{kind}: stage 0 compute"] + ms[f"{kind}: stage 1 compute"]
    assert ms["pipeline total, all frames"] > 0
    assert parts[f"{kind}: stage 0 rows per decode"] >= 1
    assert parts[f"{kind}: stage 1 rows per decode"] >= 1
    per_row = ms[f"{kind}: stage 1 compute"] / parts[f"{kind}: stage 1 rows per decode"]
    assert parts[f"{kind}: stage 1 compute per row (ms)"] == pytest.approx(per_row)
