"""The network side's settings: where p2pd listens, whom it joins, and what one stream may cost.

:class:`TransportConfig` is what :meth:`protocol.p2p.transport.Transport.start` takes;
``node/config.py`` builds it from the ``[network]`` table. This module imports nothing
from hivemind, so a configuration can be checked without loading the network stack.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from protocol.p2p._reading import Pace

__all__ = ["TransportConfig"]


@dataclass(frozen=True)
class TransportConfig:
    """Settings of the network side.

    Attributes:
        host: IP address p2pd listens on.
        port: TCP port p2pd listens on; 0 picks a free one.
        initial_peers: multiaddrs of peers to join through (empty starts a new swarm).
        identity_path: libp2p private-key file; None lets p2pd make a throwaway key.
        announce_maddrs: multiaddrs other peers should dial, when they differ from the listen ones.
        request_timeout: default deadline, in seconds, of a call, a handler and a DHT operation.
        max_message_bytes: largest request or response this node sends or accepts.
        dht_client_mode: join the DHT without serving it (for nodes others cannot dial).
            A node that finds itself unreachable at start joins as a client anyway.
        startup_timeout: deadline, in seconds, for p2pd and the DHT to come up.
        reachability: ``auto`` asks the initial peers to dial this node back at start
            (:mod:`protocol.p2p.reachability`); ``public`` or ``private`` skips the check and
            is also passed to p2pd's AutoNAT as its forced reachability.
        relay: let p2pd use circuit relays (reach peers behind NAT through others).
        auto_relay: behind NAT, reserve a slot on a relay and announce the relayed
            address, so this node becomes dialable through it.
        trusted_relays: relays ``auto_relay`` uses (p2pd's default: the initial peers).
        relay_parts: behind NAT, own parts through a relay (:mod:`protocol.p2p.relays`):
            p2pd is forced private and reserves a slot on the trusted relays (or the
            initial peers), and the node claims its circuit addresses once it holds one.
        nat_port_map: ask the home router for a port mapping (UPnP / NAT-PMP).
        auto_nat: run p2pd's AutoNAT service (tells peers whether they are reachable).
        max_inbound_streams: RPC streams this node serves at once, from everyone; one more
            is answered ``busy`` without being read. An owner serves about
            ``2 * fragments * (group_size - 1)`` part streams when every fragment syncs at
            once (240 for 8 fragments in groups of 16), hence the margin.
        max_inbound_per_peer: RPC streams served at once from one PeerID. A peer sends
            about two per fragment in flight (its part and its mixing part) plus repairs,
            state downloads and probes.
        inbound_header_timeout: seconds a caller has, from opening a stream, to send its
            8-byte request header; a silent stream is then dropped as ``too_slow``. A
            caller writes it at once; the margin covers a header queued behind other
            streams on a saturated slow link.
        min_inbound_bytes_per_second: least rate of a request body, over every sliding
            ``inbound_rate_window``; a slower stream is dropped as ``too_slow``, freeing
            its slot. The default (16 KiB/s, 128 kbit/s) lets a 1 Mbit/s link carry seven
            requests at once and still pass. 0 turns the check off.
        inbound_rate_window: seconds ``min_inbound_bytes_per_second`` is averaged over; a
            stream that sends nothing is dropped after this long.
        data_plane: ``p2pd`` carries every RPC through p2pd; ``tcp`` also listens on
            ``data_port`` and calls peers that listen too over direct TCP connections,
            opened with a handshake signed by both node keys (:mod:`protocol.p2p.direct`;
            not encrypted), falling back to p2pd for a peer whose port cannot be reached;
            ``tls`` is ``tcp`` encrypted with TLS 1.3 (bound to the signed handshake), and
            calls a peer whose port is not encrypted through p2pd. Needs
            ``identity_path``.
        data_port: TCP port of the direct data plane on ``host``; 0 picks a free one.
        dht: start the DHT process and join the DHT; False for a transport that only
            calls the initial peers (fetching a run spec before a node starts), which
            then has no DHT and skips the dial-back check.
    """

    host: str = "127.0.0.1"
    port: int = 0
    initial_peers: tuple[str, ...] = ()
    identity_path: Path | None = None
    announce_maddrs: tuple[str, ...] = ()
    request_timeout: float = 30.0
    max_message_bytes: int = 256 * 2**20
    dht_client_mode: bool = False
    startup_timeout: float = 30.0
    reachability: Literal["auto", "public", "private"] = "auto"
    relay: bool = True
    auto_relay: bool = False
    trusted_relays: tuple[str, ...] = ()
    relay_parts: bool = False
    nat_port_map: bool = False
    auto_nat: bool = True
    max_inbound_streams: int = 256
    max_inbound_per_peer: int = 32
    inbound_header_timeout: float = 10.0
    min_inbound_bytes_per_second: float = 16 * 1024
    inbound_rate_window: float = 10.0
    data_plane: Literal["p2pd", "tcp", "tls"] = "p2pd"
    data_port: int = 0
    dht: bool = True

    def __post_init__(self) -> None:
        if self.data_plane not in ("p2pd", "tcp", "tls"):
            raise ValueError(
                f"transport.data_plane = {self.data_plane!r}: expected p2pd, tcp or tls"
            )
        if self.data_plane != "p2pd" and self.identity_path is None:
            raise ValueError(
                f"transport.data_plane = {self.data_plane!r} signs its handshake with the "
                "node key: give identity_path"
            )
        if not 0 <= self.data_port <= 65535:
            raise ValueError(f"transport.data_port = {self.data_port}: expected 0..65535")
        if self.relay_parts and (not self.relay or self.reachability == "public"):
            raise ValueError(
                "transport.relay_parts needs relay = true and a reachability other than public"
            )
        if self.reachability not in ("auto", "public", "private"):
            raise ValueError(
                f"transport.reachability = {self.reachability!r}: expected auto, public or private"
            )
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            raise ValueError(f"transport.host = {self.host!r}: expected an IP address") from None
        if not 0 <= self.port <= 65535:
            raise ValueError(f"transport.port = {self.port}: expected 0..65535")
        for key in (
            "request_timeout",
            "startup_timeout",
            "max_message_bytes",
            "max_inbound_streams",
            "max_inbound_per_peer",
            "inbound_header_timeout",
            "inbound_rate_window",
        ):
            if not getattr(self, key) > 0:
                raise ValueError(f"transport.{key} = {getattr(self, key)}: expected > 0")
        if not self.min_inbound_bytes_per_second >= 0:
            raise ValueError(
                f"transport.min_inbound_bytes_per_second = {self.min_inbound_bytes_per_second}: "
                "expected >= 0"
            )

    @property
    def inbound_pace(self) -> Pace:
        """How slowly a caller may send a request (``inbound_*`` and the rate floor)."""
        return Pace(
            self.inbound_header_timeout, self.min_inbound_bytes_per_second, self.inbound_rate_window
        )

    @property
    def host_maddr(self) -> str:
        """The multiaddr p2pd listens on."""
        family = "ip4" if ipaddress.ip_address(self.host).version == 4 else "ip6"
        return f"/{family}/{self.host}/tcp/{self.port}"
