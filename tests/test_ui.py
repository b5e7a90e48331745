"""The web page's server side without a mesh: the snapshot a sampler builds from a coordinator's
state, the event stream's fan-out, the recovery timeline, and the routes behind the API key."""

from __future__ import annotations

import asyncio
import fnmatch
import json
import shutil
import subprocess
import time
import tomllib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from fake_backend import FakeBackend
from fastapi.testclient import TestClient

from mesh.api.app import Access, build_app
from mesh.api.ui import MAX_STREAMS
from mesh.backend import Acceptance, WindowChoice
from mesh.cli.watch import format_snapshot
from mesh.coordinator import Coordinator
from mesh.model.tokenizer import Tokenizer
from mesh.observe.metrics import Metrics
from mesh.observe.sampler import Sampler, busy_fraction
from mesh.reports.hop_timing import HopTotals
from mesh.reports.recovery import TIMELINE, Recoveries
from mesh.reports.snapshot import Snapshot
from mesh.routing.healing import replacements
from mesh.routing.planner import LayerWork, StageRange
from mesh.routing.route import RemoteStage
from mesh.serving.admission import Admission
from mesh.speculative.speculation import Speculation
from proto import meshpipe_pb2 as pb

ROOT = Path(__file__).resolve().parent.parent
KEY = "page-key"
GOOD = {"authorization": f"Bearer {KEY}"}


def _remote(endpoint: str, busy: float) -> RemoteStage:
    return RemoteStage(endpoint=endpoint, range=StageRange(13, 30), status_at=time.time(),
                       status=pb.StatusReply(busy_seconds=busy, engine="llama", rss_bytes=1 << 20,
                                             mem_available_bytes=1 << 30))


# 13 dense layers, then 17 of a mixture of experts that multiplies a quarter of its parameters
WORK = LayerWork(costs=(2e7,) * 13 + (2.5e7,) * 17, total=(2e7,) * 13 + (1e8,) * 17)


def _route(remote: str) -> Any:
    """Stage 0 and one remote stage, neither calibrated (no time is predicted)."""
    return SimpleNamespace(stage0=StageRange(0, 13), stages=[_remote(remote, 0.0)], calibration0=None, work=WORK,
                           coordinator_id="c0")


def _mesh() -> Any:
    """The coordinator's state a sampler reads, and nothing else: no route is built."""
    pipeline = SimpleNamespace(broken=None, waiters={}, core=SimpleNamespace(
        batcher=SimpleNamespace(busy_s=0.0), lanes=SimpleNamespace(by_session={}), tier=None))
    routes = SimpleNamespace(route=_route("127.0.0.1:7001"), pipeline=pipeline, hops=HopTotals(),
                             model=SimpleNamespace(manifest=SimpleNamespace(layer_count=30)),
                             topology=SimpleNamespace(spares=("127.0.0.1:7009",)))
    return SimpleNamespace(
        routes=routes, settings=SimpleNamespace(engine=lambda _: "llama"),
        requests=SimpleNamespace(generated=0, admission=Admission(4, 16), choices=lambda: ()), recoveries=Recoveries(),
        healer=SimpleNamespace(last_error=""), model_id="m", speculation=Speculation(None, "off: --no-draft", print))


def _sampler(mesh: Any, metrics: Metrics | None = None) -> Sampler:
    return Sampler(cast(Coordinator, mesh), metrics or Metrics())


def test_the_snapshot_shows_the_route_and_its_rates_between_ticks():
    mesh = _mesh()
    sampler = _sampler(mesh)
    sampler.sample()
    mesh.requests.generated = 50
    mesh.routes.hops.rows_sent, mesh.routes.hops.rows_voided = 40, 10
    mesh.routes.pipeline.waiters = {1: None, 2: None}
    mesh.routes.route.stages[0].ping_s = 0.004  # the watcher's last Status call to stage 1
    snap = sampler.sample()
    before, now = sampler.readings[-2], sampler.readings[-1]
    assert snap.speculation.tok_s == pytest.approx(50 / (now.at - before.at), rel=0.01)
    assert snap.speculation.stale == 0.25
    assert snap.speculation.frames_in_flight == 2
    assert [(s.stage, s.endpoint, s.start, s.end, s.engine) for s in snap.stages] == [
        (0, "coordinator", 0, 13, "llama"), (1, "127.0.0.1:7001", 13, 30, "llama")]
    assert [(s.parameters, s.active_parameters) for s in snap.stages] == [(260_000_000,) * 2,
                                                                          (1_700_000_000, 425_000_000)]
    assert [(link.to, link.round_trip_ms) for link in snap.links] == [(1, 4.0)]
    assert snap.spares == ("127.0.0.1:7009",)
    assert [p.tok_s for p in snap.history] == [0.0, snap.speculation.tok_s]


