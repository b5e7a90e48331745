"""The activation codec (f32/f16/bf16) and the header limits every received frame must meet."""

from __future__ import annotations

import asyncio
import contextlib
import time

import numpy as np
import pytest

from proto import meshpipe_pb2 as pb
from stage.transport import (
    DTYPE_BYTES,
    FrameError,
    Limits,
    Link,
    LinkClosedError,
    connect,
    decode_tensor,
    encode_tensor,
    serve,
    validate_header,
)

RNG = np.random.default_rng(13)


def _round_trip(arr: np.ndarray, dtype: pb.WireDType) -> np.ndarray:
    shape, data = encode_tensor(arr, dtype)
    assert shape == list(arr.shape)
    assert len(data) == arr.size * DTYPE_BYTES[dtype]
    header = pb.FrameHeader(kind=pb.DECODE, dtype=dtype, shape=shape, payload_bytes=len(data))
    validate_header(header, Limits())
    out = decode_tensor(header, data)
    assert out.dtype == np.float32
    assert out.shape == arr.shape
    return out


def test_f32_is_exact():
    arr = RNG.standard_normal((3, 17)).astype(np.float32)
    assert np.array_equal(_round_trip(arr, pb.F32), arr)


def test_f16_matches_numpy_half_precision():
    arr = (RNG.standard_normal((4, 33)) * 10).astype(np.float32)
    out = _round_trip(arr, pb.F16)
    assert np.array_equal(out, arr.astype(np.float16).astype(np.float32))
    np.testing.assert_allclose(out, arr, rtol=1e-3, atol=1e-4)


def test_bf16_keeps_the_high_bits_and_rounds_to_nearest_even():
    arr = (RNG.standard_normal((5, 64)) * 100).astype(np.float32)
    out = _round_trip(arr, pb.BF16)
    np.testing.assert_allclose(out, arr, rtol=2**-8)
    assert not (out.view(np.uint32) & 0xFFFF).any()  # exactly representable in bf16
    # values already bf16 survive exactly
    assert np.array_equal(_round_trip(out, pb.BF16), out)
    # ties: 1 + 2^-8 sits halfway between 1 and 1 + 2^-7; even mantissa (1.0) wins
    halfway = np.array([[1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8)]], dtype=np.float32)
    assert _round_trip(halfway, pb.BF16).tolist() == [[1.0, 1 + 2**-6, -1.0]]
    # just above halfway rounds up
    above = np.array([[np.nextafter(np.float32(1 + 2**-8), np.float32(2))]], dtype=np.float32)
    assert _round_trip(above, pb.BF16).tolist() == [[1 + 2**-7]]


def test_bf16_special_values():
    arr = np.array([[0.0, -0.0, np.inf, -np.inf, 3.0e38]], dtype=np.float32)
    out = _round_trip(arr, pb.BF16)
    assert out[0, 0] == 0
    assert np.signbit(out[0, 1])
    assert out[0, 2] == np.inf
    assert out[0, 3] == -np.inf
    assert np.isfinite(out[0, 4]) or out[0, 4] == np.inf  # near max: rounds to max or inf, never NaN
    assert np.isnan(_round_trip(np.array([[np.nan]], dtype=np.float32), pb.BF16)).all()


def test_non_contiguous_and_f64_inputs_encode_as_their_values():
    base = RNG.standard_normal((6, 8))  # float64
    view = base[::2, 1::2]
    for dtype in (pb.F32, pb.F16, pb.BF16):
        want = _round_trip(np.ascontiguousarray(view, dtype=np.float32), dtype)
        assert np.array_equal(_round_trip(view, dtype), want)


def test_unknown_dtype_is_refused_when_encoding():
    with pytest.raises(FrameError):
        encode_tensor(np.zeros((1, 1), np.float32), 99)


def _header(**kw: object) -> pb.FrameHeader:
    base: dict[str, object] = {"kind": pb.DECODE, "dtype": pb.F16, "shape": [2, 4], "payload_bytes": 16}
    base.update(kw)
    return pb.FrameHeader(**base)  # type: ignore[arg-type]  # on purpose: the cases below pass out-of-enum ints


def test_a_consistent_header_passes_and_an_empty_payload_needs_no_shape():
    validate_header(_header(), Limits())
    validate_header(pb.FrameHeader(kind=pb.END), Limits())
    validate_header(pb.FrameHeader(kind=pb.REPLY, tokens=[1, 2, 3]), Limits())


