"""The RPC endpoints of one transport: the handlers it serves and the calls it makes.

Inbound, :class:`~protocol.p2p.handlers.Handlers` serve behind one
:class:`~protocol.p2p._framing.StreamGate` on p2pd and, when it runs, on the direct
data plane (:mod:`protocol.p2p.direct`); outbound, one
:class:`~protocol.p2p.calls.Caller` picks the plane of each call. Every node also
serves the dial-back RPC of :mod:`protocol.p2p.reachability`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from hivemind.p2p import P2P

from protocol.p2p import _framing, direct, reachability
from protocol.p2p.calls import Caller
from protocol.p2p.config import TransportConfig
from protocol.p2p.direct import DirectClient
from protocol.p2p.directserver import DirectServer, DirectServerSettings
from protocol.p2p.handlers import Handlers
from verification.identity import Identity

__all__ = ["Endpoints"]

logger = logging.getLogger(__name__)


class Endpoints:
    """The handlers, the caller and the direct plane of a started transport.

    Create it with :meth:`create` on the transport's loop; end it with :meth:`close`.

    Args:
        gate: the stream caps every handler shares.
        handlers: the handlers served.
        caller: the calls made.
        plane: the direct plane's server and client, when it runs.
    """

    def __init__(
        self,
        gate: _framing.StreamGate,
        handlers: Handlers,
        caller: Caller,
        plane: tuple[DirectServer, DirectClient] | None,
    ) -> None:
        self.gate = gate
        self.handlers = handlers
        self.caller = caller
        self.direct_server, self.direct_client = plane if plane is not None else (None, None)

    @classmethod
    async def create(cls, p2p: P2P, cfg: TransportConfig, peer_id: str) -> Endpoints:
        """Serve on ``p2p`` (and on the direct plane unless ``cfg.data_plane`` is
        ``p2pd``) as ``cfg`` says, starting with the dial-back RPC."""
        gate = _framing.StreamGate(cfg.max_inbound_streams, cfg.max_inbound_per_peer)
        handlers = Handlers(p2p, gate, cfg.inbound_pace, cfg.max_message_bytes)
        plane = None
        if cfg.data_plane != "p2pd":
            plane = await _start_direct(cfg, peer_id, handlers, gate)
        caller = Caller(p2p, plane[1] if plane else None, cfg.max_message_bytes)
        await handlers.add(
            reachability.RPC_NAME,
            reachability.DialbackServer(_framing.REMOTE_ADDR.get).handle,
            reachability.MAX_REQUEST_BYTES,
            cfg.request_timeout,
        )
        return cls(gate, handlers, caller, plane)

    @property
    def data_port(self) -> int | None:
        """The direct data plane's port, when it runs."""
        return self.direct_server.port if self.direct_server is not None else None

    async def close(self) -> None:
        """Close the direct plane's connections and server, then every handler."""
        if self.direct_client is not None:
            self.direct_client.close()
        if self.direct_server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.direct_server.close(), 3.0)
        await self.handlers.close()


async def _start_direct(
    cfg: TransportConfig, peer_id: str, handlers: Handlers, gate: _framing.StreamGate
) -> tuple[DirectServer, DirectClient]:
    """Start the direct plane of a transport whose p2pd runs as ``peer_id``: its server
    on ``cfg.data_port``, serving what ``handlers`` serve there, its client, and (on
    p2pd) the RPC that tells peers its port."""
    assert cfg.identity_path is not None  # checked by the config
    identity = Identity.load(cfg.identity_path)
    if identity.peer_id != peer_id:
        raise RuntimeError("the identity file does not hold p2pd's key")
    settings = DirectServerSettings.of(cfg)
    server = settings.build(identity, handlers.served, gate)
    port = await server.start(cfg.host, cfg.data_port)
    await handlers.add(direct.RPC_NAME, server.port_handler(), 64, cfg.request_timeout)
    logger.info("direct data plane (%s) on %s:%d", cfg.data_plane, cfg.host, port)
    return server, DirectClient(identity, require_tls=settings.tls)
