"""One RPC exchange over its own p2pd byte stream, in length-prefixed frames.

Every call opens its own p2pd stream, so a frame only has to say how long it is.
A request is ``u64 length | body``; a response is ``u8 status | u64 length | body``,
where an error body is a msgpack map ``{"reason": str, "detail": str}``. A
:class:`StreamedResponse` is written while it is produced: its first frame's length is
known at the start, its bytes come as they are ready, and one more OK frame (its
trailer, whose length is not known at the start) follows on the same stream; the
caller's reader reads that frame itself (:func:`read_frame`). Bodies
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
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack
from hivemind.p2p import P2P, P2PDaemonError, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from protocol.errors import ProtocolError
from protocol.p2p.shaper import Shaper

__all__ = [
    "CHUNK_BYTES",
    "BufferPool",
    "Lease",
    "Read",
    "Receiver",
    "RequestReader",
    "StreamRead",
    "Payload",
    "REMOTE_ADDR",
    "STATUS_ERROR",
    "STATUS_OK",
    "Pace",
    "StreamGate",
    "StreamedResponse",
    "decode_error",
    "encode_error",
    "answer",
    "exchange",
    "exchange_on",
    "payload_size",
    "read_lease",
    "read_paced",
    "read_body",
    "read_frame",
    "read_into",
    "read_request_header",
    "read_response_header",
    "serve",
    "write_request",
    "write_response",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

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


def _is_payload(data: object) -> bool:
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
    await _write_slices(writer, memoryview(header))
    for view in _views(data):
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


async def read_frame(reader: asyncio.StreamReader, limit: int, peer: str | None = None) -> bytes:
    """The next response frame on a stream, which must be OK and at most ``limit``
    bytes: a :class:`StreamedResponse`'s trailer, read by the caller's receiver.

    Raises:
        ProtocolError: ``bad_trailer`` (another status, or too long).
        asyncio.IncompleteReadError: the stream ended early.
    """
    status, length = await read_response_header(reader)
    if status != STATUS_OK or length > limit:
        raise ProtocolError("bad_trailer", f"frame ({status}, {length} bytes)", peer)
    return await read_body(reader, length)


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


def _unexported(buffer: bytearray) -> bool:
    """Whether no view or tensor of ``buffer`` is alive (a bytearray with exports cannot
    be resized, so a resize that succeeds proves there are none)."""
    try:
        buffer.append(0)
    except BufferError:
        return False
    del buffer[-1]
    return True


class Lease:
    """One received body: ``data`` is a view of a pooled buffer, plain bytes, or what a
    request reader made of them (a parsed message whose body is a view of the buffer).

    :meth:`release` gives the buffer back; the pool reuses it only once nothing made
    from ``data`` (a slice, a ``torch.frombuffer`` tensor) is alive any more, so a
    consumer that keeps a view past the release keeps its bytes intact.
    """

    def __init__(
        self,
        data: bytes | memoryview,
        pool: BufferPool | None = None,
        buffer: bytearray | None = None,
    ) -> None:
        self.data = data
        self._pool = pool
        self._buffer = buffer

    def release(self) -> None:
        """Hand the buffer back (idempotent)."""
        pool, buffer = self._pool, self._buffer
        self._pool = self._buffer = None
        if isinstance(self.data, memoryview):
            self.data.release()
        self.data = b""
        if pool is not None and buffer is not None:
            pool._give_back(buffer)

    def handed_to(self, data: Any) -> Lease:
        """The same buffer, leased as ``data`` (made from this lease's view: a parsed
        message whose body is that view); this lease no longer holds it."""
        lease = Lease(data, self._pool, self._buffer)
        self._pool = self._buffer = None
        self.data = b""
        return lease

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class BufferPool:
    """Receive buffers for large bodies, reused message after message.

    A body of ``min_bytes`` or more is read into a pooled ``bytearray`` instead of being
    joined into a fresh ``bytes``: above 32 MiB every fresh allocation is a new mapping
    whose pages fault in one by one, about five times the cost of writing into memory
    already mapped. A buffer is handed out again only when nothing holds a view of it
    (see :class:`Lease`); at most ``max_free_bytes`` of idle buffers are kept.

    Used on one event loop only (no lock).
    """

    def __init__(self, max_free_bytes: int = 512 * 2**20, min_bytes: int = CHUNK_BYTES) -> None:
        self.max_free_bytes = max_free_bytes
        self.min_bytes = min_bytes
        self._idle: list[bytearray] = []
        self.allocated = 0
        """Buffers created so far (a pool that works creates few)."""

    def lease(self, nbytes: int) -> Lease:
        """A writable buffer of exactly ``nbytes`` (a reused one when an idle buffer of
        ``nbytes`` to ``2 * nbytes`` is free; a fresh, unpooled one below ``min_bytes``)."""
        if nbytes < self.min_bytes:
            return Lease(memoryview(bytearray(nbytes)))
        best = None
        for buffer in self._idle:
            size = len(buffer)
            fits = nbytes <= size <= 2 * nbytes and (best is None or size < len(best))
            if fits and _unexported(buffer):
                best = buffer
        if best is None:
            best = bytearray(nbytes)
            self.allocated += 1
        else:
            self._idle.remove(best)
        return Lease(memoryview(best)[:nbytes], self, best)

    async def read_request(self, read: Read, length: int, peer: str) -> Lease:
        """A :data:`RequestReader` that reads a large request into one of this pool's buffers."""
        lease = self.lease(length)
        try:
            await _read_all(read, length, lease.data)
        except BaseException:
            lease.release()
            raise
        return lease

    def _give_back(self, buffer: bytearray) -> None:
        self._idle.append(buffer)
        # keep the largest buffers within the budget; a buffer still viewed counts too
        # (it is reused once its views are gone)
        self._idle.sort(key=len, reverse=True)
        total = 0
        for i, kept in enumerate(self._idle):
            total += len(kept)
            if total > self.max_free_bytes:
                del self._idle[i:]
                break

    @property
    def idle_bytes(self) -> int:
        """Bytes held by idle buffers."""
        return sum(len(b) for b in self._idle)


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


