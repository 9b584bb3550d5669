"""What a check record says of a contribution, and each peer's standing from its records.

A record (:class:`verification.usefulness.CheckRecord`) holds per-window losses;
:func:`judge` turns them into two measurements, both against the checker's own
contribution to the same exchange (the *reference*: an honest member's work), so what
the base, the text and the model's stage do to a gain cancels out:

- the **work ratio**: the contribution's mean gain on the control windows over the
  reference's on the very same windows, each divided by its claimed batches raised to
  :data:`WORK_EXPONENT`. A round's gain grows more slowly than its steps (on the demo
  model 10, 50 and 100 steps from one state gave gains in the ratio 0.18 : 0.50 : 1, an
  exponent between 0.64 and 1.04; 0.75 sits inside), so an honest node that trained fewer
  steps and claims them keeps a ratio near one, while a member that trained a tenth of
  the steps it claims shows about 0.2 and one that trained half about 0.5;
- the **specific ratio**: the contribution's *lift* on its own claimed batches (its mean
  gain on windows of them beyond its mean gain on control text) over the reference's
  lift on the reference's own claimed batches. A member that trained on the batches it
  claims keeps some of what it learned there, about as much as any honest member; one
  that trained elsewhere, or sends someone else's change, lifts nothing.

One record is noisy: on the 87k-parameter test model (rounds of 24 steps, 16 claimed and
32 control windows) single records of honest work gave specific ratios from below zero
to above four, and a copied change or a tenth of the claimed steps as much as four now
and then; their centres are far apart (above one against about zero). A member that
trained half its claimed steps lifts about as much as an honest one on the batches it
did train (fewer steps after them, less forgotten), so only the work ratio tells it, on
a model whose rounds gain measurably.

Late in a run of a small model a round's gain on control text can sink into that noise
altogether, and the work ratio then means nothing. So every measurement carries its
standard error (from the spread of its windows), and :class:`Scores` pools a peer's
newest records: its work ratio is the sum of their contributions' gains over the sum of
their references' (each record's gain already scaled by its claims), its specific ratio
the sum of lifts over the sum of the references' lifts, so no single small reference
decides anything. A pooled ratio counts only where its reference is clearly positive
(above :data:`Z` standard errors). A peer *falls short* when even the upper end of its
pooled work ratio's interval (:data:`Z` standard errors on both sums) is below the
policy's ``check_min_work``, or that of its specific ratio below ``check_min_specific``;
it is flagged once it has ``check_min_records`` records from two checkers or more (this
node's own records are proof enough for itself) and it still falls short with any one
checker's records left out, so one lying checker cannot get an honest peer flagged.
:meth:`Scores.factor` is the share of its claimed weight a peer's contributions keep in
an aggregate: its pooled work ratio over :data:`WORK_FULL`, at most one, so partial work
buys partial influence before any flag.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from verification.usefulness import CheckRecord

__all__ = [
    "WORK_EXPONENT",
    "WORK_FULL",
    "Z",
    "Estimate",
    "Scores",
    "Verdict",
    "judge",
]

WORK_EXPONENT = 0.75
"""Gains are compared per claimed batch raised to this power (see the module docstring)."""
WORK_FULL = 0.8
"""A median work ratio at or above this keeps a peer's full claimed weight."""
Z = 1.645
"""Standard errors of the one-sided 95 % bounds the scores use."""


@dataclass(frozen=True)
class Estimate:
    """A mean over windows and its standard error, in nats per token."""

    mean: float
    se: float

    @classmethod
    def of(cls, values: list[float], scale: float = 1.0) -> Estimate:
        n = len(values)
        spread = statistics.stdev(values) if n > 1 else 0.0
        return cls(scale * math.fsum(values) / max(1, n), scale * spread / math.sqrt(max(1, n)))

    def minus(self, other: Estimate) -> Estimate:
        return Estimate(self.mean - other.mean, math.hypot(self.se, other.se))


def _pool(estimates: list[Estimate]) -> Estimate:
    return Estimate(
        math.fsum(e.mean for e in estimates), math.sqrt(math.fsum(e.se**2 for e in estimates))
    )


def _bounds(value: Estimate, reference: Estimate) -> tuple[float, float] | None:
    """The ratio ``value / reference`` and the upper end of its interval, or None where
    the reference is not clearly positive."""
    low = reference.mean - Z * reference.se
    if low <= 0:
        return None
    return value.mean / reference.mean, (value.mean + Z * value.se) / low


@dataclass(frozen=True)
class Verdict:
    """What one record measured.

    Attributes:
        gain: the contribution's mean gain on the control windows, scaled by the claims
            (the reference's claimed batches over its own, to :data:`WORK_EXPONENT`).
        ref_gain: the reference's mean gain on the same windows.
        lift: the contribution's gain on its claimed windows beyond its gain on control
            text (None without claimed windows).
        ref_lift: the reference's, on its own claimed windows (None likewise).
    """

    gain: Estimate
    ref_gain: Estimate
    lift: Estimate | None = None
    ref_lift: Estimate | None = None

    @property
    def work(self) -> float | None:
        """The work ratio (None where the reference gained too little to measure by)."""
        found = _bounds(self.gain, self.ref_gain)
        return None if found is None else found[0]

    @property
    def specific(self) -> float | None:
        """The specific ratio (None without lifts, or where the reference's is too small)."""
        if self.lift is None or self.ref_lift is None:
            return None
        found = _bounds(self.lift, self.ref_lift)
        return None if found is None else found[0]


