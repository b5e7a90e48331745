"""Several `mesh serve` coordinators on the same two `mesh stage` daemons (issue 45), all
real processes, the stages started with defaults (no --lanes: each range opens with room for
claims past its first, issue 57): two coordinators of SmolLM2 share each stage's range, a
Gemma-3 coordinator loads its ranges beside them, every one answers as its model does on one
node, and with a real HAProxy (deploy/haproxy.cfg) in front, a coordinator that dies loses
only its own streams, and frees its own lanes on the stages, nobody else's."""

from __future__ import annotations

import contextlib
import functools
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from chat_reference import MAX_TOKENS, PROMPTS, chat
from haproxy import haproxy
from mesh_server import free_port, mesh_serve, metric, stage_daemon, wait_for

from mesh.model.source import EMBEDDED_ID
from mesh.reports.health import Health
from mesh.routing.route import LEASE_S

pytestmark = pytest.mark.mesh

TOKEN = "shared-stages-token"
GEMMA_PROMPT = "Name three colours of the rainbow."


@dataclass
class Shared:
    stages: list[str]
    smol: list[tuple[str, subprocess.Popen[bytes]]]  # the two SmolLM2 coordinators: (URL, process)
    cache: Path
    daemons: list[subprocess.Popen[bytes]]  # the stages', then the spare's
    spare: str
    metrics: str  # the first stage's /metrics (mesh stage --metrics-listen)


def coordinator_args(stages: list[str], *extra: str) -> list[str]:
    """`mesh serve` of the stages' shared route: each its own stage 0, draft off (as fast as a test needs)."""
    peers = [a for s in stages for a in ("--peer", s)]
    return [*peers, "--advertise", "127.0.0.1", "--artifact-listen", "127.0.0.1:0", "--lanes", "4",
            "--ctx-size", "512", "--no-draft", *extra]


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory, serve_cache: Path) -> Iterator[Shared]:
    root = tmp_path_factory.mktemp("shared-stages")
    metrics = f"127.0.0.1:{free_port()}"
    exported = {1: ["--metrics-listen", metrics]}
    daemons = [stage_daemon(root / f"stage{i}", TOKEN, *exported.get(i, [])) for i in (1, 2, 3)]
    stages, spare = [at for _, at in daemons[:2]], daemons[2][1]
    env = {"MESHPIPE_TOKEN": TOKEN}
    try:
        with contextlib.ExitStack() as servers:
            smol = [servers.enter_context(mesh_serve(serve_cache, *coordinator_args(stages, "--spare", spare),
                                                     env=env)) for _ in range(2)]
            yield Shared(stages, smol, serve_cache, [proc for proc, _ in daemons], spare, f"http://{metrics}")
    finally:
        for proc, _ in daemons:
            if proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            proc.kill()


def _health(url: str) -> Health:
    return Health.model_validate_json(httpx.get(f"{url}/health", timeout=10).content)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def test_two_coordinators_share_each_stage_s_range_and_answer_as_one_node(shared: Shared, expected_texts):
    for url, _ in shared.smol:
        assert chat(_client(url), PROMPTS[0]) == expected_texts[PROMPTS[0]]
        assert chat(_client(url), PROMPTS[1], stream=True) == expected_texts[PROMPTS[1]]
    ours, theirs = (_health(url) for url, _ in shared.smol)
    for mine, other in zip(ours.stages[1:], theirs.stages[1:], strict=True):
        assert (mine.start, mine.end) == (other.start, other.end)  # one cut: the second took the first's
        assert len(mine.claims) == 2
        assert {c.start for c in mine.claims} == {mine.start}
        assert sum(c.this for c in mine.claims) == 1


def test_a_second_model_serves_from_the_same_stages(shared: Shared, gemma3_package: Path):
    single = ["--model", str(gemma3_package), "--local-stages", "1", "--no-draft", "--ctx-size", "512"]
    with mesh_serve(shared.cache, *single) as (url, _):
        reference = _gemma_chat(url)
    args = ["--model", str(gemma3_package), *coordinator_args(shared.stages)]
    with mesh_serve(shared.cache, *args, env={"MESHPIPE_TOKEN": TOKEN}) as (url, _):
        assert _gemma_chat(url) == reference
        for row in _health(url).stages[1:]:  # beside SmolLM2's two claims
            assert len(row.claims) == 3
        assert chat(_client(shared.smol[0][0]), PROMPTS[2]) != ""  # SmolLM2 serves on meanwhile


def _gemma_chat(url: str) -> str:
    client = _client(url)
    r = client.chat.completions.create(model=client.models.list().data[0].id, temperature=0, max_tokens=24,
                                       messages=[{"role": "user", "content": GEMMA_PROMPT}])
    return r.choices[0].message.content or ""


def test_a_shared_stage_that_dies_is_replaced_for_every_coordinator(shared: Shared, expected_texts):
    """Each coordinator heals its own route: both move onto the spare, which then serves both."""
    shared.daemons[1].kill()
    for url, _ in shared.smol:
        wait_for(functools.partial(_on_spare, url, shared.spare), timeout=60)
        assert chat(_client(url), PROMPTS[2]) == expected_texts[PROMPTS[2]]
    claims = _health(shared.smol[0][0]).stages[2].claims
    assert len(claims) == 2  # the spare serves both coordinators


