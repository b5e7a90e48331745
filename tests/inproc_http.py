"""A real uvicorn serving an app in this process, on an ephemeral loopback port: for what only
raw sockets show (a client hanging up mid-body, a header sent slowly), in the fast tier."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

import uvicorn
from fastapi import FastAPI

from mesh.api.reads import ReadLimits
from mesh.api.server import bind, uvicorn_config


@contextlib.contextmanager
def http_server(app: FastAPI, reads: ReadLimits | None = None) -> Iterator[int]:
    """Serve `app` as `mesh serve` does, until the block ends; yields the port."""
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn_config(app, reads or ReadLimits()))
    runner = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    runner.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert runner.is_alive(), "uvicorn did not start"
            assert time.monotonic() < deadline, "uvicorn did not start in time"
            time.sleep(0.01)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        runner.join(10)
        sock.close()


def raw(port: int, data: bytes) -> socket.socket:
    """A connection that has sent `data`, as a client that writes its request by hand."""
    conn = socket.create_connection(("127.0.0.1", port), timeout=10)
    conn.sendall(data)
    return conn


def wait_for(check: Callable[[], bool], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)
