"""Owning parts from behind NAT, through a relay (``network.relay_parts``).

p2pd relays streams (libp2p's circuit relay v2; hivemind's build lets a relayed
connection carry 4 GiB each way for 30 minutes, enough for parts) to a node behind
NAT that holds a slot, a reservation, on a public node. With ``auto_relay`` and its
reachability forced private, p2pd reserves a slot on each trusted relay (the initial
peers unless ``network.trusted_relays`` names others), but only once its relay
finder's boot delay has passed (measured: 3 minutes after start), and it never lists
the relayed address among its own.

So a node with ``relay_parts`` names its circuit addresses itself
(``RELAY/p2p-circuit/p2p/ME``, :func:`circuits`) and claims them
(:meth:`~protocol.p2p.reachability.Reachability.through`: it owns parts) once
:data:`RESERVE_SECONDS` have passed since it started and its p2pd is connected to
the relay (:func:`held`). Its registry record carries them; a peer that is not
connected to it connects through them (:func:`connect`) before calling it, and p2pd
carries its calls through the relay from then on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from hivemind.p2p import P2P, PeerID
from multiaddr import Multiaddr

if TYPE_CHECKING:
    from protocol.p2p.config import TransportConfig

__all__ = [
    "CIRCUIT",
    "RESERVE_SECONDS",
    "circuits",
    "claim",
    "connect",
    "connected",
    "held",
    "reach",
    "relay_of",
]

logger = logging.getLogger(__name__)

CIRCUIT = "/p2p-circuit/p2p/"
RESERVE_SECONDS = 200.0
"""Seconds after start before a node claims its circuits: p2pd's relay finder waits 3
minutes for more candidates before it reserves a slot on the relays it has."""


def circuits(relays: Sequence[str], me: str) -> tuple[str, ...]:
    """This node's circuit addresses through ``relays`` (multiaddrs ending in
    ``/p2p/<relay id>``)."""
    return tuple(f"{r}{CIRCUIT}{me}" for r in relays if not r.endswith(f"/p2p/{me}"))


def relay_of(circuit: str) -> str:
    """The PeerID of the relay a circuit address goes through."""
    return circuit.split(CIRCUIT, 1)[0].rsplit("/p2p/", 1)[1]


async def connected(p2p: P2P) -> set[str] | None:
    """The peers p2pd is connected to now; None where the daemon did not answer."""
    try:
        return {str(info.peer_id) for info in await p2p.list_peers()}
    except Exception as exc:  # the daemon did not answer: try again at the next refresh
        logger.info("p2pd's peers could not be listed: %r", exc)
        return None


async def held(p2p: P2P, mine: Sequence[str]) -> tuple[str, ...]:
    """The circuits of ``mine`` whose relay p2pd is connected to now (it holds its slot
    over that connection)."""
    peers = await connected(p2p) or set()
    return tuple(c for c in mine if relay_of(c) in peers)


async def claim(p2p: P2P, cfg: TransportConfig, me: str, started_at: float) -> tuple[str, ...]:
    """The circuits a node with ``relay_parts`` claims now: none before
    :data:`RESERVE_SECONDS` since it started (``time.monotonic``), then those it holds
    (:func:`held`) through the trusted relays, or the initial peers."""
    if not cfg.relay_parts or time.monotonic() - started_at < RESERVE_SECONDS:
        return ()
    return await held(p2p, circuits(cfg.trusted_relays or cfg.initial_peers, me))


async def connect(
    p2p: P2P,
    peer: str,
    maddrs: Sequence[str],
    timeout: float,
    peers: Collection[str] | None = None,
) -> bool:
    """Connect to ``peer`` through the first of its circuit addresses among ``maddrs``
    that answers, unless p2pd is connected to it already (``peers``: those it is
    connected to, where the caller listed them once for several peers); whether it is
    connected."""
    through = [m for m in maddrs if CIRCUIT in m and m.endswith(CIRCUIT + peer)]
    if not through:
        return False
    if peers is None and (peers := await connected(p2p)) is None:
        return False
    if peer in peers:
        return True
    for maddr in through:
        relayed = maddr[: -len(peer) - len("/p2p/")]
        try:
            dial = p2p._client.connect(PeerID.from_base58(peer), [Multiaddr(relayed)])
            await asyncio.wait_for(dial, timeout)
            return True
        except Exception as exc:  # no slot on that relay, relay down: try the next
            logger.info("connecting to %s through %s failed: %r", peer[:16], maddr, exc)
    return False


async def reach(p2p: P2P, wanted: dict[str, list[str]], timeout: float) -> None:
    """:func:`connect` to each peer of ``wanted`` through its circuit addresses among
    its multiaddrs, unless p2pd is connected to it already."""
    if not wanted or (peers := await connected(p2p)) is None:
        return
    for peer, maddrs in wanted.items():
        await connect(p2p, peer, maddrs, timeout, peers)
