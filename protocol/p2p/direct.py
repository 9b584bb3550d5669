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

This module holds the caller's side (:class:`DirectClient`) and what both sides share;
the callee's side is :mod:`protocol.p2p.directserver`.
"""

from __future__ import annotations

import asyncio
import ssl
import struct
import time
from dataclasses import dataclass
from typing import Any

import msgpack

from protocol.errors import ProtocolError
from protocol.p2p import _framing, _into
from protocol.p2p._handshake import DOMAIN_CALLEE, DOMAIN_CALLER, VERSION, client_tls, open_hello
from verification.identity import Identity

__all__ = [
    "DOMAIN_CALLEE",
    "DOMAIN_CALLER",
    "NAME_LENGTH",
    "RPC_NAME",
    "VERSION",
    "DirectClient",
    "DirectUnavailable",
    "Route",
    "decode_port",
    "encode_port",
]

RPC_NAME = "atoll.direct"
"""The p2pd RPC that tells a caller this node's data port."""
NAME_LENGTH = struct.Struct(">B")
"""The length of the RPC name that opens each request on a connection."""
_IDLE_PER_PEER = 4
_CLIENT_IDLE_SECONDS = 30.0  # a caller reuses a connection idle for less than this
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
        prefix = NAME_LENGTH.pack(len(name.encode())) + name.encode()
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
