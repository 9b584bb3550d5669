"""One node's p2pd: started from the transport's settings, what a failed start means, and its stop.

hivemind's ``P2P.create`` starts the daemon and connects this process to it; the
daemon process itself stays private to hivemind, so its pid is read here
(:func:`pid_of`) for the watchdog. A start that fails for a reason an operator can
fix (no initial peer answers, this node cannot be dialled back) is raised as one of
the errors below, in the operator's words (:func:`startup_error`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import Sequence

from hivemind.dht.protocol import ValidationError as DHTValidationError
from hivemind.p2p import P2P, P2PDaemonError, PeerID
from hivemind.utils.multiaddr import Multiaddr

from protocol.p2p.config import TransportConfig
from protocol.p2p.watchdog import remove_sockets

__all__ = [
    "BootstrapUnreachable",
    "NotDialable",
    "pid_of",
    "redial",
    "start",
    "startup_error",
    "stop",
]

logger = logging.getLogger(__name__)


class BootstrapUnreachable(RuntimeError):
    """None of the initial peers could be reached (p2pd refuses to start then)."""


class NotDialable(RuntimeError):
    """A DHT peer could not reach this node back at its peer id while it joined."""


def startup_error(exc: BaseException, initial_peers: Sequence[str]) -> Exception | None:
    """What a failed :meth:`protocol.p2p.transport.Transport.start` raises for ``exc``: a
    known failure in the operator's words, or None to raise ``exc`` as it is."""
    peers = ", ".join(initial_peers)
    if isinstance(exc, P2PDaemonError) and "bootstrap peers" in str(exc):
        return BootstrapUnreachable(f"none of the initial peers answered: {peers}")
    if isinstance(exc, RuntimeError) and "bootstrap failed" in str(exc):
        # their p2pd answered, their DHT not yet (a bootstrap node still starting)
        return BootstrapUnreachable(f"none of the initial peers' DHT answered yet: {peers}")
    if isinstance(exc, DHTValidationError):
        return NotDialable(
            f"{exc}: another running node may use this node's identity key (a copied "
            "data directory; give each node its own), or inbound connections are "
            "blocked (set network.reachability = 'private')"
        )
    if isinstance(exc, (P2PDaemonError, TimeoutError, concurrent.futures.TimeoutError)):
        return RuntimeError(f"transport failed to start: {exc!r}")
    return None


async def start(cfg: TransportConfig) -> P2P:
    """Start p2pd as ``cfg`` says and join the swarm through its initial peers."""
    return await P2P.create(
        initial_peers=list(cfg.initial_peers) or None,
        host_maddrs=[cfg.host_maddr],
        announce_maddrs=list(cfg.announce_maddrs) or None,
        identity_path=str(cfg.identity_path) if cfg.identity_path is not None else None,
        # hivemind's identity check cannot read Ed25519 keys and costs a second daemon
        check_if_identity_free=False,
        dht_mode="client" if cfg.dht_client_mode else "server",
        startup_timeout=cfg.startup_timeout,
        force_reachability="private" if cfg.relay_parts else _forced(cfg.reachability),
        use_relay=cfg.relay,
        use_auto_relay=cfg.auto_relay or cfg.relay_parts,
        trusted_relays=list(cfg.trusted_relays) or None,
        nat_port_map=cfg.nat_port_map,
        auto_nat=cfg.auto_nat,
    )


def _forced(reachability: str) -> str | None:
    return None if reachability == "auto" else reachability


async def stop(p2p: P2P) -> None:
    """Stop ``p2p``'s daemon (SIGTERM; SIGKILL after 5 s) and remove its socket."""
    try:
        await asyncio.wait_for(p2p.shutdown(), 5.0)
    except asyncio.TimeoutError:
        logger.warning("p2pd did not exit within 5 s of SIGTERM; it gets SIGKILL")
    # hivemind removes p2pd's socket only when p2pd was still running
    listen = getattr(p2p, "_daemon_listen_maddr", None)
    with contextlib.suppress(Exception):
        remove_sockets([listen.value_for_protocol("unix")])


def pid_of(p2p: P2P | None) -> int | None:
    """The pid of ``p2p``'s daemon, while it runs."""
    child = getattr(p2p, "_child", None)  # hivemind keeps the process private
    return getattr(child, "pid", None)


async def redial(p2p: P2P, maddrs: Sequence[str], timeout: float) -> int:
    """Connect ``p2p`` to the peer at each of ``maddrs`` (ending in ``/p2p/<peer id>``)
    again, each within ``timeout`` seconds; returns how many answered."""
    joined = 0
    for maddr in maddrs:
        try:
            where, peer = maddr.rsplit("/p2p/", 1)
            connect = p2p._client.connect(PeerID.from_base58(peer), [Multiaddr(where)])
            await asyncio.wait_for(connect, timeout)
            joined += 1
        except Exception as exc:  # unreachable, bad address, daemon error: try the next
            logger.info("re-dial of %s failed: %r", maddr, exc)
    return joined
