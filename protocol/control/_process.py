"""One control sidecar process: spawning it, greeting it, and ending it.

:class:`~protocol.control.supervisor.Supervisor` runs the sidecar; these are the
process-level steps it takes for each one it runs.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from protocol.control.frames import read_frame

__all__ = ["STOP_TIMEOUT_S", "greet", "kill", "reap", "remember", "spawn", "tcp_port"]

_PACKAGE_ROOT = Path(__file__).resolve().parents[2]
STOP_TIMEOUT_S = 5.0
"""How long a sidecar asked to stop (or being reaped) has before it is killed."""

Process = subprocess.Popen[bytes]
Write = Callable[[Process, dict[str, Any]], None]


def spawn(log_file: IO[bytes] | None) -> Process:
    """Start ``python -m protocol.control.sidecar`` with pipes for its frames.

    Raises:
        OSError: the process could not be spawned.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_PACKAGE_ROOT), env.get("PYTHONPATH")]))
    return subprocess.Popen(
        [sys.executable, "-m", "protocol.control.sidecar"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log_file,
        env=env,
    )


def greet(
    proc: Process, start: dict[str, Any], ready_timeout: float, write: Write
) -> tuple[dict[str, Any] | None, str | None]:
    """Send the sidecar its ``start`` frame and read its ``ready`` event.

    Returns:
        ``(ready frame, None)``, or ``(None, why it is not ready)``.
    """
    # A sidecar that is not ready in time is killed, which ends the read below.
    timer = threading.Timer(ready_timeout, kill, (proc,))
    timer.daemon = True
    timer.start()
    try:
        write(proc, start)
        frame = read_frame(proc.stdout)  # type: ignore[arg-type]
    except (OSError, ValueError) as e:
        return None, f"handshake failed: {e}"
    finally:
        timer.cancel()
    if isinstance(frame, dict) and frame.get("ev") == "ready":
        return frame, None
    if isinstance(frame, dict) and frame.get("ev") == "error":
        return None, str(frame.get("error"))
    if not timer.is_alive() and proc.poll() is not None and frame is None:
        return None, f"no ready event within {ready_timeout:.0f} s (see the sidecar log)"
    return None, "no ready event (see the sidecar log)"


def remember(known: OrderedDict[str, list[str]], peer_addrs: Any, limit: int) -> None:
    """Add the listen addresses a sidecar reports for its connected peers (``{peer:
    [multiaddr, ...]}``) to ``known``, most recent last, keeping at most ``limit`` peers."""
    if not isinstance(peer_addrs, dict):
        return
    for peer, addrs in peer_addrs.items():
        usable = [a for a in addrs if isinstance(a, str)][:8] if isinstance(addrs, list) else []
        if usable:
            known[peer] = usable
            known.move_to_end(peer)
    while len(known) > limit:
        known.popitem(last=False)


def tcp_port(addrs: Sequence[str]) -> int | None:
    """The TCP port of the first address that has one."""
    for addr in addrs:
        parts = addr.split("/")
        if "tcp" in parts:
            with contextlib.suppress(IndexError, ValueError):
                return int(parts[parts.index("tcp") + 1])
    return None


def kill(proc: Process) -> None:
    """Kill ``proc``; one that is already gone is no error."""
    with contextlib.suppress(OSError):
        proc.kill()


def reap(proc: Process, timeout: float) -> None:
    """Wait for ``proc`` to exit, killing it after ``timeout`` seconds."""
    with contextlib.suppress(OSError, ValueError):
        proc.stdin.close()  # type: ignore[union-attr]
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        kill(proc)
        proc.wait()
    with contextlib.suppress(OSError, ValueError):
        proc.stdout.close()  # type: ignore[union-attr]
