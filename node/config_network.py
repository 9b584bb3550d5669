"""The sections of a node's configuration that say how it syncs and talks to its peers.

``[sync]``, ``[network]``, ``[control]`` and ``[metrics]``: frozen pydantic dataclasses
that :mod:`node.config` nests into :class:`~node.config.AtollConfig` (and re-exports).
Every key carries its description as the string literal after it, which the
configuration reference is generated from.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator
from pydantic.dataclasses import dataclass

__all__ = ["CodecName", "ControlConfig", "MetricsConfig", "NetworkConfig", "SyncConfig"]

_STRICT = ConfigDict(extra="forbid")

CodecName = Literal["none", "fp16", "bf16", "int8", "int4", "topk"]


@dataclass(frozen=True, config=_STRICT)
class SyncConfig:
    """How often and how fragments are synchronised."""

    trigger: Literal["seconds", "steps"] = "seconds"
    """When a round ends: ``seconds``, on a wall clock the swarm shares (every
    ``round_seconds``, whatever each node trained); ``steps``, after ``inner_steps`` inner
    steps on every node, fast nodes waiting for slow ones."""
    inner_steps: int = Field(default=50, ge=1)
    """With ``trigger = "steps"``: inner steps per round (H); fragment ``f`` of ``F``
    syncs after step ``ceil((f + 1) * H / F)``."""
    round_seconds: float = Field(default=30.0, gt=0.0)
    """With ``trigger = "seconds"``: the length of a round, in seconds; fragment ``f`` of
    ``F`` syncs ``(f + 1) * round_seconds / F`` into it."""
    tau: int = Field(default=0, ge=0)
    """Inner steps after a sync started before its result may be applied, while training
    goes on (Streaming DiLoCo); 0: as soon as it is in."""
    alpha: float = Field(default=0.0, ge=0.0, le=1.0)
    """Share of the local copy a sync's result keeps: ``local = alpha * local + (1 -
    alpha) * (global + overlap)``, in ``[0, 1]``; 0 is plain DiLoCo."""
    fragments: int = Field(default=1, ge=1, le=1024)
    """Fragments the model is split into, balanced by element count (1 to 1024); each
    syncs on its own, spread evenly over the round."""
    codec: CodecName = "none"
    """How pseudo-gradients travel: ``none`` (float32), ``fp16``, ``bf16``, ``int8`` /
    ``int4`` (blockwise absmax quantization), or ``topk`` (in every chunk of
    ``topk_chunk`` values only the ``topk_density`` share of largest magnitude, in
    ``topk_bits`` bits; owners answer with the union of the kept values in 8 bits)."""
    block_size: int = Field(default=256, ge=1, le=2**20)
    """Values per scale of ``int8`` and ``int4`` (1 to 2^20)."""
    topk_chunk: int = Field(default=4096, ge=2, le=65535)
    """With codec ``topk``: values per chunk, each with its own scale and kept count;
    offsets within a chunk take one byte up to 256 values and two above (2 to 65535).
    Parts of a fragment start on chunk boundaries."""
    topk_density: float = Field(default=0.01, gt=0.0, le=1.0)
    """With codec ``topk``: the share of each chunk kept, ``round(density * chunk)`` values
    (at least one)."""
    topk_bits: Literal[2, 4, 8] = 2
    """With codec ``topk``: bits per kept value (per-chunk scale)."""
    feedback_decay: float = Field(default=1.0, gt=0.0, le=1.0)
    """Share of the error-feedback residual carried into the next sync of a fragment:
    1 is plain error feedback; below 1 the residual is SparseLoCo's accumulator, which
    also acts as the outer momentum (pair it with ``outer.momentum = 0``)."""
    error_feedback: bool = True
    """Keep what encoding a pseudo-gradient lost and add it to the fragment's next one."""
    stochastic_rounding: bool = False
    """Round ``int8`` / ``int4`` / ``topk`` values up or down at random in proportion
    (unbiased) instead of to the nearest; needs codec ``int8``, ``int4`` or ``topk``."""
    averaging: Literal["allreduce", "gossip"] = "allreduce"
    """``allreduce``: groups average their pseudo-gradients; ``gossip``: nodes pair up
    every round and take a NoLoCo-style outer step (see ``gossip_gamma``)."""
    layout: Literal["butterfly", "random"] = "butterfly"
    """How groups smaller than the swarm are formed: ``butterfly`` (a contribution
    reaches every node after ``log_G(n)`` rounds) or ``random`` per round and fragment."""
    gossip_gamma: float = Field(default=0.5, gt=0.0, le=1.0)
    """With ``averaging = "gossip"``: the pull toward the partner, added to the outer
    gradient as ``gossip_gamma / lr * (own copy - pair mean)``, in ``(0, 1]``."""
    mix_codec: CodecName = "fp16"
    """Codec of the global copies that groups smaller than the swarm also average (same
    choices as ``codec``)."""
    exchange: Literal["reduce", "gather"] = "reduce"
    """How a group averages its pseudo-gradients: ``reduce``, each member owns one part of
    the fragment, reduces the group's contributions to it and answers every member with
    one signed result (a butterfly all-reduce); ``gather``, each member sends its whole
    encoded pseudo-gradient to every other member and reduces all of them itself, so
    nothing is sent back (for ``topk`` parts about 1.6x fewer bytes in a group of two,
    and no owner to trust). A group with a member others cannot dial reduces by owner.
    """

    def __post_init__(self) -> None:
        if self.stochastic_rounding and self.codec not in ("int8", "int4", "topk"):
            raise ValueError(
                f"sync.stochastic_rounding needs codec int8, int4 or topk, not {self.codec!r}"
            )
        if self.mix_codec == "topk":
            raise ValueError(
                "sync.mix_codec = 'topk': global copies are not sparse; use none, fp16, "
                "bf16, int8 or int4"
            )
        if self.feedback_decay < 1.0 and not self.error_feedback:
            raise ValueError("sync.feedback_decay < 1 needs sync.error_feedback = true")

    @property
    def chunk(self) -> int:
        """Values per scale (and, for ``topk``, per chunk): where parts may start."""
        return self.topk_chunk if self.codec == "topk" else self.block_size

    def codec_args(self) -> dict[str, int]:
        """``block_size``, ``k`` and ``bits`` as :func:`protocol.wire.codec.encode` takes
        them for ``codec``."""
        if self.codec != "topk":
            return {"block_size": self.block_size}
        from protocol.wire.codec import topk_keep_count

        k = topk_keep_count(self.topk_density, self.topk_chunk)
        return {"block_size": self.topk_chunk, "k": k, "bits": self.topk_bits}


