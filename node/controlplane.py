"""The node's control plane: heartbeats, round commitments and verdicts over GossipSub.

Three topics on the node's :class:`~protocol.control.channel.ControlChannel` (a py-libp2p
sidecar), every message signed by the node key and checked on receipt:

* ``heartbeat``: alive, version, capabilities, measured throughput, current round
  and step; what ``atoll status`` shows. Every node hears every heartbeat, and each
  costs its sidecar a few ms of CPU, so in a swarm of ``n`` above
  ``control.base_rate_peers`` a node beats every ``heartbeat_seconds * n /
  base_rate_peers``: a node hears a bounded number of heartbeats per second.
* ``commit``: before an exchange a member publishes the digests of its signed parts
  for ``(round, fragment, content)`` (:class:`~protocol.averaging.parts.Commitments`); an
  owner takes a part only if its sender committed to exactly that digest before the
  owner's own commit phase closed. Two different signed commitments from one peer for
  the same exchange are proof of equivocation. The signed commitment goes straight to
  each member of the group (RPC :data:`COMMIT_RPC` over the node's transport, once
  :meth:`ControlPlane.send_direct` is set); in a swarm of up to
  ``control.base_rate_peers`` nodes it is also gossiped, so every node holds every
  commitment. Above that it is not (every node receiving every commitment would grow
  with the swarm), and an owner puts the commitments it relied on into its signed
  result instead: that is what lets anyone tell a framed owner from a bad one.
* ``verdict``: an accusation with its evidence: for equivocation both signed
  commitments; for a bad owner the head of its signed result (a few kB whatever the
  part's size) and the signed commitment of a contributor whose digest the result
  misstates. Every receiver checks the evidence itself and acts through its own trust
  policy; an accusation whose evidence does not check out is counted and costs the
  accused nothing. A bad-owner accusation whose commitment differs from the one the
  owner's result holds for that contributor (or from one this node received) proves
  the accuser equivocated, and convicts the accuser instead.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack

from protocol.averaging.parts import CONTENTS, Commitments
from protocol.control.channel import ControlChannel
from protocol.control.frames import CONTROL_VERSION, ControlMessage, open_control
from protocol.errors import ProtocolError
from protocol.wire.partwire import open_evidence
from verification.identity import Identity

if TYPE_CHECKING:
    from node.config import ControlConfig
    from node.metrics import EventLog
    from verification.verifier import Verifier

__all__ = [
    "COMMIT_RPC",
    "TOPICS",
    "ControlPlane",
    "check_bad_owner",
    "check_equivocation",
    "topic_name",
]

logger = logging.getLogger(__name__)

TOPICS = ("heartbeat", "commit", "verdict")
COMMIT_RPC = "atoll.commit"
"""The RPC a member's signed commitment is sent to its group members through."""
CAPABILITIES = ("allreduce", "butterfly", "gossip", "commit", "repair", "catch_up")
_ROUNDS_KEPT = 4  # commitments older than this many rounds are forgotten
_MAX_COMMITS = 65536
_POLL_SECONDS = 0.02
_OVERTAKE_SECONDS = 1.0
SILENCE_GRACE_SECONDS = 20.0
"""How long the channel may hear none of the live peers before :meth:`ControlPlane.silence` warns."""


@dataclass(frozen=True)
class _Commit:
    digests: dict[int, bytes]
    received: float  # this node's time.monotonic() when it arrived
    wire: bytes  # the signed message itself: evidence if the sender equivocates


def _wire(msg: ControlMessage) -> bytes:
    return msgpack.packb([CONTROL_VERSION, msg.raw_signed, msg.signature], use_bin_type=True)


