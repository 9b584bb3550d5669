"""The RPCs a node serves: each name registered on p2pd and in the direct plane's table.

An RPC name becomes the p2pd protocol ``/atoll/rpc/<name>/1``. Every handler is served
through :func:`protocol.p2p._framing.serve`, under the transport's one
:class:`~protocol.p2p._framing.StreamGate` and :class:`~protocol.p2p._framing.Pace`;
all but the two RPCs about p2pd itself are also served on the direct data plane
(:mod:`protocol.p2p.direct`), with the same limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Awaitable, Callable
from typing import Any

from hivemind.p2p import P2P

from protocol.p2p import _framing, direct, reachability
from protocol.p2p.directserver import ServedRpc

__all__ = ["P2PD_ONLY", "Handler", "Handlers", "protocol_id"]

Handler = Callable[[str, bytes], Awaitable[_framing.Payload | _framing.StreamedResponse]]
"""An RPC handler: ``(authenticated caller PeerID, request bytes) -> response``; the
response is bytes, a sequence of buffers written one after the other, or a
:class:`~protocol.p2p._framing.StreamedResponse` written as it is produced."""

P2PD_ONLY = frozenset({reachability.RPC_NAME, direct.RPC_NAME})
"""RPCs about p2pd itself: served and called through p2pd only."""

_PROTOCOL_PREFIX = "/atoll/rpc/"
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_REMOVE_SECONDS = 2.0  # each handler's removal at shutdown


def protocol_id(name: str) -> str:
    """The p2pd protocol of RPC ``name``.

    Raises:
        ValueError: ``name`` is not 1-64 of letters, digits and ``_.-``.
    """
    if not _NAME.fullmatch(name):
        raise ValueError(f"RPC name {name!r}: expected 1-64 of letters, digits and _.-")
    return f"{_PROTOCOL_PREFIX}{name}/1"


class Handlers:
    """The handlers one transport serves, on p2pd and on the direct plane.

    Used on the transport's loop, except :meth:`check` and :meth:`forget`.

    Args:
        p2p: the node's p2pd.
        gate: the stream caps every handler shares.
        pace: how slowly a caller may send.
        max_message_bytes: the largest request a handler may accept.
    """

    def __init__(
        self, p2p: P2P, gate: _framing.StreamGate, pace: _framing.Pace, max_message_bytes: int
    ) -> None:
        self._p2p = p2p
        self._gate = gate
        self._pace = pace
        self.max_message_bytes = max_message_bytes
        self._protocols: dict[str, str] = {}
        self._direct: dict[str, ServedRpc] = {}

    def check(self, name: str, max_request_bytes: int) -> None:
        """Refuse a registration before it is made.

        Raises:
            ValueError: ``max_request_bytes`` out of range, a bad name, or a name
                already served.
        """
        if not 0 < max_request_bytes <= self.max_message_bytes:
            raise ValueError(
                f"max_request_bytes = {max_request_bytes}: expected 1..{self.max_message_bytes}"
            )
        protocol_id(name)
        if name in self._protocols:
            raise ValueError(f"a handler for {name!r} is already registered")

    async def add(
        self,
        name: str,
        handler: Handler,
        max_request_bytes: int,
        timeout: float,
        receive: _framing.RequestReader | None = None,
    ) -> None:
        """Serve RPC ``name``: ``handler(caller_peer_id, request) -> response``.

        The caller's PeerID comes from the authenticated stream, never from the payload.
        A handler that raises is logged and answered with an error; it never ends the node.

        Args:
            name: RPC name (letters, digits, ``_.-``; at most 64).
            handler: coroutine function serving one request.
            max_request_bytes: longer requests are refused before their body is read.
            timeout: deadline for one whole exchange.
            receive: reads each request as it arrives (into a pooled buffer, say
                ``BufferPool.read_request``, or checking a signed head before any body
                byte); the handler gets the ``data`` of the lease it returns, valid until
                the handler returns (a view or tensor it keeps holds a pooled buffer out
                of the pool until dropped). Default: the request as bytes.
        """
        protocol = protocol_id(name)
        gate, pace = self._gate, self._pace  # one count for all of this transport's handlers

        async def serve(*stream: Any) -> None:
            await _framing.serve(
                stream,
                handler,
                max_request_bytes,
                name,
                timeout,
                gate=gate,
                pace=pace,
                receive=receive,
            )

        await self._p2p.add_binary_stream_handler(protocol, serve)
        self._protocols[name] = protocol
        if name not in P2PD_ONLY:
            self._direct[name] = ServedRpc(handler, max_request_bytes, timeout, receive)

    def forget(self, name: str) -> str:
        """Stop serving ``name`` on the direct plane; returns its p2pd protocol, which
        the caller removes from p2pd.

        Raises:
            KeyError: ``name`` is not served.
        """
        protocol = self._protocols.pop(name)
        self._direct.pop(name, None)
        return protocol

    async def remove(self, name: str) -> None:
        """Stop serving ``name``, on p2pd and on the direct plane.

        Raises:
            KeyError: ``name`` is not served.
        """
        await self._p2p.remove_binary_stream_handler(self.forget(name))

    def served(self, name: str) -> ServedRpc | None:
        """The RPC the direct plane serves under ``name``, or None."""
        return self._direct.get(name)

    async def close(self) -> None:
        """Remove every handler from p2pd (each given ``_REMOVE_SECONDS``; failures ignored)."""
        for protocol in list(self._protocols.values()):
            with contextlib.suppress(Exception):  # shutting down: p2pd may be gone already
                remove = self._p2p.remove_binary_stream_handler(protocol)
                await asyncio.wait_for(remove, _REMOVE_SECONDS)
        self._protocols.clear()
