"""The frames of an RPC stream, and how they are written.

Every call opens its own stream, so a frame only has to say how long it is. A request
is ``u64 length | body``; a response is ``u8 status | u64 length | body``, where an
error body is a msgpack map ``{"reason": str, "detail": str}``. A
:class:`StreamedResponse` is written while it is produced: its first frame's length is
known at the start, its bytes come as they are ready, and one more OK frame (its
trailer, whose length is not known at the start) follows on the same stream. Bodies
are written in chunks with a drain after each one, so a 256 MiB payload never sits in
the socket buffer twice.

Tests and benchmarks can emulate a long link on loopback by setting
``ATOLL_LINK_SHAPE`` (see :mod:`protocol.p2p.shaper`): each message then waits the one-way
delay before its header and its bytes are paced at the line rate. The wire format is
the same; unset, writes take exactly the unshaped path.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

import msgpack

from protocol.p2p.shaper import Shaper

__all__ = [
    "CHUNK_BYTES",
    "MAX_ERROR_BYTES",
    "STATUS_ERROR",
    "STATUS_OK",
    "Payload",
    "StreamedResponse",
    "decode_error",
    "encode_error",
    "is_payload",
    "payload_size",
    "read_request_header",
    "read_response_header",
    "write_request",
    "write_response",
    "write_streamed",
]

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
_ONE_WRITE_BYTES = 1 << 16  # a frame this small is copied into one write
STATUS_OK = 0
STATUS_ERROR = 1
MAX_ERROR_BYTES = 64 * 1024
"""An error report is a short text; a longer one is malformed."""

_REQUEST_HEADER = struct.Struct(">Q")
_RESPONSE_HEADER = struct.Struct(">BQ")

# Read once at import: the emulated link of this process, or None (the normal case).
_SHAPER: Shaper | None = Shaper.from_env()


Payload = bytes | Sequence[bytes | memoryview]
"""A message to write: one buffer, or several written one after the other (a part's head
and a view of its tensor body, say), so a sender never joins them into one copy."""


@dataclass(frozen=True)
class StreamedResponse:
    """A response written while it is produced (an owner's result reduced block by block).

    Attributes:
        size: bytes of its first frame, all of which ``body`` yields.
        body: yields the first frame's bytes as they become ready.
        trailer: returns the second frame's bytes once the first is written.
    """

    size: int
    body: Callable[[], AsyncIterator[bytes | memoryview]]
    trailer: Callable[[], Awaitable[bytes]]


def _views(data: Payload) -> list[memoryview]:
    buffers = [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
    views = [memoryview(b) for b in buffers]
    return [v if v.format == "B" and v.ndim == 1 else v.cast("B") for v in views]


def is_payload(data: object) -> bool:
    """Whether ``data`` is a :data:`Payload` (what a handler may answer besides a
    :class:`StreamedResponse`)."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return True
    return isinstance(data, (list, tuple)) and all(
        isinstance(b, (bytes, bytearray, memoryview)) for b in data
    )


def payload_size(data: Payload) -> int:
    """Bytes in ``data``."""
    return sum(v.nbytes for v in _views(data))


async def _write_slices(writer: asyncio.StreamWriter, view: memoryview) -> None:
    """Write ``view`` a slice at a time, draining after each (never more than one chunk
    ahead of the socket); on an emulated link each slice is paced at its line rate."""
    step = CHUNK_BYTES if _SHAPER is None else min(CHUNK_BYTES, _SHAPER.slice_bytes)
    for offset in range(0, view.nbytes, step):
        piece = view[offset : offset + step]
        if _SHAPER is not None:
            await _SHAPER.send(piece.nbytes)
        writer.write(piece)
        await writer.drain()


async def _write_body(writer: asyncio.StreamWriter, header: bytes, data: Payload) -> None:
    """Write ``header`` then ``data`` (after the link's one-way delay, when emulated)."""
    if _SHAPER is not None:
        await _SHAPER.delay()
    views = _views(data)
    if len(header) + sum(v.nbytes for v in views) <= _ONE_WRITE_BYTES:
        # a small frame goes out in one write, so a stream closed right after it (a
        # refusal) cannot carry its header without its body
        await _write_slices(writer, memoryview(b"".join([header, *views])))
        return
    await _write_slices(writer, memoryview(header))
    for view in views:
        await _write_slices(writer, view)


async def write_streamed(
    writer: asyncio.StreamWriter, response: StreamedResponse, name: str, peer: str
) -> bool:
    """Write a :class:`StreamedResponse`: its first frame as ``body`` yields it, then its
    trailer frame. Whether the stream may carry another request: not when the body
    broke off or came out another length than announced (the stream is then cut short,
    and the caller sees it end early)."""
    if _SHAPER is not None:
        await _SHAPER.delay()
    await _write_slices(writer, memoryview(_RESPONSE_HEADER.pack(STATUS_OK, response.size)))
    written = 0
    try:
        async for piece in response.body():
            view = _views(piece)[0]
            written += view.nbytes
            if written > response.size:
                raise RuntimeError(f"body longer than the {response.size} bytes announced")
            await _write_slices(writer, view)
        if written != response.size:
            raise RuntimeError(f"body of {written} bytes, {response.size} announced")
        trailer = await response.trailer()
    except Exception as e:
        logger.warning("rpc %s to %s: streamed answer broke off: %r", name, peer, e)
        return False
    frame = _RESPONSE_HEADER.pack(STATUS_OK, len(trailer)) + trailer
    await _write_slices(writer, memoryview(frame))
    return True


async def write_request(writer: asyncio.StreamWriter, data: Payload) -> None:
    """Write one request frame."""
    await _write_body(writer, _REQUEST_HEADER.pack(payload_size(data)), data)


async def write_response(writer: asyncio.StreamWriter, status: int, data: Payload) -> None:
    """Write one response frame with the given status byte."""
    await _write_body(writer, _RESPONSE_HEADER.pack(status, payload_size(data)), data)


async def read_request_header(reader: asyncio.StreamReader) -> int:
    """Read a request header and return the announced body length."""
    (length,) = _REQUEST_HEADER.unpack(await reader.readexactly(_REQUEST_HEADER.size))
    return length


async def read_response_header(reader: asyncio.StreamReader) -> tuple[int, int]:
    """Read a response header and return ``(status, body_length)``."""
    status, length = _RESPONSE_HEADER.unpack(await reader.readexactly(_RESPONSE_HEADER.size))
    return status, length


def encode_error(reason: str, detail: str) -> bytes:
    """Pack an error report for the caller."""
    return msgpack.packb({"reason": reason, "detail": detail[:4000]})


def decode_error(data: bytes) -> tuple[str, str]:
    """Unpack an error report sent by a peer; anything unexpected becomes ``("malformed", ...)``."""
    try:
        report = msgpack.unpackb(data, raw=False, max_str_len=MAX_ERROR_BYTES)
        reason, detail = report["reason"], report["detail"]
        if isinstance(reason, str) and isinstance(detail, str):
            return reason, detail
    except Exception:  # bytes from a peer: any decoding failure is just a malformed report
        pass
    return "malformed", "unreadable error report"
