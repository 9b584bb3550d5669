"""The frames of an RPC stream: request and response headers, error reports, and a
response written while it is produced."""

from __future__ import annotations

import asyncio
import struct

import msgpack

from protocol.p2p import _frames


class _Writer:
    """What the frame writers ask of a stream writer: ``write`` and ``drain``."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.drains = 0

    def write(self, data) -> None:
        self.out += bytes(data)

    async def drain(self) -> None:
        self.drains += 1


def _reader(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


def test_a_request_is_its_length_then_its_buffers_one_after_the_other() -> None:
    writer = _Writer()
    payload = [b"head", memoryview(bytearray(b"body"))]
    asyncio.run(_frames.write_request(writer, payload))  # type: ignore[arg-type]
    assert bytes(writer.out) == struct.pack(">Q", 8) + b"headbody"

    async def read() -> tuple[int, bytes]:
        reader = _reader(bytes(writer.out))
        length = await _frames.read_request_header(reader)
        return length, await reader.readexactly(length)

    assert asyncio.run(read()) == (8, b"headbody")


def test_a_response_carries_its_status_and_length() -> None:
    writer = _Writer()
    asyncio.run(_frames.write_response(writer, _frames.STATUS_ERROR, b"oops"))  # type: ignore[arg-type]
    assert bytes(writer.out)[:9] == struct.pack(">BQ", 1, 4)

    async def read() -> tuple[int, int]:
        return await _frames.read_response_header(_reader(bytes(writer.out)))

    assert asyncio.run(read()) == (_frames.STATUS_ERROR, 4)


def test_error_reports_round_trip_and_anything_else_is_malformed() -> None:
    report = _frames.encode_error("oversized", "x" * 5000)
    reason, detail = _frames.decode_error(report)
    assert reason == "oversized" and len(detail) == 4000  # the detail is cut short
    assert _frames.decode_error(b"\xc1junk") == ("malformed", "unreadable error report")
    assert _frames.decode_error(msgpack.packb({"reason": 1, "detail": "d"}))[0] == "malformed"


def test_payloads_are_buffers_or_sequences_of_them() -> None:
    assert _frames.is_payload(b"x") and _frames.is_payload([b"x", memoryview(b"yz")])
    assert not _frames.is_payload("text") and not _frames.is_payload([b"x", 1])
    assert _frames.payload_size([b"abc", memoryview(bytearray(5)).cast("B")]) == 8


def _streamed(pieces: list[bytes], size: int) -> tuple[bool, bytes]:
    async def body():
        for piece in pieces:
            yield piece

    async def trailer() -> bytes:
        return b"TRAILER"

    writer = _Writer()
    response = _frames.StreamedResponse(size, body, trailer)
    ok = asyncio.run(_frames.write_streamed(writer, response, "rpc", "peer"))  # type: ignore[arg-type]
    return ok, bytes(writer.out)


def test_a_streamed_response_is_its_frame_then_its_trailer_frame() -> None:
    ok, out = _streamed([b"ab", b"cd"], 4)
    assert ok
    assert out == struct.pack(">BQ", 0, 4) + b"abcd" + struct.pack(">BQ", 0, 7) + b"TRAILER"


def test_a_streamed_body_of_another_length_than_announced_cuts_the_stream() -> None:
    short_ok, short = _streamed([b"ab"], 4)
    long_ok, _ = _streamed([b"abc", b"def"], 4)
    assert not short_ok and not long_ok
    assert b"TRAILER" not in short
