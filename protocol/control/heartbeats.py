"""Heartbeats and the swarm view: who this node hears on its control channel, and whom it dials.

Every node signs a heartbeat (alive, version, capabilities, measured throughput, current
round and step) on the ``heartbeat`` topic; what a node hears is what ``atoll status``
shows. Every node hears every heartbeat, and each costs its sidecar a few ms of CPU, so
in a swarm of ``n`` above ``control.base_rate_peers`` a node beats every
``heartbeat_seconds * n / base_rate_peers``: a node hears a bounded number of heartbeats
per second (:class:`Pace`). A node dials up to ``control.dial_peers`` peers' sidecars.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from protocol.control.channel import ControlChannel
from protocol.control.frames import ControlMessage, topic_name
from protocol.control.settings import ControlSettings

__all__ = ["CAPABILITIES", "SILENCE_GRACE_SECONDS", "Heartbeats", "Pace", "SelfReport", "stretch"]

logger = logging.getLogger(__name__)

CAPABILITIES = ("allreduce", "butterfly", "gossip", "commit", "repair", "catch_up")
"""What a node says it can do, in every heartbeat."""
SILENCE_GRACE_SECONDS = 20.0
"""How long the channel may hear none of the live peers before :meth:`Heartbeats.silence` warns."""
_FIELDS = (
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


@dataclass(frozen=True)
class SelfReport:
    """What this node's heartbeats say about it.

    Args:
        vitals: returns this node's ``round``, ``step`` and ``throughput`` (and what
            else it reports) for each heartbeat.
        version: this node's software version.
    """

    vitals: Callable[[], dict[str, Any]]
    version: str


def stretch(nodes: int, base_rate_peers: int) -> float:
    """How much every paced interval stretches in a swarm of ``nodes``:
    ``max(1, nodes / base_rate_peers)``."""
    return max(1.0, nodes / base_rate_peers)


class Pace:
    """How often the control plane speaks, for the size of the swarm.

    Up to ``base_rate_peers`` nodes: a heartbeat every ``heartbeat_seconds``, a commit
    phase of up to ``commit_seconds``, commitments gossiped to every node. Above that
    every interval stretches by ``n / base_rate_peers`` and commitments go only to the
    group's members.
    """

    def __init__(self, settings: ControlSettings) -> None:
        self.settings = settings
        self._swarm_size = 1

    def resize(self, nodes: int) -> None:
        """The swarm now has ``nodes`` nodes, this one included."""
        self._swarm_size = max(1, nodes)

    @property
    def stretch(self) -> float:
        """:func:`stretch` for this node's view of the swarm."""
        return stretch(self._swarm_size, self.settings.base_rate_peers)

    @property
    def heartbeat_interval(self) -> float:
        """Seconds between two heartbeats of this node (and of its peers, which see
        about the same swarm): ``heartbeat_seconds``, stretched above
        ``base_rate_peers`` nodes."""
        return self.settings.heartbeat_seconds * self.stretch

    @property
    def commit_window(self) -> float:
        """Longest wait for the group's commitments: ``commit_seconds``, stretched above
        ``base_rate_peers`` nodes like every paced interval (the phase ends as soon as
        the group's commitments are in, so a longer bound costs nothing when they come)."""
        return self.settings.commit_seconds * self.stretch

    @property
    def gossips_commitments(self) -> bool:
        """Whether commitments are also gossiped to the whole swarm (up to
        ``base_rate_peers`` nodes) or only sent to the group's members."""
        return self._swarm_size <= self.settings.base_rate_peers


class Heartbeats:
    """This node's heartbeats, the peers it hears, and the peers it dials.

    Args:
        settings: the control plane's settings.
        pace: how often to beat.
        channel: returns the control channel, None while there is none.
        vitals: returns this node's ``round``, ``step`` and ``throughput`` (and what
            else it reports) for each heartbeat.
        version: this node's software version, sent in heartbeats.
    """

    def __init__(
        self,
        settings: ControlSettings,
        pace: Pace,
        channel: Callable[[], ControlChannel | None],
        vitals: Callable[[], dict[str, Any]],
        version: str,
    ) -> None:
        self.settings = settings
        self.pace = pace
        self.vitals = vitals
        self.version = version
        self._channel = channel
        self._lock = threading.Lock()
        self._peers: dict[str, dict[str, Any]] = {}
        self._connected: set[str] = set()
        self._dialled: set[str] = set()
        self._quiet_since: float | None = None
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._run, name="atoll-heartbeat", daemon=True)

    def start(self) -> None:
        """Start beating, on a thread of its own."""
        self._beat.start()

    def close(self) -> None:
        """Stop beating."""
        self._stop.set()
        if self._beat.is_alive():
            self._beat.join(self.settings.heartbeat_seconds + 2)

    def _run(self) -> None:
        topic = topic_name(self.settings.run_id, "heartbeat")
        while not self._stop.wait(self.pace.heartbeat_interval):
            body = {"version": self.version, "capabilities": list(CAPABILITIES), **self.vitals()}
            try:
                channel = self._channel()
                if channel is not None and not channel.publish(topic, body):
                    logger.debug("control: sidecar down, heartbeat not sent")
            except Exception:  # a heartbeat must never take the node down
                logger.exception("control: heartbeat failed")

    # ---- the peers heard ------------------------------------------------------------------

    def receive(self, msg: ControlMessage) -> None:
        """Take a peer's heartbeat (what it said last replaces what it said before)."""
        body = msg.body if isinstance(msg.body, dict) else {}
        info = {k: body.get(k) for k in _FIELDS}
        info["seen"] = time.time()
        with self._lock:
            self._peers[msg.sender] = info

    def peers(self) -> dict[str, dict[str, Any]]:
        """Every peer heard, with what it said last and ``last_seen_s`` ago."""
        now = time.time()
        with self._lock:
            return {
                p: {**info, "last_seen_s": round(now - info["seen"], 1)}
                for p, info in self._peers.items()
            }

    def heard(self) -> dict[str, dict[str, Any]]:
        """Peers whose heartbeat arrived within five heartbeats, with what it said."""
        window = 5 * self.pace.heartbeat_interval + 5
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
        if self.settings.commit:
            text += ", so owners refuse this node's parts (uncommitted) and it refuses theirs"
        return text + (
            "; check that control.port is open (TCP) and control.announce_maddrs is right"
        )

    # ---- dialling -------------------------------------------------------------------------

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
        room = max(0, self.settings.dial_peers - len(chosen))
        chosen += random.sample(others, min(room, len(others)))
        self._dialled = set(chosen)
        self.connect([a for p in chosen for a in candidates[p]])

    def connect(self, addrs: Sequence[str]) -> None:
        """Dial peers' sidecars not dialled yet (addresses from the DHT registry)."""
        channel = self._channel()
        if channel is None:
            return
        new = [a for a in addrs if a not in self._connected and "/p2p/" in a]
        if new:
            self._connected.update(new)
            try:
                channel.connect(new)
            except ValueError as exc:  # a peer published a bad address; skip it
                logger.warning("control: not dialling %s: %s", new, exc)
