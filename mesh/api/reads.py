"""Bounded reads: how long a client may take to send its request, and how large its head may be.

Nothing else bounds them: a client that sends its head a byte at a time (slowloris), or a body
that never ends (chunked or not), held its connection, and a body its handler too, forever.

- **The head** (request line and headers) must arrive whole within `header_timeout_s` of the
  connection opening, or of its first byte on a kept-alive connection; trickling does not
  extend it. A head still incomplete then gets 408 and the connection closes; a connection
  that sent nothing at all is closed without a word (an idle or preconnected socket), as
  nginx does.
- **A head over `header_bytes`** gets 431 before it is parsed. h11's own limit (uvicorn's
  `h11_max_incomplete_event_size`) applies only while a head is incomplete, so a large head
  arriving in one read passed it, and when it did apply uvicorn answered 400.
- **The body** may pause at most `body_timeout_s` between two reads: then 408, and the
  connection closes (the rest of the body cannot be told from the next request). Once the
  body is read the bound is gone: a stream's request then waits on its client's disconnect
  for as long as it streams. The rest of a body answered before it was read (401, 413, 415)
  gets `body_timeout_s` in all, then the connection closes: uvicorn's keep-alive timer, which
  would close it, starts over at every byte, so a trickle held it forever.

The defaults are nginx's: `client_header_timeout` 60 s for the whole head,
`client_body_timeout` 60 s between two reads of the body, and `large_client_header_buffers`
of 4 x 8 KiB: a head of at most 32 KiB.

The head is bounded in uvicorn's h11 protocol (a subclass: the app never sees a head until it
is whole), the body in ASGI middleware around `receive`, so its 408 is an ordinary response:
counted in /metrics, in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from dataclasses import dataclass
from http import HTTPStatus
from typing import ClassVar

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from mesh.api.error import ApiError

log = logging.getLogger("meshpipe.api")
_HEAD_END = re.compile(rb"\n\r?\n")  # where h11 ends a head: a blank line, CRLF or bare LF


@dataclass(frozen=True)
class ReadLimits:
    header_timeout_s: float = 60.0  # the whole head (nginx's client_header_timeout)
    body_timeout_s: float = 60.0  # between two reads of the body (nginx's client_body_timeout)
    header_bytes: int = 32 << 10  # the whole head (nginx's large_client_header_buffers, 4 x 8k)


class BoundedBody:
    """ASGI middleware: a body that pauses longer than `timeout_s` between two reads is 408."""

    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app, self.timeout_s = app, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        read = False  # the whole body: past it, `receive` waits for the disconnect, unbounded

        async def receiving() -> Message:
            nonlocal read
            if read:
                return await receive()
            try:
                async with asyncio.timeout(self.timeout_s):
                    message = await receive()
            except TimeoutError:
                raise _body_too_slow(self.timeout_s) from None
            read = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, receiving, send)


def _body_too_slow(timeout_s: float) -> ApiError:
    # raised from `receive`, so it leaves through the handler's own ApiError answer
    return ApiError(408, f"the request body stopped arriving: nothing came for {timeout_s:g} s "
                    "(mesh serve --body-timeout)", "request_body_timeout", headers={"Connection": "close"})


def bounded_protocol(limits: ReadLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the head bounded by `limits` (uvicorn builds one per connection)."""
    bound = limits

    class Bounded(_BoundedH11):
        limits = bound

    return Bounded


class _BoundedH11(H11Protocol):
    limits: ClassVar[ReadLimits] = ReadLimits()
    head_timer: asyncio.TimerHandle | None = None  # armed while a head is awaited
    drain_timer: asyncio.TimerHandle | None = None  # armed while an answered request's body still comes

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:  # a head is coming
            if self.head_timer is None:  # its first byte on a kept-alive connection
                self._await_head()
            if _head_size(self.conn.trailing_data[0] + data) > self.limits.header_bytes:
                self._refuse(ApiError(431, f"the request's head (request line and headers) is over "
                                      f"{self.limits.header_bytes} bytes (mesh serve --max-header-bytes)",
                                      "request_header_fields_too_large"))
                return
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._head_done()
        if self.drain_timer is None and self._draining():
            self.drain_timer = self.loop.call_later(self.limits.body_timeout_s, self._drain_too_slow)

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_done()
        if self.drain_timer is not None:
            self.drain_timer.cancel()
        super().connection_lost(exc)

    def _draining(self) -> bool:
        """Whether the request was answered while its body still comes (h11 drops the rest)."""
        return self.cycle is not None and self.cycle.response_complete and self.conn.their_state is h11.SEND_BODY

    def _drain_too_slow(self) -> None:
        self.drain_timer = None
        if self._draining():
            self.transport.close()

    def _await_head(self) -> None:
        self.head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_too_slow)

    def _head_done(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_too_slow(self) -> None:
        self.head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if not self.conn.trailing_data[0]:
            self.transport.close()  # nothing sent: no request to answer
            return
        self._refuse(ApiError(408, f"the request's head did not arrive whole within {self.limits.header_timeout_s:g} s "
                              "(mesh serve --header-timeout)", "request_header_timeout"))

    def _refuse(self, err: ApiError) -> None:
        """Answer `err` and close: no request was read, so no app sees it and h11 has no
        response to send; the bytes are written as they are."""
        log.info("%s: %s", self.client, err)
        body = json.dumps(err.body()).encode()
        head = (f"HTTP/1.1 {err.status} {HTTPStatus(err.status).phrase}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
        self._head_done()
        self.transport.write(head + body)
        self.transport.close()


def _head_size(buffered: bytes) -> int:
    """The bytes of the head in `buffered`: to its blank line, or all of them until it comes."""
    end = _HEAD_END.search(buffered)
    return end.end() if end is not None else len(buffered)
