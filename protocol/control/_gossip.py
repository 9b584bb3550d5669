"""The py-libp2p side of the control sidecar: GossipSub host, router and peers.

Owns the GossipSub parameter choices and peer scoring, the per-instance workarounds
for py-libp2p 0.8.1 (a router whose mesh settles, a pubsub that survives malformed
RPCs and counts what it drops, quieter libp2p logging), loading the node's key as a
libp2p key pair, and keeping the node's wanted peers dialled. What 0.8.1 lets no
instance set is changed once for the whole process by :mod:`protocol.control._patch`.
:mod:`protocol.control.sidecar` runs these in its own process; like it, this module
imports neither hivemind nor torch.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost, INetStream
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair, PrivateKey
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.pubsub.gossipsub import PROTOCOL_ID, PROTOCOL_ID_V11, PROTOCOL_ID_V12, GossipSub
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import Pubsub
from libp2p.pubsub.score import ScoreParams, TopicScoreParams
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport

from verification.identity import Identity

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GossipSettings:
    """GossipSub and queue settings, sized for Atoll's control traffic.

    Atoll sends a few small messages per second per node, in swarms of up to
    about 64 nodes. py-libp2p's defaults drop messages silently well below that,
    so every limit here is set deliberately.

    Attributes:
        degree: target mesh degree D (go-libp2p's default); 6 mesh links reach
            64 nodes in about three hops.
        degree_low: graft below this many mesh peers.
        degree_high: prune above this many mesh peers.
        heartbeat_s: mesh maintenance and gossip period (py-libp2p's default is
            120 s, which leaves a fresh mesh unrepaired for minutes).
        gossip_window: heartbeats of history advertised in IHAVE gossip.
        gossip_history: heartbeats of messages kept for IWANT replies.
        max_messages_per_topic_per_second: py-libp2p's per-forwarder flood limit.
            A mesh neighbour relays the whole swarm's traffic, so its default of
            10/s drops messages at 64 nodes x a few/s; this is a flood guard only.
        ihave_iwant_per_second: per-peer IHAVE/IWANT limits (default 10/s).
        outbound_queue: RPCs queued per peer before new ones are dropped
            (default 32): a few seconds of the whole swarm's traffic.
        subscription_queue: messages queued for delivery to the node per topic
            before new ones are dropped (default 32).
        max_pending_per_peer: messages held for a peer whose identify or
            subscription is still in flight (default 100).
        idontwant_ids: message ids remembered per peer from IDONTWANT.
        event_queue: events queued for the node pipe before new ones are dropped.
        stats_interval_s: how often a stats event is sent unasked.
        redial_s: first and longest wait before dialling a wanted peer that is
            not connected again (doubling after each failure).
    """

    degree: int = 6
    degree_low: int = 4
    degree_high: int = 12
    heartbeat_s: int = 1
    gossip_window: int = 3
    gossip_history: int = 5
    max_messages_per_topic_per_second: float = 1000.0
    ihave_iwant_per_second: float = 100.0
    outbound_queue: int = 1024
    subscription_queue: int = 4096
    max_pending_per_peer: int = 256
    idontwant_ids: int = 1024
    event_queue: int = 4096
    stats_interval_s: float = 2.0
    redial_s: tuple[float, float] = (1.0, 30.0)


GOSSIP = GossipSettings()

# Peer scoring (GossipSub v1.1). Only the penalty for invalid messages (P4) and
# for protocol misbehaviour (P5) carry weight: P1-P3 reward would need tuning
# against real traffic, and P7 (IP colocation) would punish Atoll's normal
# layouts (a local swarm on 127.0.0.1, a cluster behind one NAT). One invalid
# message costs 10 points and the count decays by 1 % a heartbeat (half-life
# about 70 s), so a peer stops receiving our gossip after ~10 recent invalid
# messages, has its own messages refused after ~20, and is ignored after ~40.
SCORE_PARAMS = ScoreParams(
    p4_invalid_messages=TopicScoreParams(weight=10.0, cap=100.0, decay=0.99),
    p5_behavior_penalty_weight=1.0,
    p5_behavior_penalty_threshold=10.0,
    p5_behavior_penalty_decay=0.99,
    gossip_threshold=-100.0,
    publish_threshold=-200.0,
    graylist_threshold=-400.0,
    accept_px_threshold=0.0,
)

_MISBEHAVIOUR_PENALTY = 10.0  # P5 points for a frame py-libp2p cannot process
_ADDRS_PER_PEER = 8


def new_gossip_host(key_pair: KeyPair) -> IHost:
    """A libp2p host for ``key_pair`` that speaks Noise only."""
    noise = NoiseTransport(key_pair, noise_privkey=create_x25519_key_pair().private_key)
    # Noise only: new_host()'s default also accepts plaintext, secio and TLS.
    return new_host(key_pair=key_pair, sec_opt={NOISE_PROTOCOL_ID: noise})


class _SteadyGossipSub(GossipSub):
    """GossipSub whose mesh settles once a topic has more than ``degree_high`` peers.

    py-libp2p 0.8.1 grafts up to two more peers into every mesh at every heartbeat
    ("opportunistic grafting", which the spec runs only when the mesh's median score
    is low, every minute or so), prunes back to ``degree`` once the mesh passes
    ``degree_high``, and does not back off from the peers it pruned: with more than
    ``degree_high`` peers on a topic (a swarm of 14 nodes or more, all dialled) the mesh
    churns every second, and each peer that is grafted again within 10 s of a prune
    is punished as a "GRAFT flood" until scores fall below the publish and graylist
    thresholds and messages stop flowing (measured here with 16 nodes: no commitment
    reached a group member within the commit phase). Opportunistic grafting is off
    (P1-P3 carry no weight here, so every score is 0 and it would only churn), and a
    GRAFT within a backoff is answered with a PRUNE, as the spec says, not punished.

    IDONTWANT (GossipSub v1.2) is not sent: py-libp2p sends one RPC per mesh peer for
    every message it receives, whatever its size, where go-libp2p sends them only for
    messages over 1 KiB. For Atoll's messages of a few hundred bytes that doubled the
    RPCs a sidecar handles and cost more than the duplicates it saved. Those received
    from peers are still honoured.
    """

    def _perform_opportunistic_grafting(self, topic: str, peers_to_graft: Any) -> int:
        return 0

    async def _emit_idontwant_for_message(self, msg_id: bytes, topic_ids: Any) -> None:
        return None


def new_router() -> GossipSub:
    """A GossipSub router configured from :data:`GOSSIP` and :data:`SCORE_PARAMS`."""
    router = _SteadyGossipSub(
        protocols=[PROTOCOL_ID_V12, PROTOCOL_ID_V11, PROTOCOL_ID],
        degree=GOSSIP.degree,
        degree_low=GOSSIP.degree_low,
        degree_high=GOSSIP.degree_high,
        gossip_window=GOSSIP.gossip_window,
        gossip_history=GOSSIP.gossip_history,
        heartbeat_interval=GOSSIP.heartbeat_s,
        do_px=False,  # peers come from the node, not from other peers' suggestions
        score_params=SCORE_PARAMS,
        max_idontwant_messages=GOSSIP.idontwant_ids,
        # Adaptive gossip "repairs" poor health by stretching the heartbeat
        # to 30-60 s; eclipse protection grafts past D_high on IP diversity,
        # which a local swarm on one IP never has.
        adaptive_gossip_enabled=False,
        spam_protection_enabled=True,
        max_messages_per_topic_per_second=GOSSIP.max_messages_per_topic_per_second,
        eclipse_protection_enabled=False,
        max_pending_messages_per_peer=GOSSIP.max_pending_per_peer,
    )
    router.max_ihave_messages_per_second = GOSSIP.ihave_iwant_per_second
    router.max_iwant_requests_per_second = GOSSIP.ihave_iwant_per_second
    router.graft_flood_threshold = 0.0  # see _SteadyGossipSub
    return router


class CountingPubsub(Pubsub):
    """Pubsub that survives malformed input and counts what it drops.

    In py-libp2p 0.8.1 one bad frame from a peer ends the whole pubsub service:
    an RPC that is not protobuf raises ``DecodeError`` out of the stream handler
    (which only catches libp2p's own ``ParseError``), and a message with a
    malformed ``key`` raises out of the libp2p signature check inside a task.
    Both are caught here, counted in :attr:`drops`, and charged to the peer's score.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.drops: Counter[str] = Counter()
        """What this pubsub dropped, by reason (py-libp2p counts nothing it drops)."""
        super().__init__(*args, **kwargs)

    async def stream_handler(self, stream: INetStream) -> None:
        peer_id = stream.muxed_conn.peer_id
        try:
            await super().stream_handler(stream)
        except Exception as e:
            self._punish(peer_id, "bad_rpc", e)
            with contextlib.suppress(Exception):
                await stream.reset()
            self._handle_dead_peer(peer_id)

    async def push_msg(self, msg_forwarder: ID, msg: rpc_pb2.Message) -> None:
        try:
            await super().push_msg(msg_forwarder, msg)
        except Exception as e:
            self._punish(msg_forwarder, "bad_libp2p_message", e)

    def _punish(self, peer_id: ID, reason: str, error: Exception) -> None:
        self.drops[reason] += 1
        logger.warning("%s from %s: %s: %s", reason, peer_id, type(error).__name__, error)
        scorer = getattr(self.router, "scorer", None)
        if scorer is not None:
            scorer.penalize_behavior(peer_id, _MISBEHAVIOUR_PENALTY)

    def notify_subscriptions(self, publish_message: rpc_pb2.Message) -> None:
        for topic in publish_message.topicIDs:
            channel = self.subscribed_topics_send.get(topic)
            if channel is None:
                continue
            try:
                channel.send_nowait(publish_message)
            except trio.WouldBlock:
                self.drops["subscription_queue_full"] += 1
                logger.warning("delivery queue for topic %s is full; message dropped", topic)


def quiet_libp2p_logs() -> None:
    """Route py-libp2p's warnings through the root logger and mute its noise."""
    # py-libp2p detaches its loggers unless LIBP2P_DEBUG is set; route its
    # warnings through ours.
    libp2p_logger = logging.getLogger("libp2p")
    libp2p_logger.propagate = True
    libp2p_logger.setLevel(logging.WARNING)
    # This one pins itself to INFO and logs every 10 s; the TCP transport logs
    # each refused dial as an error, which the redial loop reports itself.
    logging.getLogger("libp2p.network.auto_connector").setLevel(logging.WARNING)
    logging.getLogger("libp2p.transport.tcp.tcp").setLevel(logging.CRITICAL)


def load_key_pair(path: str) -> KeyPair:
    """The libp2p key pair for the node's identity file (checked by Identity.load)."""
    identity = Identity.load(path)
    with open(path, "rb") as f:
        key_data = PrivateKey.deserialize_from_protobuf(f.read()).data
    # The file holds seed || public key; the seed alone determines the key.
    key_pair = create_new_key_pair(bytes(key_data[:32]))
    peer_id = ID.from_pubkey(key_pair.public_key).to_base58()
    if peer_id != identity.peer_id:
        raise ValueError(f"{path}: libp2p derives {peer_id}, Atoll derives {identity.peer_id}")
    return key_pair


def peer_stats(
    host: IHost, pubsub: Pubsub, router: GossipSub, topics: tuple[str, ...]
) -> dict[str, Any]:
    """The peer part of the stats event: peers, their topics, mesh sizes, addresses."""
    return {
        "peers": sorted(p.to_base58() for p in pubsub.peers),
        "topic_peers": {
            t: sorted(p.to_base58() for p in pubsub.peer_topics.get(t, ())) for t in topics
        },
        "mesh": {t: len(router.mesh.get(t, ())) for t in topics},
        "peer_addrs": {p.to_base58(): _addrs_of(host, p) for p in pubsub.peers},
    }


def _addrs_of(host: IHost, peer_id: ID) -> list[str]:
    """Where ``peer_id`` can be dialled, as identify reported it (for restarts)."""
    try:
        addrs = host.get_peerstore().addrs(peer_id)
    except Exception:  # PeerStoreError when nothing is known
        return []
    suffix = f"/p2p/{peer_id.to_base58()}"
    texts = (str(a) for a in addrs)
    return [
        t if t.endswith(suffix) else t + suffix
        for t in texts
        if "/p2p/" not in t or t.endswith(suffix)
    ]


class PeerDialer:
    """Keeps the peers the node asked for connected, redialling with backoff.

    Args:
        host: the libp2p host to dial from.
        log: reports a line to the node, as ``log(level, text)``.
    """

    def __init__(self, host: IHost, log: Callable[[str, str], None]) -> None:
        self.host = host
        self.wanted: dict[ID, list[multiaddr.Multiaddr]] = {}
        self._log = log
        self._my_id = host.get_id()
        self._dialing: set[ID] = set()
        self._dial_failures: Counter[ID] = Counter()
        self._next_dial: dict[ID, float] = {}
        self._nursery: trio.Nursery | None = None

    def start(self, nursery: trio.Nursery) -> None:
        """Dial from ``nursery`` from now on, and redial wanted peers there."""
        self._nursery = nursery
        nursery.start_soon(self._redial_forever)

    def connect(self, addrs: Any) -> None:
        """Want the peers at ``addrs`` (multiaddrs with /p2p/<id>) and dial them."""
        if not isinstance(addrs, list):
            self._log("warning", "connect: addrs must be a list of multiaddrs")
            return
        by_peer: dict[ID, list[multiaddr.Multiaddr]] = {}
        for text in addrs:
            try:
                info = info_from_p2p_addr(multiaddr.Multiaddr(text))
            except Exception as e:  # py-libp2p raises several unrelated types here
                self._log("warning", f"connect: bad address {text!r}: {e}")
                continue
            if info.peer_id == self._my_id:
                continue
            by_peer.setdefault(info.peer_id, []).extend(info.addrs)
        for peer_id, peer_addrs in by_peer.items():
            known = [a for a in self.wanted.get(peer_id, []) if a not in peer_addrs]
            self.wanted[peer_id] = (peer_addrs + known)[:_ADDRS_PER_PEER]  # newest first
            self._start_dial(peer_id)

    def _start_dial(self, peer_id: ID) -> None:
        if self._nursery is None or peer_id in self._dialing or self._is_connected(peer_id):
            return
        self._dialing.add(peer_id)
        self._nursery.start_soon(self._dial, peer_id)

    async def _dial(self, peer_id: ID) -> None:
        # The swarm applies its own dial timeout; cancelling a dial half-way
        # through its handshake could leave a corrupt connection behind. It
        # also refuses to dial a peer for 60 s after a failed dial; our own
        # backoff replaces that, so a restarted peer is found in seconds.
        network = self.host.get_network()
        if hasattr(network, "unblock_peer"):
            network.unblock_peer(peer_id)
        try:
            await self.host.connect(PeerInfo(peer_id, list(self.wanted.get(peer_id, []))))
        except Exception as e:
            failures = self._dial_failures[peer_id] = self._dial_failures[peer_id] + 1
            first, longest = GOSSIP.redial_s
            self._next_dial[peer_id] = trio.current_time() + min(
                first * 2 ** (failures - 1), longest
            )
            if failures == 1:
                self._log("warning", f"could not connect to {peer_id}: {type(e).__name__}: {e}")
            else:
                logger.debug("redial of %s failed: %s", peer_id, e)
        else:
            self._next_dial.pop(peer_id, None)
            if self._dial_failures.pop(peer_id, 0):
                self._log("info", f"connected to {peer_id} again")
        finally:
            self._dialing.discard(peer_id)

    def _is_connected(self, peer_id: ID) -> bool:
        try:
            return bool(self.host.get_network().get_connections(peer_id))
        except Exception:
            return False

    async def _redial_forever(self) -> None:
        while True:
            await trio.sleep(GOSSIP.redial_s[0])
            now = trio.current_time()
            for peer_id in list(self.wanted):
                if now >= self._next_dial.get(peer_id, 0.0):
                    self._start_dial(peer_id)
