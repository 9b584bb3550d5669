"""Can peers on other hosts dial this node? Asked of the peers themselves.

A node behind NAT can open connections to the swarm but nobody can open one to it.
It then must never own a part of an all-reduce (members would have to dial it), and
its operator should be told which port to open, unless it is reachable through a
relay (``network.relay_parts``: status ``relayed``, :mod:`protocol.p2p.relays`). libp2p's AutoNAT answers a similar
question inside p2pd, but hivemind does not expose its verdict, so Atoll asks its
own: the ``atoll.dialback`` RPC. The caller names the TCP ports it listens on; the
callee opens a plain TCP connection to each of them *at the address it sees the call
coming from* (never at an address the caller names, so no node can be used to probe
a third party) and answers which ones accepted. A port that accepts from a peer's
host is open to the swarm; one that does not (connection refused, or silence: a NAT
with no forwarding) is closed.

:func:`probe` asks a few peers and combines their answers into a
:class:`Reachability`; any peer that reached the node makes it ``public``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack

from protocol.errors import ProtocolError
from protocol.p2p import addrs
from protocol.wire._limits import bounded_unpackb

__all__ = ["RPC_NAME", "DialbackServer", "Reachability", "probe"]

logger = logging.getLogger(__name__)

RPC_NAME = "atoll.dialback"
MAX_REQUEST_BYTES = 256
_MAX_PORTS = 4
_DIAL_TIMEOUT_S = 3.0
_MIN_INTERVAL_S = 5.0  # one dial-back per caller this often
_MAX_CONCURRENT = 8

Status = Literal["public", "relayed", "private", "unknown"]
Call = Callable[[str, bytes, float], Awaitable[bytes]]
"""``(peer, request, timeout) -> response``: an RPC to ``atoll.dialback`` of ``peer``."""


@dataclass(frozen=True)
class Reachability:
    """What this node learned about whether others can dial it.

    Attributes:
        status: ``public`` (a peer dialled it), ``relayed`` (reachable through a
            relay: :meth:`through`), ``private`` (peers tried and could not),
            ``unknown`` (nobody answered: a first node, or no peer yet).
        observed: this node's IP address as the peers saw it (its NAT's public
            address when it is behind one).
        ports: each port checked, and whether any peer could dial it.
        checked_by: the peers that answered.
        forced: set by the operator (``network.reachability``), not measured.
        circuits: the circuit addresses peers reach it through (``relayed``).
    """

    status: Status
    observed: str | None = None
    ports: dict[int, bool] = field(default_factory=dict)
    checked_by: tuple[str, ...] = ()
    forced: bool = False
    circuits: tuple[str, ...] = ()

    @property
    def reachable(self) -> bool:
        """Whether peers should dial this node (``unknown`` counts as reachable;
        ``relayed``: through its relay)."""
        return self.status != "private"

    def through(self, circuits: tuple[str, ...]) -> Reachability:
        """This node, private, as reachable through ``circuits``."""
        return dataclasses.replace(self, status="relayed", circuits=circuits)

    @classmethod
    def forced_to(cls, status: Literal["public", "private"]) -> Reachability:
        return cls(status=status, forced=True)

    def summary(self) -> str:
        """One line for the log and ``atoll status``: what was found, and what to do."""
        if self.forced:
            how = "set by network.reachability"
            if self.status == "public":
                return f"reachable ({how})"
            return f"not reachable ({how}): runs as a client, owns no part, contributes every round"
        if self.status == "unknown":
            return "reachability unknown: no peer has checked it yet"
        seen = f" at {self.observed}" if self.observed else ""
        if self.status == "private" and not self.ports:  # network.relay_parts, waiting
            return (
                "not reachable yet: a client (contributes every round, owns no part) until "
                "p2pd holds a slot on a relay, about 3 minutes after start"
            )
        if self.status == "relayed":
            relays = ", ".join(c.split("/p2p-circuit")[0] for c in self.circuits)
            return f"reachable through a relay ({relays}): owns parts, reached through it"
        if self.status == "public":
            ports = ", ".join(str(p) for p, ok in sorted(self.ports.items()) if ok)
            return f"reachable{seen} (tcp {ports}), checked by {len(self.checked_by)} peer(s)"
        closed = ", ".join(str(p) for p, ok in sorted(self.ports.items()) if not ok)
        return (
            f"NOT reachable: peers see this node{seen} and cannot dial tcp {closed}. "
            f"To serve parts, open or forward tcp {closed} to this machine (and set "
            "network.announce_maddrs to the public address if it differs), or let the "
            "router map it (network.nat_port_map = true, UPnP / NAT-PMP). Until then it "
            "runs as a client: it contributes every round but owns no part."
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "reachable": self.reachable,
            "observed": self.observed,
            "ports": {str(p): ok for p, ok in self.ports.items()},
            "checked_by": list(self.checked_by),
            "forced": self.forced,
            "circuits": list(self.circuits),
            "summary": self.summary(),
        }


class DialbackServer:
    """Serves ``atoll.dialback``: dial the caller back at the address it called from.

    Args:
        remote_addr: returns the multiaddr the current call arrived from (set by the
            transport for the handler's task), or None when unknown (a relayed stream).
    """

    def __init__(self, remote_addr: Callable[[], str | None]) -> None:
        self._remote_addr = remote_addr
        self._last: dict[str, float] = {}
        self._slots = asyncio.Semaphore(_MAX_CONCURRENT)

    async def handle(self, peer: str, request: bytes) -> bytes:
        ports = _parse_request(request, peer)
        now = time.monotonic()
        if now - self._last.get(peer, -_MIN_INTERVAL_S) < _MIN_INTERVAL_S:
            raise ProtocolError("busy", "one dial-back per peer every few seconds", peer)
        self._last[peer] = now
        if len(self._last) > 4096:
            self._last = {p: t for p, t in self._last.items() if now - t < _MIN_INTERVAL_S}
        remote = self._remote_addr()
        host = addrs.host_of(remote) if remote else None
        if host is None:
            return msgpack.packb({"observed": None, "open": []})
        async with self._slots:
            results = await asyncio.gather(*(_dial(host, port) for port in ports))
        return msgpack.packb({"observed": host, "open": [p for p, ok in zip(ports, results) if ok]})


def _unpack(data: bytes, peer: str) -> Any:
    try:
        return bounded_unpackb(data, max_container=16, max_str_len=256, max_items=32)
    except ValueError as exc:
        raise ProtocolError("malformed", str(exc), peer) from None


def _parse_request(request: bytes, peer: str) -> list[int]:
    body = _unpack(request, peer)
    ports = body.get("ports") if isinstance(body, dict) else None
    if not (
        isinstance(ports, list)
        and 0 < len(ports) <= _MAX_PORTS
        and all(type(p) is int and 0 < p < 65536 for p in ports)
    ):
        raise ProtocolError("malformed", f"ports must be 1..{_MAX_PORTS} TCP ports", peer)
    return list(dict.fromkeys(ports))


async def _dial(host: str, port: int) -> bool:
    """Whether a TCP connection to ``host:port`` is accepted within the dial timeout."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), _DIAL_TIMEOUT_S)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError, asyncio.TimeoutError):
        await asyncio.wait_for(writer.wait_closed(), 1.0)
    return True


async def probe(
    call: Call, peers: Sequence[str], ports: Sequence[int], timeout: float
) -> Reachability:
    """Ask up to three of ``peers`` to dial ``ports`` back; combine their answers.

    Any peer that reached a port makes it open (a peer on the same LAN may reach a
    node nobody else can: such a node is still ``public`` to that part of the swarm,
    and the failures are logged). Peers that do not answer are ignored.
    """
    ports = [p for p in dict.fromkeys(ports) if p][:_MAX_PORTS]
    asked = list(dict.fromkeys(peers))[:3]
    if not ports or not asked:
        return Reachability("unknown")
    request = msgpack.packb({"ports": ports})

    async def ask(peer: str) -> tuple[str, str | None, set[int]] | None:
        try:
            raw = await call(peer, request, timeout)
            body = _unpack(raw, peer)
            if not isinstance(body, dict):
                raise ProtocolError("malformed", "dial-back answer is not a map", peer)
            observed, open_ = body.get("observed"), body.get("open")
            if not isinstance(open_, list) or not (observed is None or isinstance(observed, str)):
                raise ProtocolError("malformed", "dial-back answer", peer)
            return peer, observed, {p for p in open_ if p in ports}
        except ProtocolError as exc:
            logger.info("dial-back check by %s failed: %s", peer[:16], exc)
            return None

    answers = [a for a in await asyncio.gather(*(ask(p) for p in asked)) if a is not None]
    if not answers:
        return Reachability("unknown")
    reached: dict[int, bool] = {p: any(p in a[2] for a in answers) for p in ports}
    observed = next((a[1] for a in answers if a[1]), None)
    for peer, _, opened in answers:
        if opened != set(ports):
            logger.info(
                "peer %s could not dial tcp %s back", peer[:16], sorted(set(ports) - opened)
            )
    status: Status = "public" if any(reached.values()) else "private"
    return Reachability(status, observed, reached, tuple(a[0] for a in answers))