@dataclass(frozen=True, config=_STRICT)
class NetworkConfig:
    """Where the node listens and whom it joins."""

    host: str = "127.0.0.1"
    """IP address p2pd, the control sidecar and the direct data plane listen on:
    ``0.0.0.0`` or the machine's own address on anything but a one-machine swarm."""
    port: int = Field(default=0, ge=0, le=65535)
    """TCP port of p2pd (parts, results, state downloads, the DHT); 0 picks a free one."""
    initial_peers: tuple[str, ...] = ()
    """Multiaddrs ending in ``/p2p/<PeerID>`` of peers to join through; empty starts a new
    swarm (a run spec brings its bootstrap peers)."""
    announce_maddrs: tuple[str, ...] = ()
    """Where peers should dial p2pd, when that differs from where it listens (a
    forwarded port on a public address)."""
    client_mode: bool = False
    """Peers cannot dial this node: it joins the DHT as a client and owns no part, but
    contributes to every round (as ``reachability = "private"``)."""
    group_size: int = Field(default=4, ge=1, le=256)
    """Most members of one all-reduce group (1 to 256); a larger swarm syncs in groups
    laid out by ``sync.layout``. Must be the same on every node."""
    request_timeout: float = Field(default=30.0, gt=0.0)
    """Deadline of one call, request handler or DHT operation, in seconds."""
    matchmaking_seconds: float = Field(default=3.0, gt=0.0)
    """How long an exchange waits for the live peers' announcements before groups form,
    in seconds."""
    round_timeout: float = Field(default=60.0, gt=0.0)
    """Deadline of one all-reduce (parts, reduction and results), in seconds; an
    announcement stays in the DHT for four of them. With ``adaptive_deadlines`` it is
    the most an all-reduce may take, and the most a node waits for its peers' signed
    states after a round that went wrong."""
    adaptive_deadlines: bool = True
    """Exchange budgets follow what this node measured (:mod:`node.train.deadlines`): four
    times the 90th percentile of its last 16 complete exchanges, never below the
    matchmaking wait and the commit window plus 10 s, never above the configured
    ``matchmaking_seconds + round_timeout`` (and commit window); doubled after an
    exchange that ran out of time. False: always the configured budget."""
    max_message_mb: float = Field(default=256.0, gt=0.0)
    """Largest request or response a node sends or accepts (a part, a result, a state
    reply), in MiB."""
    max_tokens_per_round: int = Field(default=10**9, ge=1)
    """Cap on the tokens a contribution may claim, which weigh it in the mean."""
    stream_reduce: bool = False
    """An owner reduces its part block by block while the parts arrive, instead of once
    they are all in, and (for raw float32 results) streams each block of its result back
    as soon as it is reduced, ending it with a signed trailer. It hides the reduction
    behind the transfer where a core is free for it; on a machine whose cores are all
    busy during an exchange (the benchmark here: four peers on two cores) it measured
    3-24 % slower, so it is off by default."""
    min_peers: int = Field(default=1, ge=1)
    """Nodes of the run, this one included, to wait for before training starts."""
    min_peers_timeout: float = Field(default=60.0, gt=0.0)
    """Seconds to wait for ``min_peers`` before training with fewer."""
    alone_rounds: int = Field(default=3, ge=1)
    """Rounds in a row with no exchange with any peer after which a node says at WARN
    (and in ``atoll status``) that it is training alone. A node that joined through
    initial peers or a spec and ends its ``run.max_rounds`` without ever exchanging
    with a peer exits with an error."""
    registry_seconds: float = Field(default=2.0, gt=0.0)
    """How often a node rewrites its registry record and reads everyone's, in a swarm
    of up to ``base_rate_peers`` nodes."""
    base_rate_peers: int = Field(default=8, ge=1)
    """Swarm size up to which the registry (every ``registry_seconds``) and matchmaking
    announcements (every 0.2 s) are polled at their base rate. In a swarm of ``n`` larger
    than this both polls, and the time after which a silent peer counts as gone, stretch
    by ``n / base_rate_peers``: every read returns one record per node, so this keeps the
    bytes a node reads per second flat as the swarm grows."""
    registry_shards: int = Field(default=1, ge=1, le=4096)
    """DHT keys the registry is split over. Every node reads every record, and the few
    DHT nodes storing a key serve all of its records to every reader, so in a swarm of
    ``n`` they serve about ``n^2`` records per refresh; with ``S`` keys each key's
    holders serve ``1/S`` of that. About ``n / 256`` for a swarm of ``n`` (a node warns
    when its shards hold more than 512 records each). Must be the same on every node."""
    cells_above: int = Field(default=256, ge=2)
    """Swarm size above which matchmaking no longer reads every announcement: each node
    announces and reads only on its line of a grid (Moshpit SGD's), of ``2G`` to ``2G^2``
    peers, and groups form within lines, so what a node reads per sync stays flat as the
    swarm grows. Below it groups follow ``sync.layout`` over every announced peer
    (an exact butterfly where the swarm size allows); above it mixing is close to but not
    exactly the butterfly's."""
    join_timeout: float = Field(default=120.0, ge=0.0)
    """How long to keep trying initial peers that do not answer at start, in seconds."""
    # Reaching and being reached across NAT (passed to p2pd; see "Across networks").
    reachability: Literal["auto", "public", "private"] = "auto"
    """``auto`` asks the initial peers to dial this node back at start; ``public`` or
    ``private`` skips the check and is also p2pd's forced AutoNAT reachability."""
    relay: bool = True
    """Let p2pd use circuit relays, to reach peers behind NAT through others."""
    auto_relay: bool = False
    """Behind NAT, reserve a slot on a relay and announce the relayed address (without
    ``relay_parts`` a node reachable only through a relay still owns no part)."""
    trusted_relays: tuple[str, ...] = ()
    """Multiaddrs ending in ``/p2p/<PeerID>`` of the relays ``auto_relay`` uses; empty:
    p2pd's default, the initial peers."""
    relay_parts: bool = False
    """Behind NAT, own parts through a relay: reserve a slot on the trusted relays (or
    the initial peers) and, once one is held (about 3 minutes after start), announce
    the circuit addresses as this node's; peers reach it through the relay. Needs
    ``relay`` and a ``reachability`` other than ``public``."""
    nat_port_map: bool = False
    """Ask the home router for a port mapping (UPnP / NAT-PMP)."""
    auto_nat: bool = True
    """Run p2pd's AutoNAT service, which tells peers whether they can be dialled."""
    # What one node serves at once, and how slow a sender may be (bounded memory).
    max_inbound_streams: int = Field(default=256, ge=1)
    """Requests this node serves at once, from everyone; one more is answered ``busy``
    without being read."""
    max_inbound_per_peer: int = Field(default=32, ge=1)
    """Requests served at once from one PeerID."""
    min_inbound_kib_per_second: float = Field(default=16.0, ge=0.0)
    """Least rate of a request's body, in KiB/s; a slower stream is dropped as
    ``too_slow``, freeing its slot. 0 turns the check off."""
    # Parts over direct TCP between peers that can dial each other (see "Data plane").
    data_plane: Literal["p2pd", "tcp", "tls"] = "p2pd"
    """``p2pd`` carries every request through p2pd; ``tcp`` also serves and calls peers
    that run it over direct TCP (signed handshake, not encrypted); ``tls`` is ``tcp``
    encrypted with TLS 1.3."""
    data_port: int = Field(default=0, ge=0, le=65535)
    """TCP port of the direct data plane on ``host`` (with ``data_plane`` ``tcp`` or
    ``tls``); 0 picks a free one."""

    def __post_init__(self) -> None:
        if self.relay_parts and (not self.relay or self.reachability == "public"):
            raise ValueError(
                "network.relay_parts owns parts through a relay from behind NAT: it needs "
                "network.relay = true and network.reachability 'auto' or 'private'"
            )
        if self.client_mode and self.reachability == "public":
            raise ValueError(
                "network.client_mode = true says peers cannot dial this node, but "
                "network.reachability = 'public' says they can: set one of them"
            )

    @field_validator("initial_peers", "announce_maddrs", "trusted_relays")
    @classmethod
    def _multiaddrs(cls, value: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        for maddr in value:
            if not maddr.startswith("/"):
                raise ValueError(
                    f"{maddr!r} is not a multiaddr "
                    "(expected e.g. /ip4/203.0.113.5/tcp/31337/p2p/12D3KooW...)"
                )
            if info.field_name != "announce_maddrs" and "/p2p/" not in maddr:
                raise ValueError(f"{maddr!r} needs its peer id: end it with /p2p/<PeerID>")
        return value


@dataclass(frozen=True, config=_STRICT)
class ControlConfig:
    """The control channel: a py-libp2p GossipSub sidecar per node.

    ``commit`` must be the same on every node of a run: with it on, a node refuses
    parts their sender did not commit to before the exchange.
    """

    enabled: bool = True
    """Run the control channel (heartbeats, commitments, verdicts); must be the same on
    every node."""
    heartbeat_seconds: float = Field(default=1.0, gt=0.0, le=60.0)
    """Seconds between two heartbeats (up to 60) in a swarm of up to ``base_rate_peers``
    nodes."""
    commit: bool = True
    """Members commit to the digests of their parts before each exchange, and owners
    refuse parts not committed to in time; needs ``enabled``."""
    commit_seconds: float = Field(default=2.0, gt=0.0, le=60.0)
    """Longest wait for a group's commitments, in seconds (up to 60; the phase ends as
    soon as they are in), in a swarm of up to ``base_rate_peers`` nodes."""
    dial_peers: int = Field(default=8, ge=1)
    """Peers whose sidecars a node dials (all of them in a swarm of up to this many
    others); others dial it too, so it holds about twice this many connections."""
    base_rate_peers: int = Field(default=8, ge=1)
    """Swarm size up to which heartbeats go out every ``heartbeat_seconds`` and
    commitments are also gossiped to every node. In a swarm of ``n`` larger than this
    heartbeats stretch by ``n / base_rate_peers`` (a node hears at most
    ``base_rate_peers`` heartbeats per ``heartbeat_seconds``: every message received
    costs its sidecar a few ms of CPU), and commitments go only to the members of the
    exchange's group, so what a node receives per exchange does not grow with ``n``."""
    max_message_kb: float = Field(default=256.0, gt=0.0, le=960.0)
    """Largest control message sent or accepted, in KiB: at least 1, at most 960
    (py-libp2p refuses pubsub messages over 1 MiB)."""
    port: int = Field(default=0, ge=0, le=65535)
    """TCP port of the control sidecar (on ``network.host``); 0 picks a free one."""
    announce_maddrs: tuple[str, ...] = ()
    """Where peers should dial the sidecar, when that differs from where it listens."""

    def __post_init__(self) -> None:
        if self.commit and not self.enabled:
            raise ValueError("control.commit needs control.enabled = true")


@dataclass(frozen=True, config=_STRICT)
class MetricsConfig:
    """The node's HTTP endpoint: Prometheus metrics at ``/metrics``, its state as JSON
    at ``/api/v1/state``. Off unless ``port`` is set (0 picks a free port, reported in
    ``status.json`` and by ``atoll status``)."""

    port: int | None = Field(default=None, ge=0, le=65535)
    """TCP port of the endpoint; unset: no endpoint, 0 picks a free one."""
    host: str = "127.0.0.1"
    """Where it listens; ``0.0.0.0`` to be scraped from other machines."""
