"""Where other nodes find this one: its published multiaddrs and its reachability.

The transport learns its listen addresses from p2pd once it runs
(:meth:`Presence.listen_on`), decides its reachability before it joins the DHT
(:meth:`Presence.settle`), checks it again against live peers later
(:meth:`Presence.check`), and, behind NAT with ``relay_parts``, adds a relay's circuit
addresses to what it publishes once it holds the relay's slot
(:meth:`Presence.claim_relays`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from hivemind.p2p import P2P

from protocol.p2p import addrs, reachability, relays
from protocol.p2p.config import TransportConfig
from protocol.p2p.reachability import Reachability

__all__ = ["Dial", "Presence"]

logger = logging.getLogger(__name__)

Dial = Callable[[str, bytes, float], Awaitable[bytes]]
"""``dial(peer, request, timeout) -> response``: one call of a peer's dial-back RPC."""


class Presence:
    """This node's published multiaddrs and its reachability.

    Args:
        config: the transport's settings (host, announced addresses, reachability,
            relays, request timeout).
    """

    def __init__(self, config: TransportConfig) -> None:
        self.config = config
        self.reachability = Reachability("unknown")
        self.maddrs: list[str] = []
        self.listen_maddrs: list[str] = []
        self.started_at = time.monotonic()

    @property
    def relayed(self) -> bool:
        """Whether this node owns parts through a relay's circuit addresses."""
        return self.reachability.status == "relayed"

    def listen_on(self, listen_maddrs: list[str]) -> None:
        """Record p2pd's listen addresses and publish those other hosts can use."""
        self.listen_maddrs = list(listen_maddrs)
        self.maddrs = addrs.publishable(self.listen_maddrs, self.config.host)

    async def settle(self, dial: Dial) -> Reachability:
        """Decide the reachability the node joins the DHT with: private behind NAT with
        ``relay_parts`` (until it holds a relay's slot), the forced one, or what the
        initial peers find when they dial it back."""
        cfg = self.config
        if cfg.relay_parts:
            self.reachability = Reachability("private")
            self.started_at = time.monotonic()  # the relay's boot delay counts from here
        elif cfg.reachability != "auto":
            self.reachability = Reachability.forced_to(cfg.reachability)
        else:
            self.reachability = await self.probe(dial, addrs.peer_ids(cfg.initial_peers))
        if self.reachability.status != "unknown":
            logger.info("%s", self.reachability.summary())
        return self.reachability

    async def probe(
        self, dial: Dial, peers: list[str], extra_ports: tuple[int, ...] = ()
    ) -> Reachability:
        """Ask ``peers`` to dial this node back at p2pd's ports and ``extra_ports``."""
        ports = [addrs.tcp_port(m) for m in (self.config.announce_maddrs or self.listen_maddrs)]
        wanted = [p for p in dict.fromkeys(ports) if p] + list(extra_ports)
        return await reachability.probe(dial, peers, wanted, self.config.request_timeout)

    async def check(
        self, dial: Dial, peers: list[str], extra_ports: tuple[int, ...] = ()
    ) -> Reachability:
        """:meth:`probe` again: a forced reachability is kept as it is, an answer from
        nobody keeps what was known before, and a relayed node stays relayed."""
        if self.reachability.forced:
            return self.reachability
        found = await self.probe(dial, peers, extra_ports)
        if found.status != "unknown" and not (found.status == "private" and self.relayed):
            self.reachability = found
        return self.reachability

    async def claim_relays(self, p2p: P2P, peer_id: str) -> Reachability:
        """Claim this node's circuit addresses once it holds a relay's slot
        (:func:`protocol.p2p.relays.claim`); they join :attr:`maddrs`."""
        found = await relays.claim(p2p, self.config, peer_id, self.started_at)
        if found and self.reachability.status == "private":
            self.reachability = self.reachability.through(found)
            self.maddrs = [*self.maddrs, *found]
            logger.info("%s", self.reachability.summary())
        return self.reachability