@pytest.mark.parametrize(("header", "limits"), [
    (_header(kind=99), Limits()),  # unknown kind
    (pb.FrameHeader(kind=pb.REPLY, tokens=list(range(5))), Limits(max_tokens=4)),
    (_header(shape=[8]), Limits()),  # not [rows, width]
    (_header(shape=[2, 4, 1]), Limits()),
    (_header(shape=[0, 4], payload_bytes=0), Limits()),  # an empty shape with a payload_bytes of 0
    (_header(shape=[2, 0], payload_bytes=0), Limits()),
    (_header(shape=[9, 4], payload_bytes=72), Limits(max_rows=8)),
    (_header(shape=[2, 5], payload_bytes=20), Limits(max_width=4)),
    (_header(dtype=7), Limits()),  # unknown wire dtype
    (_header(payload_bytes=15), Limits()),  # does not fit the shape
    (_header(payload_bytes=32), Limits()),
    (_header(dtype=pb.F32, payload_bytes=16), Limits()),  # f32 needs 32
    (_header(payload_bytes=0), Limits()),  # a shape but no payload
    (_header(shape=[4, 4], payload_bytes=32), Limits(max_payload_bytes=31)),
])
def test_headers_outside_the_limits_are_refused(header: pb.FrameHeader, limits: Limits):
    with pytest.raises(FrameError):
        validate_header(header, limits)


def test_limits_are_inclusive():
    limits = Limits(max_rows=2, max_width=4, max_tokens=3, max_payload_bytes=16)
    validate_header(_header(tokens=[1, 2, 3]), limits)


def test_a_frame_that_stalls_halfway_or_does_not_parse_is_a_frame_error():
    async def go() -> None:
        sent: asyncio.Queue[bytes] = asyncio.Queue()

        async def hold(link: Link) -> None:
            with contextlib.suppress(FrameError, LinkClosedError):
                await link.recv()
                await sent.put(b"got a frame")
            await sent.put(b"done")

        limits = Limits(partial_frame_s=0.2)
        server = await serve("127.0.0.1", 0, hold, token=None, limits=limits)
        port = server.sockets[0].getsockname()[1]
        for junk in (b"\x10\x00\x00\x00\x08", b"\x03\x00\x00\x00\xff\xff\xff"):  # cut short; not a header
            link = await connect("127.0.0.1", port, token=None)
            started = time.monotonic()
            link.writer.write(junk)
            assert await asyncio.wait_for(sent.get(), 5) == b"done"  # the stage gave up on it, no frame came
            assert time.monotonic() - started < 2
            link.close()
        server.close()

    asyncio.run(go())


def test_frames_sent_in_one_turn_of_the_loop_leave_in_one_write_in_order():
    """A decode's sessions send their frames in one turn: one write carries them all, so the
    next stage reads and batches them together (8 streams on split-2: 3.0 rows a decode
    became 3.8). A close writes what is still held."""
    async def go() -> tuple[list[int], int, list[int]]:
        got: asyncio.Queue[int] = asyncio.Queue()

        async def read(link: Link) -> None:
            with contextlib.suppress(LinkClosedError):
                while True:
                    header, _ = await link.recv()
                    await got.put(header.frame_id)

        server = await serve("127.0.0.1", 0, read, token=None)
        link = await connect("127.0.0.1", server.sockets[0].getsockname()[1], token=None)
        writes = 0
        write = link.writer.writelines

        def counting(parts: list[bytes]) -> None:
            nonlocal writes
            writes += 1
            write(parts)

        link.writer.writelines = counting  # type: ignore[method-assign, assignment]
        data = np.ones((1, 8), np.float32).tobytes()
        for frame in range(4):  # no await between them suspends: one turn
            await link.send(pb.FrameHeader(kind=pb.DECODE, frame_id=frame, dtype=pb.F32, shape=[1, 8],
                                           payload_bytes=len(data)), data)
        first = [await asyncio.wait_for(got.get(), 5) for _ in range(4)]
        one_turn = writes
        await link.send(pb.FrameHeader(kind=pb.END, frame_id=4))
        link.close()  # before the loop turned: the close writes it
        last = [await asyncio.wait_for(got.get(), 5)]
        server.close()
        return first, one_turn, last

    first, writes, last = asyncio.run(go())
    assert first == [0, 1, 2, 3]
    assert writes == 1
    assert last == [4]
