"""A simulation of an Atoll swarm's round schedule, for 16 to 10,000 nodes over a WAN.

Real swarms on one machine stop at a few dozen nodes; this model says what the same
protocol costs at 10,000. It replays the ``steps`` trigger of ``node.run.loop`` (or, with
``round_seconds``, the ``seconds`` trigger: rounds on the swarm's wall clock) round by
round, vectorized over nodes and groups (numpy; no torch, no network, no event heap:
each phase of a group's exchange is computed in closed form), and the control plane in
closed form. 10,000 nodes x 5 rounds take 0.5 to 2 s of one core.

* **Compute.** Each node has a step time drawn once (lognormal around
  ``step_seconds``, sigma ``step_spread``) times a per-round jitter. Fragment ``f``
  launches after step ``ceil((f + 1) H / F)`` (``node.train.outer.sync_schedule``) and its
  result is applied ``tau`` steps later (at the latest at the round's end); a result
  that has not arrived by then stalls the node.
* **Matchmaking.** Per ``(round, fragment)`` a present node announces at its launch
  and reads announcements until every expected peer announced or its deadline
  (``matchmaking_seconds``); a peer that left less than ``live_seconds`` ago is still
  expected, so one departure makes everyone wait the full deadline. A node's view is
  the peers that announced by then; nodes with the same view form the same groups,
  the protocol's own (:func:`butterfly_schedule`, which is
  ``protocol.averaging.grouping.form_groups``). In those groups a member of another
  view is found out at the commit phase (a round trip) and left out; its part is
  repaired. Only the ``_MAX_VIEWS`` largest views are simulated; the nodes of smaller
  ones fail their sync after a round trip. Above the policy's ``cells_above`` nodes
  matchmaking runs per line of the cell grid (``protocol.averaging.grouping.Cell``):
  a node waits only for its line (a departed peer on another line costs it nothing),
  its line's most common view forms the groups (:func:`cell_schedule`, which is
  ``protocol.averaging.grouping.cell_groups``) and the line's other nodes fail their
  sync after a round trip.
* **Butterfly all-reduce.** A group of ``G`` splits the encoded fragment (``V``
  bytes) into ``G`` parts: every member sends part ``j`` to member ``j``, which reduces
  it and sends the result back: ``2 (G - 1) / G x V`` bytes out per member. One
  transfer takes ``message_overhead_s + bytes / rate + one-way delay``, the delay
  ``local_one_way_s`` plus 5 µs per km between the two nodes' sites. Link sharing is
  a static fair share per phase: a sender's upload is split evenly over its
  transfers, a receiver's download over those it receives, and a transfer runs at
  the smaller share throughout (no re-allocation when another flow ends). A node runs
  one exchange at a time: one starts once its previous exchange, or a state it
  served, is done.
* **Repair.** A member gone before sending contributes nothing; its group waits until
  it notices (``request_timeout`` for the ``crash_share`` of leavers that vanish, a
  round trip for those that close their connections) and reduces without it. The
  parts of owners that are missing, or leave before returning their result, are then
  repaired all-to-all among the ``r`` members left (``r - 1`` transfers of the part
  each; ``protocol.averaging.repair``). A leaver's contribution is lost for the round.
* **Churn and re-sync.** Each round every node leaves with probability ``churn`` at
  a uniform time of its round, and ``Binomial(n, churn)`` nodes join at uniform times.
  A joiner fetches the full state (``model_bytes``) from one random peer once that
  peer finished the round, and contributes from the next round. A node whose sync
  failed re-syncs the same way only when one group spans the swarm (``n <= G``); while
  groups mix global copies it keeps its own (as ``node.run.rounds`` does). Simplifications:
  concurrent fetches from one donor do not share its link, and joiners are not
  expected in matchmaking before they contribute.
* **Mixing.** For fragment 0 the simulator follows which round's contributions each
  node's global copy holds (bitsets over a sample of ``mix_sources`` sources; exact
  when ``n <= mix_sources``): a group's result holds the union of its completing
  members' sets, a joiner takes its donor's. After ``rounds_to_mix(n, G)`` rounds
  (``ceil(log_G n)`` when ``n`` has a prime factor above ``G`` and the layout falls
  back to ``random``) it reports the share of (source, holder) pairs reached.
* **Control plane** (:func:`control_load`, per node and round): GossipSub heartbeats
  (each reaches every node about ``gossip_degree`` times and is forwarded as often),
  commitments (one per node and exchange: gossiped like heartbeats up to
  ``commit_gossip_up_to`` nodes, above that sent only to the ``G - 1`` other members)
  and the DHT (a registry write and read every ``registry_seconds``, one announcement
  and ``1 + wait / poll_seconds`` reads per fragment sync; a get or store is
  ``ceil(log2 n)`` RPCs, a store ``dht_replicas`` more). :data:`CURRENT_POLICY` is
  today's node (heartbeat every second, every record read every 2 s);
  :data:`ADAPTIVE_POLICY` caps the swarm's heartbeat rate and reads a bounded sample
  of registry records (a design not built). With ``cells_above`` a read returns only
  the node's line of announcements: ``n / G^(dims - 1) - 1`` on average.

Not modelled: bytes on the wire beyond payloads (TLS, yamux, TCP slow start), packet
loss, GossipSub's mesh maintenance, verdict messages, NAT relays and
clients, DHT latency beyond ``ceil(log2 n)`` round trips at the mean one-way delay.

:func:`calibrate` sets the per-message and per-byte constants from real runs and fits
``sync_overhead_s`` so that simulated round times match measured ones.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from protocol.averaging.grouping import Cell, cell_dims, cell_groups, form_groups, rounds_to_mix
from protocol.control.heartbeats import stretch

__all__ = [
    "ADAPTIVE_POLICY",
    "CALIBRATION_KEYS",
    "CURRENT_POLICY",
    "NODE_POLICY",
    "DEFAULT_SITES",
    "ControlPolicy",
    "SimConfig",
    "Site",
    "butterfly_schedule",
    "calibrate",
    "control_load",
    "simulate",
]

ONE_WAY_SECONDS_PER_KM = 5e-6
"""Light in fibre: about 5 µs per km one way."""
_EARTH_RADIUS_KM = 6371.0


def _require(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise ValueError(f"SimConfig.{name} = {value!r}: expected {expected}")


@dataclass(frozen=True)
class Site:
    """A place nodes run at; ``weight`` is its relative share of the nodes."""

    name: str
    lat: float
    lon: float
    weight: float = 1.0


DEFAULT_SITES: tuple[Site, ...] = (
    Site("frankfurt", 50.11, 8.68),
    Site("virginia", 38.95, -77.45),
    Site("oregon", 45.60, -121.18),
    Site("sao-paulo", -23.55, -46.63),
    Site("singapore", 1.35, 103.82),
)
"""Five cloud regions on four continents, 3,600 to 16,000 km apart (18 to 80 ms one way)."""


@dataclass(frozen=True)
class ControlPolicy:
    """How often nodes heartbeat and how much of the DHT they read.

    Attributes:
        heartbeat_seconds: each node's heartbeat interval (the shortest, when adaptive).
        heartbeat_swarm_rate: None for a fixed interval; else the swarm's heartbeats per
            second are capped at this, so the interval grows as ``n / rate``.
        registry_seconds: how often a node rewrites and re-reads its registry record.
        read: ``all`` (every record, every read) or ``sample`` (at most ``sample``
            records from a shard of the registry; announcements the same unless
            ``cells_above`` applies).
        sample: records in one sampled read.
        paced_above: None, or the node's ``base_rate_peers``: above that many nodes the
            heartbeat, registry and announcement-poll intervals all stretch by
            ``n / paced_above``, as :class:`protocol.control.heartbeats.Pace` does
            (:func:`~protocol.control.heartbeats.stretch`).
        commit_gossip_up_to: None (commitments always gossiped to every node), or the
            swarm size up to which they are; above it they go to the group only.
        cells_above: None (every announcement read), or the swarm size above which
            matchmaking reads only the node's line of the cell grid
            (``network.cells_above``).
        shard_records: None (the registry is one DHT key), or records per registry shard:
            the operator sets ``network.registry_shards`` to ``ceil(n / shard_records)``
            and a read fetches every shard (``read = all`` only).
    """

    heartbeat_seconds: float = 1.0
    heartbeat_swarm_rate: float | None = None
    registry_seconds: float = 2.0
    read: Literal["all", "sample"] = "all"
    sample: int = 32
    paced_above: int | None = None
    commit_gossip_up_to: int | None = None
    cells_above: int | None = None
    shard_records: int | None = None

    def __post_init__(self) -> None:
        rate = self.heartbeat_swarm_rate
        checks = (
            ("heartbeat_seconds", self.heartbeat_seconds > 0, "> 0"),
            ("heartbeat_swarm_rate", rate is None or rate > 0, "None or > 0"),
            ("registry_seconds", self.registry_seconds > 0, "> 0"),
            ("read", self.read in ("all", "sample"), "one of all, sample"),
            ("sample", self.sample >= 1, ">= 1"),
            ("paced_above", self.paced_above is None or self.paced_above >= 1, "None or >= 1"),
            (
                "commit_gossip_up_to",
                self.commit_gossip_up_to is None or self.commit_gossip_up_to >= 0,
                "None or >= 0",
            ),
            ("cells_above", self.cells_above is None or self.cells_above >= 2, "None or >= 2"),
            (
                "shard_records",
                self.shard_records is None or (self.shard_records >= 1 and self.read == "all"),
                "None, or >= 1 with read = all",
            ),
        )
        for name, ok, expected in checks:
            _require(ok, f"control.{name}", getattr(self, name), expected)

    def stretch(self, n: int) -> float:
        """How much the node's paced intervals stretch in a swarm of ``n``."""
        return 1.0 if self.paced_above is None else stretch(n, self.paced_above)

    def heartbeat_interval(self, n: int) -> float:
        """Seconds between one node's heartbeats in a swarm of ``n``."""
        if self.heartbeat_swarm_rate is None:
            return self.heartbeat_seconds * self.stretch(n)
        return max(self.heartbeat_seconds, n / self.heartbeat_swarm_rate)

    def registry_interval(self, n: int) -> float:
        """Seconds between one node's registry refreshes in a swarm of ``n``."""
        return self.registry_seconds * self.stretch(n)

    def registry_shards(self, n: int) -> int:
        """DHT keys the registry of a swarm of ``n`` is split over (a sampled read
        reads one shard of ``sample`` records)."""
        if self.read == "sample":
            return max(1, math.ceil(n / self.sample))
        return 1 if self.shard_records is None else max(1, math.ceil(n / self.shard_records))

    def gossips_commitments(self, n: int) -> bool:
        """Whether every node receives every commitment in a swarm of ``n``."""
        return self.commit_gossip_up_to is None or n <= self.commit_gossip_up_to

    def cells(self, n: int) -> bool:
        """Whether a swarm of ``n`` matchmakes on the cell grid."""
        return self.cells_above is not None and n > self.cells_above

    def announcements_read(self, n: int, group_size: int) -> float:
        """Announcements one read returns in a swarm of ``n`` (this node's left out)."""
        if self.cells(n):
            return min(n - 1, n / group_size ** (cell_dims(n, group_size) - 1) - 1)
        return n - 1 if self.read == "all" else min(self.sample, n - 1)


