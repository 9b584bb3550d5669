"""One RPC exchange over its own p2pd byte stream, in length-prefixed frames.

Every call opens its own p2pd stream, so a frame only has to say how long it is.
A request is ``u64 length | body``; a response is ``u8 status | u64 length | body``,
where an error body is a msgpack map ``{"reason": str, "detail": str}``. Bodies
are written in chunks with a drain after each one, so a 256 MiB payload never
sits in the socket buffer twice. A body is read as its bytes arrive, never into a
buffer sized by the length a peer announced: a stream that announces 256 MiB and sends
nothing costs nothing.

The callee side bounds what a stream may cost it: a :class:`StreamGate` caps the
streams served at once, in total and per peer (one over the cap is answered ``busy``
unread), and a :class:`Pace` drops a stream whose header or body arrives too slowly
(``too_slow``), so silent streams cannot hold the slots.

Tests and benchmarks can emulate a long link on loopback by setting
``ATOLL_LINK_SHAPE`` (see :mod:`protocol.p2p.shaper`): each message then waits the one-way
delay before its header and its bytes are paced at the line rate. The wire format is
the same; unset, writes take exactly the unshaped path.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import struct
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import msgpack
from hivemind.p2p import P2P, P2PDaemonError, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from protocol.errors import ProtocolError
from protocol.p2p.shaper import Shaper

__all__ = [
    "CHUNK_BYTES",
    "Payload",
    "REMOTE_ADDR",
    "STATUS_ERROR",
    "STATUS_OK",
    "Pace",
    "StreamGate",
    "decode_error",
    "encode_error",
    "exchange",
    "payload_size",
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
_MERGE_FRACTION = 16  # rate samples closer than window/16 are merged: at most ~2*16 per window

REMOTE_ADDR: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "atoll_remote_addr", default=None
)
"""Inside a handler: the multiaddr the current request's connection comes from."""

_REQUEST_HEADER = struct.Struct(">Q")
_RESPONSE_HEADER = struct.Struct(">BQ")

# Read once at import: the emulated link of this process, or None (the normal case).
_SHAPER: Shaper | None = Shaper.from_env()


Payload = bytes | Sequence[bytes | memoryview]
"""A message to write: one buffer, or several written one after the other (a part's head
and a view of its tensor body, say), so a sender never joins them into one copy."""