Read = Callable[[int], Awaitable[bytes]]
"""Reads up to ``n`` bytes of a stream (``b""`` at its end). A :class:`StreamRead` can
also read into a caller's buffer (see :func:`read_into`)."""


class StreamRead:
    """A :data:`Read` over a stream reader that can also fill a caller's buffer:
    straight from the socket when the reader is an :class:`~protocol.p2p._into.IntoReader`
    (the direct plane's), through ``read`` and one copy otherwise (a p2pd stream).

    Args:
        reader: the stream.
        counted: told how many bytes each read took.
    """

    def __init__(
        self, reader: asyncio.StreamReader, counted: Callable[[int], None] | None = None
    ) -> None:
        self.reader = reader
        self._counted = counted
        self._readinto = getattr(reader, "readinto", None)

    async def __call__(self, n: int) -> bytes:
        chunk = await self.reader.read(n)
        if self._counted is not None:
            self._counted(len(chunk))
        return chunk

    async def into(self, view: memoryview) -> int:
        """Read up to ``view.nbytes`` bytes into ``view``; how many (0 at the stream's end)."""
        if self._readinto is not None:
            n = await self._readinto(view)
        else:
            chunk = await self.reader.read(view.nbytes)
            n = len(chunk)
            view[:n] = chunk
        if self._counted is not None:
            self._counted(n)
        return n


async def read_into(read: Read, view: memoryview) -> int:
    """Read up to ``view.nbytes`` bytes through ``read`` into ``view``; how many (0 at
    the stream's end): without a copy when ``read`` is a :class:`StreamRead` over a
    reader that can, through one copy otherwise."""
    into = getattr(read, "into", None)
    if into is not None:
        return await into(view)  # type: ignore[no-any-return]
    chunk = await read(view.nbytes)
    view[: len(chunk)] = chunk
    return len(chunk)