CURRENT_POLICY = ControlPolicy()
"""The node before pacing: heartbeat every second, every record read every 2 s, every
commitment gossiped to every node."""


def _node_policy() -> ControlPolicy:
    """Today's node, from the node's own defaults (so that a changed default shows here):
    as :data:`CURRENT_POLICY` up to ``base_rate_peers`` nodes (8); above, intervals
    paced by ``n / base_rate_peers`` (``protocol.control.heartbeats.Pace``, and
    ``node.swarm.peers`` for the registry) and commitments sent to the group only; above
    ``network.cells_above`` nodes (256) matchmaking on the cell grid; the registry in
    ``n / 256`` shards (``network.registry_shards`` as the README recommends)."""
    from node.config import AtollConfig

    cfg = AtollConfig()
    return ControlPolicy(
        heartbeat_seconds=cfg.control.heartbeat_seconds,
        registry_seconds=cfg.network.registry_seconds,
        paced_above=cfg.network.base_rate_peers,
        commit_gossip_up_to=cfg.control.base_rate_peers,
        cells_above=cfg.network.cells_above,
        shard_records=256,
    )


NODE_POLICY = _node_policy()
"""Today's node (:func:`_node_policy`)."""
ADAPTIVE_POLICY = ControlPolicy(
    heartbeat_swarm_rate=32.0, read="sample", sample=32, commit_gossip_up_to=8, cells_above=256
)
"""At most 32 heartbeats a second swarm-wide; registry reads of at most 32 records;
commitments and matchmaking as today's node."""


