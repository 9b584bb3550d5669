"""The callee's side of the framing against streams that misbehave, on in-memory streams.

Each stream is an ``asyncio.StreamReader`` the test feeds (as p2pd's socket would) and
a writer that collects the response; no p2pd is started.
"""

from __future__ import annotations

import asyncio
import struct
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import pytest

from protocol.errors import ProtocolError
from protocol.p2p import _framing
from protocol.p2p.transport import TransportConfig

MiB = 1 << 20
# Test-sized pace: a silent header is dropped after 0.3 s, a body slower than 1000 B/s
# over any 0.3 s after 0.3 s.
FAST_PACE = _framing.Pace(header_timeout=0.3, min_bytes_per_second=1000, window=0.3)


class _Writer:
    """Collects what the callee writes back, as an ``asyncio.StreamWriter`` would send it."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = False

    def write(self, chunk: bytes | memoryview) -> None:
        self.data += chunk

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def response(self) -> tuple[int, bytes]:
        status, length = struct.unpack(">BQ", bytes(self.data[:9]))
        assert len(self.data) == 9 + length
        return status, bytes(self.data[9:])

    def error_reason(self) -> str:
        status, body = self.response()
        assert status == _framing.STATUS_ERROR
        return _framing.decode_error(body)[0]


def _stream(peer: str) -> tuple[Any, asyncio.StreamReader, _Writer]:
    info = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: peer), addr=None)
    return info, asyncio.StreamReader(), _Writer()


def _header(length: int) -> bytes:
    return struct.pack(">Q", length)


async def _echo(peer: str, data: bytes) -> bytes:
    return data


class _WatchedReader(asyncio.StreamReader):
    """A stream reader that counts the ``read`` calls made on it (a body read waiting
    for bytes has made one)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    async def read(self, n: int = -1) -> bytes:
        self.reads += 1
        return await super().read(n)


