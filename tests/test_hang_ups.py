"""A client that hangs up is the client's doing (issue 53): at any point, mid-body, while its
prompt is prepared, while it generates, streamed or not, it counts as 499 in /metrics or not at
all, and never as an internal error, in the log, /metrics or /health. Through a real uvicorn,
since only a socket closed by hand shows what a hang-up mid-body does."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator

import pytest
from fake_backend import FakeBackend
from inproc_http import http_server, raw, wait_for

from mesh.api.app import build_app
from mesh.backend import GenerationEvent, GenerationRequest
from mesh.observe.metrics import Metrics
from mesh.reports.failures import Failures

BODY = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 40}).encode()


class Slow(FakeBackend):
    """The fake's tokens, a few a second: a client can leave while they come."""

    async def _events(self, req: GenerationRequest, account: list) -> AsyncGenerator[GenerationEvent, None]:
        async for event in super()._events(req, account):
            await asyncio.sleep(0.05)
            yield event


def _head(length: int | None, chunked: bool = False) -> bytes:
    framing = b"transfer-encoding: chunked\r\n" if chunked else b"content-length: %d\r\n" % (length or 0)
    return b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n" + framing + b"\r\n"


HANG_UPS = {
    "mid-body": _head(1000) + BODY[:9],
    "mid-chunked-body": _head(None, chunked=True) + b"9\r\n" + BODY[:9] + b"\r\n",
    "while generating": _head(len(BODY)) + BODY,
    "while streaming": _head(len(BODY) + 16) + BODY[:-1] + b', "stream": true}',
}


@pytest.mark.parametrize("when", list(HANG_UPS))
def test_a_client_that_hangs_up_is_499_and_never_an_internal_error(byte_tokenizer, caplog, when: str):
    metrics, failures = Metrics(), Failures()
    metrics.watch_failures(failures)  # as `mesh serve` does: /health's record
    backend = Slow(byte_tokenizer, "x" * 40, eos=False)
    gone = 'meshpipe_requests_total{endpoint="completions",status="499"} 1.0'
    with caplog.at_level(logging.INFO), http_server(build_app(backend, metrics)) as port:
        conn = raw(port, HANG_UPS[when])
        if when.startswith("while"):
            wait_for(lambda: len(backend.requests) == 1)  # it generates now
        conn.close()
        wait_for(lambda: gone in metrics.render().decode())
        wait_for(lambda: backend.closed == len(backend.requests))  # whatever began is freed
    text = metrics.render().decode()
    assert 'status="500"' not in text
    assert "meshpipe_internal_errors_total{" not in text
    assert failures.count == 0  # what /health reports
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
