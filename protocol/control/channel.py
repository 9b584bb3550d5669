"""The node's end of the control channel: signed GossipSub broadcasts via a sidecar.

:class:`ControlChannel` runs :mod:`protocol.control.sidecar` as a child process (py-libp2p
cannot live in a process that has imported hivemind) and speaks the framed msgpack
protocol of :mod:`protocol.control.frames` with it. It owns the outgoing side: the
topics joined, signing with rising sequence numbers, publishing, dialling. Its
collaborators own the rest: :class:`~protocol.control.supervisor.Supervisor` runs the
sidecar and restarts it when it dies, :class:`~protocol.control.inbox.Inbox` checks
every message it is handed, :class:`~protocol.control.redial.Redial` keeps whom a new
sidecar dials again, and :class:`~protocol.control.tally.ChannelTally` counts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from protocol.control._process import STOP_TIMEOUT_S
from protocol.control.frames import sign_control
from protocol.control.inbox import Inbox, OnMessage
from protocol.control.redial import Redial
from protocol.control.settings import ChannelSettings
from protocol.control.supervisor import Supervisor
from protocol.control.tally import ChannelTally
from protocol.p2p.addrs import expand_wildcard, publishable, with_peer_id
from verification.identity import Identity

__all__ = ["ChannelSettings", "ControlChannel", "ControlChannelError"]

_REMEMBERED_PEERS = 256  # peers whose addresses a restarted sidecar dials again


class ControlChannelError(RuntimeError):
    """The control sidecar could not be started, or the channel is closed."""


class ControlChannel:
    """A node's GossipSub control channel, served by a supervised sidecar process.

    Build one with :meth:`start`; use it as a context manager or call
    :meth:`close`. All methods are thread-safe.

    Delivery is best effort and unordered, even from one sender (py-libp2p
    handles each received message in its own task): order by ``seq`` or ``ts``
    where it matters. A node never receives its own messages.
    """

    def __init__(
        self,
        settings: ChannelSettings,
        identity: Identity,
        topics: Sequence[str],
        on_message: OnMessage,
    ) -> None:
        self.settings = settings
        self._identity = identity
        self._topics = tuple(dict.fromkeys(topics))
        self._announce = [with_peer_id(a, identity.peer_id) for a in settings.announce_maddrs]
        self._lock = threading.Lock()  # guards the sequence number
        self._seq = time.time_ns() // 1000  # rises across node restarts too
        self._tally = ChannelTally()
        self._redial = Redial(_REMEMBERED_PEERS)
        inbox = Inbox(settings, self._topics, on_message, self._tally)
        self._sidecar = Supervisor(
            settings, identity, self._topics, inbox, self._tally, self._redial
        )

    @classmethod
    def start(
        cls,
        settings: ChannelSettings,
        topics: Sequence[str],
        on_message: OnMessage,
        *,
        identity: Identity | None = None,
    ) -> ControlChannel:
        """Start the sidecar and wait until it listens and has joined ``topics``.

        Args:
            settings: the sidecar's key file, run, caps, address and timeouts.
            topics: the GossipSub topics to join; namespace them by run if several
                runs may share peers.
            on_message: called with ``(topic, message)`` for each verified message
                from another node, on the channel's own thread; keep it short.
            identity: the node's identity, loaded from ``settings.key_file`` if
                omitted; it signs what :meth:`publish` sends.

        Returns:
            The running channel.

        Raises:
            ValueError: for bad topics, or a key file that is not ``identity``'s.
            ControlChannelError: if the sidecar does not become ready.
        """
        key_file = Path(settings.key_file)
        file_identity = Identity.load(key_file)
        if identity is None:
            identity = file_identity
        elif identity.peer_id != file_identity.peer_id:
            raise ValueError(
                f"{key_file} holds {file_identity.peer_id}, not the identity {identity.peer_id}"
            )
        if not topics or not all(isinstance(t, str) and t for t in topics):
            raise ValueError("topics must be one or more non-empty strs")
        channel = cls(settings, identity, topics, on_message)
        error = channel._sidecar.start()
        if error is not None:
            channel.close()
            raise ControlChannelError(f"control sidecar failed to start: {error}")
        return channel

    def __enter__(self) -> ControlChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def peer_id(self) -> str:
        """This node's PeerID, as the sidecar reports it (always the identity's)."""
        return self._sidecar.peer_id or self._identity.peer_id

    @property
    def addrs(self) -> list[str]:
        """Where peers can dial the sidecar, each ending in ``/p2p/<peer id>``: the
        announced addresses if any, else the listen addresses (a wildcard expanded to
        this host's interfaces; loopback only when listening on loopback)."""
        if self._announce:
            return list(self._announce)
        return publishable(expand_wildcard(self._sidecar.addrs), self.settings.listen_host)

    @property
    def restarts(self) -> int:
        """How many times a dead sidecar was replaced by a ready one."""
        return self._tally.restarts

    @property
    def sidecar_pid(self) -> int | None:
        """The current sidecar's pid, or None between a death and its restart."""
        return self._sidecar.pid

    def publish(self, topic: str, body: Any) -> bool:
        """Sign ``body`` and broadcast it on ``topic``.

        Returns:
            True if the sidecar took the message; False if it is down (between
            a death and its restart), counted as ``sidecar_down`` in :meth:`stats`.

        Raises:
            ValueError: if ``topic`` was not joined, or the signed message would
                exceed ``max_bytes``.
            TypeError: if ``body`` holds a value msgpack cannot encode.
            ControlChannelError: if the channel is closed.
        """
        return self.publish_signed(topic, self.sign(topic, body))

    def sign(self, topic: str, body: Any) -> bytes:
        """Sign ``body`` for ``topic`` with the next sequence number, without sending it.

        The caller keeps the signed bytes (as evidence of what it said) and sends them
        with :meth:`publish_signed`. Raises as :meth:`publish` does.
        """
        if topic not in self._topics:
            raise ValueError(f"topic {topic!r} was not joined; joined: {list(self._topics)}")
        if self._sidecar.closing.is_set():
            raise ControlChannelError("the control channel is closed")
        with self._lock:
            seq = self._seq
            self._seq += 1
        settings = self.settings
        return sign_control(
            self._identity, settings.run, topic, seq, body, max_bytes=settings.max_bytes
        )

    def publish_signed(self, topic: str, data: bytes) -> bool:
        """Broadcast a message made by :meth:`sign`; returns as :meth:`publish` does."""
        sent = self._sidecar.send({"op": "publish", "topic": topic, "data": data})
        if sent:
            self._tally.traffic("published", data)
        return sent

    def connect(self, addrs: Iterable[str]) -> None:
        """Dial peers at ``addrs`` (multiaddrs ending in ``/p2p/<peer id>``).

        The sidecar keeps dialling them while they are unreachable, and a
        restarted sidecar dials them again. Dial failures are logged, not raised.

        Raises:
            ValueError: if an address is not a str with a ``/p2p/`` part.
        """
        new = []
        for addr in addrs:
            if not isinstance(addr, str) or "/p2p/" not in addr:
                raise ValueError(f"not a multiaddr with /p2p/<peer id>: {addr!r}")
            if addr.rsplit("/p2p/", 1)[1] == self.peer_id:
                continue
            new.append(addr)
        self._redial.asked(new)
        if new:
            self._sidecar.send({"op": "connect", "addrs": new})

    def stats(self, refresh: bool = False, timeout: float = 2.0) -> dict[str, Any]:
        """The sidecar's latest stats, with this side's counters added.

        Keys: ``dropped`` (sidecar drops by reason, reset when it restarts),
        ``received``, ``published``, ``peers``, ``topic_peers``, ``mesh``,
        ``peer_addrs`` (from the sidecar), ``client_dropped`` (drops on this side
        by reason, including ``duplicate`` and ``sidecar_down``), ``traffic``
        (messages and signed bytes this side published and was handed, over every
        sidecar it ran: ``published``, ``published_bytes``, ``received``,
        ``received_bytes``), ``restarts`` and ``sidecar_pid``. Empty of sidecar
        keys until the first stats arrive.

        Args:
            refresh: ask the sidecar for fresh stats and wait up to ``timeout``
                seconds for them (it also sends them every ~2 s unasked).
            timeout: see ``refresh``.
        """
        if refresh:
            count = self._tally.stats_count
            if self._sidecar.send({"op": "stats"}):
                self._tally.wait_for_stats(count, timeout)
        result = self._tally.snapshot()
        result["sidecar_pid"] = self._sidecar.pid
        return result

    def close(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop the sidecar (asking first, killing after ``timeout``) and reap it."""
        self._sidecar.stop(timeout)
