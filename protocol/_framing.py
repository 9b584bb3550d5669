"""One RPC exchange over its own p2pd byte stream, in length-prefixed frames.

Every call opens its own p2pd stream, so a frame only has to say how long it is.
A request is ``u64 length | body``; a response is ``u8 status | u64 length | body``,
where an error body is a msgpack map ``{"reason": str, "detail": str}``. Bodies
are written in chunks with a drain after each one, so a 256 MiB payload never
sits in the socket buffer twice, and read into one preallocated buffer.

Tests and benchmarks can emulate a long link on loopback by setting
``ATOLL_LINK_SHAPE`` (see :mod:`protocol.shaper`): each message then waits the one-way
delay before its header and its bytes are paced at the line rate. The wire format is
the same; unset, writes take exactly the unshaped path.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import struct
from collections.abc import Awaitable, Callable

import msgpack
from hivemind.p2p import P2P, P2PDaemonError, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from protocol.errors import ProtocolError
from protocol.shaper import Shaper

__all__ = [
    "CHUNK_BYTES",
    "REMOTE_ADDR",
    "STATUS_ERROR",
    "STATUS_OK",
    "decode_error",
    "encode_error",
    "exchange",
    "read_body",
    "read_request_header",
    "read_response_header",
    "serve",
    "write_request",
    "write_response",
]

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
STATUS_OK = 0
STATUS_ERROR = 1
_MAX_ERROR_BYTES = 64 * 1024  # an error report is a short text; a longer one is malformed
_LINGER_SECONDS = 5.0

REMOTE_ADDR: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "atoll_remote_addr", default=None
)
"""Inside a handler: the multiaddr the current request's connection comes from."""

_REQUEST_HEADER = struct.Struct(">Q")
_RESPONSE_HEADER = struct.Struct(">BQ")

# Read once at import: the emulated link of this process, or None (the normal case).
_SHAPER: Shaper | None = Shaper.from_env()


async def _write_body(writer: asyncio.StreamWriter, header: bytes, data: bytes) -> None:
    if _SHAPER is not None:
        await _write_shaped(writer, header, data, _SHAPER)
        return
    writer.write(header)
    view = memoryview(data)
    for offset in range(0, len(view), CHUNK_BYTES):
        writer.write(view[offset : offset + CHUNK_BYTES])
        await writer.drain()  # backpressure: never queue more than one chunk ahead of the socket
    await writer.drain()


async def _write_shaped(
    writer: asyncio.StreamWriter, header: bytes, data: bytes, shaper: Shaper
) -> None:
    """Like :func:`_write_body` on an emulated link: delay once, then pace each slice."""
    await shaper.delay()
    await shaper.send(len(header))
    writer.write(header)
    view = memoryview(data)
    step = min(CHUNK_BYTES, shaper.slice_bytes)
    for offset in range(0, len(view), step):
        piece = view[offset : offset + step]
        await shaper.send(len(piece))
        writer.write(piece)
        await writer.drain()
    await writer.drain()


async def write_request(writer: asyncio.StreamWriter, data: bytes) -> None:
    """Write one request frame."""
    await _write_body(writer, _REQUEST_HEADER.pack(len(data)), data)


async def write_response(writer: asyncio.StreamWriter, status: int, data: bytes) -> None:
    """Write one response frame with the given status byte."""
    await _write_body(writer, _RESPONSE_HEADER.pack(status, len(data)), data)


async def read_request_header(reader: asyncio.StreamReader) -> int:
    """Read a request header and return the announced body length."""
    (length,) = _REQUEST_HEADER.unpack(await reader.readexactly(_REQUEST_HEADER.size))
    return length


async def read_response_header(reader: asyncio.StreamReader) -> tuple[int, int]:
    """Read a response header and return ``(status, body_length)``."""
    status, length = _RESPONSE_HEADER.unpack(await reader.readexactly(_RESPONSE_HEADER.size))
    return status, length


async def read_body(reader: asyncio.StreamReader, length: int) -> bytes:
    """Read exactly ``length`` bytes; the caller has already checked ``length`` against its limit.

    Raises:
        asyncio.IncompleteReadError: the stream ended early.
    """
    buffer = bytearray(length)
    view = memoryview(buffer)
    received = 0
    while received < length:
        chunk = await reader.read(min(CHUNK_BYTES, length - received))
        if not chunk:
            raise asyncio.IncompleteReadError(bytes(view[:received]), length)
        view[received : received + len(chunk)] = chunk
        received += len(chunk)
    return bytes(buffer)


def encode_error(reason: str, detail: str) -> bytes:
    """Pack an error report for the caller."""
    return msgpack.packb({"reason": reason, "detail": detail[:4000]})


def decode_error(data: bytes) -> tuple[str, str]:
    """Unpack an error report sent by a peer; anything unexpected becomes ``("malformed", ...)``."""
    try:
        report = msgpack.unpackb(data, raw=False, max_str_len=_MAX_ERROR_BYTES)
        reason, detail = report["reason"], report["detail"]
        if isinstance(reason, str) and isinstance(detail, str):
            return reason, detail
    except Exception:  # bytes from a peer: any decoding failure is just a malformed report
        pass
    return "malformed", "unreadable error report"


