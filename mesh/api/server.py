"""The HTTP side of `mesh serve`: bind early, serve with uvicorn, stop cleanly on a signal.

The socket is bound before the route is built, so a taken port fails in milliseconds rather
than after minutes of downloading and loading. SIGTERM or SIGINT stops accepting work, gives
in-flight requests a grace period, cancels the rest, then stops the coordinator (which ends
every stage it spawned); a second signal kills the spawned stages and exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
from collections.abc import Callable, Generator

import psutil
import uvicorn
from fastapi import FastAPI

from mesh.api.reads import ReadLimits, bounded_protocol
from mesh.coordinator import Coordinator

log = logging.getLogger("meshpipe.server")
SIGNALS = (signal.SIGTERM, signal.SIGINT)
DRAIN_TIMEOUT = 2.0  # cancelled requests get this long to free their sessions on the stages


def bind(host: str, port: int) -> socket.socket:
    """Resolve `host` and bind, without listening: until uvicorn serves, connections are refused."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OSError(f"cannot resolve {host!r}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart despite TIME_WAIT
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


class _QuietCancel(logging.Filter):
    """Requests cancelled when the grace period runs out are expected; uvicorn would log each as
    'Exception in ASGI application' with a traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError))


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: it re-raises a captured SIGTERM once serve()
    returns, which killed the process before the coordinator could stop its stages."""

    def __init__(self, config: uvicorn.Config, on_started: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_started = on_started

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:  # announced only now that the socket really accepts connections
            self.on_started()


class _Signals:
    """First signal: stop gracefully. Second: force."""

    def __init__(self, server: _Server, main: asyncio.Task[None], say: Callable[[str], None],
                 on_stop: Callable[[], None]):
        self.server, self.main, self.say, self.on_stop = server, main, say, on_stop
        self.count = 0

    def __call__(self, sig: signal.Signals) -> None:
        self.count += 1
        self.server.should_exit = True
        if self.count == 1:
            self.say(f"{sig.name}: shutting down (send it again to force)")
            self.on_stop()
            if not self.server.started:
                self.main.cancel()  # mid-build: abandon it; the build tears down what it started
            return
        self.say(f"{sig.name}: forced shutdown")
        self.server.force_exit = True
        for task in self.server.server_state.tasks:
            task.cancel()
        kill_children()  # so the coordinator's teardown finds them gone instead of waiting


def kill_children() -> None:
    """SIGKILL the processes this one spawned (local stages) and reap them."""
    children = psutil.Process().children()
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    psutil.wait_procs(children, timeout=5)


def uvicorn_config(app: FastAPI, reads: ReadLimits, grace: float | None = None) -> uvicorn.Config:
    """uvicorn serving `app`, each request's head bounded by `reads` (mesh/api/reads.py)."""
    # h11 whatever is installed (uvicorn would pick httptools if it were): the bounds live in
    # its protocol. uvicorn annotates the grace as int but only hands it to asyncio.wait_for
    return uvicorn.Config(app, log_level="warning", http=bounded_protocol(reads),
                          h11_max_incomplete_event_size=reads.header_bytes,
                          timeout_graceful_shutdown=grace)  # type: ignore[arg-type]


async def serve(coordinator: Coordinator, app: FastAPI, sock: socket.socket, grace: float,
                say: Callable[[str], None], on_stop: Callable[[], None] = lambda: None,
                reads: ReadLimits | None = None) -> None:
    """Build the route, serve until a signal, then stop everything. Returns normally on a signal.
    `on_stop` is told at the first signal (the web page's endless event streams end then)."""
    config = uvicorn_config(app, reads or ReadLimits(), grace)
    logging.getLogger("uvicorn.error").addFilter(_QuietCancel())  # after Config set up logging
    server = _Server(config, lambda: say(f"serving {coordinator.model_id} on {url_of(sock)}/v1 "
                                         f"(the mesh's page: {url_of(sock)}/ui)"))
    main = asyncio.current_task()
    assert main is not None
    signals = _Signals(server, main, say, on_stop)
    loop = asyncio.get_running_loop()
    for sig in SIGNALS:
        loop.add_signal_handler(sig, signals, sig)
    loop.add_signal_handler(signal.SIGUSR1, _dump_tasks)
    try:
        await coordinator.start()
        await server.serve(sockets=[sock])
        await _drain(server)
    except asyncio.CancelledError:
        if not signals.count:
            raise
    finally:
        await coordinator.stop()


def _dump_tasks() -> None:
    """SIGUSR1: log where every task is waiting, for an operator chasing a stuck request."""
    tasks = asyncio.all_tasks()
    log.warning("SIGUSR1: %d tasks", len(tasks))
    for task in tasks:
        log.warning("%s: %s", task.get_name(), " <- ".join(_awaiting(task.get_coro())))


def _awaiting(coro: object) -> list[str]:
    """Where a coroutine is suspended, outermost first, following what each one awaits."""
    where = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
        if frame is not None:
            where.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
        coro = _driven(getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None))
    return where


def _driven(awaited: object) -> object:
    """`anext()` and `async for` await wrapper objects: the generator they drive is what waits."""
    for _ in range(3):
        if awaited is None or hasattr(awaited, "cr_frame") or hasattr(awaited, "ag_frame"):
            return awaited
        awaited = next((g for g in gc.get_referents(awaited) if not isinstance(g, type)), None)
    return awaited


async def _drain(server: _Server) -> None:
    """uvicorn cancels the requests still running after the grace period but does not wait for
    them; waiting lets each one end its session on the stages before the pipeline goes."""
    tasks = set(server.server_state.tasks)
    if tasks:
        await asyncio.wait(tasks, timeout=DRAIN_TIMEOUT)
