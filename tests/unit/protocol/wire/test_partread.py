"""Reading a part from a stream: the same checks as from bytes, in stream order, the body
straight into the caller's buffer and each chunk checked as it is in."""

from __future__ import annotations

import asyncio

import pytest

from protocol.errors import ProtocolError
from protocol.wire._partformat import chunk_hashes
from protocol.wire._partread import read_part
from protocol.wire._partseal import seal_part, seal_stream_head, seal_trailer
from protocol.wire.messages import Header
from verification.identity import Identity

ME = Identity.from_seed(b"r" * 32)
HEADER = Header("reduced", "run", 3, 1, 2, ME.peer_id)
BODY = bytes(range(256)) * 40  # three chunks of 4096 bytes


def _read(wire: bytes, trailer: bytes | None = None, **kwargs):
    dest = bytearray(len(BODY))
    progress: list[int] = []

    def into(header, meta, size) -> memoryview:
        return memoryview(dest)[:size]

    async def main():
        reader = asyncio.StreamReader()
        reader.feed_data(wire)
        reader.feed_eof()

        async def frame() -> bytes:
            return trailer

        return await read_part(
            reader.read,
            len(wire),
            into,
            max_bytes=1 << 20,
            progress=progress.append,
            trailer=frame if trailer is not None else None,
            **kwargs,
        )

    return asyncio.run(main()), bytes(dest), progress


def test_the_body_lands_in_the_callers_buffer_checked_chunk_by_chunk() -> None:
    wire = seal_part(ME, HEADER, {"w": 1}, BODY, chunk_bytes=4096).to_bytes()
    part, dest, progress = _read(wire, expected_sender=ME.peer_id, kinds=("reduced",))
    assert dest == BODY and part.meta == {"w": 1} and part.header == HEADER
    assert progress == [4096, 8192, len(BODY)]


def test_a_bad_chunk_stops_the_read_before_the_rest_is_reported() -> None:
    wire = bytearray(seal_part(ME, HEADER, {}, BODY, chunk_bytes=4096).to_bytes())
    wire[-5000] ^= 1  # in the second chunk
    with pytest.raises(ProtocolError, match="chunk 1 of 3") as info:
        _read(bytes(wire))
    assert info.value.reason == "bad_chunk"


def test_a_streamed_result_is_taken_only_where_a_trailer_is_expected() -> None:
    head = seal_stream_head(ME, HEADER, {"content": "update"}, len(BODY), chunk_bytes=4096)
    wire = b"".join(head.buffers()) + BODY
    frame = seal_trailer(ME, head, {"contributors": ["a"]}, chunk_hashes(BODY, 4096))
    part, dest, progress = _read(wire, frame)
    assert dest == BODY and part.meta == {"content": "update", "contributors": ["a"]}
    assert part.trailer == frame and progress == []  # unchecked until the trailer came
    with pytest.raises(ProtocolError) as info:
        _read(wire)
    assert info.value.reason == "wrong_kind"


def test_a_trailer_that_names_other_chunks_is_refused() -> None:
    head = seal_stream_head(ME, HEADER, {}, len(BODY), chunk_bytes=4096)
    wire = b"".join(head.buffers()) + BODY
    other = seal_trailer(ME, head, {}, [b"h" * 32] * 3)
    with pytest.raises(ProtocolError, match="chunk 0 of 3") as info:
        _read(wire, other)
    assert info.value.reason == "bad_chunk"


def test_a_stream_that_ends_early_is_an_incomplete_read() -> None:
    wire = seal_part(ME, HEADER, {}, BODY, chunk_bytes=4096).to_bytes()

    async def main() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(wire[:-10])
        reader.feed_eof()
        dest = bytearray(len(BODY))
        await read_part(
            reader.read, len(wire), lambda h, m, n: memoryview(dest)[:n], max_bytes=1 << 20
        )

    with pytest.raises(asyncio.IncompleteReadError):
        asyncio.run(main())
