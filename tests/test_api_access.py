"""The API's front door over the fake backend: API keys, /health and /metrics with and without
one, JSON-only POSTs, web origins and CORS, GET /v1/models/{id}, and a left stream counted."""

from __future__ import annotations

import asyncio
import gzip
import hmac
import json
from collections.abc import Iterator, MutableMapping
from typing import Any

import pytest
from fake_backend import FakeBackend
from fastapi.testclient import TestClient

from mesh.api.app import Access, build_app
from mesh.api.keys import ApiKeys
from mesh.observe.metrics import Metrics

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]
KEYS = ("first-key", "second-key")
GOOD = {"authorization": "Bearer second-key"}
APP = "http://app.example"


@pytest.fixture
def backend(byte_tokenizer) -> FakeBackend:
    return FakeBackend(byte_tokenizer, "Hello world")


def _client(backend: FakeBackend, metrics: Metrics | None = None, **access: Any) -> TestClient:
    return TestClient(build_app(backend, metrics or Metrics(), access=Access(**access)))


@pytest.fixture
def keyed(backend: FakeBackend) -> Iterator[TestClient]:
    with _client(backend, api_keys=KEYS) as c:
        yield c


def _error(r: Any, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"]
    return dict(body["error"])


CALLS = [("POST", CHAT, {"model": "tiny", "messages": HI}),
         ("POST", CHAT, {"model": "tiny", "messages": HI, "stream": True}),
         ("POST", COMPLETIONS, {"model": "tiny", "prompt": "hi"}),
         ("POST", COMPLETIONS, {"model": "tiny", "prompt": "hi", "stream": True}),
         ("GET", "/v1/models", None),
         ("GET", "/v1/models/tiny", None)]


@pytest.mark.parametrize(("method", "path", "body"), CALLS)
def test_every_v1_route_needs_a_key_when_keys_are_set(keyed: TestClient, method: str, path: str, body: Any):
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "first-key"},
                    {"authorization": "Basic Zmlyc3Qta2V5"}, {"authorization": "Bearer "}):
        r = keyed.request(method, path, json=body, headers=headers)
        _error(r, 401, "invalid_api_key")
        assert r.headers["www-authenticate"] == "Bearer"
    for key in KEYS:  # any of the keys, the scheme in any case
        r = keyed.request(method, path, json=body, headers={"authorization": f"bearer {key}"})
        assert r.status_code == 200, r.text
    if body is not None and body.get("stream"):
        assert r.text.endswith("data: [DONE]\n\n")


@pytest.mark.parametrize("header", ["second-key", "Basic c2Vjb25kLWtleQ==", "Token second-key"])
def test_a_key_without_the_bearer_scheme_is_told_the_scheme(keyed: TestClient, header: str):
    err = _error(keyed.post(CHAT, json={"model": "tiny", "messages": HI}, headers={"authorization": header}),
                 401, "invalid_api_key")
    assert err["message"] == "the Authorization header must use the Bearer scheme: 'Authorization: Bearer <key>'"
    wrong = _error(keyed.post(CHAT, json={"model": "tiny", "messages": HI}, headers={"authorization": "Bearer x"}),
                   401, "invalid_api_key")
    assert wrong["message"] == "the API key is not valid for this server"


@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/nothing"), ("POST", "/v1/nothing"), ("GET", "/v1"),
                                             ("GET", "/v1/chat/completions"), ("DELETE", "/v1/models")])
def test_a_path_the_api_lacks_needs_the_key_before_it_is_a_404(keyed: TestClient, method: str, path: str):
    for headers in ({}, {"authorization": "Bearer wrong"}):
        _error(keyed.request(method, path, json={}, headers=headers), 401, "invalid_api_key")
    r = keyed.request(method, path, json={}, headers=GOOD)
    assert r.status_code in (404, 405), r.text
    assert keyed.get("/nothing").status_code == 404  # outside /v1 there is nothing a key would unlock


def test_without_keys_the_api_stays_open(backend: FakeBackend):
    with _client(backend) as c:
        assert c.post(CHAT, json={"model": "tiny", "messages": HI}).status_code == 200
        assert c.get("/metrics").status_code == 200
        assert c.get("/health").json()["model"] == "tiny"


def test_every_key_is_compared_whichever_matches(monkeypatch: pytest.MonkeyPatch):
    compared: list[bytes] = []
    real = hmac.compare_digest

    def counted(a: bytes, b: bytes) -> bool:
        compared.append(a)
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counted)
    keys = ApiKeys(("a", "b", "c"))
    for header in ("Bearer a", "Bearer c", "Bearer nope", None):
        compared.clear()
        assert keys.admits(header) == (header in ("Bearer a", "Bearer c"))
        assert len(compared) == 3, header  # no early exit: the time says nothing of which key