def _views(data: Payload) -> list[memoryview]:
    buffers = [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
    views = [memoryview(b) for b in buffers]
    return [v if v.format == "B" and v.ndim == 1 else v.cast("B") for v in views]


def _is_payload(data: object) -> bool:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return True
    return isinstance(data, (list, tuple)) and all(
        isinstance(b, (bytes, bytearray, memoryview)) for b in data
    )


def payload_size(data: Payload) -> int:
    """Bytes in ``data``."""
    return sum(v.nbytes for v in _views(data))


async def _write_body(writer: asyncio.StreamWriter, header: bytes, data: Payload) -> None:
    if _SHAPER is not None:
        await _write_shaped(writer, header, data, _SHAPER)
        return
    writer.write(header)
    for view in _views(data):
        for offset in range(0, view.nbytes, CHUNK_BYTES):
            writer.write(view[offset : offset + CHUNK_BYTES])
            await writer.drain()  # backpressure: never more than one chunk ahead of the socket
    await writer.drain()


async def _write_shaped(
    writer: asyncio.StreamWriter, header: bytes, data: Payload, shaper: Shaper
) -> None:
    """Like :func:`_write_body` on an emulated link: delay once, then pace each slice."""
    await shaper.delay()
    await shaper.send(len(header))
    writer.write(header)
    step = min(CHUNK_BYTES, shaper.slice_bytes)
    for view in _views(data):
        for offset in range(0, view.nbytes, step):
            piece = view[offset : offset + step]
            await shaper.send(len(piece))
            writer.write(piece)
            await writer.drain()
    await writer.drain()


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


@dataclass(frozen=True)
class Pace:
    """How slowly a caller may send its request before the stream is dropped as ``too_slow``.

    Attributes:
        header_timeout: seconds from the stream's opening to its 8-byte request header.
        min_bytes_per_second: least rate of the request body, averaged over every sliding
            ``window`` seconds from the body's start; 0 turns the check off.
        window: seconds the rate is averaged over.
    """

    header_timeout: float
    min_bytes_per_second: float
    window: float


class StreamGate:
    """Counts the streams being served, in total and per peer, against two caps.

    One per serving transport, shared by all its handlers and used on its loop only
    (no lock needed: every call runs between two awaits).
    """

    def __init__(self, max_streams: int, max_per_peer: int) -> None:
        self.max_streams = max_streams
        self.max_per_peer = max_per_peer
        self.open = 0
        self._by_peer: dict[str, int] = {}

    def open_from(self, peer: str) -> int:
        """Streams from ``peer`` being served now."""
        return self._by_peer.get(peer, 0)

    def try_enter(self, peer: str) -> bool:
        """Count one more stream from ``peer``, unless either cap is reached."""
        held = self._by_peer.get(peer, 0)
        if self.open >= self.max_streams or held >= self.max_per_peer:
            return False
        self.open += 1
        self._by_peer[peer] = held + 1
        return True

    def leave(self, peer: str) -> None:
        """Uncount a stream admitted by :meth:`try_enter`."""
        self.open -= 1
        held = self._by_peer.pop(peer) - 1
        if held:
            self._by_peer[peer] = held


class _Pacer:
    """Watches one body read against a :class:`Pace`: cancels the reading task once fewer
    than ``min_bytes_per_second * window`` bytes arrived over the last ``window`` seconds.

    ``samples`` holds ``(time, bytes so far)``; the oldest kept is the first whose count
    is still within the last window's quota, so the stream is too slow from that
    sample's time plus the window on, unless more bytes come. One timer, re-armed only
    when it fires early, keeps the per-chunk cost to a few list operations.
    """

    def __init__(self, pace: Pace) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._window = pace.window
        self._need = pace.min_bytes_per_second * pace.window
        now = self._loop.time()
        self._samples: deque[tuple[float, int]] = deque([(now, 0)])
        self._received = 0
        self.deadline = now + pace.window
        self.expired = False
        self._timer = self._loop.call_at(self.deadline, self._check)

    def add(self, nbytes: int) -> None:
        now = self._loop.time()
        self._received += nbytes
        samples = self._samples
        # merging drops an intermediate sample, which only makes the stream look faster
        if len(samples) > 1 and now - samples[-2][0] < self._window / _MERGE_FRACTION:
            samples.pop()
        samples.append((now, self._received))
        floor = self._received - self._need
        while samples[0][1] <= floor:  # the newest sample is above it: never empties
            samples.popleft()
        self.deadline = samples[0][0] + self._window

    def _check(self) -> None:
        if self._loop.time() < self.deadline:
            self._timer = self._loop.call_at(self.deadline, self._check)
            return
        self.expired = True
        self._task.cancel()

    def owns_cancel(self) -> bool:
        """After a CancelledError: whether it came from this pacer alone (not a shutdown)."""
        if not self.expired:
            return False
        uncancel = getattr(self._task, "uncancel", None)  # Python 3.11+ counts cancel requests
        return uncancel is None or uncancel() == 0

    def close(self) -> None:
        self._timer.cancel()


async def read_body(reader: asyncio.StreamReader, length: int, pace: Pace | None = None) -> bytes:
    """Read exactly ``length`` bytes; the caller has already checked ``length`` against its limit.

    Memory grows with the bytes that arrived, never with the announced ``length``, and
    never past it: each read asks for at most what is still missing.

    Raises:
        asyncio.IncompleteReadError: the stream ended early.
        ProtocolError: ``too_slow``, when ``pace`` is given and the body falls below it.
    """
    pacer = _Pacer(pace) if pace is not None and pace.min_bytes_per_second > 0 else None
    chunks: list[bytes] = []
    received = 0
    try:
        while received < length:
            chunk = await reader.read(min(CHUNK_BYTES, length - received))
            if not chunk:
                raise asyncio.IncompleteReadError(b"".join(chunks), length)
            chunks.append(chunk)
            received += len(chunk)
            if pacer is not None:
                pacer.add(len(chunk))
    except asyncio.CancelledError:
        if pacer is None or not pacer.owns_cancel():
            raise
        assert pace is not None
        detail = (
            f"{received} of {length} bytes; under {pace.min_bytes_per_second:.0f} B/s "
            f"over {pace.window:.1f}s"
        )
        raise ProtocolError("too_slow", detail) from None
    finally:
        if pacer is not None:
            pacer.close()
    # one copy, as the preallocated buffer had; a single chunk needs none
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)  # b"" for an empty body


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