async def exchange(p2p: P2P, peer: str, protocol: str, data: bytes, limit: int) -> bytes:
    """Caller side: open a stream to ``peer``, send ``data`` and return the response body.

    Raises:
        ProtocolError: ``unreachable``, ``no_handler``, ``oversized``, ``remote_error``,
            ``connection_lost`` or ``malformed``.
    """
    try:
        _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer), protocol)
    except P2PDaemonError as e:
        # p2pd reports a missing handler only through multistream's error text
        reason = "no_handler" if "protocols not supported" in str(e) else "unreachable"
        raise ProtocolError(reason, str(e), peer) from None
    except OSError as e:
        raise ProtocolError("unreachable", f"local p2pd: {e!r}", peer) from None
    # The request is written while the response is awaited: a callee that refuses an
    # oversized request answers before the body is through, and the caller sees why.
    sender = asyncio.ensure_future(write_request(writer, data))
    try:
        status, length = await read_response_header(reader)
        if status == STATUS_OK:
            if length > limit:
                raise ProtocolError("oversized", f"response of {length} bytes", peer)
            return await read_body(reader, length)
        if status == STATUS_ERROR and length <= _MAX_ERROR_BYTES:
            reason, detail = decode_error(await read_body(reader, length))
            if reason == "oversized":
                raise ProtocolError("oversized", detail, peer)
            raise ProtocolError("remote_error", f"{reason}: {detail}", peer)
        raise ProtocolError("malformed", f"response header ({status}, {length})", peer)
    except (asyncio.IncompleteReadError, ConnectionError) as e:
        raise ProtocolError("connection_lost", repr(e), peer) from None
    finally:
        if not sender.done():
            sender.cancel()
        elif not sender.cancelled():
            sender.exception()  # retrieved: a broken pipe after a refusal is expected
        writer.close()


async def serve(
    stream: tuple[StreamInfo, asyncio.StreamReader, asyncio.StreamWriter],
    handler: Callable[[str, bytes], Awaitable[bytes]],
    max_request_bytes: int,
    name: str,
    timeout: float,
) -> None:
    """Callee side: answer one request on ``stream``; never raises.

    The peer passed to ``handler`` is the stream's authenticated PeerID.
    """
    info, reader, writer = stream
    peer = info.peer_id.to_base58()
    REMOTE_ADDR.set(str(info.addr) if info.addr is not None else None)
    try:
        await asyncio.wait_for(
            _answer(reader, writer, handler, max_request_bytes, name, peer), timeout
        )
    except asyncio.TimeoutError:
        logger.warning("rpc %s from %s rejected: timeout after %.1fs", name, peer, timeout)
    except (asyncio.IncompleteReadError, ConnectionError) as e:
        logger.info("rpc %s from %s: connection lost: %r", name, peer, e)
    except Exception:  # a stream handler must never take the node down
        logger.exception("rpc %s from %s: failed", name, peer)
    except asyncio.CancelledError:
        # only the transport's shutdown cancels this outermost coroutine of the stream task;
        # letting it propagate makes asyncio's stream callback log a spurious traceback
        logger.debug("rpc %s from %s: cancelled by shutdown", name, peer)
    finally:
        writer.close()


async def _linger(reader: asyncio.StreamReader) -> None:
    """Drop incoming bytes until the caller hangs up, for at most ``_LINGER_SECONDS``.

    Closing a stream while the caller's request is still arriving resets it, and the
    reset can overtake the refusal just written; the caller closes as soon as it has
    read the refusal, so this rarely reads more than what is already in flight.
    """
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(_drain_input(reader), _LINGER_SECONDS)


async def _drain_input(reader: asyncio.StreamReader) -> None:
    while await reader.read(CHUNK_BYTES):
        pass


async def _answer(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    handler: Callable[[str, bytes], Awaitable[bytes]],
    max_request_bytes: int,
    name: str,
    peer: str,
) -> None:
    # an oversized request is refused from its header, before its body is read
    length = await read_request_header(reader)
    if length > max_request_bytes:
        detail = f"request of {length} bytes exceeds the {max_request_bytes}-byte limit of {name}"
        logger.warning("rpc %s from %s rejected: oversized: %s", name, peer, detail)
        await write_response(writer, STATUS_ERROR, encode_error("oversized", detail))
        await _linger(reader)
        return
    request = await read_body(reader, length)
    try:
        response = await handler(peer, request)
        if not isinstance(response, (bytes, bytearray, memoryview)):
            raise TypeError(f"handler returned {type(response).__name__}, not bytes")
    except Exception as e:
        known = isinstance(e, ProtocolError)
        reason = e.reason if known else type(e).__name__
        logger.warning("rpc %s from %s rejected: %s: %s", name, peer, reason, e, exc_info=not known)
        await write_response(writer, STATUS_ERROR, encode_error(reason, str(e)))
        return
    await write_response(writer, STATUS_OK, bytes(response))
