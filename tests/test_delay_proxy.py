"""The bench's delay proxy over real sockets: an echo server in a thread behind it."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from bench.harness.delay_proxy import DelayProxy


@contextlib.contextmanager
def _echo_server() -> Iterator[tuple[str, int]]:
    """Echoes every byte of every connection until the peer closes; one thread per connection."""
    listener = socket.create_server(("127.0.0.1", 0))

    def echo(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    def accept() -> None:
        with contextlib.suppress(OSError):  # closed at the end
            while True:
                conn, _ = listener.accept()
                threading.Thread(target=echo, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield listener.getsockname()
    finally:
        listener.close()


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    got = bytearray()
    while len(got) < n:
        chunk = sock.recv(n - len(got))
        assert chunk, "the proxy closed the connection early"
        got += chunk
    return bytes(got)


@pytest.fixture
def echo() -> Iterator[tuple[str, int]]:
    with _echo_server() as address:
        yield address


def test_a_round_trip_through_the_proxy_takes_the_delay_each_way(echo):
    delay_ms = 40
    with DelayProxy(echo, delay_ms) as proxy, socket.create_connection(("127.0.0.1", proxy.port)) as sock:
        start = time.monotonic()
        sock.sendall(b"ping")
        assert _recv_exactly(sock, 4) == b"ping"
        elapsed = time.monotonic() - start
    assert elapsed >= 2 * delay_ms / 1000


def test_without_a_delay_the_round_trip_is_quick(echo):
    with DelayProxy(echo, 0) as proxy, socket.create_connection(("127.0.0.1", proxy.port)) as sock:
        sock.sendall(b"ping")
        _recv_exactly(sock, 4)  # the first one pays for the connect upstream
        start = time.monotonic()
        sock.sendall(b"pong")
        assert _recv_exactly(sock, 4) == b"pong"
        assert time.monotonic() - start < 0.5


def test_many_megabytes_arrive_intact_and_in_order(echo):
    payload = os.urandom(4 << 20)  # many reads per direction, so order is really at stake
    with DelayProxy(echo, 5) as proxy, socket.create_connection(("127.0.0.1", proxy.port)) as sock:
        writer = threading.Thread(target=sock.sendall, args=(payload,))
        writer.start()
        got = _recv_exactly(sock, len(payload))
        writer.join()
    assert got == payload


def test_back_to_back_messages_share_the_delay_instead_of_queueing_behind_it(echo):
    """Latency, not bandwidth: ten messages sent at once come back about 2D later, not 20D."""
    delay_ms, n = 50, 10
    with DelayProxy(echo, delay_ms) as proxy, socket.create_connection(("127.0.0.1", proxy.port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        start = time.monotonic()
        for i in range(n):
            sock.sendall(bytes([i]) * 100)
        got = _recv_exactly(sock, 100 * n)
        elapsed = time.monotonic() - start
    assert got == b"".join(bytes([i]) * 100 for i in range(n))
    assert 2 * delay_ms / 1000 <= elapsed < n * delay_ms / 1000


def test_each_connection_is_relayed_on_its_own(echo):
    with DelayProxy(echo, 1) as proxy, socket.create_connection(("127.0.0.1", proxy.port)) as a, \
            socket.create_connection(("127.0.0.1", proxy.port)) as b:
        a.sendall(b"first")
        b.sendall(b"second")
        assert _recv_exactly(b, 6) == b"second"
        assert _recv_exactly(a, 5) == b"first"


def test_a_closed_target_closes_the_client_connection():
    with socket.create_server(("127.0.0.1", 0)) as placeholder:
        target = placeholder.getsockname()
    with DelayProxy(target, 0) as proxy, socket.create_connection(("127.0.0.1", proxy.port)) as sock:
        sock.settimeout(5)
        assert sock.recv(1) == b""


def test_a_negative_delay_is_refused():
    with pytest.raises(ValueError, match=">= 0"):
        DelayProxy(("127.0.0.1", 1), -1)


def test_closing_the_proxy_under_a_live_connection_logs_no_error(echo, caplog):
    with DelayProxy(echo, 0) as proxy:
        sock = socket.create_connection(("127.0.0.1", proxy.port))
        sock.sendall(b"x")
        _recv_exactly(sock, 1)
    sock.close()
    assert not [r for r in caplog.records if r.name == "asyncio" and r.levelname == "ERROR"]