def test_acceptance_is_read_per_proposer_from_the_metrics():
    metrics, mesh = Metrics(), _mesh()
    metrics.record_speculative(Acceptance().add(4, 3, "draft").add(4, 1, "draft").add(2, 2, "ngram"))
    chose = WindowChoice(2, 3, 30.0, 17.0, "window 2, 3 in flight: 30.0 tok/s predicted against 17.0 without")
    mesh.requests.choices = lambda: (("draft", chose),)  # the draft's window is cost-aware, prompt lookup's not
    (draft, ngram) = _sampler(mesh, metrics).sample().speculation.proposers
    assert (draft.name, draft.accept_rate, draft.mean_window, draft.proposed) == ("draft", 0.5, 4.0, 8)
    assert draft.choice == chose.why
    assert (ngram.name, ngram.accept_rate, ngram.choice) == ("ngram", 1.0, None)


def test_a_rebuilt_route_shows_rebuilding_then_the_stage_that_replaced_one():
    mesh = _mesh()
    sampler = _sampler(mesh)
    sampler.sample()
    mesh.recoveries.broke("stage 127.0.0.1:7001 exited (code -9)")
    mesh.routes.route = mesh.routes.pipeline = None
    down = sampler.sample()
    assert [s.state for s in down.stages] == ["REBUILDING", "REBUILDING"]
    assert not down.healing.ok
    mesh.routes.route = _route("127.0.0.1:7009")
    mesh.routes.pipeline = _mesh().routes.pipeline
    mesh.recoveries.healed(replacements(("127.0.0.1:7001",), ("127.0.0.1:7009",)))
    up = sampler.sample()
    assert up.healing.ok
    assert up.stages[1].replaced == "127.0.0.1:7001"
    (recovery,) = up.healing.timeline
    assert recovery.cause.startswith("stage 127.0.0.1:7001 exited")
    assert recovery.replaced == (("127.0.0.1:7001", "127.0.0.1:7009"),)


def test_the_timeline_keeps_the_latest_recoveries():
    r = Recoveries()
    for n in range(TIMELINE + 5):
        r.broke(f"break {n}")
        r.healed()
    assert len(r.timeline) == TIMELINE
    assert r.timeline[-1].cause == f"break {TIMELINE + 4}"
    assert r.count == TIMELINE + 5


def test_replacements_pair_each_stage_gone_with_the_one_in_its_place():
    assert replacements(("a", "b"), ("a", "s")) == (("b", "s"),)
    assert replacements(("a", "b"), ("b",)) == (("a", ""),)  # no spare: the others took its layers
    assert replacements(("a", "b"), ("a", "b")) == ()


def test_busy_is_divided_by_the_stage_replies_own_times():
    assert busy_fraction((3.0, 12.0), (2.5, 10.0)) == 0.25
    assert busy_fraction((0.1, 12.0), (2.5, 10.0)) is None  # a new route's stage counts from 0
    assert busy_fraction((2.5, 10.0), None) is None


def test_a_watcher_that_leaves_does_not_stop_the_others():
    async def watch() -> None:
        sampler = _sampler(_mesh())
        sampler.sample()
        leaving, staying = sampler.events(), sampler.events()
        first = await anext(leaving)
        assert first == await anext(staying)
        assert first.startswith(b"data: {")
        assert first.endswith(b"\n\n")
        assert sampler.watchers == 2
        waiting = asyncio.ensure_future(anext(leaving))
        await asyncio.sleep(0)
        waiting.cancel()  # the client went: Starlette cancels its generator
        await asyncio.gather(waiting, return_exceptions=True)
        await leaving.aclose()
        assert sampler.watchers == 1
        nxt = asyncio.ensure_future(anext(staying))
        await asyncio.sleep(0)
        sampler.sample()
        event = await asyncio.wait_for(nxt, 1)
        assert Snapshot.model_validate_json(event.removeprefix(b"data: ").strip()).model == "m"
        await staying.aclose()
        assert sampler.watchers == 0

    asyncio.run(watch())


class _Feed:
    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot: Snapshot | None = snapshot
        self.watchers, self.started = 0, False

    def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.started = False

    async def events(self) -> AsyncIterator[bytes]:
        yield b"data: {}\n\n"


@pytest.fixture
def page(byte_tokenizer: Tokenizer) -> Iterator[tuple[TestClient, _Feed]]:
    feed = _Feed(_sampler(_mesh()).sample())
    app = build_app(FakeBackend(byte_tokenizer), Metrics(), access=Access(api_keys=(KEY,)), ui=feed)
    with TestClient(app, follow_redirects=False) as client:
        assert feed.started  # the server's life starts the sampler
        yield client, feed
    assert not feed.started