@dataclass(frozen=True)
class SimConfig:
    """Everything the simulation assumes; defaults describe a 1B-parameter run on WAN links.

    Workload:
        group_size: butterfly group size ``G`` (>= 2).
        fragments: fragments ``F`` synced per round, staggered over the round.
        fragment_bytes: one fragment after the codec (int8 of 250M values: 250 MB).
        mix_bytes: what each sync carries besides when groups do not span the swarm:
            the group's global copies of the fragment (``sync.mix_codec``, fp16 by
            default: about twice the int8 fragment); 0 (the default) leaves it out.
        model_bytes: the full state a joining or re-syncing node fetches (bf16: 2 GB).
        inner_steps: ``H``, inner steps per round (``sync.trigger = "steps"``).
        round_seconds: None (the default) replays the ``steps`` trigger; a length in
            seconds replays ``sync.trigger = "seconds"``: rounds on the swarm's wall
            clock, fragment ``f`` launched ``f / F`` of the way into the round by every
            node at once (within ``clock_skew_s``), training never waiting for a result,
            and an exchange not over by 95 % of a round later failed.
        clock_skew_s: standard deviation of nodes' clocks around the swarm's (seconds
            trigger only).
        tau: steps of compute that may hide a sync before its result must be applied.
        step_seconds: median inner step time.
        step_spread: lognormal sigma of per-node step times (hardware differences).
        step_jitter: lognormal sigma of a node's step time from one round to the next.
    Network:
        upload_gbit, download_gbit: median per-node link rates (Gbit/s).
        bandwidth_spread: lognormal sigma of per-node link rates.
        sites: where nodes run; nodes are placed by site weight.
        local_one_way_s: one-way delay between nodes of one site.
        seconds_per_km: one-way fibre delay per km of great-circle distance.
        message_overhead_s: fixed cost of one part transfer (framing, signing, checks).
        sync_overhead_s: fixed cost of one fragment sync beyond matchmaking's wait
            (final announcement read, commit phase); the ``wan`` benchmark measured
            0.58 s on loopback. :func:`calibrate` fits it.
        matchmaking_seconds, request_timeout: as ``network.*`` in a node's config.
        live_seconds: a registry record this old is a peer presumed gone.
        poll_seconds: interval of announcement reads while matchmaking waits.
        churn: per round, the chance a node leaves; as many join on average.
        crash_share: share of leavers that vanish without closing their connections
            (power or network loss): peers wait ``request_timeout`` for them. The others
            leave cleanly and are noticed within a round trip.
    Control plane (calibration constants, see :data:`CALIBRATION_KEYS`):
        control: heartbeat and registry read policy.
        gossip_degree: GossipSub mesh degree ``D``.
        heartbeat_bytes: one heartbeat on the wire.
        commit_bytes: one signed commitment on the wire.
        control_cpu_per_message_s: CPU one node spends on one control message it
            receives (py-libp2p: 2.5-3 ms).
        record_bytes, announce_bytes: one registry record, one announcement.
        dht_rpc_bytes: request and reply framing of one DHT RPC.
        dht_replicas: nodes a DHT value is stored on.
        dht_cpu_per_op_s: CPU of one DHT RPC, on the side that sends it and on the side
            that serves it (a get is ``ceil(log2 n)`` RPCs).
        dht_cpu_per_record_s: CPU to decode and verify one signed record read.
    Measurement:
        mix_sources: sources whose contributions are followed (a sample above it).
    """

    group_size: int = 4
    fragments: int = 4
    fragment_bytes: float = 2.5e8
    mix_bytes: float = 0.0
    model_bytes: float = 2e9
    inner_steps: int = 100
    round_seconds: float | None = None
    clock_skew_s: float = 0.05
    tau: int = 0
    step_seconds: float = 1.0
    step_spread: float = 0.005
    step_jitter: float = 0.002
    upload_gbit: float = 10.0
    download_gbit: float = 10.0
    bandwidth_spread: float = 0.0
    sites: tuple[Site, ...] = DEFAULT_SITES
    local_one_way_s: float = 2.5e-4
    seconds_per_km: float = ONE_WAY_SECONDS_PER_KM
    message_overhead_s: float = 2e-3
    sync_overhead_s: float = 0.58
    matchmaking_seconds: float = 3.0
    request_timeout: float = 30.0
    live_seconds: float = 10.0
    poll_seconds: float = 0.2
    churn: float = 0.0
    crash_share: float = 0.25
    control: ControlPolicy = CURRENT_POLICY
    gossip_degree: int = 6
    heartbeat_bytes: int = 400
    commit_bytes: int = 350
    control_cpu_per_message_s: float = 2.75e-3
    record_bytes: int = 600
    announce_bytes: int = 400
    dht_rpc_bytes: int = 200
    dht_replicas: int = 5
    dht_cpu_per_op_s: float = 1e-3
    dht_cpu_per_record_s: float = 1e-4
    mix_sources: int = 1024

    def __post_init__(self) -> None:
        for name, ok, expected in self._checks():
            _require(ok, name, getattr(self, name), expected)

    def _checks(self) -> list[tuple[str, bool, str]]:
        at_least_one = ("fragments", "inner_steps", "gossip_degree", "dht_replicas", "mix_sources")
        positive = ("fragment_bytes", "model_bytes", "step_seconds", "upload_gbit",
                    "download_gbit", "matchmaking_seconds", "request_timeout", "live_seconds",
                    "poll_seconds")  # fmt: skip
        non_negative = ("tau", "step_spread", "step_jitter", "bandwidth_spread",
                        "local_one_way_s", "seconds_per_km", "message_overhead_s",
                        "sync_overhead_s", "heartbeat_bytes", "commit_bytes",
                        "control_cpu_per_message_s",
                        "record_bytes", "announce_bytes", "dht_rpc_bytes", "dht_cpu_per_op_s",
                        "dht_cpu_per_record_s")  # fmt: skip
        sites = "at least one site, every weight > 0"
        return [
            ("group_size", self.group_size >= 2, ">= 2 (a group of one averages with no one)"),
            *((k, getattr(self, k) >= 1, "an integer >= 1") for k in at_least_one),
            *((k, getattr(self, k) > 0, "> 0") for k in positive),
            *((k, getattr(self, k) >= 0, ">= 0") for k in non_negative),
            ("churn", 0 <= self.churn < 1, "0 <= churn < 1"),
            (
                "round_seconds",
                self.round_seconds is None or self.round_seconds > 0,
                "None or > 0",
            ),  # fmt: skip
            ("clock_skew_s", self.clock_skew_s >= 0, ">= 0"),
            ("crash_share", 0 <= self.crash_share <= 1, "0 <= crash_share <= 1"),
            ("sites", bool(self.sites) and min(x.weight for x in self.sites) > 0, sites),
            ("control", isinstance(self.control, ControlPolicy), "a ControlPolicy"),
        ]


def butterfly_schedule(
    peers: Iterable[str], rounds: int | Iterable[int], fragment: int, group_size: int
) -> list[list[list[str]]]:
    """Groups of ``peers`` for each round (``range(rounds)`` for an int) of one fragment.

    Exactly ``form_groups(peers, round_, fragment, group_size, layout="butterfly")``
    per round: the simulator groups nodes with the protocol's own rule.
    """
    names = sorted(set(peers))
    numbers = range(rounds) if isinstance(rounds, int) else rounds
    return [form_groups(names, r, fragment, group_size, layout="butterfly") for r in numbers]


def cell_schedule(
    peers: Iterable[str], round_: int, fragment: int, group_size: int, n: int
) -> list[list[str]]:
    """Groups of ``peers`` in one round of a swarm of about ``n`` on the cell grid:
    exactly ``protocol.averaging.grouping.cell_groups``."""
    return cell_groups(peers, round_, fragment, group_size, n)