async def _until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    """Yield to the loop until ``condition`` holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.001)


def _serve(
    stream: tuple[Any, asyncio.StreamReader, _Writer],
    *,
    limit: int = MiB,
    timeout: float = 10.0,
    gate: _framing.StreamGate | None = None,
    pace: _framing.Pace | None = None,
    handler: Callable[[str, bytes], Awaitable[bytes]] = _echo,
) -> asyncio.Task:
    serving = _framing.serve(stream, handler, limit, "test", timeout, gate=gate, pace=pace)
    return asyncio.ensure_future(serving)


# ---- read_body ---------------------------------------------------------------------------


def test_read_body_slow_feed_returns_everything_and_leaves_the_rest() -> None:
    payload = bytes(range(256)) * 40  # 10 240 bytes in 7-byte drips and a few larger pieces

    async def main() -> tuple[bytes, bytes]:
        reader = asyncio.StreamReader()

        async def feed() -> None:
            for offset in range(0, 700, 7):
                reader.feed_data(payload[offset : offset + 7])
                await asyncio.sleep(0.001)
            reader.feed_data(payload[700:] + b"next")
            reader.feed_eof()

        feeder = asyncio.ensure_future(feed())
        body = await asyncio.wait_for(_framing.read_body(reader, len(payload)), 5)
        await feeder
        return body, await reader.read()

    body, rest = asyncio.run(main())
    assert body == payload
    assert isinstance(body, bytes)
    assert rest == b"next"  # never reads past the announced length


def test_read_body_empty_and_single_chunk() -> None:
    async def main() -> tuple[bytes, bytes]:
        reader = asyncio.StreamReader()
        reader.feed_data(b"abc")
        reader.feed_eof()
        return await _framing.read_body(reader, 0), await _framing.read_body(reader, 3)

    assert asyncio.run(main()) == (b"", b"abc")


def test_read_body_early_eof() -> None:
    async def main() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(b"x" * 1000)
        reader.feed_eof()
        await _framing.read_body(reader, 5000)

    with pytest.raises(asyncio.IncompleteReadError) as info:
        asyncio.run(main())
    assert info.value.partial == b"x" * 1000
    assert info.value.expected == 5000


def test_announced_256_mib_with_nothing_sent_allocates_nothing() -> None:
    async def main() -> int:
        reader = _WatchedReader()
        reader.feed_data(_header(256 * MiB))  # then silence
        stream = (SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: "a"), addr=None),)
        stream += (reader, _Writer())
        silent = _WatchedReader()
        tracemalloc.start()
        try:
            body = asyncio.ensure_future(_framing.read_body(silent, 256 * MiB))
            served = _serve(stream, limit=256 * MiB)  # no pace: held until the handler timeout
            await _until(lambda: silent.reads > 0 and reader.reads > 0)  # both wait for bytes
            assert not body.done() and not served.done()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        for task in (body, served):
            task.cancel()
        await asyncio.gather(body, served, return_exceptions=True)
        return peak

    assert asyncio.run(main()) < 2 * MiB


# ---- request size ----------------------------------------------------------------------


@pytest.mark.parametrize("extra", [0, 1])
def test_request_of_exactly_the_limit_is_served_one_more_byte_is_refused(extra: int) -> None:
    limit = 100_000

    async def main() -> _Writer:
        stream = _stream("a")
        stream[1].feed_data(_header(limit + extra) + b"y" * (limit + extra))
        stream[1].feed_eof()
        await asyncio.wait_for(_serve(stream, limit=limit, pace=FAST_PACE), 10)
        return stream[2]

    writer = asyncio.run(main())
    if extra:
        assert writer.error_reason() == "oversized"
    else:
        assert writer.response() == (_framing.STATUS_OK, b"y" * limit)
    assert writer.closed


def test_a_request_its_reader_refuses_is_answered_and_the_rest_drained_before_closing() -> None:
    """Closing while the caller still sends resets the stream, and the reset can overtake
    the refusal: the callee answers, then reads until the caller hangs up."""

    async def refuse(read: Any, length: int, peer: str) -> _framing.Lease:
        await read(4)
        raise ProtocolError("malformed", "not a part")

    async def main() -> tuple[_Writer, bool, bool]:
        stream = _stream("a")
        stream[1].feed_data(_header(100_000) + b"z" * 1000)
        serving = asyncio.ensure_future(
            _framing.serve(stream, _echo, MiB, "test", 10.0, receive=refuse)
        )
        await _until(lambda: bool(stream[2].data) or stream[2].closed)
        answered_while_open = bool(stream[2].data) and not stream[2].closed
        stream[1].feed_data(b"z" * 99_000)
        stream[1].feed_eof()  # the caller hangs up once it has read the refusal
        await asyncio.wait_for(serving, 10)
        return stream[2], answered_while_open, serving.done()

    writer, answered_while_open, done = asyncio.run(main())
    assert answered_while_open
    assert done and writer.closed
    assert writer.error_reason() == "malformed"


# ---- stream caps -----------------------------------------------------------------------


def test_streams_over_the_caps_are_answered_busy_unread() -> None:
    gate = _framing.StreamGate(max_streams=3, max_per_peer=2)

    async def main() -> dict[str, Any]:
        silent = [_stream("a"), _stream("a"), _stream("b")]
        held = [_serve(s, gate=gate) for s in silent]  # headers never come: held open
        await _until(lambda: gate.open == 3)
        assert gate.open == 3 and gate.open_from("a") == 2
        over_peer, over_total = _stream("a"), _stream("c")
        for stream in (over_peer, over_total):
            stream[1].feed_data(_header(10) + b"0123456789")
            stream[1].feed_eof()
            await asyncio.wait_for(_serve(stream, gate=gate), 2)
        unread = [await s[1].read() for s in (over_peer, over_total)]
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        after = gate.open, gate.open_from("a")
        late = _stream("a")
        late[1].feed_data(_header(2) + b"ok")
        late[1].feed_eof()
        await asyncio.wait_for(_serve(late, gate=gate), 2)
        return {
            "over": (over_peer[2], over_total[2]),
            "unread": unread,
            "after": after,
            "late": late[2],
        }

    out = asyncio.run(main())
    for writer in out["over"]:
        assert writer.error_reason() == "busy"
        assert writer.closed
    assert out["unread"] == [_header(10) + b"0123456789"] * 2  # not a byte was consumed
    assert out["after"] == (0, 0)  # every slot is given back, cancelled streams included
    assert out["late"].response() == (_framing.STATUS_OK, b"ok")


def test_gate_counts_streams_that_fail_or_time_out() -> None:
    gate = _framing.StreamGate(max_streams=4, max_per_peer=4)

    async def boom(peer: str, data: bytes) -> bytes:
        raise RuntimeError("kaboom")

    async def main() -> None:
        failing, cut, slow = _stream("a"), _stream("a"), _stream("a")
        failing[1].feed_data(_header(1) + b"x")
        cut[1].feed_data(_header(100) + b"x")
        cut[1].feed_eof()
        await asyncio.wait_for(
            asyncio.gather(
                _serve(failing, gate=gate, handler=boom),
                _serve(cut, gate=gate),
                _serve(slow, gate=gate, timeout=0.2),
            ),
            5,
        )
        assert failing[2].error_reason() == "RuntimeError"

    asyncio.run(main())
    assert (gate.open, gate.open_from("a")) == (0, 0)


# ---- slow streams ----------------------------------------------------------------------


def _drop_time(feed: Callable[[asyncio.StreamReader], Awaitable[None]]) -> tuple[_Writer, float]:
    """Serve one stream fed by ``feed`` under FAST_PACE; its writer and how long it took."""

    async def main() -> tuple[_Writer, float]:
        stream = _stream("slowpoke")
        feeder = asyncio.ensure_future(feed(stream[1]))
        started = time.monotonic()
        await asyncio.wait_for(_serve(stream, limit=10 * MiB, pace=FAST_PACE), 10)
        elapsed = time.monotonic() - started
        feeder.cancel()
        await asyncio.gather(feeder, return_exceptions=True)
        return stream[2], elapsed

    return asyncio.run(main())


def test_missing_header_is_too_slow(caplog: pytest.LogCaptureFixture) -> None:
    async def nothing(reader: asyncio.StreamReader) -> None:
        await asyncio.sleep(60)

    writer, elapsed = _drop_time(nothing)
    assert writer.error_reason() == "too_slow"
    assert writer.closed
    assert 0.25 < elapsed < 2
    dropped = [r for r in caplog.records if "too_slow" in r.getMessage()]
    assert len(dropped) == 1 and "slowpoke" in dropped[0].getMessage()  # one line, with the peer


def test_trickling_body_is_too_slow() -> None:
    async def trickle(reader: asyncio.StreamReader) -> None:
        reader.feed_data(_header(MiB))
        for _ in range(400):  # 10 bytes per 20 ms: 500 B/s, half the floor
            reader.feed_data(b"t" * 10)
            await asyncio.sleep(0.02)

    writer, elapsed = _drop_time(trickle)
    assert writer.error_reason() == "too_slow"
    assert 0.25 < elapsed < 2


def test_burst_then_silence_is_judged_on_the_last_window_not_the_average() -> None:
    async def burst(reader: asyncio.StreamReader) -> None:
        reader.feed_data(_header(MiB) + b"b" * 200_000)  # 2/3 of the average for 200 s
        await asyncio.sleep(60)

    writer, elapsed = _drop_time(burst)
    assert writer.error_reason() == "too_slow"
    assert 0.25 < elapsed < 2


def test_steady_body_above_the_floor_is_served() -> None:
    size = 3000

    async def steady(reader: asyncio.StreamReader) -> None:
        reader.feed_data(_header(size))
        for _ in range(size // 30):  # 30 bytes per 10 ms: 3000 B/s for a second, 3x the floor
            reader.feed_data(b"s" * 30)
            await asyncio.sleep(0.01)

    writer, elapsed = _drop_time(steady)
    assert writer.response() == (_framing.STATUS_OK, b"s" * size)
    assert elapsed > 0.6  # it did outlast several windows


def test_cancellation_by_others_is_not_mistaken_for_slowness() -> None:
    async def main() -> None:
        reader = _WatchedReader()
        task = asyncio.ensure_future(_framing.read_body(reader, 100, FAST_PACE))
        await _until(lambda: reader.reads > 0)  # the paced read has started, well within its window
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_read_body_raises_too_slow_with_detail() -> None:
    async def main() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(b"z" * 10)
        await _framing.read_body(reader, 100, FAST_PACE)

    with pytest.raises(ProtocolError) as info:
        asyncio.run(main())
    assert info.value.reason == "too_slow"
    assert "10 of 100 bytes" in info.value.detail


# ---- configuration ---------------------------------------------------------------------


def test_transport_config_stream_limits() -> None:
    cfg = TransportConfig()
    assert cfg.max_inbound_per_peer <= cfg.max_inbound_streams
    # a 1 Mbit/s link (125 000 B/s) clears the floor with several requests at once
    assert 125_000 / cfg.min_inbound_bytes_per_second >= 4
    assert TransportConfig(min_inbound_bytes_per_second=0).min_inbound_bytes_per_second == 0
    for key in ("max_inbound_streams", "max_inbound_per_peer", "inbound_rate_window"):
        with pytest.raises(ValueError, match=f"transport.{key} = 0: expected > 0"):
            TransportConfig(**{key: 0})
    with pytest.raises(ValueError, match="min_inbound_bytes_per_second = -1"):
        TransportConfig(min_inbound_bytes_per_second=-1)


# ---- receive buffers ---------------------------------------------------------------------


def test_pool_reuses_a_released_buffer_and_never_one_still_viewed() -> None:
    pool = _framing.BufferPool(min_bytes=1024)
    first = pool.lease(4096)
    first.data[:4] = b"abcd"
    kept = first.data[:4]  # a consumer keeps a view past the release
    first.release()
    second = pool.lease(4096)
    assert pool.allocated == 2  # the viewed buffer was not handed out again
    second.data[:4] = b"wxyz"
    assert bytes(kept) == b"abcd"
    del kept
    second.release()
    third = pool.lease(3000)  # either idle buffer fits (3000..6000 bytes)
    assert pool.allocated == 2 and len(third.data) == 3000
    third.release()


def test_pool_gives_small_bodies_plain_bytes_and_bounds_idle_memory() -> None:
    pool = _framing.BufferPool(max_free_bytes=10_000, min_bytes=1024)
    small = pool.lease(100)
    assert small.data.nbytes == 100 and pool.allocated == 0
    small.release()
    leases = [pool.lease(4000) for _ in range(4)]
    for lease in leases:
        lease.release()
        lease.release()  # idempotent
    assert pool.idle_bytes <= 10_000
    assert pool.lease(9000).data.nbytes == 9000  # no idle buffer of 9000..18000: a new one
    assert pool.allocated == 5


def test_a_large_request_is_read_into_the_pool_and_given_back_after_the_handler() -> None:
    pool = _framing.BufferPool(min_bytes=1024)
    payload = bytes(range(256)) * 64
    seen: list[object] = []

    async def handler(peer: str, data: bytes) -> bytes:
        seen.append(type(data))
        return bytes(data[:8])

    async def main() -> bytes:
        for _ in range(3):
            stream = _stream("peer")
            stream[1].feed_data(_header(len(payload)) + payload)
            stream[1].feed_eof()
            serving = _framing.serve(stream, handler, MiB, "test", 5.0, receive=pool.read_request)
            await asyncio.wait_for(serving, 5)
        return stream[2].response()[1]

    assert asyncio.run(main()) == payload[:8]
    assert seen == [memoryview] * 3
    assert pool.allocated == 1  # one buffer, reused request after request


def test_a_lease_handed_to_a_parsed_message_goes_back_with_it() -> None:
    pool = _framing.BufferPool(min_bytes=1024)
    lease = pool.lease(4096)
    message = {"body": lease.data}  # a parsed message whose body is the buffer itself
    parsed = lease.handed_to(message)
    lease.release()  # spent: gives nothing back
    assert pool.idle_bytes == 0
    del message, lease
    parsed.release()  # the message goes, and its buffer with it
    again = pool.lease(4096)
    assert pool.allocated == 1 and again.data.nbytes == 4096


# ---- responses written while they are produced ---------------------------------------------


def _streamed_answer(pieces: list[bytes], size: int, trailer: bytes) -> tuple[bool, bytes]:
    async def handler(peer: str, data: bytes) -> _framing.StreamedResponse:
        async def body():
            for piece in pieces:
                await asyncio.sleep(0)  # as if each block had just been reduced
                yield piece

        async def tail() -> bytes:
            return trailer

        return _framing.StreamedResponse(size, body, tail)

    async def main() -> tuple[bool, bytes]:
        reader, writer = asyncio.StreamReader(), _Writer()
        reader.feed_data(_header(2) + b"hi")
        reusable = await _framing.answer(reader, writer, handler, MiB, "test", "peer", None)
        return reusable, bytes(writer.data)

    return asyncio.run(main())


def test_a_streamed_answer_is_its_frame_then_its_trailer_frame() -> None:
    reusable, wire = _streamed_answer([b"ab", b"cde", b"f"], 6, b"TRAILER")
    assert reusable
    assert wire == struct.pack(">BQ", 0, 6) + b"abcdef" + struct.pack(">BQ", 0, 7) + b"TRAILER"

    async def read() -> tuple[bytes, bytes]:
        reader = asyncio.StreamReader()
        reader.feed_data(wire)
        reader.feed_eof()
        status, length = await _framing.read_response_header(reader)
        body = await _framing.read_body(reader, length)
        return body, await _framing.read_frame(reader, 64, "owner")

    assert asyncio.run(read()) == (b"abcdef", b"TRAILER")


@pytest.mark.parametrize("pieces", [[b"abc"], [b"abcdef", b"g"]], ids=["short", "long"])
def test_a_streamed_answer_of_another_length_is_cut_short(pieces: list[bytes]) -> None:
    # the frame's length was promised: a body that breaks it ends the stream, no trailer
    reusable, wire = _streamed_answer(pieces, 6, b"TRAILER")
    assert not reusable and b"TRAILER" not in wire


def test_a_trailer_frame_over_its_limit_or_an_error_frame_is_refused() -> None:
    async def read(frame: bytes) -> bytes:
        reader = asyncio.StreamReader()
        reader.feed_data(frame)
        reader.feed_eof()
        return await _framing.read_frame(reader, 4, "owner")

    for frame in (struct.pack(">BQ", 0, 5) + b"12345", struct.pack(">BQ", 1, 2) + b"no"):
        with pytest.raises(ProtocolError, match="bad_trailer"):
            asyncio.run(read(frame))
