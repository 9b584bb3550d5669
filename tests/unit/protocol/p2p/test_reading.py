"""Reading a body as its bytes arrive: exactly its length, into a caller's buffer or
joined, and dropped as too slow below the pace."""

from __future__ import annotations

import asyncio

import pytest

from protocol.errors import ProtocolError
from protocol.p2p._reading import Pace, StreamRead, read_all, read_body, read_into, read_paced


def _reader(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


def test_a_body_is_exactly_its_length_and_the_rest_stays_in_the_stream() -> None:
    async def main() -> tuple[bytes, bytes]:
        reader = _reader(b"0123456789next")
        return await read_body(reader, 10), await reader.read()

    assert asyncio.run(main()) == (b"0123456789", b"next")

    async def short() -> bytes:
        return await read_body(_reader(b"short"), 10)

    with pytest.raises(asyncio.IncompleteReadError):
        asyncio.run(short())


def test_a_body_can_be_read_into_the_callers_buffer() -> None:
    async def main() -> tuple[bytes, int]:
        counted: list[int] = []
        read = StreamRead(_reader(b"abcdef"), counted.append)
        view = memoryview(bytearray(6))
        out = await read_all(read, 6, view)
        return bytes(out), sum(counted)

    assert asyncio.run(main()) == (b"abcdef", 6)


def test_read_into_copies_once_through_a_plain_read() -> None:
    async def main() -> tuple[int, bytes]:
        reader = _reader(b"xyz")
        view = memoryview(bytearray(5))
        n = await read_into(reader.read, view)
        return n, bytes(view)

    assert asyncio.run(main()) == (3, b"xyz\x00\x00")


def test_a_silent_body_is_dropped_as_too_slow_within_its_window() -> None:
    pace = Pace(header_timeout=1.0, min_bytes_per_second=1000, window=0.2)

    async def main() -> None:
        reader = _reader(b"x" * 10, eof=False)  # ten bytes, then nothing
        await read_paced(reader, 1 << 20, pace, lambda read: read_all(read, 1 << 20, None))

    with pytest.raises(ProtocolError, match="too_slow") as info:
        asyncio.run(asyncio.wait_for(main(), 5))
    assert "10 of 1048576 bytes" in info.value.detail


def test_without_a_pace_the_read_waits_for_its_bytes() -> None:
    async def main() -> bytes:
        reader = _reader(b"", eof=False)

        async def feed() -> None:
            await asyncio.sleep(0.05)  # the bytes come late: no pace, no drop
            reader.feed_data(b"late")
            reader.feed_eof()

        feeder = asyncio.ensure_future(feed())
        body = await read_body(reader, 4, Pace(1.0, 0, 0.2))
        await feeder
        return body

    assert asyncio.run(main()) == b"late"
