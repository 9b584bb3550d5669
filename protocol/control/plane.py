"""A node's control plane: heartbeats, round commitments, verdicts and useful-work check
records over GossipSub.

Four topics on the node's :class:`~protocol.control.channel.ControlChannel` (a py-libp2p
sidecar), every message signed by the node key and checked on receipt:

* ``heartbeat``: alive, version, capabilities, throughput, round and step
  (:mod:`protocol.control.heartbeats`);
* ``commit``: before an exchange a member commits to the digests of its signed parts
  (:mod:`protocol.control.commitments`); the commitment also goes straight to each
  member of the group, over the node's transport (RPC
  :data:`~protocol.control.commitments.COMMIT_RPC`, which the plane serves);
* ``verdict``: an accusation with its evidence, checked by every receiver
  (:mod:`protocol.control.verdicts`, by the rules of :mod:`verification.evidence`);
* ``check``: a useful-work check record, signed by its checker and judged by each
  receiver (:mod:`node.checks`; the plane only carries it).

:class:`ControlPlane` is what the node holds: it starts and closes the channel and the
heartbeats, hands each message to its part, and reports what it sees.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from protocol.control.channel import ControlChannel
from protocol.control.commitments import (
    COMMIT_RPC,
    CommitLinks,
    CommitmentStore,
    SendDirect,
)
from protocol.control.frames import ControlMessage, topic_name
from protocol.control.heartbeats import Heartbeats, Pace, SelfReport
from protocol.control.settings import ControlSettings
from protocol.control.verdicts import Convictions, Verdicts
from protocol.errors import ProtocolError
from verification.identity import Identity

if TYPE_CHECKING:
    from protocol.p2p.transport import Transport
    from verification.verifier import EventSink, Verifier

__all__ = ["COMMIT_RPC", "TOPICS", "ControlPlane", "topic_name"]

logger = logging.getLogger(__name__)

TOPICS = ("heartbeat", "commit", "verdict", "check")
"""The topics of a run's control channel (see :func:`topic_name`)."""


def _direct(transport: Transport | None) -> SendDirect | None:
    """Sends a commitment to a peer's :data:`COMMIT_RPC` over ``transport``."""
    if transport is None:
        return None

    async def send(peer: str, wire: bytes, timeout: float) -> Any:
        return await transport.call(peer, COMMIT_RPC, wire, timeout=timeout)

    return send