def _hops(n: int) -> int:
    """RPCs of one Kademlia lookup among ``n`` nodes (0 when alone)."""
    return 0 if n <= 1 else max(1, math.ceil(math.log2(n)))


def control_load(
    cfg: SimConfig, n: int, round_seconds: float, matchmaking_wait_s: float = 0.0
) -> dict[str, float]:
    """Heartbeat and DHT load of one node per round, in a swarm of ``n`` (closed form).

    Per-node figures are swarm means: every RPC or forward a node sends is served or
    received by another, so a node's messages, bytes and CPU count both sides.
    ``dht_hotspot_bytes_per_round`` is what the busiest DHT node serves.

    Raises:
        ValueError: ``n < 1`` or ``round_seconds < 0``.
    """
    _check_n(n)
    if round_seconds < 0 or matchmaking_wait_s < 0:
        raise ValueError("round_seconds and matchmaking_wait_s must be >= 0")
    policy, others = cfg.control, n - 1
    interval = policy.heartbeat_interval(n)
    beats = min(cfg.gossip_degree, others) * others * round_seconds / interval
    commits = _commits_received(cfg, n)
    received = beats + commits
    hops, replicas = _hops(n), min(cfg.dht_replicas, others)
    refreshes = round_seconds / policy.registry_interval(n)
    polls = cfg.fragments * (1 + matchmaking_wait_s / (cfg.poll_seconds * policy.stretch(n)))
    per_read = others if policy.read == "all" else min(policy.sample, others)
    per_poll = policy.announcements_read(n, cfg.group_size)
    shards = policy.registry_shards(n)
    gets = refreshes * (shards if policy.read == "all" else 1) + polls
    rpcs = (refreshes + cfg.fragments) * (hops + replicas) + gets * hops
    records = refreshes * per_read + polls * per_poll
    payload = replicas * (refreshes * cfg.record_bytes + cfg.fragments * cfg.announce_bytes)
    registry_bytes = per_read * refreshes * cfg.record_bytes
    announce_bytes = per_poll * polls * cfg.announce_bytes
    issued_bytes = rpcs * cfg.dht_rpc_bytes + payload + registry_bytes + announce_bytes
    # the busiest DHT node: a replica of a registry shard (or of the whole registry),
    # and of a matchmaking key (the swarm's, or one line's), each read by its readers
    keys_per_node = max(1, math.ceil(shards * replicas / n)) if replicas else 0
    readers = per_poll + 1  # the nodes that read one matchmaking key
    hotspot = (n / shards * registry_bytes * keys_per_node + readers * announce_bytes) / max(
        replicas, 1
    )
    control_cpu = received * cfg.control_cpu_per_message_s
    dht_cpu = 2 * rpcs * cfg.dht_cpu_per_op_s + records * cfg.dht_cpu_per_record_s
    return {
        "heartbeat_interval_s": interval,
        "control_messages_per_node_round": received,
        "commit_messages_per_node_round": commits,
        "control_bytes_per_node_round": 2
        * (beats * cfg.heartbeat_bytes + commits * cfg.commit_bytes),
        "control_cpu_s_per_node_round": control_cpu,
        "dht_rpcs_per_node_round": 2 * rpcs,
        "dht_records_read_per_node_round": records,
        "dht_bytes_per_node_round": 2 * issued_bytes,
        "dht_cpu_s_per_node_round": dht_cpu,
        "dht_hotspot_bytes_per_round": hotspot,
        "cpu_core_share": (control_cpu + dht_cpu) / round_seconds if round_seconds else 0.0,
    }


def _commits_received(cfg: SimConfig, n: int) -> float:
    """Commitments one node receives per round: one per node and exchange (the update, and
    the global copy when groups mix), gossiped to the node's degree or sent in its group."""
    policy, others = cfg.control, n - 1
    exchanges = cfg.fragments * (2 if cfg.mix_bytes and n > cfg.group_size else 1)
    if policy.gossips_commitments(n):
        return min(cfg.gossip_degree, others) * others * exchanges
    return min(cfg.group_size - 1, others) * exchanges


def _check_n(n: int) -> None:
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n = {n!r}: expected a swarm of at least 1 node")


@dataclass
class _Swarm:
    """Per-node state indexed by slot; a joiner takes the next free slot."""

    names: list[str]
    site: np.ndarray
    step: np.ndarray  # base inner step seconds
    up: np.ndarray  # bytes/s
    down: np.ndarray
    delay: np.ndarray  # one-way seconds, site x site
    present: np.ndarray  # in the swarm now
    active: np.ndarray  # holds the state and contributes this round
    leave: np.ndarray  # time it leaves (inf: stays)
    notice: np.ndarray  # how long its peers take to notice it left
    start: np.ndarray  # when its current round starts
    link_free: np.ndarray  # when its last exchange or served state ended

    @classmethod
    def create(
        cls,
        cfg: SimConfig,
        capacity: int,
        rng: np.random.Generator,
        names: Sequence[str] = (),
    ) -> _Swarm:
        weights = np.array([s.weight for s in cfg.sites])
        site = rng.choice(len(cfg.sites), size=capacity, p=weights / weights.sum())
        step = cfg.step_seconds * rng.lognormal(0.0, cfg.step_spread, capacity)
        up = cfg.upload_gbit * 1e9 / 8 * rng.lognormal(0.0, cfg.bandwidth_spread, capacity)
        down = cfg.download_gbit * 1e9 / 8 * rng.lognormal(0.0, cfg.bandwidth_spread, capacity)
        return cls(
            names=[*names, *(f"p{i:05d}" for i in range(len(names), capacity))],
            site=site,
            step=step,
            up=up,
            down=down,
            delay=_site_delays(cfg),
            present=np.zeros(capacity, bool),
            active=np.zeros(capacity, bool),
            leave=np.full(capacity, np.inf),
            notice=np.zeros(capacity),
            start=np.zeros(capacity),
            link_free=np.full(capacity, -np.inf),
        )

    def fetch_seconds(self, cfg: SimConfig, donor: np.ndarray, taker: np.ndarray) -> np.ndarray:
        """Time to copy the full state from ``donor`` to ``taker`` (element-wise)."""
        rate = np.minimum(self.up[donor], self.down[taker])
        lag = self.delay[self.site[donor], self.site[taker]]
        return cfg.message_overhead_s + cfg.model_bytes / rate + lag


def _site_delays(cfg: SimConfig) -> np.ndarray:
    """One-way seconds between every two sites: great-circle km at ``seconds_per_km``."""
    lat = np.radians([s.lat for s in cfg.sites])
    lon = np.radians([s.lon for s in cfg.sites])
    dlat, dlon = lat[:, None] - lat[None, :], lon[:, None] - lon[None, :]
    h = np.sin(dlat / 2) ** 2 + np.cos(lat[:, None]) * np.cos(lat[None, :]) * np.sin(dlon / 2) ** 2
    km = 2 * _EARTH_RADIUS_KM * np.arcsin(np.sqrt(np.clip(h, 0.0, 1.0)))
    return cfg.local_one_way_s + km * cfg.seconds_per_km