def _on_spare(url: str, spare: str) -> bool:
    health = _health(url)
    return health.ok and spare in health.route


class Load:
    """8 streams and 8 whole requests through `front`, each client with a key of its own (HAProxy
    hashes it); every stream has begun once `started` is set for all."""

    def __init__(self, front: str) -> None:
        self.front = front
        self.prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
        self.streams: list[str | BaseException | None] = [None] * 8
        self.wholes: list[str | None] = [None] * 8
        self.started = [threading.Event() for _ in self.prompts]
        self.threads = [threading.Thread(target=self._stream, args=(i,)) for i in range(8)]
        self.threads += [threading.Thread(target=self._whole, args=(i,)) for i in range(8)]
        for t in self.threads:
            t.start()

    def client(self, i: int, retries: int = openai.DEFAULT_MAX_RETRIES) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.front}/v1", api_key=f"client-{i}", max_retries=retries)

    def _stream(self, i: int) -> None:
        try:
            chunks = self.client(i, retries=0).chat.completions.create(
                model=EMBEDDED_ID, messages=[{"role": "user", "content": self.prompts[i]}], temperature=0,
                max_tokens=MAX_TOKENS, stream=True)
            parts = []
            for chunk in chunks:
                self.started[i].set()
                parts += [chunk.choices[0].delta.content or ""] if chunk.choices else []
            self.streams[i] = "".join(parts)
        except Exception as exc:  # noqa: BLE001 -- a stream on the killed coordinator breaks: counted
            self.streams[i] = exc
        finally:
            self.started[i].set()

    def _whole(self, i: int) -> None:  # with the SDK's own retries, as users have them
        self.wholes[i] = chat(self.client(i), self.prompts[i])


def test_through_haproxy_a_coordinator_killed_under_load_loses_only_its_own_streams(
        shared: Shared, expected_texts, tmp_path):
    """8 streams and 8 whole requests through the shipped HAProxy config, spread over both
    coordinators by their keys; one coordinator is SIGKILLed mid-stream. The other's streams
    end exactly as the unsplit model's, every whole request succeeds, and so does every
    request sent after the kill, with the SDK's own retries; the dead one's lanes on the
    stages are freed when its lease runs out."""
    (dead_url, dead), (url, _) = shared.smol
    dead_id = next(c.coordinator for c in _health(url).stages[1].claims if not c.this)
    assert metric(shared.metrics, f'meshpipe_stage_claim_lanes{{coordinator="{dead_id}"}}') == 4
    free_before = metric(shared.metrics, "meshpipe_stage_range_free_lanes")
    with haproxy([dead_url, url], tmp_path) as front:
        load = Load(front)
        for event in load.started:
            assert event.wait(60)
        on_dead = metric(dead_url, "meshpipe_requests_in_flight")
        assert on_dead, "the keys sent no stream to the coordinator to kill, or its streams had ended"
        dead.kill()
        killed = time.monotonic()
        first = chat(load.client(0), PROMPTS[0])
        served_in = time.monotonic() - killed
        for t in load.threads:
            t.join(120)
        for i, prompt in enumerate(load.prompts):  # every key, so some were the dead coordinator's
            assert chat(load.client(i), prompt) == expected_texts[prompt]
    # a whole request on the dead coordinator had sent nothing: HAProxy (retry-on
    # empty-response) or else the SDK sent it again, and it succeeded
    assert load.wholes == [expected_texts[p] for p in load.prompts]
    broken = [r for r in load.streams if isinstance(r, BaseException)]
    print(f"served {served_in:.2f} s after the kill; {len(broken)} of 8 streams broke")  # -s shows it
    assert first == expected_texts[PROMPTS[0]]
    assert served_in < 3
    assert 0 < len(broken) <= on_dead  # only streams on the dead coordinator broke
    assert len(broken) < 8, "the keys sent every stream to the coordinator killed"
    for prompt, result in zip(load.prompts, load.streams, strict=True):
        if not isinstance(result, BaseException):
            assert result == expected_texts[prompt]

    def freed() -> bool:
        return all(dead_id not in {c.coordinator for c in row.claims} for row in _health(url).stages[1:])

    wait_for(freed, timeout=LEASE_S + 5)
    for row in _health(url).stages[1:]:
        assert [(c.this, c.lanes) for c in row.claims] == [(True, 4)]
    # and the stage's own /metrics says so (within its reading's second): the dead coordinator's
    # lanes are back among the range's free ones
    wait_for(lambda: metric(shared.metrics, "meshpipe_stage_range_free_lanes") == free_before + 4, timeout=5)
    assert f'coordinator="{dead_id}"' not in httpx.get(f"{shared.metrics}/metrics").text
    assert metric(shared.metrics, "meshpipe_stage_claim_lanes{") == 4