async def read_paced(
    reader: asyncio.StreamReader,
    length: int,
    pace: Pace | None,
    consume: Callable[[Read], Awaitable[T]],
) -> T:
    """Run ``consume(read)`` over a body of ``length`` bytes, ``read`` held to ``pace``.

    Raises:
        ProtocolError: ``too_slow``, when the body falls below ``pace``; else what
            ``consume`` raises.
    """
    pacer = _Pacer(pace) if pace is not None and pace.min_bytes_per_second > 0 else None
    received = 0

    def counted(n: int) -> None:
        nonlocal received
        received += n
        if pacer is not None:
            pacer.add(n)

    try:
        return await consume(StreamRead(reader, counted))
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


async def read_body(reader: asyncio.StreamReader, length: int, pace: Pace | None = None) -> bytes:
    """Read exactly ``length`` bytes; the caller has already checked ``length`` against its limit.

    Memory grows with the bytes that arrived, never with the announced ``length``, and
    never past it: each read asks for at most what is still missing.

    Raises:
        asyncio.IncompleteReadError: the stream ended early.
        ProtocolError: ``too_slow``, when ``pace`` is given and the body falls below it.
    """
    body = await read_paced(reader, length, pace, lambda read: _read_all(read, length, None))
    return body  # type: ignore[return-value]  # joined bytes without ``into``


async def _read_all(read: Read, length: int, into: memoryview | None) -> bytes | memoryview:
    """Exactly ``length`` bytes through ``read``: written into ``into``, or joined."""
    received = 0
    if into is not None:
        while received < length:
            n = await read_into(read, into[received : received + CHUNK_BYTES])
            if not n:
                raise asyncio.IncompleteReadError(b"", length)
            received += n
        return into
    chunks: list[bytes] = []
    while received < length:
        chunk = await read(min(CHUNK_BYTES, length - received))
        if not chunk:
            raise asyncio.IncompleteReadError(b"".join(chunks), length)
        chunks.append(chunk)
        received += len(chunk)
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


RequestReader = Callable[[Read, int, str], Awaitable[Lease]]
"""Callee side: reads a request body of the given length with ``read`` (held to the
stream's pace) for the given caller, checking what it can as the bytes come, and
returns a :class:`Lease` whose ``data`` the handler gets; it raises
:class:`ProtocolError` to refuse the request (answered with the reason; the stream is
then closed). Released once the handler has answered."""

Receiver = Callable[[asyncio.StreamReader, int], Awaitable[Any]]
"""Reads an OK response body of the given length from the stream and returns what the
caller wants of it (by default a :class:`Lease` of the bytes); it must read exactly that
many bytes or raise (the stream is then closed)."""


async def read_lease(reader: asyncio.StreamReader, length: int) -> Lease:
    """The default :data:`Receiver`: the body as bytes."""
    return Lease(await read_body(reader, length))


async def exchange(
    p2p: P2P,
    peer: str,
    protocol: str,
    data: Payload,
    limit: int,
    receive: Receiver | None = None,
) -> Any:
    """Caller side: open a stream to ``peer``, send ``data`` and return the response body
    as ``receive`` reads it (a :class:`Lease` of bytes by default).

    Raises:
        ProtocolError: ``unreachable``, ``no_handler``, ``oversized``, ``remote_error``,
            ``connection_lost`` or ``malformed``; or what ``receive`` raises.
    """
    try:
        _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer), protocol)
    except P2PDaemonError as e:
        # p2pd reports a missing handler only through multistream's error text
        reason = "no_handler" if "protocols not supported" in str(e) else "unreachable"
        raise ProtocolError(reason, str(e), peer) from None
    except OSError as e:
        raise ProtocolError("unreachable", f"local p2pd: {e!r}", peer) from None
    try:
        return await exchange_on(reader, writer, peer, data, limit, receive)
    finally:
        writer.close()