class ControlPlane:
    """Heartbeats, commitments and verdicts for one node.

    Args:
        settings: the ``[control]`` settings, with the channel's.
        identity: the node key (signs every message).
        transport: the node's transport: commitments go straight to the group's members
            through it, and it serves theirs; None sends and serves none.
        verifier: acts on proven misbehaviour through the trust policy.
        events: the node's event log.
        report: what this node's heartbeats say (its round, step, throughput and
            software version).
    """

    def __init__(
        self,
        settings: ControlSettings,
        identity: Identity,
        transport: Transport | None,
        verifier: Verifier,
        events: EventSink | None,
        report: SelfReport,
    ) -> None:
        self.settings = settings
        self.identity = identity
        self.me = identity.peer_id
        self.transport = transport
        self.verifier = verifier
        self.channel: ControlChannel | None = None
        self.pace = Pace(settings)
        self.heartbeats = Heartbeats(
            settings, self.pace, self._channel, report.vitals, report.version
        )
        self.convictions = Convictions(self.me, verifier, self._publish_verdict)
        links = CommitLinks(
            self._channel, verifier.blocks, self.convictions.convict, _direct(transport)
        )
        self.commitments = CommitmentStore(settings, self.me, self.pace, links, verifier.clock)
        self.verdicts = Verdicts(settings.run_id, self.commitments, self.convictions, events)
        self.on_check: Callable[[str, bytes], None] | None = None
        """Takes a useful-work check record gossiped on ``check`` (sender, record bytes)."""
        self.malformed = 0

    # ---- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        """Start the sidecar and the heartbeats, and serve :data:`COMMIT_RPC`.

        Raises:
            ControlChannelError: the sidecar did not come up.
        """
        run = self.settings.run_id
        self.channel = ControlChannel.start(
            self.settings.channel,
            [topic_name(run, t) for t in TOPICS],
            self._on_message,
            identity=self.identity,
        )
        self.heartbeats.start()
        if self.transport is not None:
            self.transport.add_handler(
                COMMIT_RPC,
                self.commitments.receive_commit,
                max_request_bytes=self.settings.max_bytes,
            )

    def close(self) -> None:
        """Stop heartbeats and the sidecar (reaped)."""
        self.heartbeats.close()
        if self.channel is not None:
            self.channel.close()

    def _channel(self) -> ControlChannel | None:
        return self.channel

    @property
    def addrs(self) -> list[str]:
        """Where peers dial this node's sidecar (empty before it started)."""
        return self.channel.addrs if self.channel else []

    @property
    def sidecar_pid(self) -> int | None:
        return self.channel.sidecar_pid if self.channel else None

    # ---- the swarm's size and view ------------------------------------------------------

    def resize(self, nodes: int) -> None:
        """The swarm now has ``nodes`` nodes, this one included (sets the pace of
        heartbeats and the commit window)."""
        self.pace.resize(nodes)

    @property
    def commit_window(self) -> float:
        """Longest wait for a group's commitments (:attr:`Pace.commit_window`)."""
        return self.pace.commit_window

    def dial(self, candidates: dict[str, Sequence[str]]) -> None:
        """Keep up to ``control.dial_peers`` of the ``candidates`` dialled
        (:meth:`Heartbeats.dial`)."""
        self.heartbeats.dial(candidates)

    def heard(self) -> dict[str, dict[str, Any]]:
        """Peers whose heartbeat arrived within five heartbeats, with what it said."""
        return self.heartbeats.heard()

    def silence(self, live: set[str], now: float | None = None) -> str | None:
        """A warning when this node hears none of the ``live`` peers
        (:meth:`Heartbeats.silence`)."""
        return self.heartbeats.silence(live, now)

    @property
    def counters(self) -> dict[str, int]:
        """Verdicts received, forged verdicts among them, malformed messages refused."""
        return {**self.verdicts.counters, "malformed": self.malformed}

    def swarm(self) -> dict[str, Any]:
        """Peers as this node sees them from heartbeats, with the channel's counters."""
        stats = self.channel.stats() if self.channel else {}
        return {
            "peers": self.heartbeats.peers(),
            "sidecar_pid": self.sidecar_pid,
            "sidecar_restarts": stats.get("restarts", 0),
            "dropped": {**stats.get("dropped", {}), **stats.get("client_dropped", {})},
            **self.counters,
        }

    def pardoned(self, peer: str) -> None:
        """The operator pardoned ``peer``: new proof of a new offence convicts it again."""
        self.convictions.pardoned(peer)

    # ---- messages ---------------------------------------------------------------------

    def _publish_verdict(self, body: Any) -> None:
        topic = topic_name(self.settings.run_id, "verdict")
        if self.channel is not None and not self.channel.publish(topic, body):
            logger.debug("control: sidecar down, verdict not sent")

    def publish_check(self, record: bytes) -> bool:
        """Gossip a signed useful-work check record to the run; False when not sent."""
        topic = topic_name(self.settings.run_id, "check")
        return self.channel is not None and bool(self.channel.publish(topic, record))

    def _on_message(self, full_topic: str, msg: ControlMessage) -> None:
        if msg.sender == self.me:
            return
        topic = full_topic.rsplit("/", 1)[-1]
        try:
            if topic == "heartbeat":
                self.heartbeats.receive(msg)
            elif topic == "commit":
                self.commitments.receive(msg)
            elif topic == "verdict":
                self.verdicts.receive(msg)
            elif topic == "check" and self.on_check is not None:
                if not isinstance(msg.body, bytes):
                    raise ProtocolError("malformed", "a check record is bytes", msg.sender)
                self.on_check(msg.sender, msg.body)
        except ProtocolError as exc:
            self.malformed += 1
            logger.warning("control: %s from %s refused: %s", topic, msg.sender[:16], exc)
