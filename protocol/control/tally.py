"""The control channel's counters: the sidecar's latest stats and this side's tallies.

The sidecar sends its stats every ~2 s (and when asked); this side counts what it
refused (by reason, ``duplicate`` and ``sidecar_down`` included), the messages and
signed bytes it published and was handed, and how many times a dead sidecar was
replaced. :meth:`ChannelTally.snapshot` puts them together for
:meth:`~protocol.control.channel.ControlChannel.stats`.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

__all__ = ["ChannelTally"]


class ChannelTally:
    """What a control channel counted, over every sidecar it ran. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats_changed = threading.Condition(self._lock)
        self._last_stats: dict[str, Any] = {}
        self._stats_count = 0
        self._dropped: Counter[str] = Counter()
        self._traffic: Counter[str] = Counter()
        self._restarts = 0

    def drop(self, reason: str) -> int:
        """Count a message refused (or not sent) on this side; returns the count so far."""
        with self._lock:
            self._dropped[reason] += 1
            return self._dropped[reason]

    def traffic(self, kind: str, data: Any) -> None:
        """Count one message ``kind`` (``published`` or ``received``) and its bytes."""
        with self._lock:
            self._traffic[kind] += 1
            self._traffic[f"{kind}_bytes"] += len(data) if isinstance(data, bytes) else 0

    def restarted(self) -> None:
        """A dead sidecar was replaced by a ready one."""
        with self._lock:
            self._restarts += 1

    @property
    def restarts(self) -> int:
        with self._lock:
            return self._restarts

    @property
    def stats_count(self) -> int:
        """How many stats frames arrived (to wait for the next one)."""
        with self._lock:
            return self._stats_count

    def stats_arrived(self, frame: dict[str, Any]) -> None:
        """The sidecar's stats (its frame, less its ``ev``)."""
        with self._stats_changed:
            self._last_stats = frame
            self._stats_count += 1
            self._stats_changed.notify_all()

    def wait_for_stats(self, after: int, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for stats frames beyond the first ``after``."""
        with self._stats_changed:
            self._stats_changed.wait_for(lambda: self._stats_count > after, timeout)

    def snapshot(self) -> dict[str, Any]:
        """The sidecar's latest stats with ``client_dropped``, ``traffic`` and
        ``restarts`` added."""
        with self._lock:
            result: dict[str, Any] = dict(self._last_stats)
            result["client_dropped"] = dict(self._dropped)
            result["traffic"] = dict(self._traffic)
            result["restarts"] = self._restarts
            return result
