"""What a check record says of a contribution, and each peer's standing from its records.

A record (:class:`verification.usefulness.CheckRecord`) holds per-window losses;
:func:`judge` turns them into two measurements, both against the checker's own
contribution to the same exchange (the *reference*: an honest member's work), measured
on the very same windows, so what makes a window easy or hard to learn cancels out:

- the **work ratio**: the contribution's gain on the control windows over the
  reference's, each divided by its claimed batches raised to :data:`WORK_EXPONENT`. A
  round's gain grows more slowly than its steps (on the demo model 10, 50 and 100 steps
  from one state gave gains in the ratio 0.18 : 0.50 : 1, an exponent between 0.64 and
  1.04; 0.75 sits inside), so an honest node that trained fewer steps and claims them
  keeps a ratio near one, while a member that trained a tenth of the steps it claims
  shows about 0.2 and one that trained half about 0.5;
- the **specific gain**: on each sampled window of the contribution's claimed batches,
  its gain beyond the reference's gain on that window scaled to the contribution's
  generic gain (the two gains' ratio on control text), in units of the reference's
  mean control gain. A window its member trained on keeps some of what it learned
  there; one it never saw gains no more than any text.

A record *passes* when its work ratio is at least :data:`WORK_FLOOR` and its mean
specific gain at least :data:`SPECIFIC_FLOOR` (the work ratio alone where the run checks
validation only). On the demo model, with 16 windows of each kind, honest records gave
work ratios of 0.58 to 1.28 and specific gains of 0.42 to 1.50; half the claimed steps
0.19 to 0.65 and 0.15 to 0.71; a tenth -0.01 to 0.21 and -0.03 to 0.44: one record is
noisy, a peer's records together are not.

:class:`Scores` keeps each peer's newest records. A peer is flagged once it has
:attr:`Scores.min_records` records, the upper Wilson bound (one-sided 95 %) of their pass
rate is below the policy's ``check_pass_rate``, and failing records came from two
checkers or more (this node's own records are proof enough for itself): one lying
checker cannot get an honest peer flagged. :meth:`Scores.factor` is the share of its
claimed weight a peer's contributions keep in an aggregate: the median of its recent
work ratios over :data:`WORK_FULL`, at most one, so partial work buys partial influence
before any flag.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from verification.usefulness import CheckRecord

__all__ = [
    "SPECIFIC_FLOOR",
    "WORK_EXPONENT",
    "WORK_FLOOR",
    "WORK_FULL",
    "Scores",
    "Verdict",
    "judge",
    "wilson_upper",
]

WORK_EXPONENT = 0.75
"""Gains are compared per claimed batch raised to this power (see the module docstring)."""
WORK_FLOOR = 0.5
"""A record whose work ratio is below this fails."""
SPECIFIC_FLOOR = 0.2
"""A record whose mean specific gain (in the reference's control gain) is below this
fails."""
WORK_FULL = 0.8
"""A median work ratio at or above this keeps a peer's full claimed weight."""
_Z = 1.645
"""One-sided 95 % for the Wilson bound of a peer's pass rate."""


@dataclass(frozen=True)
class Verdict:
    """What one record says.

    Attributes:
        work: the work ratio (None when the record cannot tell: the reference gained
            nothing on the control windows, or claimed nothing).
        specific: the mean specific gain (None without claimed windows, or when the
            record cannot tell).
        passed: whether the record speaks for its contribution (None: it cannot tell).
        why: why it failed, for logs.
    """

    work: float | None
    specific: float | None
    passed: bool | None
    why: str = ""


def _sum(values: list[float]) -> float:
    return math.fsum(values)


def judge(record: CheckRecord) -> Verdict:
    """The work ratio, the specific gain and whether ``record`` passes (see the module
    docstring)."""
    gains = [before - after for before, after, _, _ in record.control]
    reference = [before - after for _, _, before, after in record.control]
    gain, ref_gain = _sum(gains), _sum(reference)
    if ref_gain <= 0 or record.reference_claimed <= 0:
        return Verdict(None, None, None, "the reference gained nothing on control text")
    if record.claimed <= 0:
        return Verdict(0.0, None, False, "claims no batches that can be drawn")
    scale = gain / ref_gain
    work = scale * (record.reference_claimed / record.claimed) ** WORK_EXPONENT
    why = "" if work >= WORK_FLOOR else f"work ratio {work:.2f} < {WORK_FLOOR}"
    if not record.assigned:
        return Verdict(work, None, not why, why)
    mean_ref = ref_gain / len(reference)
    specific = [
        ((before - after) - scale * (ref_before - ref_after)) / mean_ref
        for before, after, ref_before, ref_after in record.assigned
    ]
    mean_specific = _sum(specific) / len(specific)
    if not why and mean_specific < SPECIFIC_FLOOR:
        why = f"specific gain {mean_specific:+.2f} < {SPECIFIC_FLOOR} on its claimed batches"
    return Verdict(work, mean_specific, not why, why)


def wilson_upper(passed: int, total: int, z: float = _Z) -> float:
    """The upper Wilson bound of a pass rate of ``passed`` of ``total`` (1 with none)."""
    if total <= 0:
        return 1.0
    p = passed / total
    denom = 1 + z * z / total
    centre = p + z * z / (2 * total)
    spread = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total))
    return min(1.0, (centre + spread) / denom)


