"""The control sidecar's supervisor: one thread that runs the sidecar and keeps it running.

The supervisor thread spawns :mod:`protocol.control.sidecar`, greets it, reads its
frames and, if it dies, starts a new one with the same key (so the same PeerID) on
the same port where it can, and has it dial the peers it was told about again.
Spawning from that long-lived thread matters: the sidecar asks Linux to kill it when
the thread that forked it exits (``PR_SET_PDEATHSIG``), so a SIGKILLed node takes its
sidecar with it, and a short-lived caller thread must not.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from protocol.control import _process
from protocol.control._process import STOP_TIMEOUT_S, kill, reap
from protocol.control.frames import read_frame, write_frame
from protocol.control.inbox import Inbox
from protocol.control.redial import Redial
from protocol.control.settings import ChannelSettings
from protocol.control.tally import ChannelTally
from verification.identity import Identity

__all__ = ["Supervisor"]

logger = logging.getLogger(__name__)

_RESTART_BACKOFF_S = (0.5, 10.0)  # first and longest wait before a restart
_STABLE_AFTER_S = 30.0  # a sidecar that lived this long resets the backoff


class Supervisor:
    """Runs a channel's sidecar on its own thread, and writes frames into its pipe.

    Args:
        settings: the sidecar's key file, run, caps, address and timeouts.
        identity: the node's identity (the sidecar must report its PeerID).
        topics: the topics the sidecar joins.
        inbox: takes the sidecar's ``message`` frames.
        tally: takes its stats, and counts restarts and frames not sent.
        redial: takes where its peers listen, and says whom a new sidecar dials.
    """

    def __init__(
        self,
        settings: ChannelSettings,
        identity: Identity,
        topics: Sequence[str],
        inbox: Inbox,
        tally: ChannelTally,
        redial: Redial,
    ) -> None:
        self.settings = settings
        self._identity = identity
        self._topics = tuple(topics)
        self._inbox = inbox
        self._tally = tally
        self._redial = redial
        self._restart = settings.restart  # off for good once a sidecar reports another key
        self._port = settings.port  # the port picked first, reused by a restarted sidecar
        log_path = settings.log_path
        self._log_file: IO[bytes] | None = open(log_path, "ab") if log_path else None  # noqa: SIM115
        self._lock = threading.Lock()  # guards the state below
        self._write_lock = threading.Lock()  # one frame at a time into the pipe
        self._proc: subprocess.Popen[bytes] | None = None
        self._live: subprocess.Popen[bytes] | None = None  # ready and serving
        self._peer_id: str | None = None
        self._addrs: list[str] = []
        self.closing = threading.Event()
        self._first_ready = threading.Event()
        self._start_error: str | None = None
        self._thread = threading.Thread(target=self._supervise, name="atoll-control", daemon=True)

    def start(self) -> str | None:
        """Start the supervisor thread and wait for the first sidecar to be ready;
        returns why it is not (None: it is)."""
        self._thread.start()
        if not self._first_ready.wait(self.settings.ready_timeout + STOP_TIMEOUT_S):
            self._start_error = f"not ready within {self.settings.ready_timeout:.0f} s"
        return self._start_error

    @property
    def peer_id(self) -> str | None:
        """The PeerID the sidecar reported, None before the first was ready."""
        with self._lock:
            return self._peer_id

    @property
    def addrs(self) -> list[str]:
        """The addresses the current sidecar listens on."""
        with self._lock:
            return list(self._addrs)

    @property
    def pid(self) -> int | None:
        """The current sidecar's pid, or None between a death and its restart."""
        with self._lock:
            return None if self._proc is None else self._proc.pid

    def send(self, frame: dict[str, Any]) -> bool:
        """Write ``frame`` to the ready sidecar; False (counted as ``sidecar_down``) when
        there is none or the pipe broke."""
        with self._lock:
            proc = self._live
        if proc is None:
            self._tally.drop("sidecar_down")
            return False
        try:
            self._write(proc, frame)
        except (OSError, ValueError):
            self._tally.drop("sidecar_down")
            return False
        return True

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop the sidecar (asking first, killing after ``timeout``) and reap it."""
        with self._lock:
            if self.closing.is_set():
                return
            self.closing.set()
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
        while not self.closing.is_set():
            began = time.monotonic()
            error = self._serve_one(port)
            if not self._first_ready.is_set():
                self._start_error = error or "the sidecar exited before it was ready"
                self._first_ready.set()
                return
            if self.closing.is_set():
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
            if self.closing.wait(backoff):
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
            closing = self.closing.is_set()
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
            "key_file": str(Path(settings.key_file)),
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
        restarted = self._first_ready.is_set()
        with self._lock:
            self._live = proc
            self._peer_id = frame["peer_id"]
            self._addrs = addrs
            self._port = _process.tcp_port(addrs) or self._port
        known = self._redial.addresses()
        if restarted:
            self._tally.restarted()
        logger.info("control sidecar %d ready: %s", proc.pid, addrs)
        if restarted and known:
            self.send({"op": "connect", "addrs": known})
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
            self._inbox.deliver(frame)
        elif kind == "stats":
            frame.pop("ev")
            # where connected peers listen, so a restarted sidecar can dial them
            self._redial.listening(frame.get("peer_addrs"))
            self._tally.stats_arrived(frame)
        elif kind == "log":
            level = logging.getLevelName(str(frame.get("level", "info")).upper())
            logger.log(
                level if isinstance(level, int) else logging.INFO, "sidecar: %s", frame.get("msg")
            )
        elif kind == "error":
            logger.error("control sidecar error: %s", frame.get("error"))

    def _write(self, proc: subprocess.Popen[bytes], frame: dict[str, Any]) -> None:
        with self._write_lock:
            write_frame(proc.stdin, frame)  # type: ignore[arg-type]