def _commit_fields(body: Any) -> tuple[int, int, str, dict[int, bytes]]:
    """``(round, fragment, content, {part: digest})`` of a commitment body, or
    ProtocolError."""
    if not isinstance(body, dict):
        raise ProtocolError("malformed", "commitment body is not a map")
    r, f, pairs = body.get("round"), body.get("fragment"), body.get("digests")
    content = body.get("content")
    if not (isinstance(r, int) and isinstance(f, int) and r >= 0 and f >= 0):
        raise ProtocolError("malformed", "commitment round and fragment must be integers")
    if content not in CONTENTS:
        raise ProtocolError("malformed", f"commitment content {content!r}")
    if not isinstance(pairs, list):
        raise ProtocolError("malformed", "commitment digests must be a list")
    digests: dict[int, bytes] = {}
    for pair in pairs:
        if not (
            isinstance(pair, list)
            and len(pair) == 2
            and isinstance(pair[0], int)
            and isinstance(pair[1], bytes)
            and len(pair[1]) == 32
        ):
            raise ProtocolError("malformed", "a commitment digest is not [part, 32 bytes]")
        digests[pair[0]] = pair[1]
    return r, f, str(content), digests


def topic_name(run: str, topic: str) -> str:
    """The GossipSub topic of ``topic`` in ``run`` (runs never share a topic)."""
    return f"atoll/{run}/{topic}"


def check_equivocation(evidence: Any, accused: str, run: str) -> tuple[int, int]:
    """Check equivocation evidence: two commitments by ``accused`` for the same exchange
    (round, fragment, content), differing.

    Returns:
        The ``(round, fragment)`` the accused equivocated on.

    Raises:
        ProtocolError: the evidence does not prove it (reason ``bad_evidence``).
    """
    if not (isinstance(evidence, list) and len(evidence) == 2):
        raise ProtocolError("bad_evidence", "equivocation needs exactly two commitments")
    opened = []
    for item in evidence:
        if not isinstance(item, bytes):
            raise ProtocolError("bad_evidence", "evidence items must be signed messages")
        try:
            msg = open_control(item, run, topic_name(run, "commit"))
            opened.append((msg, _commit_fields(msg.body)))
        except ProtocolError as exc:
            raise ProtocolError("bad_evidence", f"{exc.reason}: {exc.detail}") from None
    (a, (ra, fa, ca, da)), (b, (rb, fb, cb, db)) = opened
    if a.sender != accused or b.sender != accused:
        raise ProtocolError("bad_evidence", "a commitment is not signed by the accused")
    if (ra, fa, ca) != (rb, fb, cb):
        raise ProtocolError("bad_evidence", "the commitments are for different exchanges")
    if da == db:
        raise ProtocolError("bad_evidence", "the commitments agree")
    return ra, fa


def check_bad_owner(evidence: Any, accused: str, run: str) -> tuple[int, int]:
    """Check bad-owner evidence: the accused's signed result names, for a contributor,
    a digest other than the one that contributor's signed commitment gives.

    Returns:
        The ``(round, fragment)`` of the result.

    Raises:
        ProtocolError: the evidence does not prove it (reason ``bad_evidence``).
    """
    if not isinstance(evidence, dict):
        raise ProtocolError("bad_evidence", "bad-owner evidence is a map")
    reduced, commit = evidence.get("reduced"), evidence.get("commit")
    if not isinstance(reduced, bytes) or not isinstance(commit, bytes):
        raise ProtocolError("bad_evidence", "bad-owner evidence needs a result and a commitment")
    try:
        h, meta = open_evidence(reduced, expected_sender=accused)
        if h.run_id != run or h.kind != "reduced":
            raise ProtocolError("wrong_kind", f"a {h.kind!r} of run {h.run_id!r}")
        msg = open_control(commit, run, topic_name(run, "commit"))
        r, f, content, committed = _commit_fields(msg.body)
    except ProtocolError as exc:
        raise ProtocolError("bad_evidence", f"{exc.reason}: {exc.detail}") from None
    peers, digests = meta.get("contributors"), meta.get("digests")
    if (h.round, h.fragment, meta.get("content")) != (r, f, content) or h.part not in committed:
        raise ProtocolError("bad_evidence", "the commitment is for another exchange or part")
    if not (isinstance(peers, list) and isinstance(digests, list) and msg.sender in peers):
        raise ProtocolError("bad_evidence", "the result does not name the committer")
    named = digests[peers.index(msg.sender)] if len(digests) == len(peers) else None
    if msg.sender == accused or named == committed[h.part]:
        raise ProtocolError("bad_evidence", "the result matches the commitment")
    return r, f


