"""The callee's side of the direct data plane (:mod:`protocol.p2p.direct`).

:class:`DirectServer` listens on the data port, checks each caller's signed handshake
(:mod:`protocol.p2p._handshake`), and serves the RPCs the transport's handlers name
(:class:`ServedRpc`), one request at a time per connection, under the transport's
stream caps and pace. Its settings come from the transport's
(:meth:`DirectServerSettings.of`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from protocol.errors import ProtocolError
from protocol.p2p import _framing, _into
from protocol.p2p._handshake import answer_hello, server_tls
from protocol.p2p.config import TransportConfig
from protocol.p2p.direct import NAME_LENGTH, encode_port
from verification.identity import Identity

__all__ = ["DirectServer", "DirectServerSettings", "ServedRpc"]

logger = logging.getLogger(__name__)

_SERVER_IDLE_SECONDS = 90.0  # a callee keeps a connection open this long without a request


@dataclass(frozen=True)
class ServedRpc:
    """One RPC as the direct server runs it (the same settings as on p2pd)."""

    handler: Callable[[str, bytes], Awaitable[_framing.Payload]]
    max_request_bytes: int
    timeout: float
    receive: _framing.RequestReader | None


@dataclass(frozen=True)
class DirectServerSettings:
    """How a :class:`DirectServer` serves.

    Args:
        pace: how slowly a caller may send.
        header_timeout: seconds a new connection has to finish its handshake.
        max_connections: connections open at once; one more is closed at once.
        tls: speak TLS 1.3 on the port (a certificate made at start-up).
    """

    pace: _framing.Pace
    header_timeout: float
    max_connections: int
    tls: bool = False

    @classmethod
    def of(cls, cfg: TransportConfig) -> DirectServerSettings:
        """The settings of the transport's ``cfg``."""
        return cls(
            cfg.inbound_pace,
            cfg.inbound_header_timeout,
            cfg.max_inbound_streams,
            tls=cfg.data_plane == "tls",
        )

    def build(
        self,
        identity: Identity,
        lookup: Callable[[str], ServedRpc | None],
        gate: _framing.StreamGate,
    ) -> DirectServer:
        """A server answering as ``identity``, serving what ``lookup`` finds."""
        return DirectServer(identity, lookup, gate, self)


class DirectServer:
    """The callee side: accepts connections on the data port and serves RPCs on them.

    Build it with :meth:`DirectServerSettings.build`.

    Args:
        identity: this node's key (answers the handshake).
        lookup: the RPC served under a name, or None.
        gate: the transport's stream caps (a request counts as one stream).
        settings: pace, handshake deadline, connection cap and TLS.
    """

    def __init__(
        self,
        identity: Identity,
        lookup: Callable[[str], ServedRpc | None],
        gate: _framing.StreamGate,
        settings: DirectServerSettings,
    ) -> None:
        self.identity = identity
        self.tls = settings.tls
        self._tls_context: ssl.SSLContext | None = None
        self._certificate_hash = b""
        self.lookup = lookup
        self.gate = gate
        self.pace = settings.pace
        self.header_timeout = settings.header_timeout
        self.max_connections = settings.max_connections
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
                head = await asyncio.wait_for(reader.read(NAME_LENGTH.size), _SERVER_IDLE_SECONDS)
            except asyncio.TimeoutError:
                return  # idle: the caller opens a new connection next time
            if not head:
                return  # the caller hung up
            (length,) = NAME_LENGTH.unpack(head)
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


def _maddr(host: str, port: int) -> str:
    family = "ip6" if ":" in host else "ip4"
    return f"/{family}/{host}/tcp/{port}"