@dataclass
class _Outcome:
    """One size class of groups after their exchange: members ``(m, k)`` and per member."""

    members: np.ndarray
    ok: np.ndarray  # stayed to the end and holds the group's result
    averaged: np.ndarray  # ok, with at least one other member: its contribution counts
    finish: np.ndarray  # when it holds every reduced part
    sent: np.ndarray  # bytes of parts and results
    repair: np.ndarray  # bytes of repair transfers


def _exchange(
    sw: _Swarm, cfg: SimConfig, members: np.ndarray, t0: np.ndarray, silent: np.ndarray
) -> _Outcome:
    """Butterfly all-reduce of ``m`` groups of ``k`` members starting at ``t0`` (see module).

    ``silent`` members (another view of the round's groups) send nothing, like leavers.
    """
    m, k = members.shape
    part, ovh = cfg.fragment_bytes / k, cfg.message_overhead_s
    leave, up, down = sw.leave[members], sw.up[members], sw.down[members]
    notice = sw.notice[members]
    site = sw.site[members]
    lag = sw.delay[site[:, :, None], site[:, None, :]]  # [group, sender, receiver]
    other = ~np.eye(k, dtype=bool)[None]
    sends = (leave > t0) & ~silent  # there, and in these groups, when it starts
    gone = (leave <= t0) & ~silent  # found out only by waiting for it
    # Phase 1: parts to every owner that agreed on the group at the commit phase.
    outbound = ((~silent)[:, None, :] & other).sum(axis=2)
    inbound = (sends[:, :, None] & other).sum(axis=1)
    rate = np.minimum(
        up[:, :, None] / np.maximum(outbound, 1)[:, :, None],
        down[:, None, :] / np.maximum(inbound, 1)[:, None, :],
    )
    arrive = np.where(sends[:, :, None] & other, t0[:, :, None] + ovh + part / rate + lag, -np.inf)
    missing = np.where(gone[:, :, None] & other, notice[:, :, None], -np.inf).max(axis=1)
    reduced = np.maximum(arrive.max(axis=1), t0)
    reduced = np.maximum(reduced, t0 + missing)  # waits until it notices a leaver
    ok = sends & (leave > reduced)  # owners that return their result
    # Phase 2: results back to every member whose part arrived.
    outbound = (sends[:, None, :] & other).sum(axis=2)
    inbound = (ok[:, :, None] & other).sum(axis=1)
    rate = np.minimum(
        up[:, :, None] / np.maximum(outbound, 1)[:, :, None],
        down[:, None, :] / np.maximum(inbound, 1)[:, None, :],
    )
    back = np.where(ok[:, :, None] & other, reduced[:, :, None] + ovh + part / rate + lag, -np.inf)
    finish = np.maximum(back.max(axis=1), reduced)
    # Repair: the parts of owners that are missing, all-to-all among the r that stayed. An
    # owner that left is waited for (request_timeout); one of another view is known at
    # the commit phase (a round trip).
    lost = (~ok).sum(axis=1)
    stayed = ok.sum(axis=1)
    commit = 2 * lag.max(axis=(1, 2))
    waited = np.maximum(np.where(~ok & ~silent, notice, -np.inf).max(axis=1), commit)
    begin = np.where(ok, t0, -np.inf).max(axis=1) + waited
    volume = lost * part
    pairs = ok[:, :, None] & ok[:, None, :] & other & (lost > 0)[:, None, None]
    rate = np.minimum(up[:, :, None], down[:, None, :]) / np.maximum(stayed - 1, 1)[:, None, None]
    fixed = np.where(
        pairs, (begin + ovh)[:, None, None] + volume[:, None, None] / rate + lag, -np.inf
    )
    repaired = np.maximum(fixed.max(axis=1), np.where(lost > 0, begin, -np.inf)[:, None])
    finish = np.maximum(finish, repaired)
    sent = part * outbound * (sends.astype(float) + ok)  # parts to members still there, results
    repair = np.where(
        ok & (stayed >= 2)[:, None], (volume * np.maximum(stayed - 1, 0))[:, None], 0.0
    )
    averaged = ok & ((stayed >= 2) | (k == 1))[:, None]
    return _Outcome(members, ok, averaged, finish, sent, repair)


class _Mixing:
    """Which fragment-0 contributions of a round each node's global copy holds.

    One bitset row per slot and origin round over a sample of that round's sources.
    """

    def __init__(self, cfg: SimConfig, capacity: int, window: int, last_origin: int) -> None:
        self.cfg, self.capacity, self.window, self.last_origin = cfg, capacity, window, last_origin
        self.origins: dict[int, tuple[int, np.ndarray, np.ndarray]] = {}  # r0 -> (S, own, held)
        self.reach: list[float] = []
        self.full: list[bool] = []

    def begin(self, round_: int, act: np.ndarray, rng: np.random.Generator) -> None:
        if round_ > self.last_origin or act.size == 0:
            return
        count = min(self.cfg.mix_sources, act.size)
        sources = np.sort(rng.choice(act, size=count, replace=False))
        own = np.zeros((self.capacity, count), bool)
        own[sources, np.arange(count)] = True
        packed = np.packbits(own, axis=1)
        self.origins[round_] = (count, packed, np.zeros_like(packed))

    def exchange(self, round_: int, outcome: _Outcome) -> None:
        rows, cols = np.nonzero(outcome.averaged)
        for r0, (_, own, held) in self.origins.items():
            base = own if round_ == r0 else held
            values = base[outcome.members].copy()
            values[~outcome.averaged] = 0
            union = np.bitwise_or.reduce(values, axis=1)
            held[outcome.members[rows, cols]] = union[rows]

    def copy(self, takers: np.ndarray, donors: np.ndarray) -> None:
        for _, _, held in self.origins.values():
            held[takers] = held[donors]

    def finish(self, round_: int, holders: np.ndarray) -> None:
        for r0 in [r0 for r0 in self.origins if r0 + self.window - 1 == round_]:
            count, _, held = self.origins.pop(r0)
            if holders.size == 0:
                continue
            reached = np.unpackbits(held[holders], axis=1, count=count).sum(axis=1)
            self.reach.append(float(reached.sum() / (holders.size * count)))
            self.full.append(bool((reached == count).all()))


def _mix_window(n: int, group_size: int, cells: bool = False) -> tuple[int, bool]:
    """Rounds after which ``n`` peers should hold every contribution, and whether exactly
    (never on the cell grid)."""
    exact = None if cells else rounds_to_mix(n, group_size)
    if exact is not None:
        return exact, True
    return max(1, math.ceil(math.log(n) / math.log(group_size) - 1e-9)), False


