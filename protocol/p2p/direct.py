"""The direct data plane: RPCs over plain TCP between peers that can dial each other.

Through p2pd every byte takes two extra hops (a unix socket to the local daemon on each
side) and is encrypted and decrypted once more; for parts of tens of megabytes that is
most of an all-reduce's cost on a busy host. With ``network.data_plane = "tcp"`` a node
also listens on a TCP port of its own, and a caller that can reach that port sends its
requests there, over connections it keeps open between calls. p2pd stays the default,
the discovery channel and the fallback: a peer whose port does not answer, or answers
with the wrong key, is called through p2pd as before.

Finding the port: the caller asks the peer once, over p2pd (RPC ``atoll.direct``), for
its data port, and dials it at the address of its p2pd connection to that peer, never
at an address the peer names, so a peer cannot point others' connections elsewhere.

Opening a connection, each side proves its node key in a signed handshake
(:mod:`protocol.p2p._handshake`): a callee that is not the peer the caller meant, or a
caller whose key does not match the PeerID it claims, is refused and the connection
closed. Encryption is optional (``data_plane = "tls"``): TLS 1.3 with a certificate
the callee makes for itself, bound to the signed handshake. A node that asks for TLS
calls a peer whose port speaks plain TCP through p2pd instead (p2pd encrypts), never
in the clear; a node on plain ``tcp`` calling a TLS port speaks TLS. On plain ``tcp``
nothing after the handshake is encrypted: parts and results are signed end to end,
not secret.

Then each request is ``u8 name length | name`` followed by a request frame, answered
by a response frame, exactly as on a p2pd stream (:mod:`protocol.p2p._framing`), with
the same per-peer stream caps, pace and size limits. A connection carries one request
at a time; a caller opens another for a concurrent call and keeps up to
``_IDLE_PER_PEER`` idle ones per peer.

Both ends read through :mod:`protocol.p2p._into`: a part's or result's body goes from
the socket (from TLS, decrypted) straight into the buffer it is checked and reduced
in, without the two copies of an ``asyncio.StreamReader``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack

from protocol.errors import ProtocolError
from protocol.p2p import _framing, _into
from protocol.p2p._handshake import (
    DOMAIN_CALLEE,
    DOMAIN_CALLER,
    VERSION,
    answer_hello,
    client_tls,
    open_hello,
    server_tls,
)
from verification.identity import Identity

if TYPE_CHECKING:
    from protocol.p2p.config import TransportConfig

__all__ = [
    "DOMAIN_CALLEE",
    "DOMAIN_CALLER",
    "RPC_NAME",
    "VERSION",
    "DirectClient",
    "DirectServer",
    "DirectUnavailable",
    "Route",
    "decode_port",
    "encode_port",
    "start",
]

logger = logging.getLogger(__name__)

RPC_NAME = "atoll.direct"
"""The p2pd RPC that tells a caller this node's data port."""
_NAME = struct.Struct(">B")
_IDLE_PER_PEER = 4
_CLIENT_IDLE_SECONDS = 30.0  # a caller reuses a connection idle for less than this...
_SERVER_IDLE_SECONDS = 90.0  # ...and a callee keeps one open this long without a request
_CONNECT_SECONDS = 3.0


class DirectUnavailable(Exception):
    """The direct connection could not be opened or authenticated; nothing was sent."""


@dataclass(frozen=True)
class Route:
    """Where a peer's data port is: ``host`` from the p2pd connection, ``port`` (and
    whether it speaks TLS) as the peer said."""

    host: str
    port: int
    tls: bool = False
    """Whether the port speaks TLS (as the peer said)."""


@dataclass(frozen=True)
class ServedRpc:
    """One RPC as the direct server runs it (the same settings as on p2pd)."""

    handler: Callable[[str, bytes], Awaitable[_framing.Payload]]
    max_request_bytes: int
    timeout: float
    receive: _framing.RequestReader | None


def encode_port(port: int, tls: bool = False) -> bytes:
    """The ``atoll.direct`` answer: this node's data port and whether it speaks TLS."""
    return msgpack.packb({"port": port, "tls": tls})


def decode_port(data: bytes) -> tuple[int, bool]:
    """A peer's ``atoll.direct`` answer: ``(port, tls)``.

    Raises:
        ProtocolError: ``malformed`` when it is not a map with a TCP port.
    """
    try:
        answer = msgpack.unpackb(data, raw=False, max_map_len=4, max_str_len=64)
        port, tls = answer["port"], answer.get("tls", False)
    except Exception:  # a peer's bytes: any decoding failure is just malformed
        raise ProtocolError("malformed", "unreadable data-port answer") from None
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port <= 65535:
        raise ProtocolError("malformed", f"data port {port!r}")
    if not isinstance(tls, bool):
        raise ProtocolError("malformed", f"tls flag {tls!r}")
    return port, tls


