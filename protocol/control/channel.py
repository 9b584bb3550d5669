"""The node's end of the control channel: signed GossipSub broadcasts via a sidecar.

:class:`ControlChannel` starts :mod:`protocol.control.sidecar` as a child process (py-libp2p
cannot live in a process that has imported hivemind), speaks the framed msgpack
protocol of :mod:`protocol.control.frames` over its stdin and stdout, and keeps it
running: if the sidecar dies, the channel starts a new one with the same key (so
the same PeerID) on the same port where it can, and dials the peers it was told
about again.

One supervisor thread owns the sidecar: it spawns it, reads its frames, calls
``on_message`` and restarts it. Spawning from that long-lived thread matters:
the sidecar asks Linux to kill it when the thread that forked it exits
(``PR_SET_PDEATHSIG``), so a SIGKILLed node takes its sidecar with it, and a
short-lived caller thread must not.

Every message is verified again here with :func:`~protocol.control.frames.open_control`
(the sidecar is a separate process and is not trusted blindly) and de-duplicated
by ``(sender, seq)``, since a restarted sidecar is sent recent history again.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import IO, Any

from protocol.control import _process
from protocol.control._process import STOP_TIMEOUT_S, kill, reap
from protocol.control.frames import (
    ControlMessage,
    open_control,
    read_frame,
    sign_control,
    write_frame,
)
from protocol.control.settings import ChannelSettings
from protocol.errors import ProtocolError
from protocol.p2p.addrs import expand_wildcard, publishable, with_peer_id
from verification.identity import Identity

__all__ = ["ChannelSettings", "ControlChannel", "ControlChannelError", "OnMessage"]

logger = logging.getLogger(__name__)

OnMessage = Callable[[str, ControlMessage], None]
"""Called on the channel's thread with ``(topic, message)`` for each verified message."""

