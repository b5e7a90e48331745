"""The activation data plane: one persistent TCP stream per hop (DESIGN.md §4).

Each frame is a 4-byte little-endian header length, a protobuf FrameHeader, then exactly
`payload_bytes` of raw tensor data. A connection opens with a Handshake (protocol version
and mesh token). Every size and shape is checked against Limits before anything is
allocated, because these bytes come from the network.
"""

from __future__ import annotations

import asyncio
import hmac
import random
import socket
import ssl
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from config.errors import MeshpipeError
from proto import meshpipe_pb2 as pb
from proto.version import PROTOCOL_VERSION, check_version
from stage.tls import MESH_NAME

_LEN = struct.Struct("<I")
DTYPE_BYTES: dict[int, int] = {pb.F32: 4, pb.F16: 2, pb.BF16: 2}
KNOWN_KINDS = {pb.PREFILL, pb.DECODE, pb.VERIFY, pb.END, pb.REPLY, pb.ERROR}


class LinkClosedError(MeshpipeError, ConnectionError):
    """The link is gone. `recv` turns every socket failure into this; a send can still raise
    the socket's own ConnectionError, so senders catch ConnectionError (this is one)."""


class TransportRefusedError(MeshpipeError, ConnectionError):
    """The peer refused the handshake (wrong token or protocol version)."""


class FrameError(MeshpipeError, ValueError):
    """A frame broke the limits or contradicted itself."""


@dataclass(frozen=True)
class Limits:
    max_header_bytes: int = 1 << 20
    max_payload_bytes: int = 512 << 20
    max_rows: int = 8192
    max_width: int = 65536
    max_tokens: int = 8192
    # once a frame's length prefix has arrived, the rest must follow within this long: a
    # peer that stalls mid-frame would otherwise hold the link, and the lanes, forever
    partial_frame_s: float = 30.0


def validate_header(h: pb.FrameHeader, limits: Limits) -> None:
    if h.kind not in KNOWN_KINDS:
        raise FrameError(f"unknown frame kind {h.kind}")
    if len(h.tokens) > limits.max_tokens:
        raise FrameError(f"{len(h.tokens)} tokens exceed the limit of {limits.max_tokens}")
    if h.payload_bytes == 0 and not h.shape:
        return
    if len(h.shape) != 2:
        raise FrameError(f"payload shape must be [rows, width], got {list(h.shape)}")
    rows, width = h.shape
    if not 0 < rows <= limits.max_rows or not 0 < width <= limits.max_width:
        raise FrameError(f"payload shape {list(h.shape)} outside limits")
    if h.dtype not in DTYPE_BYTES:
        raise FrameError(f"unknown wire dtype {h.dtype}")
    expected = rows * width * DTYPE_BYTES[h.dtype]
    if h.payload_bytes != expected or expected > limits.max_payload_bytes:
        raise FrameError(f"payload of {h.payload_bytes} bytes does not fit shape {list(h.shape)}")


def encode_tensor(arr: np.ndarray, dtype: int) -> tuple[list[int], bytes]:
    rows, width = arr.shape
    if dtype == pb.F32:
        data = np.ascontiguousarray(arr, dtype=np.float32).tobytes()
    elif dtype == pb.F16:
        data = arr.astype(np.float16).tobytes()
    elif dtype == pb.BF16:
        bits = np.ascontiguousarray(arr, dtype=np.float32).view(np.uint32)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even
        data = rounded.astype(np.uint16).tobytes()
    else:
        raise FrameError(f"unknown wire dtype {dtype}")
    return [rows, width], data


def decode_tensor(h: pb.FrameHeader, payload: bytes) -> np.ndarray:
    rows, width = h.shape
    if h.dtype == pb.F32:
        return np.frombuffer(payload, dtype=np.float32).reshape(rows, width)
    if h.dtype == pb.F16:
        return np.frombuffer(payload, dtype=np.float16).astype(np.float32).reshape(rows, width)
    bits = np.frombuffer(payload, dtype=np.uint16).astype(np.uint32) << 16
    return bits.view(np.float32).reshape(rows, width)


REPLIES_ROLE = "replies"  # the handshake role of stage 0's link to the final stage (direct return)


