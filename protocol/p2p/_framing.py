"""One RPC exchange over its own byte stream, in length-prefixed frames.

The caller side (:func:`exchange`, :func:`exchange_on`) writes a request and reads its
response; the callee side (:func:`serve`, :func:`answer`) reads a request and answers
it. The callee bounds what a stream may cost it: a :class:`StreamGate` caps the
streams served at once, in total and per peer (one over the cap is answered ``busy``
unread), and a :class:`~protocol.p2p._reading.Pace` drops a stream whose header or
body arrives too slowly (``too_slow``), so silent streams cannot hold the slots.

The frames (:mod:`protocol.p2p._frames`), the body readers
(:mod:`protocol.p2p._reading`) and the receive buffers (:mod:`protocol.p2p._buffers`)
live in modules of their own; their names are re-exported here, the one place the
transport and the direct plane import the framing from.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from hivemind.p2p import P2P, P2PDaemonError, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from protocol.errors import ProtocolError
from protocol.p2p._buffers import BufferPool, Lease
from protocol.p2p._frames import (
    CHUNK_BYTES,
    MAX_ERROR_BYTES,
    STATUS_ERROR,
    STATUS_OK,
    Payload,
    StreamedResponse,
    decode_error,
    encode_error,
    is_payload,
    payload_size,
    read_request_header,
    read_response_header,
    write_request,
    write_response,
    write_streamed,
)
from protocol.p2p._reading import Pace, Read, StreamRead, read_body, read_into, read_paced

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
    "write_streamed",
]

logger = logging.getLogger(__name__)

_LINGER_SECONDS = 5.0

REMOTE_ADDR: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "atoll_remote_addr", default=None
)
"""Inside a handler: the multiaddr the current request's connection comes from."""


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
        if status == STATUS_ERROR and length <= MAX_ERROR_BYTES:
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
            if not (is_payload(response) or isinstance(response, StreamedResponse)):
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