_RESTART_BACKOFF_S = (0.5, 10.0)  # first and longest wait before a restart
_STABLE_AFTER_S = 30.0  # a sidecar that lived this long resets the backoff
_SEEN_CAPACITY = 16384
_REMEMBERED_PEERS = 256  # peers whose addresses a restarted sidecar dials again
_LOG_EVERY = 1000


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
        self._key_file = Path(settings.key_file)
        self._identity = identity
        self._topics = tuple(dict.fromkeys(topics))
        self._on_message = on_message
        self._restart = settings.restart  # off for good once a sidecar reports another key
        self._port = settings.port  # the port picked first, reused by a restarted sidecar
        self._announce = [with_peer_id(a, identity.peer_id) for a in settings.announce_maddrs]
        log_path = settings.log_path
        self._log_file: IO[bytes] | None = open(log_path, "ab") if log_path else None  # noqa: SIM115

        self._lock = threading.Lock()  # guards the state below
        self._write_lock = threading.Lock()  # one frame at a time into the pipe
        self._stats_changed = threading.Condition(self._lock)
        self._proc: subprocess.Popen[bytes] | None = None
        self._live: subprocess.Popen[bytes] | None = None  # ready and serving
        self._peer_id: str | None = None
        self._addrs: list[str] = []
        self._known_addrs: list[str] = []
        self._peer_addrs: OrderedDict[str, list[str]] = OrderedDict()
        self._seq = time.time_ns() // 1000  # rises across node restarts too
        self._seen: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._last_stats: dict[str, Any] = {}
        self._stats_count = 0
        self._client_dropped: Counter[str] = Counter()
        self._traffic: Counter[str] = Counter()
        self._restarts = 0
        self._closed = False
        self._closing = threading.Event()
        self._first_ready = threading.Event()
        self._start_error: str | None = None
        self._thread = threading.Thread(target=self._supervise, name="atoll-control", daemon=True)

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
        channel._thread.start()
        if not channel._first_ready.wait(settings.ready_timeout + STOP_TIMEOUT_S):
            channel._start_error = f"not ready within {settings.ready_timeout:.0f} s"
        if channel._start_error is not None:
            channel.close()
            raise ControlChannelError(f"control sidecar failed to start: {channel._start_error}")
        return channel

    def __enter__(self) -> ControlChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def peer_id(self) -> str:
        """This node's PeerID, as the sidecar reports it (always the identity's)."""
        with self._lock:
            return self._peer_id or self._identity.peer_id

    @property
    def addrs(self) -> list[str]:
        """Where peers can dial the sidecar, each ending in ``/p2p/<peer id>``: the
        announced addresses if any, else the listen addresses (a wildcard expanded to
        this host's interfaces; loopback only when listening on loopback)."""
        if self._announce:
            return list(self._announce)
        with self._lock:
            return publishable(expand_wildcard(self._addrs), self.settings.listen_host)

    @property
    def restarts(self) -> int:
        """How many times a dead sidecar was replaced by a ready one."""
        with self._lock:
            return self._restarts

    @property
    def sidecar_pid(self) -> int | None:
        """The current sidecar's pid, or None between a death and its restart."""
        with self._lock:
            return None if self._proc is None else self._proc.pid

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
        with self._lock:
            if self._closed:
                raise ControlChannelError("the control channel is closed")
            seq = self._seq
            self._seq += 1
        settings = self.settings
        return sign_control(
            self._identity, settings.run, topic, seq, body, max_bytes=settings.max_bytes
        )

    def publish_signed(self, topic: str, data: bytes) -> bool:
        """Broadcast a message made by :meth:`sign`; returns as :meth:`publish` does."""
        sent = self._send({"op": "publish", "topic": topic, "data": data})
        if sent:
            with self._lock:
                self._traffic["published"] += 1
                self._traffic["published_bytes"] += len(data)
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
        with self._lock:
            self._known_addrs.extend(a for a in new if a not in self._known_addrs)
        if new:
            self._send({"op": "connect", "addrs": new})

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
            with self._lock:
                count = self._stats_count
            if self._send({"op": "stats"}):
                with self._stats_changed:
                    self._stats_changed.wait_for(lambda: self._stats_count > count, timeout)
        with self._lock:
            result: dict[str, Any] = dict(self._last_stats)
            result["client_dropped"] = dict(self._client_dropped)
            result["traffic"] = dict(self._traffic)
            result["restarts"] = self._restarts
            result["sidecar_pid"] = None if self._proc is None else self._proc.pid
            return result

    def close(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop the sidecar (asking first, killing after ``timeout``) and reap it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._closing.set()
            proc = self._proc
        if proc is not None:
            with contextlib.suppress(OSError, ValueError):
                self._write(proc, {"op": "stop"})
            with contextlib.suppress(OSError, ValueError):
                proc.stdin.close()  # type: ignore[union-attr]
        if threading.current_thread() is self._thread:
            return  # closed from on_message: the supervisor reaps on its way out
        self._thread.join(timeout)
        if self._thread.is_alive():
            # The sidecar ignored stop; killing it ends the supervisor's read.
            with self._lock:
                proc = self._proc
            if proc is not None:
                kill(proc)
            self._thread.join(timeout)
        if self._log_file is not None:
            self._log_file.close()

    # -- the supervisor thread ------------------------------------------------

    def _supervise(self) -> None:
        backoff = _RESTART_BACKOFF_S[0]
        port = self._port
        while not self._closing.is_set():
            began = time.monotonic()
            error = self._serve_one(port)
            if not self._first_ready.is_set():
                self._start_error = error or "the sidecar exited before it was ready"
                self._first_ready.set()
                return
            if self._closing.is_set():
                return
            if not self._restart:
                logger.error("control sidecar exited (%s); restart is off", error or "end of pipe")
                return
            if time.monotonic() - began > _STABLE_AFTER_S:
                backoff = _RESTART_BACKOFF_S[0]
            # Reuse the port peers know, unless that is what just failed.
            port = self._port if error is None else 0
            logger.warning(
                "control sidecar exited (%s); restarting in %.1f s", error or "end of pipe", backoff
            )
            if self._closing.wait(backoff):
                return
            backoff = min(2 * backoff, _RESTART_BACKOFF_S[1])

    def _serve_one(self, port: int) -> str | None:
        """Run one sidecar until it exits; returns why it failed to start, if it did."""
        try:
            proc = _process.spawn(self._log_file)
        except OSError as e:
            return f"cannot spawn: {e}"
        with self._lock:
            self._proc = proc
            closing = self._closing.is_set()
        try:
            if closing:
                return "closing"
            error = self._handshake(proc, port)
            if error is None:
                self._pump(proc)
            return error
        finally:
            with self._lock:
                self._proc = None
                self._live = None
            reap(proc, timeout=STOP_TIMEOUT_S)

    def _handshake(self, proc: subprocess.Popen[bytes], port: int) -> str | None:
        settings = self.settings
        start = {
            "op": "start",
            "key_file": str(self._key_file),
            "listen_host": settings.listen_host,
            "port": port,
            "run": settings.run,
            "topics": list(self._topics),
            "max_bytes": settings.max_bytes,
        }
        frame, error = _process.greet(proc, start, settings.ready_timeout, self._write)
        if frame is None:
            return error
        if frame.get("peer_id") != self._identity.peer_id:
            self._restart = False  # the same key file will give the same wrong answer
            return f"sidecar reports {frame.get('peer_id')}, expected {self._identity.peer_id}"
        addrs = [a for a in frame.get("addrs", []) if isinstance(a, str)]
        with self._lock:
            restarted = self._first_ready.is_set()
            self._live = proc
            self._peer_id = frame["peer_id"]
            self._addrs = addrs
            self._port = _process.tcp_port(addrs) or self._port
            known = list(self._known_addrs)
            known += [a for seen in self._peer_addrs.values() for a in seen if a not in known]
            if restarted:
                self._restarts += 1
        logger.info("control sidecar %d ready: %s", proc.pid, addrs)
        if restarted and known:
            self._send({"op": "connect", "addrs": known})
        self._first_ready.set()
        return None

    def _pump(self, proc: subprocess.Popen[bytes]) -> None:
        while True:
            try:
                frame = read_frame(proc.stdout)  # type: ignore[arg-type]
            except (OSError, ValueError) as e:
                logger.error("corrupt frame from control sidecar %d: %s", proc.pid, e)
                kill(proc)
                return
            if frame is None:
                return
            if isinstance(frame, dict):
                self._dispatch(frame)

    def _dispatch(self, frame: dict[str, Any]) -> None:
        kind = frame.get("ev")
        if kind == "message":
            self._deliver(frame)
        elif kind == "stats":
            frame.pop("ev")
            with self._stats_changed:
                self._last_stats = frame
                self._stats_count += 1
                # where connected peers listen, so a restarted sidecar can dial them
                _process.remember(self._peer_addrs, frame.get("peer_addrs"), _REMEMBERED_PEERS)
                self._stats_changed.notify_all()
        elif kind == "log":
            level = logging.getLevelName(str(frame.get("level", "info")).upper())
            logger.log(
                level if isinstance(level, int) else logging.INFO, "sidecar: %s", frame.get("msg")
            )
        elif kind == "error":
            logger.error("control sidecar error: %s", frame.get("error"))

    def _deliver(self, frame: dict[str, Any]) -> None:
        topic, data, source = frame.get("topic"), frame.get("data"), frame.get("from")
        with self._lock:
            self._traffic["received"] += 1
            self._traffic["received_bytes"] += len(data) if isinstance(data, bytes) else 0
        if topic not in self._topics or not isinstance(data, bytes):
            self._drop("malformed", source, f"bad message frame on topic {topic!r}")
            return
        try:
            settings = self.settings
            message = open_control(
                data, settings.run, topic, settings.max_bytes, max_age_s=settings.max_age_s
            )
        except ProtocolError as e:
            self._drop(e.reason, source, e.detail)
            return
        if message.sender != source:
            self._drop("sender_mismatch", source, f"signed by {message.sender}")
            return
        key = (message.sender, message.seq)
        with self._lock:
            if key in self._seen:
                self._client_dropped["duplicate"] += 1
                return
            self._seen[key] = None
            if len(self._seen) > _SEEN_CAPACITY:
                self._seen.popitem(last=False)
        try:
            self._on_message(topic, message)
        except Exception:
            logger.exception(
                "on_message failed for %s #%d on %s", message.sender, message.seq, topic
            )

    def _drop(self, reason: str, source: object, detail: str) -> None:
        with self._lock:
            self._client_dropped[reason] += 1
            count = self._client_dropped[reason]
        if count <= 10 or count % _LOG_EVERY == 0:
            logger.warning("refused control message from %s: %s: %s", source, reason, detail)

    # -- the pipe ---------------------------------------------------------------

    def _send(self, frame: dict[str, Any]) -> bool:
        with self._lock:
            proc = self._live
        if proc is None:
            with self._lock:
                self._client_dropped["sidecar_down"] += 1
            return False
        try:
            self._write(proc, frame)
        except (OSError, ValueError):
            with self._lock:
                self._client_dropped["sidecar_down"] += 1
            return False
        return True

    def _write(self, proc: subprocess.Popen[bytes], frame: dict[str, Any]) -> None:
        with self._write_lock:
            write_frame(proc.stdin, frame)  # type: ignore[arg-type]
