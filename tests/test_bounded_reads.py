"""Bounded reads (issue 53): a request's head must arrive whole in time and within its size, and
its body may not pause too long, or the connection is answered (408, 431) and closed instead of
held forever; a request whose body was read is never bounded by them, however long it streams.
Through a real uvicorn, configured as `mesh serve` configures it, and raw sockets."""

from __future__ import annotations

import contextlib
import json
import socket
import time

import pytest
from fake_backend import FakeBackend
from inproc_http import http_server, raw
from test_hang_ups import BODY, Slow

from mesh.api.app import build_app
from mesh.api.reads import ReadLimits
from mesh.observe.metrics import Metrics

READS = ReadLimits(header_timeout_s=1.0, body_timeout_s=0.5, header_bytes=4096)
# uvloop's timers run on libuv's clock, cached at the start of each loop turn: a deadline can
# fire a few ms before time.monotonic() says it is due
LOOP_CLOCK_S = 0.01
HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"


def _answer(conn: socket.socket) -> tuple[bytes, float]:
    """All the server sends until it closes, and when it closed. A reset counts as the close:
    a client still writing when the server closes with those bytes unread gets an RST after the
    answer (the kernel's rule, not the server's), as a slowloris test's last line may."""
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := conn.recv(65536):
            data += chunk
    return data, time.monotonic()


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def _error(answer: bytes) -> dict:
    return json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]


@pytest.mark.parametrize("framing", [b"content-length: 1000\r\n\r\n" + BODY[:9],
                                     b"transfer-encoding: chunked\r\n\r\n9\r\n" + BODY[:9] + b"\r\n"])
def test_a_body_that_stops_arriving_is_408_and_closed(byte_tokenizer, framing: bytes):
    metrics = Metrics()
    with http_server(build_app(FakeBackend(byte_tokenizer), metrics, reads=READS), READS) as port:
        started = time.monotonic()
        answer, closed = _answer(raw(port, HEAD + framing))
    assert _status(answer) == 408, answer
    assert _error(answer)["code"] == "request_body_timeout"
    assert b"connection: close" in answer.lower()
    assert READS.body_timeout_s - LOOP_CLOCK_S <= closed - started < READS.body_timeout_s + 3
    assert 'meshpipe_requests_total{endpoint="completions",status="408"} 1.0' in metrics.render().decode()


def test_the_rest_of_a_body_answered_unread_cannot_trickle_forever(byte_tokenizer):
    """A 415 is answered before its body is read; the rest of the body, a byte at a time, no
    longer holds the connection: it gets the body timeout in all."""
    head = HEAD.replace(b"application/json", b"text/plain") + b"content-length: 100000\r\n\r\n"
    with http_server(build_app(FakeBackend(byte_tokenizer), Metrics(), reads=READS), READS) as port:
        conn = raw(port, head + b"x")
        assert _status(conn.recv(65536)) == 415
        started = time.monotonic()
        with contextlib.suppress(OSError):  # the server closes it under the client's writes
            while time.monotonic() - started < 5:
                conn.sendall(b"x")
                time.sleep(0.1)
        stopped = time.monotonic()
    assert stopped - started < READS.body_timeout_s + 2


def test_a_head_sent_slowly_is_408_at_its_deadline_however_it_trickles(byte_tokenizer):
    with http_server(build_app(FakeBackend(byte_tokenizer), Metrics(), reads=READS), READS) as port:
        started = time.monotonic()  # before the connection: the server's deadline starts when it accepts
        conn = raw(port, b"POST /v1/completions HTTP/1.1\r\n")
        conn.settimeout(0.2)
        answer = b""
        while not answer and time.monotonic() - started < 5:
            try:
                conn.sendall(b"x-slow: 1\r\n")  # a line in less than the deadline, each time (slowloris)
                answer = conn.recv(65536)
            except TimeoutError:
                continue
        conn.settimeout(5)
        closed_at = time.monotonic()
        rest, _ = _answer(conn)
    assert _status(answer + rest) == 408, answer
    assert _error(answer + rest)["code"] == "request_header_timeout"
    assert READS.header_timeout_s - LOOP_CLOCK_S <= closed_at - started < READS.header_timeout_s + 1


def test_a_connection_that_sends_nothing_is_closed_at_the_head_deadline(byte_tokenizer):
    with http_server(build_app(FakeBackend(byte_tokenizer), Metrics(), reads=READS), READS) as port:
        started = time.monotonic()
        answer, closed = _answer(raw(port, b""))
    assert answer == b""  # nothing asked, nothing answered
    assert READS.header_timeout_s - LOOP_CLOCK_S <= closed - started < READS.header_timeout_s + 3


BIG = b"".join(b"x-big-%d: %s\r\n" % (i, b"a" * 100) for i in range(64))  # 7 KiB of headers


@pytest.mark.parametrize("parts", [
    [HEAD + BIG + b"content-length: 0\r\n\r\n"],  # whole, in one read: h11's own limit let it pass
    [HEAD + BIG[:3000], BIG[3000:6000]],  # still coming when it is over
])
def test_a_head_over_the_limit_is_431(byte_tokenizer, parts: list[bytes]):
    backend = FakeBackend(byte_tokenizer)
    with http_server(build_app(backend, Metrics(), reads=READS), READS) as port:
        conn = raw(port, parts[0])
        for part in parts[1:]:
            time.sleep(0.1)  # a read of its own
            conn.sendall(part)
        answer, _ = _answer(conn)
    assert _status(answer) == 431, answer
    assert _error(answer)["code"] == "request_header_fields_too_large"
    assert backend.requests == []


def test_a_stream_outlives_the_body_timeout_and_the_connection_serves_again(byte_tokenizer):
    """Once its body is read, a request waits on its client for as long as it streams."""
    backend = Slow(byte_tokenizer, "x" * 30, eos=False)  # 0.05 s a token: 1.5 s, three body timeouts
    body = BODY[:-1] + b', "stream": true}'
    request = HEAD + b"content-length: %d\r\n\r\n" % len(body) + body
    with http_server(build_app(backend, Metrics(), reads=READS), READS) as port:
        conn = raw(port, request)
        data = b""
        while b"data: [DONE]" not in data:
            chunk = conn.recv(65536)
            assert chunk, data
            data += chunk
        conn.sendall(HEAD.replace(b"POST /v1/completions", b"GET /v1/models") + b"\r\n")
        again = conn.recv(65536)
    assert _status(data) == 200
    assert data.count(b'"text": "x"') == 30
    assert _status(again) == 200
