"""An owner's result sent back while it is reduced, without a network: what one reply
carries as the reduction advances, and the trailer that binds it."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from protocol.averaging.streamback import StreamedResult
from protocol.errors import ProtocolError
from protocol.wire.messages import Header
from protocol.wire.partwire import MAX_TRAILER_BYTES, chunk_hashes, read_part
from tests.waiting import eventually
from verification.identity import Identity

OWNER = Identity.from_seed(bytes([7]) * 32)
NUMEL = 3 * (1 << 18)  # three 1 MiB chunks of float32


def _reply_bytes(values: torch.Tensor, used: bool, steps: list[int]) -> tuple[bytes, bytes]:
    """Run one reply while a reduction reaches ``steps`` values, then the result is
    signed with ``values``; returns the reply's first frame and its trailer."""

    async def main() -> tuple[bytes, bytes]:
        header = Header("reduced", "run", 1, 0, 2, OWNER.peer_id)
        stream = StreamedResult(OWNER, header, "update", NUMEL, 256)
        streamed = torch.full((NUMEL,), 5.0)  # what the blocks said before the verdict
        upto = 0
        reply = stream.response(lambda: (streamed, upto), time.monotonic() + 10)
        pieces: list[bytes] = []

        async def read() -> None:
            async for piece in reply.body():
                pieces.append(bytes(piece))

        def received() -> int:
            return sum(len(p) for p in pieces)

        reading = asyncio.ensure_future(read())
        for step in steps:
            upto = step
            stream.advance()
            # the block went out before the result is signed: wait until it was read
            want = sum(len(b) for b in stream.head.buffers()) + 4 * step
            assert await eventually(lambda want=want: received() >= want, 5), received()
        meta = {"contributors": ["a"], "weights": [1.0]}
        final = values if used else values.clone()
        body = memoryview(final.numpy()).cast("B")
        stream.finish(meta, chunk_hashes(body), body, used)
        await asyncio.wait_for(reading, 5)
        return b"".join(pieces), await reply.trailer()

    return asyncio.run(main())


def _read(first: bytes, trailer: bytes):
    dest = torch.empty(NUMEL)

    def into(header, meta, size) -> memoryview:
        return memoryview(dest.numpy()).cast("B")

    async def frame() -> bytes:
        assert len(trailer) <= MAX_TRAILER_BYTES
        return trailer

    async def main():
        reader = asyncio.StreamReader()
        reader.feed_data(first)
        reader.feed_eof()
        return await read_part(
            reader.read, len(first), into, max_bytes=1 << 26, expected_sender=OWNER.peer_id,
            kinds=("reduced",), trailer=frame,
        )  # fmt: skip

    return asyncio.run(main()), dest


def test_blocks_go_out_as_they_are_reduced_and_the_trailer_binds_them() -> None:
    values = torch.full((NUMEL,), 5.0)  # the blocks streamed are the result's
    first, trailer = _reply_bytes(values, used=True, steps=[1 << 18, 2 << 18])
    part, dest = _read(first, trailer)
    assert torch.equal(dest, values)
    codec = {"c": "none", "n": NUMEL, "b": 256}
    assert part.meta == {"content": "update", **codec, "contributors": ["a"], "weights": [1.0]}


def test_blocks_given_up_after_they_went_out_end_in_a_redo_trailer() -> None:
    values = torch.full((NUMEL,), 2.0)  # screening changed the result after one block
    first, trailer = _reply_bytes(values, used=False, steps=[1 << 18])
    with pytest.raises(ProtocolError) as info:
        _read(first, trailer)
    assert info.value.reason == "redo"


def test_a_reply_that_sent_no_block_before_the_verdict_needs_no_redo() -> None:
    values = torch.arange(NUMEL, dtype=torch.float32)
    first, trailer = _reply_bytes(values, used=False, steps=[])
    _, dest = _read(first, trailer)
    assert torch.equal(dest, values)


def test_a_reply_ends_without_a_trailer_once_the_exchange_is_over() -> None:
    async def main() -> None:
        header = Header("reduced", "run", 1, 0, 2, OWNER.peer_id)
        stream = StreamedResult(OWNER, header, "update", NUMEL, 256)
        reply = stream.response(lambda: (None, 0), time.monotonic() + 10)
        body = reply.body()
        await body.__anext__()  # the head's pieces come at once
        stream.drop()
        with pytest.raises(ProtocolError, match="late"):
            async for _ in body:
                pass
        with pytest.raises(ProtocolError, match="late"):
            await reply.trailer()

    asyncio.run(main())