class DirectServer:
    """The callee side: accepts connections on the data port and serves RPCs on them.

    Args:
        identity: this node's key (answers the handshake).
        lookup: the RPC served under a name, or None.
        gate: the transport's stream caps (a request counts as one stream).
        pace: how slowly a caller may send.
        header_timeout: seconds a new connection has to finish its handshake.
        max_connections: connections open at once; one more is closed at once.
        tls: speak TLS 1.3 on the port (a certificate made at start-up).
    """

    def __init__(
        self,
        identity: Identity,
        lookup: Callable[[str], ServedRpc | None],
        gate: _framing.StreamGate,
        pace: _framing.Pace,
        header_timeout: float,
        max_connections: int,
        tls: bool = False,
    ) -> None:
        self.identity = identity
        self.tls = tls
        self._tls_context: ssl.SSLContext | None = None
        self._certificate_hash = b""
        self.lookup = lookup
        self.gate = gate
        self.pace = pace
        self.header_timeout = header_timeout
        self.max_connections = max_connections
        self.port = 0
        self.refused: dict[str, int] = {}
        """Connections refused at the handshake, by reason."""
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[asyncio.Task] = set()

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0 picks a free port); returns the port."""
        if self.tls:
            self._tls_context, self._certificate_hash = server_tls()
        tls: dict[str, Any] = {}
        if self._tls_context is not None:
            tls = {"ssl": self._tls_context, "ssl_handshake_timeout": self.header_timeout}
        self._server = await _into.start_server(self._accept, host, port, **tls)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    def port_handler(self) -> Callable[[str, bytes], Awaitable[bytes]]:
        """The ``atoll.direct`` handler (served through p2pd): tells a caller this
        server's port, once it listens."""
        answer = encode_port(self.port, tls=self.tls)

        async def tell_port(peer: str, request: bytes) -> bytes:
            return answer

        return tell_port

    async def close(self) -> None:
        """Stop listening and end every connection."""
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._connections) >= self.max_connections:
            self._count("busy")
            writer.close()
            return
        self._connections.add(task)
        remote = writer.get_extra_info("peername") or ("?", 0)
        try:
            handshake = answer_hello(self.identity, reader, writer, self._certificate_hash)
            peer = await asyncio.wait_for(handshake, self.header_timeout)
            _framing.REMOTE_ADDR.set(_maddr(remote[0], remote[1]))
            await self._serve(peer, reader, writer)
        except ProtocolError as e:
            self._count(e.reason)
            logger.info("direct connection from %s refused: %s: %s", remote[0], e.reason, e.detail)
        except asyncio.TimeoutError:
            self._count("too_slow")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except asyncio.CancelledError:
            pass  # shutdown
        except Exception:  # a connection must never take the node down
            logger.exception("direct connection from %s failed", remote[0])
        finally:
            self._connections.discard(task)
            writer.close()

    def _count(self, reason: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1

    async def _serve(
        self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        while True:
            try:
                head = await asyncio.wait_for(reader.read(_NAME.size), _SERVER_IDLE_SECONDS)
            except asyncio.TimeoutError:
                return  # idle: the caller opens a new connection next time
            if not head:
                return  # the caller hung up
            (length,) = _NAME.unpack(head)
            name = (await reader.readexactly(length)).decode("utf-8", "replace")
            rpc = self.lookup(name)
            if rpc is None:
                detail = f"no handler for {name!r}"
                await _framing.write_response(
                    writer, _framing.STATUS_ERROR, _framing.encode_error("no_handler", detail)
                )
                return
            if not self.gate.try_enter(peer):
                detail = f"{self.gate.open_from(peer)} streams open from this peer"
                await _framing.write_response(
                    writer, _framing.STATUS_ERROR, _framing.encode_error("busy", detail)
                )
                return
            try:
                served = _framing.answer(
                    reader,
                    writer,
                    rpc.handler,
                    rpc.max_request_bytes,
                    name,
                    peer,
                    self.pace,
                    rpc.receive,
                )
                reusable = await asyncio.wait_for(served, rpc.timeout)
            except asyncio.TimeoutError:
                logger.warning(
                    "rpc %s from %s (direct): timeout after %.1fs", name, peer, rpc.timeout
                )
                return
            finally:
                self.gate.leave(peer)
            if not reusable:
                return


class DirectClient:
    """The caller side: opens authenticated connections and keeps idle ones for reuse.

    Used on the transport's event loop only.

    Args:
        identity: this node's key (signs the handshake).
        require_tls: never send over plain TCP: a peer whose port does not speak TLS is
            :class:`DirectUnavailable` (called through p2pd instead).
    """

    def __init__(self, identity: Identity, require_tls: bool = False) -> None:
        self.identity = identity
        self.require_tls = require_tls
        self._tls_context = client_tls()
        self._idle: dict[str, list[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]]] = {}
        self.opened = 0
        """Connections opened so far (reuse keeps this near one per peer)."""

    async def call(
        self,
        peer: str,
        route: Route,
        name: str,
        data: _framing.Payload,
        limit: int,
        receive: _framing.Receiver | None = None,
    ) -> Any:
        """One request to ``peer`` over a direct connection (the response read by
        ``receive``, as for a p2pd call).

        Raises:
            DirectUnavailable: no connection could be opened and authenticated (nothing
                was sent: call through p2pd instead).
            ProtocolError: as a p2pd call, once the request is on its way.
        """
        if self.require_tls and not route.tls:
            raise DirectUnavailable(f"{peer[:16]}'s data port is not encrypted")
        prefix = _NAME.pack(len(name.encode())) + name.encode()
        reused = self._take(peer)
        if reused is not None:
            reader, writer = reused
            try:
                return await self._exchange(peer, reader, writer, data, limit, receive, prefix)
            except ProtocolError as e:
                # an idle connection the callee closed meanwhile: once more on a new one
                if e.reason != "connection_lost":
                    raise
        reader, writer = await self._connect(peer, route)
        return await self._exchange(peer, reader, writer, data, limit, receive, prefix)

    async def _exchange(
        self,
        peer: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        data: _framing.Payload,
        limit: int,
        receive: _framing.Receiver | None,
        prefix: bytes,
    ) -> Any:
        try:
            lease = await _framing.exchange_on(
                reader, writer, peer, data, limit, receive, prefix=prefix, reuse=True
            )
        except BaseException:
            writer.close()  # an error answer or a cut stream: this connection is done
            raise
        self._put(peer, reader, writer)
        return lease

    def _take(self, peer: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        idle = self._idle.get(peer, [])
        now = time.monotonic()
        while idle:
            reader, writer, since = idle.pop()
            if (
                now - since < _CLIENT_IDLE_SECONDS
                and not writer.is_closing()
                and not reader.at_eof()
            ):
                return reader, writer
            writer.close()
        return None

    def _put(self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        idle = self._idle.setdefault(peer, [])
        if len(idle) >= _IDLE_PER_PEER:
            writer.close()
            return
        idle.append((reader, writer, time.monotonic()))

    async def _connect(
        self, peer: str, route: Route
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            reader, writer = await asyncio.wait_for(
                _into.open_connection(
                    route.host,
                    route.port,
                    ssl=self._tls_context if route.tls else None,
                    server_hostname="" if route.tls else None,
                ),
                _CONNECT_SECONDS,
            )
        except (OSError, ssl.SSLError, asyncio.TimeoutError) as e:
            raise DirectUnavailable(f"{route.host}:{route.port}: {e!r}") from None
        try:
            handshake = open_hello(self.identity, peer, reader, writer)
            await asyncio.wait_for(handshake, _CONNECT_SECONDS)
        except (ProtocolError, OSError, asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
            writer.close()
            raise DirectUnavailable(f"{route.host}:{route.port}: handshake: {e!r}") from None
        self.opened += 1
        return reader, writer

    def close(self) -> None:
        """Close every idle connection."""
        for idle in self._idle.values():
            for _, writer, _ in idle:
                writer.close()
        self._idle.clear()


async def start(
    cfg: TransportConfig,
    peer_id: str,
    lookup: Callable[[str], ServedRpc | None],
    gate: _framing.StreamGate,
    serve: Callable[[str, Callable[[str, bytes], Awaitable[bytes]], int, float], Awaitable[None]],
) -> tuple[DirectServer, DirectClient]:
    """Start the direct plane of a transport whose p2pd runs as ``peer_id``: its server
    on ``cfg.data_port``, serving what ``lookup`` finds, its client, and (through
    ``serve``: p2pd's handlers) the RPC that tells peers its port."""
    assert cfg.identity_path is not None  # checked by the config
    identity = Identity.load(cfg.identity_path)
    if identity.peer_id != peer_id:
        raise RuntimeError("the identity file does not hold p2pd's key")
    tls = cfg.data_plane == "tls"
    server = DirectServer(
        identity,
        lookup,
        gate,
        cfg.inbound_pace,
        cfg.inbound_header_timeout,
        cfg.max_inbound_streams,
        tls=tls,
    )
    port = await server.start(cfg.host, cfg.data_port)
    await serve(RPC_NAME, server.port_handler(), 64, cfg.request_timeout)
    logger.info("direct data plane (%s) on %s:%d", cfg.data_plane, cfg.host, port)
    return server, DirectClient(identity, require_tls=tls)


def _maddr(host: str, port: int) -> str:
    family = "ip6" if ":" in host else "ip4"
    return f"/{family}/{host}/tcp/{port}"
