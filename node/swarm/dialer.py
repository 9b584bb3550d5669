"""Keeping this node connected to its live peers, one step per registry refresh: the
control plane sized to the swarm and dialled, reachability checked once when the first
node of a swarm had nobody to ask at start, and parts owned through relays reached
(:mod:`protocol.p2p.relays`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from node.swarm.peers import PeerView
from protocol.control.plane import ControlPlane
from protocol.p2p.relays import CIRCUIT
from protocol.p2p.transport import Transport

__all__ = ["Dialer"]

logger = logging.getLogger(__name__)


class Dialer:
    """Dials the live peers this node's registry view holds.

    Args:
        transport: the node's transport.
        peers: this node's view of the registry.
        control: the control plane (None without one).
        relayed: told this node's new addresses once its circuits are claimed.
    """

    def __init__(
        self,
        transport: Transport,
        peers: PeerView,
        control: ControlPlane | None,
        relayed: Callable[[list[str]], None],
    ) -> None:
        self.transport = transport
        self.peers = peers
        self.control = control
        self.relayed = relayed
        self.checked = False  # reachability asked of live peers once

    async def dial(self, live: set[str]) -> None:
        """One step over ``live``."""
        transport, control = self.transport, self.control
        if control is not None:
            control.resize(len(live) + 1)
        if not self.checked and live and transport.reachability.status == "unknown":
            # The first node of a swarm had nobody to ask at start.
            self.checked = True
            found = await transport.check_reachability(sorted(live)[:3])
            logger.info("%s", found.summary())
        await self.relays(live)
        if control is not None:
            records = self.peers.records
            # a peer nobody can dial dials us instead
            control.dial({p: records[p].control for p in live if records[p].reachable})

    async def relays(self, live: set[str]) -> None:
        """Behind NAT with ``network.relay_parts``: claim this node's circuits once it
        holds a relay's slot; and connect to live peers that own parts through a relay,
        so calls to them go through it."""
        transport, records = self.transport, self.peers.records
        waiting = transport.config.relay_parts and transport.reachability.status == "private"
        if waiting and (await transport.claim_relays()).status == "relayed":
            self.relayed(transport.maddrs)
        reachable = [records[p] for p in sorted(live) if p in records and records[p].reachable]
        wanted = {r.peer: list(r.maddrs) for r in reachable if any(CIRCUIT in m for m in r.maddrs)}
        await transport.reach(wanted)
