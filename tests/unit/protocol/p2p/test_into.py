"""Receiving straight into the reader's buffer (protocol.p2p._into), on real TCP and TLS
sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from protocol.p2p import _framing, _handshake, _into
from protocol.wire.messages import Header
from protocol.wire.partwire import read_part, seal_part
from verification.identity import Identity

BODY = os.urandom(3 * 2**20 + 12345)


class CountingReader(_into.IntoReader):
    """Counts the bytes that went through the reader's own buffer."""

    buffered = 0

    def feed_data(self, data: Any) -> None:
        CountingReader.buffered += len(data)
        super().feed_data(data)


async def _pair(
    serve: Callable[[asyncio.StreamWriter], Awaitable[None]], tls: bool = False
) -> tuple[_into.IntoReader, asyncio.StreamWriter, asyncio.base_events.Server]:
    """A server that runs ``serve(writer)`` on each connection, and a client reading from it."""

    async def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await serve(writer)
        finally:
            writer.close()

    extra: dict[str, Any] = {}
    client: dict[str, Any] = {}
    if tls:
        context, _ = _handshake.server_tls()
        extra = {"ssl": context}
        client = {"ssl": _handshake.client_tls(), "server_hostname": ""}
    server = await _into.start_server(connected, "127.0.0.1", 0, **extra)
    port = server.sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()
    reader = CountingReader(loop=loop)
    protocol = _into.IntoProtocol(reader, loop=loop)
    transport, _ = await loop.create_connection(lambda: protocol, "127.0.0.1", port, **client)
    return reader, asyncio.StreamWriter(transport, protocol, reader, loop), server


def _run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 20))


async def _frames(writer: asyncio.StreamWriter) -> None:
    """A 4-byte header, the body in uneven pieces with pauses, then a trailer."""
    writer.write(b"HEAD")
    await writer.drain()
    for lo in range(0, len(BODY), 700_001):
        writer.write(BODY[lo : lo + 700_001])
        await writer.drain()
        await asyncio.sleep(0.01)
    writer.write(b"TAIL")
    await writer.drain()


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
def test_a_body_lands_in_the_callers_buffer_with_the_stream_order_kept(tls: bool) -> None:
    async def main() -> tuple[bytes, bytes, bytes, int, int]:
        CountingReader.buffered = 0
        reader, writer, server = await _pair(_frames, tls)
        try:
            head = await reader.readexactly(4)
            dest = memoryview(bytearray(len(BODY)))
            got = 0
            while got < len(BODY):
                n = await reader.readinto(dest[got : got + 2**20])
                assert n > 0
                got += n
            tail = await reader.readexactly(4)
            end = await reader.readinto(memoryview(bytearray(8)))
            return head, bytes(dest), tail, end, CountingReader.buffered
        finally:
            writer.close()
            server.close()

    head, body, tail, end, buffered = _run(main())
    assert (head, tail, end) == (b"HEAD", b"TAIL", 0)
    assert body == BODY
    # what arrived while readinto waited went to the destination, not through the buffer
    assert buffered < len(BODY) // 4, buffered


def test_bytes_buffered_before_readinto_come_first_and_none_are_lost() -> None:
    async def main() -> bytes:
        CountingReader.buffered = 0
        reader, writer, server = await _pair(_frames)
        try:
            # wait, boundedly, until part of the body went through the reader's own buffer
            deadline = time.monotonic() + 10
            while CountingReader.buffered <= len(b"HEAD"):
                assert time.monotonic() < deadline, "nothing was buffered"
                await asyncio.sleep(0.005)
            out = bytearray()
            piece = memoryview(bytearray(100_000))
            while True:
                n = await reader.readinto(piece)
                if not n:
                    return bytes(out)
                out += piece[:n]
        finally:
            writer.close()
            server.close()

    assert _run(main()) == b"HEAD" + BODY + b"TAIL"


def test_a_lost_connection_raises_and_an_early_end_returns_what_came() -> None:
    async def cut(writer: asyncio.StreamWriter) -> None:
        writer.write(b"x" * 1000)
        await writer.drain()
        writer.transport.abort()

    async def main() -> int:
        reader, writer, server = await _pair(cut)
        try:
            dest = memoryview(bytearray(10_000))
            got = 0
            while True:
                n = await reader.readinto(dest[got:])
                if not n:
                    return got
                got += n
        finally:
            writer.close()
            server.close()

    try:
        got = _run(main())
    except ConnectionError:
        return  # an abort may reach the reader as a reset
    assert got == 1000


def test_a_stream_read_fills_a_buffer_from_either_kind_of_reader() -> None:
    async def main() -> list[bytes]:
        plain = asyncio.StreamReader()
        into = _into.IntoReader()
        for r in (plain, into):
            r.feed_data(b"abcdef")
            r.feed_eof()
        out = []
        for r in (plain, into):
            counted: list[int] = []
            read = _framing.StreamRead(r, counted.append)
            dest = memoryview(bytearray(4))
            n = await _framing.read_into(read, dest)
            rest = await read(10)
            out.append(bytes(dest[:n]) + b"|" + rest + b"|%d" % sum(counted))
        # a bare read function has no into(): one copy through read
        plain = asyncio.StreamReader()
        plain.feed_data(b"xyz")
        plain.feed_eof()
        dest = memoryview(bytearray(8))
        n = await _framing.read_into(plain.read, dest)
        out.append(bytes(dest[:n]))
        return out

    assert asyncio.run(main()) == [b"abcd|ef|6", b"abcd|ef|6", b"xyz"]


def test_a_part_read_through_a_stream_read_is_checked_as_through_read() -> None:
    identity = Identity.from_seed(b"i" * 32)
    body = os.urandom(5 * 2**20 + 7)
    sealed = seal_part(identity, Header("part", "run", 1, 0, 0, identity.peer_id), {}, body)
    message = b"".join(bytes(b) for b in sealed.buffers())
    flipped = bytearray(message)
    flipped[-100] ^= 1

    async def read(message: bytes) -> bytes:
        async def send(writer: asyncio.StreamWriter) -> None:
            writer.write(message)
            await writer.drain()

        reader, writer, server = await _pair(send)
        try:
            dest = memoryview(bytearray(len(body)))
            part = await read_part(
                _framing.StreamRead(reader),
                len(message),
                lambda h, m, size: dest[:size],
                max_bytes=1 << 30,
            )
            return bytes(part.body)
        finally:
            writer.close()
            server.close()

    assert _run(read(message)) == body
    with pytest.raises(Exception, match="bad_chunk|does not match"):
        _run(read(bytes(flipped)))


def test_tls_errors_still_surface_as_ssl_errors() -> None:
    async def main() -> None:
        context, _ = _handshake.server_tls()
        server = await _into.start_server(lambda r, w: w.close(), "127.0.0.1", 0, ssl=context)
        port = server.sockets[0].getsockname()[1]
        strict = ssl.create_default_context()  # verifies certificates: refuses the self-signed
        try:
            await _into.open_connection("127.0.0.1", port, ssl=strict, server_hostname="x")
        finally:
            server.close()

    with pytest.raises(ssl.SSLError):
        _run(main())