async def exchange(p2p: P2P, peer: str, protocol: str, data: Payload, limit: int) -> bytes:
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
    handler: Callable[[str, bytes], Awaitable[Payload]],
    max_request_bytes: int,
    name: str,
    timeout: float,
    *,
    gate: StreamGate | None = None,
    pace: Pace | None = None,
) -> None:
    """Callee side: answer one request on ``stream``; never raises.

    The peer passed to ``handler`` is the stream's authenticated PeerID. A stream the
    ``gate`` does not admit is answered ``busy`` at once, unread; one whose request is
    slower than ``pace`` is answered ``too_slow`` and closed.
    """
    info, reader, writer = stream
    peer = info.peer_id.to_base58()
    REMOTE_ADDR.set(str(info.addr) if info.addr is not None else None)
    admitted = gate is None or gate.try_enter(peer)
    try:
        if admitted:
            answer = _answer(reader, writer, handler, max_request_bytes, name, peer, pace)
            await asyncio.wait_for(answer, timeout)
        else:
            assert gate is not None
            await asyncio.wait_for(_refuse_busy(writer, gate, name, peer), _LINGER_SECONDS)
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
        if admitted and gate is not None:
            gate.leave(peer)
        writer.close()


async def _refuse_busy(
    writer: asyncio.StreamWriter, gate: StreamGate, name: str, peer: str
) -> None:
    detail = (
        f"{gate.open} streams open ({gate.open_from(peer)} from this peer); "
        f"limits {gate.max_streams} in total, {gate.max_per_peer} per peer"
    )
    logger.info("rpc %s from %s refused: busy: %s", name, peer, detail)
    await write_response(writer, STATUS_ERROR, encode_error("busy", detail))


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
    handler: Callable[[str, bytes], Awaitable[Payload]],
    max_request_bytes: int,
    name: str,
    peer: str,
    pace: Pace | None,
) -> None:
    try:
        request = await _read_request(reader, writer, max_request_bytes, name, peer, pace)
    except ProtocolError as e:  # too slow: the stream's slot goes to someone else
        logger.warning("rpc %s from %s dropped: %s: %s", name, peer, e.reason, e.detail)
        await write_response(writer, STATUS_ERROR, encode_error(e.reason, e.detail))
        return
    if request is None:
        return
    try:
        response = await handler(peer, request)
        if not _is_payload(response):
            raise TypeError(f"handler returned {type(response).__name__}, not bytes")
    except Exception as e:
        known = isinstance(e, ProtocolError)
        reason = e.reason if known else type(e).__name__
        logger.warning("rpc %s from %s rejected: %s: %s", name, peer, reason, e, exc_info=not known)
        await write_response(writer, STATUS_ERROR, encode_error(reason, str(e)))
        return
    await write_response(writer, STATUS_OK, response)


async def _read_request(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    max_request_bytes: int,
    name: str,
    peer: str,
    pace: Pace | None,
) -> bytes | None:
    """The request body, or None when it was refused as oversized (and answered so).

    Raises:
        ProtocolError: ``too_slow``.
    """
    if pace is None:
        length = await read_request_header(reader)
    else:
        try:
            length = await asyncio.wait_for(read_request_header(reader), pace.header_timeout)
        except asyncio.TimeoutError:
            detail = f"no request header within {pace.header_timeout:.1f}s"
            raise ProtocolError("too_slow", detail) from None
    # an oversized request is refused from its header, before its body is read
    if length > max_request_bytes:
        detail = f"request of {length} bytes exceeds the {max_request_bytes}-byte limit of {name}"
        logger.warning("rpc %s from %s rejected: oversized: %s", name, peer, detail)
        await write_response(writer, STATUS_ERROR, encode_error("oversized", detail))
        await _linger(reader)
        return None
    return await read_body(reader, length, pace)