def test_health_says_only_ok_without_a_key(backend: FakeBackend, keyed: TestClient):
    assert keyed.get("/health").json() == {"ok": True}
    assert keyed.get("/health", headers={"authorization": "Bearer wrong"}).json() == {"ok": True}
    full = keyed.get("/health", headers=GOOD)
    assert full.status_code == 200
    assert full.json()["route"] == "none"
    assert full.json()["model"] == "tiny"
    backend.healthy = backend.healthy.model_copy(update={"ok": False})
    r = keyed.get("/health")
    assert (r.status_code, r.json()) == (503, {"ok": False})  # load balancers still see the state
    assert keyed.get("/health", headers=GOOD).status_code == 503


def test_metrics_need_the_key_unless_public(backend: FakeBackend, keyed: TestClient):
    _error(keyed.get("/metrics"), 401, "invalid_api_key")
    assert "meshpipe_requests_total" in keyed.get("/metrics", headers=GOOD).text
    with _client(backend, api_keys=KEYS, public_metrics=True) as public:
        assert public.get("/metrics").status_code == 200
        _error(public.get("/v1/models"), 401, "invalid_api_key")  # only the metrics are public
        assert public.get("/health").json() == {"ok": True}


def test_refusals_are_counted(backend: FakeBackend):
    metrics = Metrics()
    with _client(backend, metrics, api_keys=KEYS) as c:
        c.post(CHAT, json={"model": "tiny", "messages": HI})
        c.post(CHAT, content=b"{}", headers={**GOOD, "content-type": "text/plain"})
        c.post(CHAT, json={}, headers={**GOOD, "origin": "http://evil.example"})
    text = metrics.render().decode()
    for status in ("401", "415", "403"):
        assert f'meshpipe_requests_total{{endpoint="chat",status="{status}"}} 1.0' in text


@pytest.mark.parametrize("kind", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                  "application/jsonx", "text/json", "", None])
def test_a_post_that_is_not_json_gets_415(backend: FakeBackend, kind: str | None):
    body = json.dumps({"model": "tiny", "messages": HI}).encode()
    with _client(backend) as c:
        for path in (CHAT, COMPLETIONS):
            r = c.post(path, content=body, headers={} if kind is None else {"content-type": kind})
            _error(r, 415, "unsupported_media_type")
    assert backend.requests == []  # nothing was generated


def test_json_with_parameters_is_json(backend: FakeBackend):
    body = json.dumps({"model": "tiny", "messages": HI}).encode()
    with _client(backend) as c:
        for kind in ("application/json; charset=utf-8", "Application/JSON", "application/json ; charset=UTF-8"):
            assert c.post(CHAT, content=body, headers={"content-type": kind}).status_code == 200, kind


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "GZIP", "gzip, identity"])
def test_a_compressed_body_gets_415_naming_its_encoding(backend: FakeBackend, encoding: str):
    body = json.dumps({"model": "tiny", "messages": HI}).encode()
    with _client(backend) as c:
        for path in (CHAT, COMPLETIONS):
            r = c.post(path, content=gzip.compress(body), headers={"content-type": "application/json",
                                                                   "content-encoding": encoding})
            err = _error(r, 415, "unsupported_content_encoding")
            assert err["message"] == (f"Content-Encoding {encoding.lower()!r} is not supported; "
                                      "send the body uncompressed")
        assert backend.requests == []
        r = c.post(CHAT, content=body, headers={"content-type": "application/json", "content-encoding": "identity"})
        assert r.status_code == 200, r.text


def test_without_cors_any_web_origin_is_refused(backend: FakeBackend):
    with _client(backend) as c:
        # the CSRF-style "simple request" a page may send anywhere: refused before it is read
        r = c.post(CHAT, content=json.dumps({"model": "tiny", "messages": HI}),
                   headers={"origin": "http://evil.example", "content-type": "text/plain"})
        err = _error(r, 403, "origin_not_allowed")
        assert "evil.example" in err["message"]
        assert "access-control-allow-origin" not in r.headers
        _error(c.get("/v1/models", headers={"origin": "null"}), 403, "origin_not_allowed")
        _error(c.options(CHAT, headers={"origin": APP, "access-control-request-method": "POST"}), 403,
               "origin_not_allowed")
        assert c.post(CHAT, json={"model": "tiny", "messages": HI}).status_code == 200  # no Origin: curl, SDKs
    assert len(backend.requests) == 1


