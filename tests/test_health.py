"""/health: one pydantic model, served as JSON and read back by `mesh status` and the bench."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator

import pytest
from fake_backend import FakeBackend
from fastapi.testclient import TestClient
from pydantic import ValidationError

from mesh.api.app import build_app
from mesh.cli.main import main
from mesh.cli.status import format_health
from mesh.observe.metrics import Metrics
from mesh.reports.health import Health, StageHealth

# The keys, in order, that /health serves; readers outside this repo rely on them, so new
# keys only ever go at the end (the busy seconds came with issue 14, the engine with 17).
HEALTH_KEYS = ["ok", "model", "route", "stages", "error", "speculative", "draft_busy_s", "recoveries",
               "sessions_resumed", "last_recovery", "internal_errors", "last_internal_error"]
STAGE_KEYS = ["stage", "endpoint", "start", "end", "state", "rss_bytes", "mem_available_bytes", "status_at",
              "busy_s", "engine", "predicted_ms", "measured_ms", "link_ms", "parameters", "active_parameters",
              "kv_tier", "claims"]

SPLIT = Health(
    ok=True, model="tiny", route="coordinator [0,2) -> 127.0.0.1:7070 [2,4)", error=None,
    speculative="off (--no-draft)",
    stages=(StageHealth(stage=0, endpoint="coordinator", start=0, end=2, state="READY", rss_bytes=300 << 20,
                        mem_available_bytes=2 << 30, status_at=1700000000.5, engine="mlx",
                        predicted_ms=5.25, measured_ms=6.5, parameters=1_234_000_000,
                        active_parameters=300_000_000),
            StageHealth(stage=1, endpoint="127.0.0.1:7070", start=2, end=4, state="UNREACHABLE",
                        rss_bytes=None, mem_available_bytes=None, status_at=0.0)))


def test_health_round_trips_through_json_with_the_served_keys():
    raw = SPLIT.model_dump_json()
    assert Health.model_validate_json(raw) == SPLIT
    data = json.loads(raw)
    assert list(data) == HEALTH_KEYS
    assert [list(s) for s in data["stages"]] == [STAGE_KEYS, STAGE_KEYS]
    assert data["stages"][1]["rss_bytes"] is None
    assert data["stages"][0]["status_at"] == 1700000000.5


def test_health_refuses_what_the_server_never_sends():
    data = json.loads(SPLIT.model_dump_json())
    with pytest.raises(ValidationError):
        Health.model_validate_json(json.dumps({**data, "extra": 1}))
    data["stages"][0]["state"] = "LOST"
    with pytest.raises(ValidationError):
        Health.model_validate_json(json.dumps(data))
    with pytest.raises(ValidationError):
        Health.model_validate_json(json.dumps({**data, "ok": "yes"}))  # strict: no coercion


def test_the_endpoint_serves_the_model_as_is(byte_tokenizer):
    backend = FakeBackend(byte_tokenizer)
    backend.healthy = SPLIT
    with TestClient(build_app(backend, Metrics())) as client:
        r = client.get("/health")
    assert r.status_code == 200
    assert r.json() == json.loads(SPLIT.model_dump_json())
    assert Health.model_validate_json(r.content) == SPLIT


def test_status_table():
    lines = format_health(SPLIT).splitlines()
    assert lines[0] == "model: tiny   route: ok"
    assert lines[1] == "speculative: off (--no-draft)"
    assert lines[2].split() == ["stage", "endpoint", "layers", "engine", "state", "rss", "mem", "free", "busy",
                                "decode", "predicted", "decode", "measured", "link", "rtt", "params"]
    assert lines[3].split()[:5] == ["0", "coordinator", "[0,2)", "mlx", "READY"]
    # per stage: predicted, then measured; then its parameters, all and (a mixture of experts) active
    assert lines[3].split()[-7:] == ["5.25", "ms", "6.50", "ms", "1.2B", "(active", "300M)"]
    assert lines[4].split()[:5] == ["1", "127.0.0.1:7070", "[2,4)", "?", "UNREACHABLE"]  # never answered


@pytest.fixture
def served() -> Iterator[tuple[str, list[tuple[int, bytes]]]]:
    """A bare HTTP server answering /health with whatever (status, body) the test queues."""
    answers: list[tuple[int, bytes]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, body = answers.pop(0)
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", answers
    finally:
        server.shutdown()
        server.server_close()


def test_mesh_status_prints_what_health_serves_even_on_503(served, capsys):
    url, answers = served
    broken = SPLIT.model_copy(update={"ok": False, "error": "rebuilding route: stage gone"})
    answers += [(200, SPLIT.model_dump_json().encode()), (503, broken.model_dump_json().encode())]
    assert main(["status", "--url", url]) == 0
    assert capsys.readouterr().out == format_health(SPLIT) + "\n"
    assert main(["status", "--url", url]) == 0
    out = capsys.readouterr().out
    assert out.startswith("model: tiny   route: BROKEN\nerror: rebuilding route: stage gone\n")


def test_mesh_status_names_a_server_that_is_not_a_coordinator(served, capsys):
    url, answers = served
    answers += [(200, b'{"status": "ok"}'), (200, b"<html>hello</html>")]
    for _ in range(2):
        assert main(["status", "--url", url]) == 2
        err = capsys.readouterr().err
        assert err.startswith("mesh status: error: http://127.0.0.1:")
        assert "not a meshpipe coordinator's answer" in err