@dataclass(frozen=True)
class WireEmulation:
    """Benchmark-only one-way latency on every link a process sends on (DESIGN.md §4).

    Each frame waits `delay_ms` plus a uniform draw in [-jitter_ms, +jitter_ms] (never less
    than 0) before it leaves, and never leaves before the frame sent ahead of it, as on TCP.
    The draws come from a generator seeded by the link's name, so a run repeats exactly.
    """

    delay_ms: float = 0.0
    jitter_ms: float = 0.0

    def __post_init__(self) -> None:
        if not (self.delay_ms >= 0 and self.jitter_ms >= 0):  # also refuses NaN
            raise ValueError("wire delay and jitter must be >= 0 ms")

    @property
    def active(self) -> bool:
        return self.delay_ms > 0 or self.jitter_ms > 0

    def delays(self, name: str) -> Callable[[], float]:
        """Seconds to hold each next frame on the link called `name`."""
        rng = random.Random(f"meshpipe-wire/{name}")  # emulation, not security
        d, j = self.delay_ms / 1000, self.jitter_ms / 1000
        return lambda: max(0.0, d + rng.uniform(-j, j)) if j else d


NO_EMULATION = WireEmulation()


class Link:
    """One end of an activation stream. Sends are serialized; one task should receive.

    `role` is what the peer said in its handshake (set on accepted links only).

    Frames sent in one turn of the event loop leave in one write (`_flush`). A decode's
    sessions send their frames one after another in the same turn; written one by one they
    reached the next stage apart, and it began its decode with the first few (8 streams on
    split-2: about 3 rows a decode where stage 0 batched 4). Together they are read, and
    batched, together, and the peer wakes once for them.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 limits: Limits, emulation: WireEmulation = NO_EMULATION, name: str = "",
                 role: str = "") -> None:
        self.reader, self.writer, self.limits, self.role = reader, writer, limits, role
        self.lock = asyncio.Lock()
        self.corked: list[bytes | memoryview] = []  # sent this turn of the loop, not yet written
        self.delayed: asyncio.Queue[tuple[float, list[bytes]]] | None = None
        self.delayer: asyncio.Task[None] | None = None
        self.emulate(emulation, name or role)

    def emulate(self, emulation: WireEmulation, name: str) -> None:
        """Hold every frame sent from now on as `emulation` says (benchmarks only)."""
        self.next_delay = emulation.delays(name) if emulation.active else None
        self.last_due = 0.0

    @property
    def peer(self) -> str:
        info = self.writer.get_extra_info("peername")
        return f"{info[0]}:{info[1]}" if info else "?"

    async def send(self, header: pb.FrameHeader, payload: bytes | memoryview | None = None) -> None:
        head = header.SerializeToString()
        parts = [_LEN.pack(len(head)), head, *([payload] if payload else [])]
        if self.next_delay is not None:
            self._send_later(parts, self.next_delay())
            return
        if self.writer.is_closing():
            raise LinkClosedError("link is closed")
        if not self.corked:
            asyncio.get_running_loop().call_soon(self._flush)
        self.corked.extend(parts)
        async with self.lock:  # back-pressure: wait while the socket's buffer is full
            await self.writer.drain()

    def _flush(self) -> None:
        parts, self.corked = self.corked, []
        if parts and not self.writer.is_closing():
            self.writer.writelines(parts)

    def _send_later(self, parts: list[bytes | memoryview], delay_s: float) -> None:
        # Emulated one-way latency: each frame leaves `delay_s` after it was sent, or right
        # after the frame ahead of it if that one is held longer; the frames behind it are not
        # held back by it.
        loop = asyncio.get_running_loop()
        if self.writer.is_closing() or (self.delayer is not None and self.delayer.done()):
            raise LinkClosedError("link is closed")
        if self.delayed is None:
            self.delayed = asyncio.Queue()
            self.delayer = loop.create_task(self._drain_delayed())
        self.last_due = max(self.last_due, loop.time() + delay_s)
        self.delayed.put_nowait((self.last_due, [bytes(p) for p in parts]))

    async def _drain_delayed(self) -> None:
        assert self.delayed is not None
        loop = asyncio.get_running_loop()
        while True:
            due, parts = await self.delayed.get()
            await asyncio.sleep(max(0.0, due - loop.time()))
            while not self.delayed.empty() and self.last_due <= loop.time():
                parts += self.delayed.get_nowait()[1]  # every frame held is due now: one write, as `_flush`
            try:
                self.writer.writelines(parts)
                await self.writer.drain()
            except ConnectionError:
                return  # the receiver sees the link close; later sends raise LinkClosedError

    async def recv(self) -> tuple[pb.FrameHeader, bytes]:
        """The next frame; raises LinkClosedError, or FrameError for a frame that breaks the
        limits, does not parse, or stalls halfway (after which the link is unusable)."""
        try:
            (size,) = _LEN.unpack(await self.reader.readexactly(4))
            if size > self.limits.max_header_bytes:
                raise FrameError(f"frame header of {size} bytes exceeds the limit")
            async with asyncio.timeout(self.limits.partial_frame_s):
                header = _parse_header(await self.reader.readexactly(size))
                validate_header(header, self.limits)
                payload = await self.reader.readexactly(header.payload_bytes) if header.payload_bytes else b""
        except TimeoutError:
            raise FrameError(f"a frame stalled halfway for {self.limits.partial_frame_s:g}s") from None
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            raise LinkClosedError(str(exc) or "peer closed the link") from None
        return header, payload

    def close(self) -> None:
        if self.delayer:
            self.delayer.cancel()
        self._flush()  # what was sent leaves before the close
        self.writer.close()


def _parse_header(data: bytes) -> pb.FrameHeader:
    try:
        return pb.FrameHeader.FromString(data)
    except DecodeError as exc:
        raise FrameError(f"not a frame header: {exc}") from None


async def _read_message(reader: asyncio.StreamReader, kind: Any, limit: int = 4096) -> Any:
    (size,) = _LEN.unpack(await reader.readexactly(4))
    if size > limit:
        raise FrameError("handshake too large")
    return kind.FromString(await reader.readexactly(size))


def _write_message(writer: asyncio.StreamWriter, message: object) -> None:
    data = message.SerializeToString()  # type: ignore[attr-defined]
    writer.writelines([_LEN.pack(len(data)), data])


def _nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


HANDSHAKE_S = 10.0  # a peer that has not answered the handshake by then is not a meshpipe stage, or is hung


async def connect(host: str, port: int, *, token: str | None, ssl_context: ssl.SSLContext | None = None,
                  role: str = "coordinator", emulation: WireEmulation = NO_EMULATION, name: str = "") -> Link:
    """A link to the stage at host:port, past its handshake; the frames it reads are held to
    the default Limits (what a coordinator or a stage reads back is a stage's reply)."""
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(host, port, ssl=ssl_context,
                                server_hostname=MESH_NAME if ssl_context else None), HANDSHAKE_S)
    _nodelay(writer)
    _write_message(writer, pb.Handshake(protocol_version=PROTOCOL_VERSION, token=token or "", role=role))
    await writer.drain()
    try:
        reply = await asyncio.wait_for(_read_message(reader, pb.HandshakeReply), HANDSHAKE_S)
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        writer.close()
        raise TransportRefusedError(f"{host}:{port} closed the connection during the handshake") from exc
    except (TimeoutError, FrameError, DecodeError) as exc:  # not a meshpipe stage, or a hung one
        writer.close()
        raise TransportRefusedError(f"{host}:{port} sent no valid handshake reply ({exc or 'timed out'})") from exc
    if not reply.ok:
        writer.close()
        raise TransportRefusedError(f"{host}:{port} refused the link: {reply.message}")
    return Link(reader, writer, Limits(), emulation, name or f"{role}->{host}:{port}")


async def serve(host: str, port: int, handler: Callable[[Link], Awaitable[None]], *,
                token: str | None, ssl_context: ssl.SSLContext | None = None,
                limits: Limits = Limits()) -> asyncio.Server:
    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _nodelay(writer)
        try:
            hello = await asyncio.wait_for(_read_message(reader, pb.Handshake), 10)
        except (asyncio.IncompleteReadError, OSError, TimeoutError, FrameError, DecodeError):
            # closed early, reset or TLS failure, silent for 10 s, too large, not a Handshake
            writer.close()
            return
        problem = check_version(hello.protocol_version) or _token_problem(token, hello.token)
        _write_message(writer, pb.HandshakeReply(ok=problem is None, message=problem or "",
                                                 protocol_version=PROTOCOL_VERSION))
        await writer.drain()
        if problem:
            writer.close()
            return
        await handler(Link(reader, writer, limits, role=hello.role))

    return await asyncio.start_server(on_connect, host, port, ssl=ssl_context)


def _token_problem(expected: str | None, sent: str) -> str | None:
    if expected and not hmac.compare_digest(expected.encode(), sent.encode()):
        return "wrong or missing mesh token"
    return None

