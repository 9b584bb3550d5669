"""When fragments sync: after H inner steps (``steps``) or on the swarm's wall clock (``seconds``).

In ``seconds`` mode the swarm shares a round clock: a start time ``t0`` and a round
length ``T``. Round ``r`` (1-based) spans ``[t0 + (r-1)T, t0 + rT)`` and fragment
``f`` of ``F`` syncs at ``t0 + (r-1)T + (f+1)T/F``, so fragment syncs are spread
evenly across the round and the link carries a steady stream. Every node syncs at the
same wall time with whatever it trained since its last sync, weighted by tokens; no
node waits for another.

How the clock is agreed: the first node of a run stores a signed manifest
``{t0, round_seconds}`` in the DHT under ``{run_id}:manifest``; every later node reads
it and uses the same numbers (an existing manifest always wins over local config).
Clocks are assumed synchronised to NTP level (tens of milliseconds): skew shifts
when a node announces a sync by that much, and the matchmaking window
(``network.matchmaking_seconds``) absorbs it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

__all__ = ["SecondsClock"]


@dataclass
class SecondsClock:
    """Wall-clock rounds of ``round_seconds`` starting at ``t0`` (unix time)."""

    t0: float
    round_seconds: float
    fragments: int

    def sync_time(self, round_: int, fragment: int) -> float:
        """Unix time at which fragment ``fragment`` of round ``round_`` syncs."""
        return (
            self.t0
            + (round_ - 1) * self.round_seconds
            + ((fragment + 1) * self.round_seconds / self.fragments)
        )

    def round_at(self, now: float) -> int:
        """The round in progress at ``now`` (0 before ``t0``)."""
        if now < self.t0:
            return 0
        return int(math.floor((now - self.t0) / self.round_seconds)) + 1

    def due(self, now: float, after: tuple[int, int]) -> list[tuple[int, int]]:
        """Every ``(round, fragment)`` after ``after`` whose sync time has passed."""
        out = []
        r, f = after
        while True:
            f += 1
            if f >= self.fragments:
                r, f = r + 1, 0
            if r < 1 or self.sync_time(r, f) > now:
                return out
            out.append((r, f))

    def next_boundary(self, after: tuple[int, int]) -> tuple[int, int]:
        """The sync that follows ``after``."""
        r, f = after
        return (r, f + 1) if f + 1 < self.fragments else (r + 1, 0)

    @staticmethod
    def start_time(round_seconds: float, lead: float = 2.0) -> float:
        """A ``t0`` a little in the future, on a whole second, for a new swarm."""
        return math.ceil(time.time() + lead)