def judge(record: CheckRecord) -> Verdict:
    """What ``record`` measured (see the module docstring)."""
    gains = [before - after for before, after, _ in record.control]
    ref_gain = Estimate.of([before - ref for before, _, ref in record.control])
    ref_lift = None
    if record.reference_assigned:
        own = Estimate.of([b - a for b, a in record.reference_assigned])
        ref_lift = own.minus(ref_gain)
    if record.reference_claimed <= 0:
        return Verdict(Estimate.of(gains), Estimate(0.0, 0.0))  # no reference to go by
    if record.claimed <= 0:
        # a claim no one can draw from counts as no work at all
        nothing = Estimate(0.0, 0.0)
        return Verdict(nothing, ref_gain, nothing if ref_lift is not None else None, ref_lift)
    scale = (record.reference_claimed / record.claimed) ** WORK_EXPONENT
    scaled = Estimate.of(gains, scale)
    if not record.assigned or ref_lift is None:
        return Verdict(scaled, ref_gain)
    lift = Estimate.of([b - a for b, a in record.assigned]).minus(Estimate.of(gains))
    return Verdict(scaled, ref_gain, lift, ref_lift)


class Scores:
    """Per peer, its newest records' measurements, and whether it is flagged.

    Thread-safe: records are added on the checks' worker, weights read on the
    transport's loop.

    Args:
        me: this node's PeerID (its own records are proof enough for itself).
        min_records: records needed before a peer can be flagged.
        min_work: a peer whose pooled work ratio is below this falls short.
        min_specific: a peer whose pooled specific ratio is below this falls short.
        window: records kept per peer (the newest).
    """

    def __init__(
        self,
        me: str,
        min_records: int,
        min_work: float,
        min_specific: float,
        window: int = 8,
    ) -> None:
        self.me = me
        self.min_records = min_records
        self.min_work = min_work
        self.min_specific = min_specific
        self.window = window
        self._seen: dict[str, deque[tuple[str, str, int, int]]] = {}
        self._records: dict[str, deque[tuple[str, Verdict]]] = {}
        self._lock = threading.Lock()

    def add(self, record: CheckRecord, verdict: Verdict) -> bool:
        """Count ``verdict`` of ``record`` (once per checker, peer, round and fragment);
        whether it was new."""
        with self._lock:
            seen = self._seen.setdefault(record.peer, deque(maxlen=8 * self.window))
            if record.key in seen:
                return False
            seen.append(record.key)
            kept = self._records.setdefault(record.peer, deque(maxlen=self.window))
            kept.append((record.checker, verdict))
            return True

    def short(self, verdict: Verdict) -> bool:
        """Whether one record's figures fall short (for logs; flags pool records)."""
        return self._short([verdict])

    def _pooled(
        self, verdicts: list[Verdict]
    ) -> tuple[tuple[float, float] | None, tuple[float, float] | None]:
        """The pooled work and specific ratios, each with the upper end of its interval
        (None where the pooled reference is not clearly positive)."""
        work = _bounds(_pool([v.gain for v in verdicts]), _pool([v.ref_gain for v in verdicts]))
        lifted = [v for v in verdicts if v.lift is not None and v.ref_lift is not None]
        specific = None
        if lifted:
            specific = _bounds(
                _pool([v.lift for v in lifted]),  # type: ignore[misc]
                _pool([v.ref_lift for v in lifted]),  # type: ignore[misc]
            )
        return work, specific

    def _short(self, verdicts: list[Verdict]) -> bool:
        work, specific = self._pooled(verdicts)
        return (work is not None and work[1] < self.min_work) or (
            specific is not None and specific[1] < self.min_specific
        )

    def score(self, peer: str) -> dict[str, Any]:
        """``{"records", "checkers", "work", "specific", "factor", "short", "flagged"}``
        for ``peer``."""
        with self._lock:
            return self._score(list(self._records.get(peer, ())))

    def _score(self, records: list[tuple[str, Verdict]]) -> dict[str, Any]:
        verdicts = [v for _, v in records]
        checkers = {c for c, _ in records}
        short = bool(verdicts) and self._short(verdicts)
        robust = short and all(
            self._short(rest) for c in checkers if (rest := [v for who, v in records if who != c])
        )
        work, specific = self._pooled(verdicts) if verdicts else (None, None)
        return {
            "records": len(records),
            "checkers": len(checkers),
            "work": None if work is None else round(work[0], 4),
            "specific": None if specific is None else round(specific[0], 4),
            "factor": _factor(None if work is None else work[0]),
            "short": short,
            "flagged": (
                len(records) >= self.min_records
                and robust
                and (len(checkers) >= 2 or self.me in checkers)
            ),
        }

    def factor(self, peer: str) -> float:
        """The share of its claimed weight ``peer``'s contributions keep (1 with no
        evidence yet)."""
        with self._lock:
            verdicts = [v for _, v in self._records.get(peer, ())]
        work = self._pooled(verdicts)[0] if verdicts else None
        return _factor(None if work is None else work[0])

    def flagged(self) -> set[str]:
        """Peers whose records say they do not do the work they claim."""
        with self._lock:
            return {p for p, r in self._records.items() if self._score(list(r))["flagged"]}

    def all(self) -> dict[str, dict[str, Any]]:
        """Every scored peer's :meth:`score`."""
        with self._lock:
            return {p: self._score(list(self._records[p])) for p in sorted(self._records)}


def _factor(work: float | None) -> float:
    if work is None:
        return 1.0
    return round(min(1.0, max(0.0, work / WORK_FULL)), 4)
