"""A userspace TCP relay that holds every chunk a fixed time in each direction, order kept.

`mesh bench --scenarios peers` puts it on llama.cpp's RPC link, the one link a
`llama-server --rpc` split has, so that link pays the same one-way delay meshpipe's hops pay
with `--wire-delay-ms`. This kernel has no netem, hence a relay.

Method: per connection and per direction, one task reads whatever the socket has (up to
CHUNK bytes), stamps it with the time it arrived and queues it; a second task takes the
queue in order, sleeps until stamp + delay and writes. Reading never waits for writing, so
the link keeps its bandwidth and only its latency grows, as on a long wire; and since one
task writes each direction in arrival order, bytes leave in the order they came. Both
sockets set TCP_NODELAY: Nagle would hold small RPC messages back on top of the delay.
The relay runs on its own event loop in a daemon thread of the process that starts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from types import TracebackType

CHUNK = 1 << 16


class DelayProxy:
    """Listens on 127.0.0.1 (`port`) and relays every connection to `target`, `delay_ms` each way.

    Use as a context manager: the listener is bound when `__enter__` returns and every
    connection is closed by `__exit__`.
    """

    def __init__(self, target: tuple[str, int], delay_ms: float, host: str = "127.0.0.1") -> None:
        if not delay_ms >= 0:  # also refuses NaN
            raise ValueError("the delay must be >= 0 ms")
        self.target, self.delay, self.host = target, delay_ms / 1000, host
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="delay-proxy", daemon=True)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def __enter__(self) -> DelayProxy:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _listen(self) -> asyncio.Server:
        return await asyncio.start_server(self._accept, self.host, 0)

    async def _close(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)  # so __exit__ can cancel a connection still open
        try:
            try:
                server_r, server_w = await asyncio.open_connection(*self.target)
            except OSError:
                return  # nothing listens there: the client sees its connection close
            for writer in (client_w, server_w):
                _no_delay(writer)
            try:
                await asyncio.gather(self._direction(client_r, server_w), self._direction(server_r, client_w))
            except asyncio.CancelledError:
                pass  # __exit__ closing a live connection: a cancelled handler would be logged as an error
            finally:
                server_w.close()
        finally:
            client_w.close()
            self._tasks.discard(task)

    async def _direction(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One way of one connection: read and stamp, and separately wait out the delay and write."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        sender = asyncio.create_task(self._send(queue, writer))
        try:
            while data := await _read(reader):
                queue.put_nowait((time.monotonic(), data))
            queue.put_nowait((time.monotonic(), b""))  # EOF travels with the same delay
            await sender
        finally:
            sender.cancel()

    async def _send(self, queue: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter) -> None:
        while True:
            stamp, data = await queue.get()
            if (wait := stamp + self.delay - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            if not data:
                with contextlib.suppress(OSError):
                    writer.write_eof()
                return
            writer.write(data)
            try:
                await writer.drain()
            except OSError:
                return


async def _read(reader: asyncio.StreamReader) -> bytes:
    try:
        return await reader.read(CHUNK)
    except OSError:  # reset by the peer: the same as its end
        return b""


def _no_delay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