@dataclass
class _Peer:
    keys: deque[tuple[str, str, int, int]]
    """The newest records seen (each counted once)."""
    results: deque[tuple[str, bool]] = field(default_factory=deque)
    """``(checker, passed)`` of the newest conclusive records."""
    works: deque[float] = field(default_factory=deque)
    last_failure: str = ""


class Scores:
    """Per peer, its newest records' results and work ratios, and whether it is flagged.

    Thread-safe: records are added on the checks' worker, weights read on the
    transport's loop.

    Args:
        me: this node's PeerID (its own records are proof enough for itself).
        min_records: records needed before a peer can be flagged.
        pass_rate: a peer is flagged once the upper bound of its records' pass rate is
            below this.
        window: records kept per peer (the newest).
    """

    def __init__(self, me: str, min_records: int, pass_rate: float, window: int = 12) -> None:
        self.me = me
        self.min_records = min_records
        self.pass_rate = pass_rate
        self.window = window
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()

    def add(self, record: CheckRecord, verdict: Verdict) -> bool:
        """Count ``verdict`` of ``record`` (once per checker, peer, round and fragment);
        whether it was new."""
        with self._lock:
            peer = self._peers.setdefault(record.peer, _Peer(deque(maxlen=8 * self.window)))
            if record.key in peer.keys:
                return False
            peer.keys.append(record.key)
            if verdict.passed is None:
                return True
            _push(peer.results, (record.checker, verdict.passed), self.window)
            if verdict.work is not None:
                _push(peer.works, verdict.work, self.window)
            if not verdict.passed:
                peer.last_failure = verdict.why
            return True

    def score(self, peer: str) -> dict[str, Any]:
        """``{"records", "passed", "upper", "work", "factor", "flagged", "last_failure"}``
        for ``peer``."""
        with self._lock:
            return self._score(self._peers.get(peer))

    def _score(self, peer: _Peer | None) -> dict[str, Any]:
        if peer is None:
            peer = _Peer(deque())
        results = list(peer.results)
        passed = sum(ok for _, ok in results)
        upper = wilson_upper(passed, len(results))
        accusers = {c for c, ok in results if not ok}
        work = statistics.median(peer.works) if peer.works else None
        return {
            "records": len(results),
            "passed": passed,
            "upper": round(upper, 4),
            "work": None if work is None else round(work, 4),
            "factor": _factor(work),
            "flagged": (
                len(results) >= self.min_records
                and upper < self.pass_rate
                and (len(accusers) >= 2 or self.me in accusers)
            ),
            "last_failure": peer.last_failure,
        }

    def factor(self, peer: str) -> float:
        """The share of its claimed weight ``peer``'s contributions keep (1 with no
        evidence yet)."""
        with self._lock:
            p = self._peers.get(peer)
            return _factor(statistics.median(p.works) if p is not None and p.works else None)

    def flagged(self) -> set[str]:
        """Peers whose records say they do not do the work they claim."""
        with self._lock:
            return {p for p, s in self._peers.items() if self._score(s)["flagged"]}

    def all(self) -> dict[str, dict[str, Any]]:
        """Every scored peer's :meth:`score`."""
        with self._lock:
            return {p: self._score(self._peers[p]) for p in sorted(self._peers)}


def _push(values: deque, value: Any, window: int) -> None:
    values.append(value)
    while len(values) > window:
        values.popleft()


def _factor(work: float | None) -> float:
    if work is None:
        return 1.0
    return round(min(1.0, max(0.0, work / WORK_FULL)), 4)