def embedded_commit(reduced: bytes, contributor: str) -> bytes | None:
    """The commitment of ``contributor`` that the owner's signed result (evidence
    bytes) says it relied on, or None when the result holds none."""
    try:
        _, meta = open_evidence(reduced)
    except ProtocolError:
        return None
    peers, commits = meta.get("contributors"), meta.get("commits")
    if not (isinstance(peers, list) and isinstance(commits, list) and len(peers) == len(commits)):
        return None
    if contributor not in peers:
        return None
    wire = commits[peers.index(contributor)]
    return wire if isinstance(wire, bytes) and wire else None


_CHECKS: dict[str, Callable[[Any, str, str], tuple[int, int]]] = {
    "equivocation": check_equivocation,
    "bad_owner": check_bad_owner,
}


class ControlPlane(Commitments):
    """Heartbeats, commitments and verdicts for one node.

    Args:
        cfg: the ``[control]`` settings.
        run_id: the run; messages of other runs are refused.
        identity: the node key (signs every message).
        key_file: the node's private-key file (the sidecar loads the same key).
        data_dir: where the sidecar's log goes.
        verifier: acts on proven misbehaviour through the trust policy.
        events: the node's event log.
        vitals: returns this node's ``round``, ``step`` and ``throughput`` for heartbeats.
        version: this node's software version, sent in heartbeats.
        listen_host: the IP address the sidecar listens on (``network.host``).
    """

    def __init__(
        self,
        cfg: ControlConfig,
        run_id: str,
        identity: Identity,
        key_file: Path,
        data_dir: Path,
        verifier: Verifier,
        events: EventLog | None,
        vitals: Callable[[], dict[str, Any]],
        version: str,
        listen_host: str = "127.0.0.1",
    ) -> None:
        self.cfg = cfg
        self.listen_host = listen_host
        self.run_id = run_id
        self.identity = identity
        self.me = identity.peer_id
        self.verifier = verifier
        self.events = events
        self.vitals = vitals
        self.version = version
        self._key_file = key_file
        self._log_path = data_dir / "sidecar.log"
        self._lock = threading.Lock()
        self._commits: dict[tuple[str, int, int, str], _Commit] = {}
        self._peers: dict[str, dict[str, Any]] = {}
        self._convicted: set[str] = set()
        self._newest = 0
        self._connected: set[str] = set()
        self._dialled: set[str] = set()
        self._quiet_since: float | None = None
        self._swarm_size = 1
        self.counters = {"forged_verdicts": 0, "verdicts": 0, "malformed": 0}
        self._stop = threading.Event()
        self.send_direct: Callable[[str, bytes, float], Awaitable[Any]] | None = None
        """Sends a signed commitment to a peer's :data:`COMMIT_RPC` (peer, bytes,
        timeout); set by the node once its transport serves that RPC."""
        self._sending: set[asyncio.Task] = set()
        self.channel: ControlChannel | None = None
        self._beat: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        """Start the sidecar and the heartbeat thread.

        Raises:
            ControlChannelError: the sidecar did not come up.
        """
        self.channel = ControlChannel.start(
            self._key_file,
            self.run_id,
            [topic_name(self.run_id, t) for t in TOPICS],
            self._on_message,
            identity=self.identity,
            max_bytes=int(self.cfg.max_message_kb * 1024),
            log_path=self._log_path,
            listen_host=self.listen_host,
            port=self.cfg.port,
            announce_maddrs=self.cfg.announce_maddrs,
        )
        self._beat = threading.Thread(target=self._heartbeats, name="atoll-heartbeat", daemon=True)
        self._beat.start()

    def close(self) -> None:
        """Stop heartbeats and the sidecar (reaped)."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join(self.cfg.heartbeat_seconds + 2)
        if self.channel is not None:
            self.channel.close()

    @property
    def addrs(self) -> list[str]:
        return self.channel.addrs if self.channel else []

    @property
    def sidecar_pid(self) -> int | None:
        return self.channel.sidecar_pid if self.channel else None

    def dial(self, candidates: dict[str, Sequence[str]]) -> None:
        """Keep up to ``control.dial_peers`` of the ``candidates`` dialled.

        Args:
            candidates: live peers that can be dialled, with their sidecars' addresses
                (from the registry). Peers dialled before stay chosen while they are
                candidates; the rest of the quota is filled at random. Each node is
                also dialled by others, so it holds about twice the quota in
                connections: enough for a mesh of ``degree`` and a connected swarm,
                and not one connection per node of the swarm.
        """
        chosen = [p for p in self._dialled if p in candidates]
        others = sorted(set(candidates) - set(chosen))
        room = max(0, self.cfg.dial_peers - len(chosen))
        chosen += random.sample(others, min(room, len(others)))
        self._dialled = set(chosen)
        self.connect([a for p in chosen for a in candidates[p]])

    def connect(self, addrs: Sequence[str]) -> None:
        """Dial peers' sidecars not dialled yet (addresses from the DHT registry)."""
        if self.channel is None:
            return
        new = [a for a in addrs if a not in self._connected and "/p2p/" in a]
        if new:
            self._connected.update(new)
            try:
                self.channel.connect(new)
            except ValueError as exc:  # a peer published a bad address; skip it
                logger.warning("control: not dialling %s: %s", new, exc)

    # ---- heartbeats and the swarm view ---------------------------------------------------

    def resize(self, nodes: int) -> None:
        """The swarm now has ``nodes`` nodes, this one included (sets the pace of
        heartbeats and the commit window)."""
        self._swarm_size = max(1, nodes)

    @property
    def stretch(self) -> float:
        """``max(1, n / base_rate_peers)`` for a swarm of ``n``."""
        return max(1.0, self._swarm_size / self.cfg.base_rate_peers)

    @property
    def heartbeat_interval(self) -> float:
        """Seconds between two heartbeats of this node (and of its peers, which see
        about the same swarm): ``heartbeat_seconds``, stretched above
        ``base_rate_peers`` nodes."""
        return self.cfg.heartbeat_seconds * self.stretch

    @property
    def commit_window(self) -> float:
        """Longest wait for the group's commitments: ``commit_seconds``, stretched above
        ``base_rate_peers`` nodes like every paced interval (the phase ends as soon as
        the group's commitments are in, so a longer bound costs nothing when they come)."""
        return self.cfg.commit_seconds * self.stretch

    @property
    def gossips_commitments(self) -> bool:
        """Whether commitments are also gossiped to the whole swarm (up to
        ``base_rate_peers`` nodes) or only sent to the group's members."""
        return self._swarm_size <= self.cfg.base_rate_peers

    def _heartbeats(self) -> None:
        while not self._stop.wait(self.heartbeat_interval):
            body = {"version": self.version, "capabilities": list(CAPABILITIES), **self.vitals()}
            try:
                self._publish("heartbeat", body)
            except Exception:  # a heartbeat must never take the node down
                logger.exception("control: heartbeat failed")

    def swarm(self) -> dict[str, Any]:
        """Peers as this node sees them from heartbeats, with the channel's counters."""
        now = time.time()
        with self._lock:
            peers = {
                p: {**info, "last_seen_s": round(now - info["seen"], 1)}
                for p, info in self._peers.items()
            }
        stats = self.channel.stats() if self.channel else {}
        return {
            "peers": peers,
            "sidecar_pid": self.sidecar_pid,
            "sidecar_restarts": stats.get("restarts", 0),
            "dropped": {**stats.get("dropped", {}), **stats.get("client_dropped", {})},
            **self.counters,
        }

    def heard(self) -> dict[str, dict[str, Any]]:
        """Peers whose heartbeat arrived within five heartbeats, with what it said."""
        window = 5 * self.heartbeat_interval + 5
        now = time.time()
        with self._lock:
            return {p: dict(info) for p, info in self._peers.items() if now - info["seen"] < window}

    def silence(self, live: set[str], now: float | None = None) -> str | None:
        """A warning when this node hears none of the ``live`` peers on the channel.

        Commitments and verdicts travel here: with ``control.commit`` on, owners refuse
        the parts of a node whose commitments never reach them (``uncommitted``, at no
        cost to its reputation), so a deaf channel must be loud. Peers count as heard
        when their heartbeat arrived within five heartbeats; the warning starts after
        :data:`SILENCE_GRACE_SECONDS` of hearing none of them.
        """
        now = time.monotonic() if now is None else now
        heard = set(self.heard())
        if not live or heard & live:
            self._quiet_since = None
            return None
        if self._quiet_since is None:
            self._quiet_since = now
        quiet = now - self._quiet_since
        if quiet < SILENCE_GRACE_SECONDS:
            return None
        text = (
            f"the control channel hears none of the {len(live)} live peers (for {quiet:.0f} s): "
            "commitments and verdicts cannot reach them"
        )
        if self.cfg.commit:
            text += ", so owners refuse this node's parts (uncommitted) and it refuses theirs"
        return text + (
            "; check that control.port is open (TCP) and control.announce_maddrs is right"
        )

    # ---- commitments ------------------------------------------------------------------

    async def commit(
        self,
        round_: int,
        fragment: int,
        group: Sequence[str],
        digests: dict[int, bytes],
        content: str = "update",
    ) -> None:
        wire = await self.publish_commit(round_, fragment, digests, content)
        self._send_to_group(group, wire)
        others = [p for p in group if p != self.me and not self.verifier.blocks(p, round_)]
        deadline = time.monotonic() + self.commit_window
        while time.monotonic() < deadline:
            with self._lock:
                if all((p, round_, fragment, content) in self._commits for p in others):
                    return
            await asyncio.sleep(_POLL_SECONDS)
        logger.info(
            "round %d fragment %d (%s): commit phase closed without %s",
            round_,
            fragment,
            content,
            [p[:12] for p in others if (p, round_, fragment, content) not in self._commits],
        )

    def _send_to_group(self, group: Sequence[str], wire: bytes) -> None:
        """Send the signed commitment to every other member, in the background."""
        if self.send_direct is None or not wire:
            return
        for peer in group:
            if peer != self.me:
                task = asyncio.ensure_future(self._send_one(peer, wire))
                self._sending.add(task)
                task.add_done_callback(self._sending.discard)

    async def _send_one(self, peer: str, wire: bytes) -> None:
        assert self.send_direct is not None
        # without a gossip copy the direct one is the only one: try it twice
        attempts = 1 if self.gossips_commitments else 2
        deadline = time.monotonic() + self.commit_window
        for attempt in range(attempts):
            try:
                await self.send_direct(peer, wire, max(0.1, deadline - time.monotonic()))
                return
            except Exception as exc:
                logger.debug("control: commitment to %s not sent directly: %s", peer[:16], exc)
            if attempt + 1 < attempts:
                await asyncio.sleep(min(_POLL_SECONDS, max(0.0, deadline - time.monotonic())))

    async def receive_commit(self, peer: str, data: bytes) -> bytes:
        """Serve :data:`COMMIT_RPC`: a group member's signed commitment, sent directly.

        Raises:
            ProtocolError: the message is not a valid commitment signed by ``peer``
                (the authenticated caller).
        """
        topic = topic_name(self.run_id, "commit")
        msg = open_control(data, self.run_id, topic, int(self.cfg.max_message_kb * 1024))
        if msg.sender != peer:
            raise ProtocolError("sender_mismatch", f"a commitment signed by {msg.sender}", peer)
        if msg.sender != self.me:
            self._on_commit(msg)
        return b""

    async def publish_commit(
        self, round_: int, fragment: int, digests: dict[int, bytes], content: str = "update"
    ) -> bytes:
        """Publish (and record) this node's commitment for ``(round, fragment, content)``;
        returns the signed message (empty without a channel)."""
        body = {
            "round": round_,
            "fragment": fragment,
            "content": content,
            "digests": [[j, d] for j, d in sorted(digests.items())],
        }
        wire = b""
        if self.channel is not None:
            topic = topic_name(self.run_id, "commit")
            wire = self.channel.sign(topic, body)
            if self.gossips_commitments and not self.channel.publish_signed(topic, wire):
                logger.debug("control: sidecar down, commitment not gossiped")
        with self._lock:
            self._commits[(self.me, round_, fragment, content)] = _Commit(
                dict(digests), time.monotonic(), wire
            )
        return wire

    async def check(
        self,
        peer: str,
        round_: int,
        fragment: int,
        part: int,
        digest: bytes,
        closed_at: float,
        content: str = "update",
    ) -> str | None:
        key = (peer, round_, fragment, content)
        # A commitment travels by gossip and its part by a direct stream, so a part sent
        # right after a (late) commitment can overtake it: wait a moment to tell a late
        # commitment from none at all. Either way the part is refused.
        deadline = time.monotonic() + _OVERTAKE_SECONDS
        while True:
            with self._lock:
                rec = self._commits.get(key)
            if rec is not None or time.monotonic() >= deadline:
                break
            await asyncio.sleep(_POLL_SECONDS)
        if rec is None:
            return "uncommitted"
        if rec.received > closed_at:
            return "late_commit"
        if rec.digests.get(part) != digest:
            return "commit_mismatch"
        return None

    def committed(self, peer: str, round_: int, fragment: int, content: str = "update") -> bool:
        with self._lock:
            return (peer, round_, fragment, content) in self._commits

    def evidence(self, peer: str, round_: int, fragment: int, content: str = "update") -> bytes:
        with self._lock:
            rec = self._commits.get((peer, round_, fragment, content))
        return rec.wire if rec is not None else b""

    def check_result(
        self,
        owner: str,
        round_: int,
        fragment: int,
        part: int,
        reply: bytes,
        contributors: Sequence[str],
        digests: Sequence[bytes],
        content: str = "update",
    ) -> str | None:
        # Only this node's own entry is judged: it knows exactly what it committed to and
        # never commits twice, whereas another contributor's commitment could be one of
        # two it sent (an equivocator framing an honest owner).
        if self.me not in contributors:
            return None
        named = digests[list(contributors).index(self.me)]
        with self._lock:
            rec = self._commits.get((self.me, round_, fragment, content))
        if rec is None or part not in rec.digests or rec.digests[part] == named:
            return None
        if rec.wire:
            evidence = {"reduced": reply, "commit": rec.wire}
            self._convict(owner, round_, fragment, "bad_owner", evidence, publish=True)
        return "bad_owner"

    # ---- incoming ---------------------------------------------------------------------

    def _publish(self, topic: str, body: Any) -> None:
        if self.channel is not None and not self.channel.publish(
            topic_name(self.run_id, topic), body
        ):
            logger.debug("control: sidecar down, %s not sent", topic)

    def _on_message(self, full_topic: str, msg: ControlMessage) -> None:
        if msg.sender == self.me:
            return
        topic = full_topic.rsplit("/", 1)[-1]
        try:
            if topic == "heartbeat":
                self._on_heartbeat(msg)
            elif topic == "commit":
                self._on_commit(msg)
            elif topic == "verdict":
                self._on_verdict(msg)
        except ProtocolError as exc:
            self.counters["malformed"] += 1
            logger.warning("control: %s from %s refused: %s", topic, msg.sender[:16], exc)

    def _on_heartbeat(self, msg: ControlMessage) -> None:
        body = msg.body if isinstance(msg.body, dict) else {}
        info = {
            k: body.get(k)
            for k in (
                "version",
                "capabilities",
                "round",
                "step",
                "throughput",
                "device",
                "reachable",
                "spec",
                "digest",
            )
        }
        info["seen"] = time.time()
        with self._lock:
            self._peers[msg.sender] = info

    def _on_commit(self, msg: ControlMessage) -> None:
        r, f, content, digests = _commit_fields(msg.body)
        key = (msg.sender, r, f, content)
        new = _Commit(digests, time.monotonic(), _wire(msg))
        with self._lock:
            old = self._commits.get(key)
            if old is None:
                self._commits[key] = new
                self._forget_old(r)
                return
        if old.digests != digests and old.wire:
            evidence = [old.wire, new.wire]
            self._convict(msg.sender, r, f, "equivocation", evidence, publish=True)

    def _forget_old(self, r: int) -> None:
        """Drop commitments from rounds long past (called with the lock held)."""
        if r <= self._newest and len(self._commits) < _MAX_COMMITS:
            return
        self._newest = max(self._newest, r)
        for key in [k for k in self._commits if k[1] < self._newest - _ROUNDS_KEPT]:
            del self._commits[key]

    def _on_verdict(self, msg: ControlMessage) -> None:
        body = msg.body if isinstance(msg.body, dict) else {}
        accused, kind = body.get("accused"), body.get("kind")
        self.counters["verdicts"] += 1
        try:
            if not isinstance(accused, str) or kind not in _CHECKS:
                raise ProtocolError("bad_evidence", f"unknown accusation {kind!r}")
            r, f = _CHECKS[kind](body.get("evidence"), accused, self.run_id)
        except ProtocolError as exc:
            # The accused loses nothing; the accuser signed a claim that does not hold.
            self.counters["forged_verdicts"] += 1
            logger.warning(
                "control: verdict from %s against %s ignored: %s",
                msg.sender[:16],
                str(accused)[:16],
                exc.detail,
            )
            if self.events is not None:
                self.events.write(
                    "verdict_ignored", accuser=msg.sender, accused=str(accused), reason=exc.detail
                )
            return
        if kind == "bad_owner" and self._framed(body["evidence"]):
            return
        self._convict(accused, r, f, kind, body["evidence"], publish=False)

    def _framed(self, evidence: dict[str, bytes]) -> bool:
        """Whether bad-owner evidence rests on a commitment its sender contradicted.

        If the owner's result holds another commitment from the same sender for the same
        exchange (the one the owner relied on), or this node received one, the sender
        equivocated: it is the sender, not the owner, that is proven to have cheated.
        """
        msg = open_control(evidence["commit"], self.run_id, topic_name(self.run_id, "commit"))
        r, f, content, digests = _commit_fields(msg.body)
        with self._lock:
            held = self._commits.get((msg.sender, r, f, content))
        for other in (embedded_commit(evidence["reduced"], msg.sender), held and held.wire):
            if not other or other == evidence["commit"]:
                continue
            try:
                check_equivocation([other, evidence["commit"]], msg.sender, self.run_id)
            except ProtocolError:
                continue  # not two differing commitments for this exchange
            self._convict(msg.sender, r, f, "equivocation", [other, evidence["commit"]], True)
            return True
        return False

    def pardoned(self, peer: str) -> None:
        """The operator pardoned ``peer``: new proof of a new offence convicts it again."""
        with self._lock:
            self._convicted.discard(peer)

    def _convict(self, peer: str, r: int, f: int, kind: str, evidence: Any, publish: bool) -> None:
        with self._lock:
            if peer in self._convicted or peer == self.me:
                return
            self._convicted.add(peer)
        self.verifier.convict(peer, r, f, kind)
        if publish:
            verdict = {"accused": peer, "kind": kind, "evidence": evidence}
            try:
                self._publish("verdict", verdict)
            except ValueError:
                # Larger than a control message (a bad owner's result for a big part):
                # this node acts on its own proof; others rely on their own checks.
                logger.warning("control: %s verdict against %s too large to broadcast", kind, peer)
