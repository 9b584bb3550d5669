"""The RPCs a node makes: over the direct data plane when the callee runs it, else through p2pd.

A callee's data port is asked once through p2pd (RPC ``atoll.direct``) and kept a while
with the address of this node's p2pd connection to it (:class:`~protocol.p2p.direct.Route`);
a call that cannot open a direct connection goes through p2pd, and that peer is not
tried directly again for a minute.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any

from hivemind.p2p import P2P

from protocol.errors import ProtocolError
from protocol.p2p import _framing, direct
from protocol.p2p.handlers import P2PD_ONLY, protocol_id

__all__ = ["PLANES", "Caller"]

logger = logging.getLogger(__name__)

PLANES = ("p2pd", "tcp", "tls")
"""The data planes a call can take."""

_ROUTE_SECONDS = 600.0  # a peer's data port is asked again after this long...
_NO_ROUTE_SECONDS = 60.0  # ...and a peer without one (or unreachable on it) after this
_ROUTE_TIMEOUT = 5.0
_MADDR_HOST = re.compile(r"/(ip4|ip6)/([^/]+)/tcp/\d+")


class Caller:
    """One transport's outgoing calls, and the direct routes it found.

    Used on the transport's loop only.

    Args:
        p2p: the node's p2pd.
        direct_client: the direct plane's caller, when this node runs it.
        max_message_bytes: the largest request sent and, by default, response accepted.
    """

    def __init__(
        self, p2p: P2P, direct_client: direct.DirectClient | None, max_message_bytes: int
    ) -> None:
        self._p2p = p2p
        self._direct = direct_client
        self.max_message_bytes = max_message_bytes
        self.routes: dict[str, tuple[direct.Route | None, float]] = {}
        """Each peer's direct route (None: none) and until when it is kept (monotonic)."""
        self._route_locks: dict[str, asyncio.Lock] = {}
        self.calls_by_plane = dict.fromkeys(PLANES, 0)
        """Calls made so far over each data plane."""

    async def call_into(
        self,
        peer_id: str,
        name: str,
        data: _framing.Payload,
        *,
        timeout: float,
        receive: _framing.Receiver | None = None,
        max_response_bytes: int | None = None,
    ) -> Any:
        """Send ``data`` to RPC ``name`` of ``peer_id``; returns the response as
        ``receive(reader, length)`` reads it (checked as it arrives, into a buffer of the
        caller's), by default a :class:`~protocol.p2p._framing.Lease` of bytes: release
        it when done.

        Args:
            peer_id: the callee's base58 PeerID.
            name: the RPC name the callee registered.
            data: the request: bytes, or buffers sent one after the other.
            timeout: deadline, in seconds, for the whole exchange.
            receive: reads an OK response body; default: the body as bytes.
            max_response_bytes: refuse longer responses; defaults to ``max_message_bytes``.

        Raises:
            ProtocolError: with ``reason`` timeout, unreachable, no_handler, connection_lost,
                oversized, remote_error or malformed. A callee at its stream caps answers
                remote_error with a detail starting ``busy:``; one that found this request
                too slow, ``too_slow:``.
        """
        protocol = protocol_id(name)
        size = _framing.payload_size(data)
        if size > self.max_message_bytes:
            raise ProtocolError(
                "oversized", f"request of {size} bytes exceeds max_message_bytes", peer_id
            )
        limit = max_response_bytes or self.max_message_bytes
        try:
            exchange = self._exchange(peer_id, name, protocol, data, limit, receive)
            return await asyncio.wait_for(exchange, timeout)
        except asyncio.TimeoutError:
            raise ProtocolError("timeout", f"{name} took over {timeout:.1f}s", peer_id) from None

    async def _exchange(
        self,
        peer_id: str,
        name: str,
        protocol: str,
        data: _framing.Payload,
        limit: int,
        receive: _framing.Receiver | None,
    ) -> Any:
        """Over the direct data plane when it runs on both sides, else through p2pd."""
        client = self._direct
        if client is not None and name not in P2PD_ONLY:
            route = await self._route(peer_id)
            if route is not None:
                try:
                    lease = await client.call(peer_id, route, name, data, limit, receive)
                    self.calls_by_plane["tls" if route.tls else "tcp"] += 1
                    return lease
                except direct.DirectUnavailable as e:
                    logger.info("direct to %s failed, using p2pd: %s", peer_id[:16], e)
                    self.routes[peer_id] = (None, time.monotonic() + _NO_ROUTE_SECONDS)
        self.calls_by_plane["p2pd"] += 1
        return await _framing.exchange(self._p2p, peer_id, protocol, data, limit, receive)

    async def _route(self, peer_id: str) -> direct.Route | None:
        """Where ``peer_id``'s data port is, asked once through p2pd and kept a while."""
        known = self.routes.get(peer_id)
        if known is not None and time.monotonic() < known[1]:
            return known[0]
        lock = self._route_locks.setdefault(peer_id, asyncio.Lock())
        async with lock:
            known = self.routes.get(peer_id)
            if known is not None and time.monotonic() < known[1]:
                return known[0]
            route = None
            try:
                answer = await asyncio.wait_for(
                    _framing.exchange(
                        self._p2p,
                        peer_id,
                        protocol_id(direct.RPC_NAME),
                        b"",
                        64,  # type: ignore[arg-type]
                    ),
                    _ROUTE_TIMEOUT,
                )
                port, tls = direct.decode_port(answer.data)  # type: ignore[arg-type]
                host = await self._connected_host(peer_id)
                if host is not None:
                    route = direct.Route(host, port, tls)
            except (ProtocolError, asyncio.TimeoutError) as e:
                logger.debug("no direct route to %s: %s", peer_id[:16], e)
            expires = _ROUTE_SECONDS if route is not None else _NO_ROUTE_SECONDS
            self.routes[peer_id] = (route, time.monotonic() + expires)
            return route

    async def _connected_host(self, peer_id: str) -> str | None:
        """The IP address of this node's p2pd connection to ``peer_id`` (not a relay)."""
        for info in await self._p2p.list_peers():
            if info.peer_id.to_base58() != peer_id:
                continue
            for maddr in info.addrs:
                text = str(maddr)
                found = _MADDR_HOST.match(text)
                if found and "p2p-circuit" not in text:
                    return found.group(2)
        return None