async def exchange_on(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    peer: str,
    data: Payload,
    limit: int,
    receive: Receiver | None = None,
    prefix: bytes = b"",
    reuse: bool = False,
) -> Any:
    """One request and its response on an open stream (``prefix`` is written first).

    With ``reuse``, returns only after the whole request was written as well, so the
    stream is ready for another exchange.

    Raises:
        ProtocolError: as :func:`exchange`, less ``unreachable`` and ``no_handler``.
    """
    if prefix:
        writer.write(prefix)
    # The request is written while the response is awaited: a callee that refuses an
    # oversized request answers before the body is through, and the caller sees why.
    sender = asyncio.ensure_future(write_request(writer, data))
    try:
        status, length = await read_response_header(reader)
        if status == STATUS_OK:
            if length > limit:
                raise ProtocolError("oversized", f"response of {length} bytes", peer)
            body = await (receive or read_lease)(reader, length)
            if reuse:
                try:
                    await sender  # an OK answer means the request was read in full
                except BaseException:
                    if isinstance(body, Lease):
                        body.release()
                    raise
            return body
        if status == STATUS_ERROR and length <= _MAX_ERROR_BYTES:
            reason, detail = decode_error(await read_body(reader, length))
            if reason == "oversized":
                raise ProtocolError("oversized", detail, peer)
            if reason == "no_handler":
                raise ProtocolError("no_handler", detail, peer)
            raise ProtocolError("remote_error", f"{reason}: {detail}", peer)
        raise ProtocolError("malformed", f"response header ({status}, {length})", peer)
    except (asyncio.IncompleteReadError, ConnectionError) as e:
        raise ProtocolError("connection_lost", repr(e), peer) from None
    finally:
        if not sender.done():
            sender.cancel()
        elif not sender.cancelled():
            sender.exception()  # retrieved: a broken pipe after a refusal is expected


async def serve(
    stream: tuple[StreamInfo, asyncio.StreamReader, asyncio.StreamWriter],
    handler: Callable[[str, bytes], Awaitable[Payload]],
    max_request_bytes: int,
    name: str,
    timeout: float,
    *,
    gate: StreamGate | None = None,
    pace: Pace | None = None,
    receive: RequestReader | None = None,
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
            served = answer(reader, writer, handler, max_request_bytes, name, peer, pace, receive)
            await asyncio.wait_for(served, timeout)
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


async def answer(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    handler: Callable[[str, bytes], Awaitable[Payload]],
    max_request_bytes: int,
    name: str,
    peer: str,
    pace: Pace | None,
    receive: RequestReader | None = None,
) -> bool:
    """Read one request, answer it; whether the stream may carry another request (the
    request was read in full and answered, OK or with the handler's error)."""
    try:
        request = await _read_request(reader, writer, max_request_bytes, name, peer, pace, receive)
    except ProtocolError as e:  # too slow, or refused by its reader: the stream is done
        logger.warning("rpc %s from %s dropped: %s: %s", name, peer, e.reason, e.detail)
        await write_response(writer, STATUS_ERROR, encode_error(e.reason, e.detail))
        if e.reason != "too_slow":  # a slow caller is not waited for any longer
            await _linger(reader)
        return False
    if request is None:
        return False
    try:
        try:
            response = await handler(peer, request.data)  # type: ignore[arg-type]
            if not (_is_payload(response) or isinstance(response, StreamedResponse)):
                raise TypeError(f"handler returned {type(response).__name__}, not bytes")
        except Exception as e:
            known = isinstance(e, ProtocolError)
            reason = e.reason if known else type(e).__name__
            logger.warning(
                "rpc %s from %s rejected: %s: %s", name, peer, reason, e, exc_info=not known
            )
            await write_response(writer, STATUS_ERROR, encode_error(reason, str(e)))
            return True
        if isinstance(response, StreamedResponse):
            return await write_streamed(writer, response, name, peer)
        await write_response(writer, STATUS_OK, response)
        return True
    finally:
        request.release()


async def _read_request(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    max_request_bytes: int,
    name: str,
    peer: str,
    pace: Pace | None,
    receive: RequestReader | None = None,
) -> Lease | None:
    """The request body, or None when it was refused as oversized (and answered so).

    Raises:
        ProtocolError: ``too_slow``, or a refusal by ``receive``.
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
    if receive is None:
        return Lease(await read_body(reader, length, pace))
    return await read_paced(reader, length, pace, lambda read: receive(read, length, peer))