def test_the_page_is_served_to_anyone_its_data_only_with_the_key(page):
    client, _ = page
    assert client.get("/").headers["location"] == "/ui"
    html = client.get("/ui")
    assert html.status_code == 200
    assert "default-src 'none'" in html.headers["content-security-policy"]
    assert "frame-ancestors 'none'" in html.headers["content-security-policy"]
    assert '<script src="/ui/static/ui.js"' in html.text
    assert client.get("/ui/static/ui.js").status_code == 200
    assert client.get("/ui/static/index.html").status_code == 404  # only the listed files
    assert client.get("/ui/snapshot").status_code == 401
    assert client.get("/ui/events").status_code == 401
    assert client.get("/ui/events", headers={"authorization": "Bearer wrong"}).status_code == 401
    snap = client.get("/ui/snapshot", headers=GOOD)
    assert Snapshot.model_validate_json(snap.content).stages[1].endpoint == "127.0.0.1:7001"


def test_no_page_route_takes_a_post(page):
    client, _ = page
    for path in ("/", "/ui", "/ui/events", "/ui/snapshot"):
        assert client.post(path, headers=GOOD, json={}).status_code == 405, path


def test_streams_beyond_the_limit_are_refused(page):
    client, feed = page
    feed.watchers = MAX_STREAMS
    r = client.get("/ui/events", headers=GOOD)
    assert r.status_code == 503
    assert r.headers["retry-after"] == "5"


def test_status_watch_draws_the_snapshot_as_a_table():
    mesh = _mesh()
    sampler = _sampler(mesh)
    sampler.sample()
    mesh.recoveries.broke("stage 127.0.0.1:7001 exited (code -9)")
    mesh.routes.route.stages = [_remote("127.0.0.1:7009", 0.0)]
    mesh.recoveries.healed(replacements(("127.0.0.1:7001",), ("127.0.0.1:7009",)))
    text = format_snapshot(sampler.sample())
    lines = text.splitlines()
    assert lines[0].startswith("model: m   route: ok")
    stage_rows = [line.split() for line in lines if line[:1].isdigit()]
    assert [row[:4] for row in stage_rows] == [["0", "coordinator", "[0,13)", "llama"],
                                               ["1", "127.0.0.1:7009", "[13,30)", "llama"]]
    assert stage_rows[0][-1] == "260M"  # dense: one figure
    assert stage_rows[1][-5:] == ["1.7B", "(active", "425M)", "replaced", "127.0.0.1:7001"]
    assert "spare: 127.0.0.1:7009" in lines
    assert "stage 127.0.0.1:7001 exited (code -9)" in lines[-1]


def test_closing_the_sampler_ends_every_stream():
    """At the server's first stop signal: an endless response would hold the graceful stop."""

    async def close() -> None:
        sampler = _sampler(_mesh())
        sampler.sample()
        stream = sampler.events()
        await anext(stream)
        rest = asyncio.ensure_future(anext(stream, None))
        await asyncio.sleep(0)
        sampler.close()
        assert await asyncio.wait_for(rest, 1) is None
        assert sampler.watchers == 0

    asyncio.run(close())


def test_the_page_files_are_package_data():
    """A wheel carries mesh/ui only when pyproject names the package and its files' patterns
    (checked by hand with `pip wheel . --no-deps`; building one here would start a process)."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "mesh.ui" in setuptools["packages"]
    patterns = setuptools["package-data"]["mesh.ui"]
    files = [p for p in (ROOT / "mesh" / "ui").iterdir() if p.suffix != ".py" and p.is_file()]
    assert {p.name for p in files} >= {"index.html", "ui.css", "ui.js"}
    assert all(any(fnmatch.fnmatch(p.name, pattern) for pattern in patterns) for p in files)


@pytest.mark.mesh  # it starts node
def test_the_page_shows_all_and_active_parameters_per_stage(tmp_path):
    """ui.js's stage card figure, run in node: both figures for a mixture of experts, one when dense."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("no node on this machine")
    js = (ROOT / "mesh" / "ui" / "ui.js").read_text()
    functions = js[js.index("function count("):js.index("function layerBar(")]
    stages = [{"parameters": 1_234_000_000, "active_parameters": 300_000_000},
              {"parameters": 135_000_000, "active_parameters": 135_000_000}, {"parameters": None}]
    script = tmp_path / "params.js"
    script.write_text(functions + f"console.log(JSON.stringify({json.dumps(stages)}.map(params)));")
    out = subprocess.run([node, str(script)], capture_output=True, text=True, timeout=30, check=True).stdout
    assert json.loads(out) == ["1.2B (active 300M)", "135M", "–"]
    assert 'row("parameters", el("span", { class: "params" }, params(s)))' in js