def _launch_steps(cfg: SimConfig) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """Fragments launched and applied after each inner step (``node.train.outer.sync_schedule``)."""
    launches: dict[int, list[int]] = {}
    applies: dict[int, list[int]] = {}
    for f in range(cfg.fragments):
        step = -(-(f + 1) * cfg.inner_steps // cfg.fragments)
        launches.setdefault(step, []).append(f)
        applies.setdefault(min(step + cfg.tau, cfg.inner_steps), []).append(f)
    return launches, applies


_MAX_VIEWS = 4  # the largest matchmaking views simulated per sync; the rest fail
_TALLIES = ("exchange", "repair", "resync", "node_rounds", "contributions", "included",
            "compute", "wall", "waits", "wait_s", "left", "joined", "resyncs")  # fmt: skip


class _Run:
    """One simulation: the swarm, its round loop and its tallies."""

    def __init__(
        self,
        cfg: SimConfig,
        n: int,
        rounds: int,
        seed: int,
        names: Sequence[str] = (),
        mix_rounds: int | None = None,
    ) -> None:
        self.cfg, self.n, self.rounds = cfg, n, rounds
        self.rng = np.random.default_rng(seed)
        self.joins = self.rng.binomial(n, cfg.churn, size=rounds)
        capacity = n + int(self.joins.sum())
        self.sw = _Swarm.create(cfg, capacity, self.rng, names)
        self.sw.present[:n] = self.sw.active[:n] = True
        self.index = {name: i for i, name in enumerate(self.sw.names)}
        self.next_slot = n
        window, self.exact = _mix_window(n, cfg.group_size, cfg.control.cells(n))
        if mix_rounds is not None:
            window, self.exact = mix_rounds, False
        self.window = min(window, rounds)
        self.mixing = _Mixing(cfg, capacity, self.window, rounds - self.window + 1)
        weights = np.array([s.weight for s in cfg.sites])
        weights = weights / weights.sum()
        self.mean_lag = mean_lag = float(weights @ self.sw.delay @ weights)
        self.lookup_s = 2 * _hops(n) * mean_lag
        rate = min(cfg.upload_gbit, cfg.download_gbit) * 1e9 / 8
        share = 2 * (cfg.group_size - 1) / cfg.group_size
        self.sync_guess = cfg.fragments * (
            cfg.sync_overhead_s + share * cfg.fragment_bytes / rate + 2 * mean_lag
        )
        self.t = dict.fromkeys(_TALLIES, 0.0)
        self.walls: list[np.ndarray] = []
        self.sizes: list[int] = []

    def run(self) -> dict[str, Any]:
        for r in range(1, self.rounds + 1):
            self._round(r)
        return self._report()

    def _round(self, r: int) -> None:
        cfg, sw, rng = self.cfg, self.sw, self.rng
        act = np.flatnonzero(sw.active)
        self.sizes.append(act.size)
        step = np.full(sw.site.size, np.nan)
        step[act] = sw.step[act] * rng.lognormal(0.0, cfg.step_jitter, act.size)
        leaving = act[rng.random(act.size) < cfg.churn]
        if cfg.round_seconds is not None:
            spans = np.full(leaving.size, cfg.round_seconds)
        else:
            spans = cfg.inner_steps * step[leaving] + self.sync_guess
        sw.leave[leaving] = sw.start[leaving] + rng.random(leaving.size) * spans
        crashes = rng.random(leaving.size) < cfg.crash_share
        sw.notice[leaving] = np.where(crashes, cfg.request_timeout, 2 * self.mean_lag)
        self.mixing.begin(r, act, rng)
        clock = np.full(sw.site.size, np.nan)
        clock[act] = sw.start[act]
        failed = np.zeros(sw.site.size, bool)
        if cfg.round_seconds is not None:
            self._wall_round(r, act, clock, failed)
            return
        launches, applies = _launch_steps(cfg)
        results: dict[int, np.ndarray] = {}
        done = 0
        for k in sorted({*launches, *applies}):
            clock[act] += (k - done) * step[act]
            done = k
            for f in launches.get(k, []):
                results[f] = self._sync(r, f, act, clock, failed)
            for f in applies.get(k, []):
                clock[act] = np.maximum(clock[act], results.pop(f)[act])
        self.t["contributions"] += act.size * cfg.fragments
        began = float(sw.start[act].min()) if act.size else 0.0
        self._end_round(act, clock, failed, cfg.inner_steps * step[act])
        self._join(r, began, clock)
        self.mixing.finish(r, np.flatnonzero(sw.present))

    def _wall_round(self, r: int, act: np.ndarray, clock: np.ndarray, failed: np.ndarray) -> None:
        """Round ``r`` on the swarm's wall clock (``sync.trigger = "seconds"``): every
        node launches fragment ``f`` at ``(r - 1 + f / F) L``, a joiner from the first
        launch after its state arrived; nobody waits for a result, and one that is not
        back by 95 % of a round later is a failed sync."""
        cfg, sw, rng = self.cfg, self.sw, self.rng
        length = float(cfg.round_seconds or 0.0)
        began = (r - 1) * length
        act = act[sw.start[act] < began + length]  # still fetching the state: not in it
        for f in range(cfg.fragments):
            at = began + f * length / cfg.fragments
            ready = act[sw.start[act] <= at]  # a joiner still fetching skips this sync
            skew = rng.normal(0.0, cfg.clock_skew_s, ready.size) if cfg.clock_skew_s else 0.0
            clock[ready] = at + np.abs(skew)
            result = self._sync(r, f, ready, clock, failed)
            late = ready[~(result[ready] <= at + 0.95 * length)]
            failed[late] = True
        late_joiners = act[sw.start[act] > began]
        clock[act] = began + length
        self.t["contributions"] += act.size * cfg.fragments
        compute = clock[act] - np.maximum(sw.start[act], began)
        failed[late_joiners] = False  # it sat the round out joining, as a node does
        self._end_round(act, clock, failed, compute)
        self._join(r, began, clock)
        self.mixing.finish(r, np.flatnonzero(sw.present))

    def _sync(
        self, r: int, f: int, act: np.ndarray, clock: np.ndarray, failed: np.ndarray
    ) -> np.ndarray:
        """Matchmaking and exchange of fragment ``f``: when each node holds its result.

        Node ``i`` reads announcements until every expected peer announced or its deadline
        ``L_i + matchmaking_seconds``; its view is every peer that announced by then.
        Nodes with the same view form the same groups; in them, a member of another
        view is silent (its parts would be refused as ``group_mismatch``).
        """
        cfg, sw = self.cfg, self.sw
        result = np.full(sw.site.size, -np.inf)
        there = act[sw.leave[act] > clock[act]]
        if there.size == 0:
            return result
        launch = clock[there]
        order = np.argsort(launch, kind="stable")
        announced = np.zeros(sw.site.size, bool)
        announced[there] = True
        gone = np.isfinite(sw.leave) & ~announced & (sw.leave > launch.min() - cfg.live_seconds)
        ghost = bool(gone.any())  # a departed peer is still expected: its absence is waited out
        deadline = launch + cfg.matchmaking_seconds
        seen = np.searchsorted(launch[order], deadline, side="right")  # the view: a prefix
        complete = (seen == there.size) & (not ghost)
        ready = np.where(complete, launch.max(), deadline)
        self.t["waits"] += there.size
        self.t["wait_s"] += float((ready - launch).sum())
        if cfg.control.cells(act.size):
            return self._sync_cells(r, f, act.size, there, launch, gone, result, failed)
        begin = np.full(sw.site.size, np.inf)
        begin[there] = ready + cfg.sync_overhead_s + self.lookup_s
        sizes, counts = np.unique(seen, return_counts=True)
        for rank, view in enumerate(sizes[np.argsort(-counts, kind="stable")]):
            mine = there[seen == view]
            if rank >= _MAX_VIEWS:  # a scattered minority: refused at the commit phase
                result[mine] = begin[mine] + 2 * self.mean_lag
                failed[mine] = True
                continue
            self._exchange_view(r, f, there[order[:view]], mine, begin, result, failed)
        return result

    def _sync_cells(
        self,
        r: int,
        f: int,
        n: int,
        there: np.ndarray,
        launch: np.ndarray,
        gone: np.ndarray,
        result: np.ndarray,
        failed: np.ndarray,
    ) -> np.ndarray:
        """:meth:`_sync` on the cell grid: each line matchmakes on its own; the nodes of
        a line's most common view exchange, its other nodes fail after a round trip."""
        cfg, sw = self.cfg, self.sw

        def line(i: int) -> str:
            return Cell.of(sw.names[i], r, f, cfg.group_size, n).key

        lines: dict[str, list[int]] = {}
        for k, i in enumerate(there):
            lines.setdefault(line(i), []).append(k)
        ghosts = {line(i) for i in np.flatnonzero(gone)}
        deadline = launch + cfg.matchmaking_seconds
        ready = deadline.copy()
        peers, mine, scattered = [], [], []
        for key, rows in lines.items():
            at = np.array(rows)
            order = at[np.argsort(launch[at], kind="stable")]
            seen = np.searchsorted(launch[order], deadline[at], side="right")
            if key not in ghosts:
                everyone = seen == at.size
                ready[at[everyone]] = launch[at].max()
            sizes, counts = np.unique(seen, return_counts=True)
            view = sizes[np.argmax(counts)]
            peers.extend(there[order[:view]])
            mine.extend(there[at[seen == view]])
            scattered.extend(there[at[seen != view]])
        self.t["waits"] += there.size
        self.t["wait_s"] += float((ready - launch).sum())
        begin = np.full(sw.site.size, np.inf)
        begin[there] = ready + cfg.sync_overhead_s + self.lookup_s
        lost = np.array(scattered, dtype=int)
        result[lost] = begin[lost] + 2 * self.mean_lag
        failed[lost] = True
        self._exchange_view(r, f, np.array(peers, int), np.array(mine, int), begin, result,
                            failed, cells=n)  # fmt: skip
        return result

    def _exchange_view(
        self,
        r: int,
        f: int,
        peers: np.ndarray,
        mine: np.ndarray,
        begin: np.ndarray,
        result: np.ndarray,
        failed: np.ndarray,
        cells: int | None = None,
    ) -> None:
        """The groups that the nodes ``mine`` form from the announced ``peers`` (on the
        cell grid of a swarm of ``cells`` nodes when given)."""
        cfg, sw = self.cfg, self.sw
        inside = np.zeros(sw.site.size, bool)
        inside[mine] = True
        names = [sw.names[i] for i in peers]
        if cells is None:
            groups = butterfly_schedule(names, [r], f, cfg.group_size)[0]
        else:
            groups = cell_schedule(names, r, f, cfg.group_size, cells)
        if len(groups) > 1 or cells is not None:  # groups mix their global copies too
            cfg = dataclasses.replace(cfg, fragment_bytes=cfg.fragment_bytes + cfg.mix_bytes)
        by_size: dict[int, list[list[int]]] = {}
        for g in groups:
            slots = [self.index[p] for p in g]
            if any(inside[i] for i in slots):
                by_size.setdefault(len(g), []).append(slots)
        for rows in by_size.values():
            members = np.array(rows)
            t0 = np.maximum(begin[members], sw.link_free[members])
            out = _exchange(sw, cfg, members, t0, ~inside[members])
            stay = members[out.ok]
            result[stay] = out.finish[out.ok]
            sw.link_free[stay] = out.finish[out.ok]
            failed[members[out.ok & ~out.averaged]] = True
            self.t["exchange"] += float(out.sent.sum())
            self.t["repair"] += float(out.repair.sum())
            self.t["included"] += float(out.averaged.sum())
            if f == 0:
                self.mixing.exchange(r, out)

    def _end_round(
        self, act: np.ndarray, clock: np.ndarray, failed: np.ndarray, compute: np.ndarray
    ) -> None:
        """Leavers go, failed syncs re-sync from a peer, and the round's times are tallied."""
        cfg, sw, rng = self.cfg, self.sw, self.rng
        stays = sw.leave[act] > clock[act]
        gone = act[~stays]
        sw.present[gone] = sw.active[gone] = False
        self.t["left"] += gone.size
        holders = act[stays]
        # A node whose sync failed re-syncs only when one group spans the swarm; while
        # groups mix global copies there is no one state to take (node.run.rounds).
        spans = act.size <= cfg.group_size
        needy = holders[failed[holders]] if spans else holders[:0]
        donors = holders[~failed[holders]]
        if donors.size == 0:
            donors = holders
        if needy.size and donors.size:
            picked = rng.choice(donors, size=needy.size)
            begin = np.maximum(clock[needy], clock[picked])
            clock[needy] = begin + sw.fetch_seconds(cfg, picked, needy)
            np.maximum.at(sw.link_free, picked, clock[needy])
            self.mixing.copy(needy, picked)
            self.t["resync"] += needy.size * cfg.model_bytes
            self.t["resyncs"] += needy.size
        walls = clock[holders] - sw.start[holders]
        self.walls.append(walls)
        self.t["wall"] += float(walls.sum())
        self.t["compute"] += float(compute[stays].sum())
        self.t["node_rounds"] += act.size
        if holders.size:
            self.sync_guess = float(np.mean(walls - compute[stays]))
        sw.start[holders] = clock[holders]

    def _join(self, r: int, began: float, clock: np.ndarray) -> None:
        """This round's joiners arrive during it and fetch the state once their donor has it."""
        cfg, sw, rng = self.cfg, self.sw, self.rng
        holders = np.flatnonzero(sw.active)
        count = int(self.joins[r - 1])
        if count == 0 or holders.size == 0:
            return
        new = np.arange(self.next_slot, self.next_slot + count)
        self.next_slot += count
        span = float(self.walls[-1].mean()) if self.walls[-1].size else 0.0
        arrive = began + rng.random(count) * span
        donors = rng.choice(holders, size=count)
        begin = np.maximum(arrive, clock[donors])
        sw.start[new] = begin + sw.fetch_seconds(cfg, donors, new)
        np.maximum.at(sw.link_free, donors, sw.start[new])
        sw.present[new] = sw.active[new] = True
        self.mixing.copy(new, donors)
        self.t["resync"] += count * cfg.model_bytes
        self.t["joined"] += count

    def _report(self) -> dict[str, Any]:
        cfg, t = self.cfg, self.t
        walls = np.concatenate(self.walls) if self.walls else np.zeros(0)
        node_rounds = max(t["node_rounds"], 1.0)
        round_s = float(walls.mean()) if walls.size else 0.0
        wait = t["wait_s"] / t["waits"] if t["waits"] else 0.0
        mean_n = max(1, round(float(np.mean(self.sizes))))
        total = t["exchange"] + t["repair"] + t["resync"]
        return {
            "n": self.n,
            "rounds": self.rounds,
            "group_size": cfg.group_size,
            "fragments": cfg.fragments,
            "bytes_sent_per_node_round": total / node_rounds,
            "exchange_bytes_per_node_round": t["exchange"] / node_rounds,
            "repair_bytes_per_node_round": t["repair"] / node_rounds,
            "resync_bytes_per_node_round": t["resync"] / node_rounds,
            "round_seconds_mean": round_s,
            "round_seconds_p95": float(np.percentile(walls, 95)) if walls.size else 0.0,
            "utilization": t["compute"] / t["wall"] if t["wall"] else 0.0,
            "matchmaking_wait_s": wait,
            "included_share": t["included"] / t["contributions"] if t["contributions"] else 0.0,
            "reach_share": float(np.mean(self.mixing.reach)) if self.mixing.reach else None,
            "fully_mixed": all(self.mixing.full) if self.mixing.full else None,
            "mix_rounds": self.window,
            "mix_exact_butterfly": self.exact,
            "left": int(t["left"]),
            "joined": int(t["joined"]),
            "resyncs": int(t["resyncs"]),
            "control": control_load(cfg, mean_n, round_s, wait),
        }


def simulate(
    cfg: SimConfig,
    n: int,
    rounds: int,
    seed: int = 0,
    names: Sequence[str] = (),
    mix_rounds: int | None = None,
) -> dict[str, Any]:
    """Simulate ``rounds`` rounds of ``n`` nodes; the same seed gives the same result.

    ``names`` are the first nodes' PeerIDs (a real swarm's, to form its very groups);
    the others are named ``p00000``, ``p00001``, ... ``mix_rounds``: the rounds after
    which reach is measured (default ``rounds_to_mix``, or ``ceil(log_G n)`` where no
    exact butterfly applies; at most ``rounds``).

    Returns a JSON-ready dict: bytes sent per node and round (exchange, repair and
    served state), round wall time (mean and p95 over nodes that finished the round),
    utilization (compute over wall time), the share of contributions included in their
    group's result (``included_share``), the share reaching every node after
    ``mix_rounds`` rounds (``reach_share``, ``fully_mixed``; None when no window
    fits) and :func:`control_load` at the simulated round time.

    Raises:
        ValueError: ``n < 1``, ``rounds < 1``, more ``names`` than ``n``, a name twice
            or ``mix_rounds < 1``.
    """
    _check_n(n)
    if mix_rounds is not None and (not isinstance(mix_rounds, int) or mix_rounds < 1):
        raise ValueError(f"mix_rounds = {mix_rounds!r}: expected at least 1 round")
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds = {rounds!r}: expected at least 1 round")
    if len(names) > n or len(set(names)) != len(names):
        raise ValueError(f"names: expected at most n = {n} distinct names, got {len(names)}")
    return _Run(cfg, n, rounds, seed, list(names), mix_rounds).run()


CALIBRATION_KEYS: dict[str, str] = {
    "step_seconds": "median inner step seconds of one node (real run's steps / compute time)",
    "round_seconds": "{n: measured mean round seconds}; fits sync_overhead_s",
    "control_cpu_per_message_s": "sidecar CPU seconds per control message received",
    "dht_cpu_per_op_s": "CPU seconds per DHT RPC (sent or served)",
    "dht_cpu_per_record_s": "CPU seconds to decode and verify one record",
    "message_overhead_s": "fixed seconds of one part transfer",
    "fragment_bytes": "encoded bytes of one fragment (alias: bytes_per_fragment)",
    "mix_bytes": "bytes of the global copies a sync carries when groups mix",
    "model_bytes": "bytes of the full state a re-sync fetches",
    "record_bytes": "bytes of one registry record",
    "heartbeat_bytes": "bytes of one heartbeat",
}
"""Keys :func:`calibrate` knows; any other :class:`SimConfig` field may also be given."""


def calibrate(
    measured: Mapping[str, Any], base: SimConfig | None = None, rounds: int = 3
) -> SimConfig:
    """A config whose constants come from real runs (see :data:`CALIBRATION_KEYS`).

    Scalars replace the matching fields of ``base`` (default :class:`SimConfig`; pass
    the real runs' workload and one site for local swarms). With ``round_seconds``
    (swarm size -> measured mean round seconds), ``sync_overhead_s`` is then fitted by
    bisection per size so the simulated mean round time matches, and set to the median.

    Raises:
        ValueError: an unknown key or a value a config refuses.
    """
    cfg = base or SimConfig()
    fields = {f.name for f in dataclasses.fields(SimConfig)}
    values = {
        ("fragment_bytes" if k == "bytes_per_fragment" else k): v for k, v in measured.items()
    }
    unknown = sorted(set(values) - fields - {"round_seconds"})
    if unknown:
        raise ValueError(f"calibrate: unknown keys {unknown}; known: {sorted(CALIBRATION_KEYS)}")
    cfg = dataclasses.replace(cfg, **{k: v for k, v in values.items() if k != "round_seconds"})
    targets = values.get("round_seconds") or {}
    fits = [_fit_overhead(cfg, int(n), float(s), rounds) for n, s in targets.items()]
    if fits:
        cfg = dataclasses.replace(cfg, sync_overhead_s=float(np.median(fits)))
    return cfg


def _fit_overhead(cfg: SimConfig, n: int, target: float, rounds: int) -> float:
    """``sync_overhead_s`` that gives ``target`` mean round seconds at ``n`` (0 if unreachable)."""

    def round_s(overhead: float) -> float:
        trial = dataclasses.replace(cfg, sync_overhead_s=overhead)
        return simulate(trial, n, rounds, seed=0)["round_seconds_mean"]

    low, high = 0.0, max(target, 1e-3)
    if round_s(low) >= target:
        return 0.0
    while high - low > 1e-4:
        mid = (low + high) / 2
        low, high = (mid, high) if round_s(mid) < target else (low, mid)
    return (low + high) / 2