def test_an_allowed_origin_gets_a_proper_preflight_and_cors_headers(backend: FakeBackend):
    with _client(backend, api_keys=KEYS, cors_origins=(APP, "https://other.example:8443")) as c:
        pre = c.options(CHAT, headers={"origin": APP, "access-control-request-method": "POST",
                                       "access-control-request-headers": "authorization, content-type, x-stainless-os"})
        assert pre.status_code == 204  # a preflight carries no key, and needs none
        assert pre.headers["access-control-allow-origin"] == APP
        assert {"GET", "POST", "OPTIONS"} <= {m.strip() for m in pre.headers["access-control-allow-methods"].split(",")}
        allowed = {h.strip().lower() for h in pre.headers["access-control-allow-headers"].split(",")}
        assert {"authorization", "content-type", "x-stainless-os"} <= allowed
        assert int(pre.headers["access-control-max-age"]) > 0
        assert "Origin" in pre.headers["vary"]
        r = c.post(CHAT, json={"model": "tiny", "messages": HI}, headers={**GOOD, "origin": APP})
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == APP
        denied = c.get("/v1/models", headers={"origin": APP})  # CORS does not stand in for the key
        _error(denied, 401, "invalid_api_key")
        assert denied.headers["access-control-allow-origin"] == APP  # so the page can read why
        _error(c.post(CHAT, json={}, headers={**GOOD, "origin": "http://app.example:8080"}), 403,
               "origin_not_allowed")
        assert c.get("/v1/models", headers={**GOOD, "origin": "https://other.example:8443"}).status_code == 200


def test_any_origin_with_a_star(backend: FakeBackend):
    with _client(backend, cors_origins=("*",)) as c:
        r = c.get("/v1/models", headers={"origin": "http://anything.example"})
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "*"
        pre = c.options(CHAT, headers={"origin": "http://anything.example", "access-control-request-method": "POST"})
        assert pre.status_code == 204
        assert pre.headers["access-control-allow-origin"] == "*"
        assert {"authorization", "content-type"} <= {
            h.strip().lower() for h in pre.headers["access-control-allow-headers"].split(",")}


def test_a_model_by_id(backend: FakeBackend):
    with _client(backend) as c:
        assert c.get("/v1/models/tiny").json() == {"id": "tiny", "object": "model", "created": 0,
                                                   "owned_by": "meshpipe"}
        err = _error(c.get("/v1/models/gpt-4o"), 404, "model_not_found")
        assert err["param"] == "model"
        assert "'gpt-4o'" in err["message"]
        for odd in ("%ED%A0%80", "%FF%FE", "a%00b%0D%0A", "x" * 5000, "org/name"):
            r = c.get(f"/v1/models/{odd}")
            err = _error(r, 404, "model_not_found")
            assert err["message"].isascii()
            assert len(err["message"]) < 400


def _asgi_stream_left(backend: FakeBackend, metrics: Metrics) -> list[MutableMapping[str, Any]]:
    """Drive the app as a server would, with a client that leaves after the first chunk."""
    app = build_app(backend, metrics)
    body = json.dumps({"model": "tiny", "prompt": "hi", "stream": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": COMPLETIONS, "raw_path": COMPLETIONS.encode(), "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80)}
    sent: list[MutableMapping[str, Any]] = []

    async def run() -> None:
        first_chunk, requested = asyncio.Event(), False

        async def receive() -> dict[str, Any]:
            nonlocal requested
            if not requested:
                requested = True
                return {"type": "http.request", "body": body, "more_body": False}
            await first_chunk.wait()
            return {"type": "http.disconnect"}

        async def send(message: MutableMapping[str, Any]) -> None:
            sent.append(message)
            if message["type"] == "http.response.body" and message.get("body"):
                first_chunk.set()
                await asyncio.sleep(0.05)  # the disconnect lands while the stream is still going

        await app(scope, receive, send)

    asyncio.run(run())
    return sent


def test_a_stream_whose_client_left_counts_as_499(backend: FakeBackend):
    metrics = Metrics()
    sent = _asgi_stream_left(backend, metrics)
    assert sent[0]["status"] == 200
    assert all(m.get("more_body", False) for m in sent[1:])  # the stream never ended
    assert backend.closed == 1  # the generation was closed: its session freed
    text = metrics.render().decode()
    assert 'meshpipe_requests_total{endpoint="completions",status="499"} 1.0' in text
    assert 'status="200"' not in text


def test_a_finished_stream_still_counts_as_200(backend: FakeBackend):
    metrics = Metrics()
    with _client(backend, metrics) as c:
        c.post(COMPLETIONS, json={"model": "tiny", "prompt": "hi", "stream": True})
    assert 'meshpipe_requests_total{endpoint="completions",status="200"} 1.0' in metrics.render().decode()
