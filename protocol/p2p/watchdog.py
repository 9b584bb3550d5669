"""Ends a node's helper processes (p2pd, the DHT process) when the node dies, however it dies.

hivemind starts p2pd and its DHT process as children of the node, and a SIGKILLed
node leaves both running. So the node starts this small watchdog next to them
(:meth:`Watchdog.spawn`) and tells it, over the watchdog's stdin, which pids to
end: one JSON line ``[[pid, create_time], ...]`` per change, each line replacing
the previous set, and a line ``"exit"`` when the node has ended them itself.
When the node dies (its pidfd becomes readable, the watchdog's parent pid
changes, or stdin reaches EOF), the watchdog sends SIGTERM, then SIGKILL to the
survivors, and exits. The create time guards against a pid that was reused
after the process ended.

EOF alone cannot be trusted: every process forked from the node after the
watchdog started (hivemind's DHT process among them) inherits the write end of
the watchdog's stdin, so the pipe stays open while any of them lives. Hence the
pidfd, and the parent-pid check where pidfds are unavailable.

The watchdog runs as a script by path rather than ``-m protocol.p2p.watchdog`` so
that starting it imports nothing but psutil. It ignores SIGINT and runs in its
own session, so a Ctrl-C or a closed terminal that kills the node does not
kill the watchdog before it has cleaned up.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import select
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterable

import psutil

__all__ = [
    "Watchdog",
    "remove_sockets",
    "set_parent_death_signal",
    "terminate_processes",
    "unix_sockets",
]

_LISTEN_UNIX = "-listen=/unix"

logger = logging.getLogger(__name__)

_POLL_SECONDS = 1.0  # how often the parent pid is rechecked when no pidfd is available
_TERM_GRACE_SECONDS = 3.0
_PR_SET_PDEATHSIG = 1
_EXIT = b'"exit"'


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Ask Linux to send ``sig`` to this process when the thread that forked it exits.

    Note that the signal follows the forking *thread*, not the whole parent process:
    only call this in a child forked from a thread that lives as long as the child should.

    Returns:
        Whether the request was accepted (False off Linux).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _is_running(proc: psutil.Process) -> bool:
    try:
        # a zombie is dead; only its parent (or init) can still reap it
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    alive = [p for p in procs if _is_running(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if _is_running(p)]
    return alive


def terminate_processes(
    pids: Iterable[tuple[int, float]], grace: float = _TERM_GRACE_SECONDS
) -> list[int]:
    """SIGTERM the given processes, then SIGKILL those still alive after ``grace`` seconds.

    Args:
        pids: ``(pid, create_time)`` pairs; a pid whose create time differs belongs to
            another process now and is left alone.
        grace: seconds between SIGTERM and SIGKILL.

    Returns:
        The pids that are still running afterwards (normally none).
    """
    procs = []
    for pid, create_time in pids:
        try:
            proc = psutil.Process(pid)
            if abs(proc.create_time() - create_time) < 0.01:
                procs.append(proc)
        except psutil.Error:
            continue
    sockets = [path for proc in procs for path in unix_sockets(proc)]
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    alive = _wait_gone(procs, grace)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    left = [p.pid for p in _wait_gone(alive, 2.0)]
    if not left:
        remove_sockets(sockets)
    return left


def unix_sockets(proc: psutil.Process) -> list[str]:
    """The unix socket paths a p2pd listens on (its ``-listen=/unix/PATH`` argument):
    p2pd leaves them behind when it is killed, and hivemind removes one only when it
    stops a p2pd that is still running."""
    try:
        args = proc.cmdline()
    except psutil.Error:
        return []
    return [a.removeprefix(_LISTEN_UNIX) for a in args if a.startswith(_LISTEN_UNIX)]


def remove_sockets(paths: Iterable[str]) -> None:
    """Remove the given unix socket files (anything else at those paths is left alone)."""
    for path in paths:
        with contextlib.suppress(OSError):
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)


class Watchdog:
    """The node's handle on its watchdog process."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self._proc = proc
        self._tracked: list[tuple[int, float]] = []

    @classmethod
    def spawn(cls) -> Watchdog:
        """Start a watchdog for the current process."""
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            close_fds=True,
            start_new_session=True,
        )
        return cls(proc)

    @property
    def pid(self) -> int:
        """The watchdog's own pid."""
        return self._proc.pid

    @property
    def tracked(self) -> list[tuple[int, float]]:
        """The ``(pid, create_time)`` pairs the watchdog will end if this process dies."""
        return list(self._tracked)

    def is_alive(self) -> bool:
        """Whether the watchdog process is still running."""
        return self._proc.poll() is None

    def track(self, roots: Iterable[int]) -> None:
        """Make ``roots`` and all their descendants the set to end if this process dies."""
        pairs = set()
        for pid in roots:
            with contextlib.suppress(psutil.Error):
                root = psutil.Process(pid)
                for proc in [root, *root.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        pairs.add((proc.pid, proc.create_time()))
        if pairs == set(self._tracked):
            return
        self._tracked = sorted(pairs)
        try:
            assert self._proc.stdin is not None
            self._proc.stdin.write(json.dumps(self._tracked).encode() + b"\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            logger.error("watchdog %d is gone; helper processes may outlive this node", self.pid)

    def close(self, timeout: float = 5.0) -> None:
        """Tell the watchdog nothing is left to end, and let it exit."""
        self._tracked = []
        if self._proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError, ValueError):
                self._proc.stdin.write(_EXIT + b"\n")
                self._proc.stdin.flush()
            with contextlib.suppress(BrokenPipeError, ValueError):
                self._proc.stdin.close()
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def _open_pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when ``pid`` exits, or None where unsupported."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _parse(line: bytes) -> list[tuple[int, float]] | None:
    try:
        return [(int(pid), float(ctime)) for pid, ctime in json.loads(line)]
    except (ValueError, TypeError):
        return None


def _watch(node_pid: int) -> list[tuple[int, float]]:
    """Block until the node dies or closes stdin; return what to end."""
    tracked: list[tuple[int, float]] = []
    stdin = sys.stdin.fileno()
    pidfd = _open_pidfd(node_pid)
    pending = b""
    while os.getppid() == node_pid and psutil.pid_exists(node_pid):
        watched = [stdin] if pidfd is None else [stdin, pidfd]
        ready, _, _ = select.select(watched, [], [], _POLL_SECONDS)
        if pidfd is not None and pidfd in ready:
            break
        if stdin in ready:
            chunk = os.read(stdin, 1 << 16)
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                if line.strip() == _EXIT:
                    return []
                parsed = _parse(line)
                if parsed is not None:
                    tracked = parsed
    return tracked


def main(argv: list[str] | None = None) -> int:
    """Watchdog entry point: ``watchdog.py NODE_PID``."""
    args = sys.argv[1:] if argv is None else argv
    node_pid = int(args[0])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    tracked = _watch(node_pid)
    if tracked:
        survivors = terminate_processes(tracked)
        if survivors:
            sys.stderr.write(f"atoll watchdog: could not end {survivors}\n")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
