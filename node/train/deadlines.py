"""Deadlines from what this node measured, so that an operator need not guess them.

A fixed deadline must be guessed: too short and slow links fail every sync, too long
and one peer that vanished costs every member of its group the whole wait
(``network.round_timeout`` is 60 s by default, and a crashed peer in a 30-s round cost
its partner three rounds). With ``network.adaptive_deadlines`` (on by default) the
configured values are the most a wait may take, and within them:

- **an exchange's budget** (matchmaking, the commit phase and the all-reduce) is
  :data:`FACTOR` times the 90th percentile of the durations of this node's last
  :data:`WINDOW` complete exchanges, never below its floor (the matchmaking wait and
  the commit window, plus :data:`SLACK_SECONDS`) and never above the configured
  budget. Until :data:`MIN_SAMPLES` exchanges completed it is the configured budget;
- an exchange that ran out of its budget (failed or came back partial at it) doubles
  the next one, up to the configured budget, until one completes: a swarm that slowed
  down is waited for again within a few syncs;
- **the wait for peers' signed states** after a round that went wrong (at most
  ``network.round_timeout``, and never less than 5 s) is the exchange budget: a peer
  that is alive answers within the time its exchanges take.

Every node measures its own, so budgets differ from node to node; a member that gives
up earlier than its peers is one that left, and its parts are repaired as anyone's.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from typing import Any

__all__ = ["FACTOR", "MIN_SAMPLES", "SLACK_SECONDS", "WINDOW", "Deadlines"]

FACTOR = 4.0
"""Budget over the 90th percentile of recent exchange durations."""
WINDOW = 16
"""Complete exchanges the percentile is taken over."""
MIN_SAMPLES = 4
"""Complete exchanges before the budget follows them (the configured one until then)."""
SLACK_SECONDS = 10.0
"""Seconds above the matchmaking wait and the commit window that a budget always keeps."""
_MIN_WAIT_SECONDS = 5.0
_RAN_OUT = 0.9
"""Share of its budget after which an exchange that did not complete ran out of it."""
_MAX_BACKOFF = 64


class Deadlines:
    """The budget of this node's next exchange, and how long it waits for peers' states.

    Args:
        adaptive: follow measured durations (``network.adaptive_deadlines``); False
            keeps the configured budgets.
    """

    def __init__(self, adaptive: bool = True) -> None:
        self.adaptive = adaptive
        self._seconds: deque[float] = deque(maxlen=WINDOW)
        self._backoff = 1
        self._lock = threading.Lock()
        self.last: float | None = None
        """The budget the latest exchange was given."""

    def budget(self, ceiling: float, floor: float) -> float:
        """Seconds the next exchange may take.

        Args:
            ceiling: the configured budget (:meth:`node.run.loop.LoopSettings.exchange_budget`).
            floor: the least it needs: the matchmaking wait and the commit window.
        """
        with self._lock:
            measured = self._measured()
            if measured is None:
                budget = ceiling
            else:
                lowest = floor + SLACK_SECONDS
                budget = min(ceiling, max(lowest, FACTOR * measured) * self._backoff)
            self.last = budget
            return budget

    def finished(self, seconds: float, budget: float, complete: bool) -> None:
        """An exchange given ``budget`` ended after ``seconds``: complete (every part
        reduced) or not (failed, or some parts kept this node's own values)."""
        if not math.isfinite(seconds) or seconds < 0:
            return
        with self._lock:
            if complete:
                self._seconds.append(seconds)
                self._backoff = 1
            elif seconds >= _RAN_OUT * budget:
                self._backoff = min(_MAX_BACKOFF, self._backoff * 2)

    def state_wait(self, ceiling: float) -> float:
        """Seconds to wait for every live peer's signed state of a round: the latest
        exchange budget, at most ``ceiling`` (``network.round_timeout``), at least 5 s."""
        with self._lock:
            last = self.last if self.adaptive and self._measured() is not None else None
        wait = ceiling if last is None else min(ceiling, last)
        return max(_MIN_WAIT_SECONDS, wait)

    def summary(self) -> dict[str, Any]:
        """For round events and ``atoll status``: the latest budget, the measured 90th
        percentile it follows (None until :data:`MIN_SAMPLES`), the backoff factor."""
        with self._lock:
            measured = self._measured()
            return {
                "adaptive": self.adaptive,
                "exchange_seconds": None if self.last is None else round(self.last, 3),
                "measured_p90": None if measured is None else round(measured, 3),
                "backoff": self._backoff,
            }

    def _measured(self) -> float | None:
        if not self.adaptive or len(self._seconds) < MIN_SAMPLES:
            return None
        return _quantile(sorted(self._seconds), 0.9)


def _quantile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of sorted values, interpolated between neighbours."""
    at = q * (len(ordered) - 1)
    lo = math.floor(at)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (at - lo)
