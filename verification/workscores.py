"""Each peer's standing from its check records: pooled into flags and weights.

What one record measured of a contribution (its gain and lift) is
:func:`verification.gains.judge`; :class:`Scores` compares each with its round's
*reference*: the median over every contribution to that round measured so far (of
peers not flagged), once :data:`MIN_POOLED` were. Not the checker's own contribution: honest contributions to one
round differ (a member whose copy had come further gains less from the same work; on
the 87k-parameter test model by up to 3.5 times), so against a checker that gained much
an honest peer would look lazy, and the median is what a minority of lazy or lying peers
cannot move. A contribution's *work ratio* is its gain over the reference gain, its
*specific ratio* its lift over the reference lift.

One record is noisy (single honest records on the test model gave specific ratios from
below zero to above four), so :class:`Scores` pools a peer's records of its newest
rounds (``trust.check_rounds``), each first held within ``1 ± CLIP`` times its round's
reference, with the ratio estimator: the sum of their values over the sum of their rounds' references, with
an interval from the larger of the records' scatter about that ratio and their windows'
standard errors. A peer *falls short* when even the upper end of its pooled work ratio's
one-sided interval (:data:`Z` standard errors) is below the policy's ``check_min_work``,
or that of its specific ratio below ``check_min_specific``; it is flagged once it has
``check_min_records`` records over :data:`MIN_ROUNDS` rounds or more, from two
checkers or more (this node's own records too are one checker's), and it still falls
short with any one checker's records left out, so one checker, lying or unlucky, cannot
get an honest peer flagged, and with any one round's, so one round cannot either.
:meth:`Scores.factor` is the share of its claimed weight a peer's contributions keep in
an aggregate: its pooled work ratio over :data:`WORK_FULL`, at most one, so partial work
buys partial influence before any flag. A failed replay check
(:mod:`verification.replay`) flags its peer besides, with a weight factor of 0
(:class:`verification.replayfailures.FailedReplays`).
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from verification.gains import Verdict
from verification.replayfailures import FailedReplays
from verification.usefulness import CheckRecord

__all__ = [
    "WORK_FULL",
    "Z",
    "CLIP",
    "MIN_POOLED",
    "MIN_ROUNDS",
    "Pooled",
    "Scores",
]

WORK_FULL = 0.8
"""A pooled work ratio at or above this keeps a peer's full claimed weight."""
Z = 1.645
"""Standard errors of the one-sided 95 % bounds the scores use."""
CLIP = 4.0
"""A record's gain and lift are held within ``1 ± CLIP`` times its round's reference
before pooling (:class:`Scores`): honest lifts on the test model ran from eight times the
reference below zero to a hundred above, and one such record decided a pooled ratio.
Replayed (:mod:`benchmarks._checks_replay`), 4 cleared the honest member a CI run of the
useful-work test flagged and delayed no attacker in a quick checks run of seed 0, and in
one of seed 1 two by a round (``copy`` and ``random_data`` in groups); 3 delayed
``random_data`` further, 5 left the honest member flagged."""
MIN_POOLED = 3
"""Contributions a round needs measured before it has a reference."""
MIN_ROUNDS = 2
"""Rounds a peer's records must span before it can be flagged: a round's records (two
checkers on each checked fragment) all measure one contribution, and one round's bad
luck (a damaged copy, a group that went wrong) must not read as a habit. With any one
round's records left out the rest must still fall short (:meth:`Scores._robust`), so
over two rounds each round alone must. Three rounds flagged no honest peer either in 21
replayed benchmark swarms, one round later (docs/trust.md)."""
_ROUNDS_POOLED = 32
"""Rounds whose measured contributions are kept for references."""


@dataclass(frozen=True)
class Pooled:
    """A peer's pooled ratio over the round references, and the upper end of its
    one-sided interval."""

    ratio: float
    upper: float


@dataclass(frozen=True)
class _Kept:
    checker: str
    round: int
    verdict: Verdict


class Scores:
    """Per peer, its newest records' measurements, and whether it is flagged.

    Every record adds two measured contributions to its round's pool (the checked one
    and the checker's own); a round's *reference* is the median, over the contributions
    measured in it of peers not flagged here, of each one's mean gain and mean lift. A
    peer's pooled work ratio is the sum of its records' gains over the sum of their
    rounds' reference gains (the ratio estimator), with an interval from the larger of
    two variances: the records' scatter about that ratio (which takes in everything that
    differs from record to record: the text, the checker, how far the peer's copy had
    come) and their windows' standard errors. The specific ratio likewise from lifts.
    Failed replay checks (:mod:`verification.replay`) flag a peer besides: one this
    node replayed itself at once, others' words from two checkers (:meth:`replay_failed`).
    A checker proven so here has its own records left out of every peer's score.

    Thread-safe: records are added on the checks' worker, weights read on the
    transport's loop.

    Args:
        min_records: records needed before a peer can be flagged.
        min_work: a peer whose pooled work ratio's upper bound is below this falls short.
        min_specific: likewise for its pooled specific ratio.
        window: records kept per peer (the newest).
        rounds: where set, a peer is judged on its records of its newest this many
            rounds only, so that rounds long past (a fresh model's first, whose gains
            say little of the work) stop weighing on it.
        clip: each record's value is held within ``1 ± clip`` times its round's
            reference before it is pooled (:data:`CLIP`; None: as measured).
    """

    def __init__(
        self,
        min_records: int,
        min_work: float,
        min_specific: float,
        window: int = 24,
        rounds: int | None = None,
        clip: float | None = CLIP,
    ) -> None:
        self.min_records = min_records
        self.min_work = min_work
        self.min_specific = min_specific
        self.window = window
        self.rounds = rounds
        self.clip = clip
        self._seen: dict[str, deque[tuple[str, str, int, int]]] = {}
        self._records: dict[str, deque[_Kept]] = {}
        # round -> (peer, fragment) -> its measured (gain, lift) pairs
        self._pools: dict[int, dict[tuple[str, int], list[tuple[float, float | None]]]] = {}
        self._flagged: set[str] = set()
        self._replays = FailedReplays(rounds)
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
            kept.append(_Kept(record.checker, record.round, verdict))
            pool = self._pools.setdefault(record.round, {})
            lift = None if verdict.lift is None else verdict.lift.mean
            pool.setdefault((record.peer, record.fragment), []).append((verdict.gain.mean, lift))
            if verdict.ref_gain is not None:
                ref_lift = None if verdict.ref_lift is None else verdict.ref_lift.mean
                own = (verdict.ref_gain.mean, ref_lift)
                pool.setdefault((record.checker, record.fragment), []).append(own)
            for old in [r for r in self._pools if r <= record.round - _ROUNDS_POOLED]:
                del self._pools[old]
            flagged = self._score(record.peer, self._recent(kept), {})["flagged"]
            (self._flagged.add if flagged else self._flagged.discard)(record.peer)
            return True

    def replay_failed(self, peer: str, checker: str, round_: int, proven: bool) -> bool:
        """Count a failed replay check of ``peer`` (:mod:`verification.replay`):
        ``proven`` where this node replayed the window itself and it failed here too,
        else on ``checker``'s word. Whether ``peer`` is flagged now."""
        with self._lock:
            self._replays.add(peer, checker, round_, proven)
            flagged = self._replays.flags(peer)
            if flagged:
                self._flagged.add(peer)
            return flagged

    def proven(self, peer: str) -> bool:
        """Whether a replay of ``peer``'s trace failed on this node."""
        with self._lock:
            return self._replays.proven(peer)

    def _recent(self, kept: Iterable[_Kept]) -> list[_Kept]:
        """The records a peer is judged on: those of its newest rounds, less any whose
        checker this node proved to cheat (its word counts for nothing, back to its
        first record)."""
        cheats = self._replays.cheats()
        records = [k for k in kept if k.checker not in cheats]
        if self.rounds is None or not records:
            return records
        newest = max(k.round for k in records)
        return [k for k in records if k.round > newest - self.rounds]

    def reference(self, round_: int) -> tuple[float | None, float | None]:
        """Round ``round_``'s reference gain and lift (None where fewer than
        :data:`MIN_POOLED` contributions were measured)."""
        with self._lock:
            return self._reference(round_)

    def _reference(self, round_: int) -> tuple[float | None, float | None]:
        pool = self._pools.get(round_, {})
        gains, lifts = [], []
        for (peer, _), measured in pool.items():
            if peer in self._flagged:
                continue
            gains.append(statistics.fmean(g for g, _ in measured))
            found = [x for _, x in measured if x is not None]
            if found:
                lifts.append(statistics.fmean(found))
        return (
            statistics.median(gains) if len(gains) >= MIN_POOLED else None,
            statistics.median(lifts) if len(lifts) >= MIN_POOLED else None,
        )

    def relative(self, verdict: Verdict, round_: int) -> tuple[float | None, float | None]:
        """One record's work and specific ratios against its round's reference, or
        where the round has none yet against the checker's own contribution in the
        record (None where neither is positive)."""
        with self._lock:
            work, specific = self._pooled(
                [_Kept("", round_, verdict)], self._single(verdict, round_)
            )
        return (
            None if work is None else work.ratio,
            None if specific is None else specific.ratio,
        )

    def short(self, verdict: Verdict, round_: int) -> bool:
        """Whether one record's figures fall short, measured as :meth:`relative` does
        (for logs, and for whether a record accuses its peer; flags pool records)."""
        with self._lock:
            return self._short([_Kept("", round_, verdict)], self._single(verdict, round_))

    def _single(
        self, verdict: Verdict, round_: int
    ) -> dict[int, tuple[float | None, float | None]]:
        gain, lift = self._reference(round_)
        if gain is None and verdict.ref_gain is not None:
            gain = verdict.ref_gain.mean
        if lift is None and verdict.ref_lift is not None:
            lift = verdict.ref_lift.mean
        return {round_: (gain, lift)}

    def _pooled(
        self, records: list[_Kept], refs: dict[int, tuple[float | None, float | None]]
    ) -> tuple[Pooled | None, Pooled | None]:
        """The pooled work and specific ratios (None without a positive reference)."""
        work, specific = [], []
        for kept in records:
            if kept.round not in refs:
                refs[kept.round] = self._reference(kept.round)
            gain_ref, lift_ref = refs[kept.round]
            v = kept.verdict
            if gain_ref is not None and gain_ref > 0:
                work.append((self._held(v.gain.mean, gain_ref), v.gain.se, gain_ref))
            if v.lift is not None and lift_ref is not None and lift_ref > 0:
                specific.append((self._held(v.lift.mean, lift_ref), v.lift.se, lift_ref))
        return _ratio(work), _ratio(specific)

    def _held(self, value: float, reference: float) -> float:
        if self.clip is None:
            return value
        return min(max(value, (1 - self.clip) * reference), (1 + self.clip) * reference)

    def _short(
        self, records: list[_Kept], refs: dict[int, tuple[float | None, float | None]]
    ) -> bool:
        work, specific = self._pooled(records, refs)
        return (work is not None and work.upper < self.min_work) or (
            specific is not None and specific.upper < self.min_specific
        )

    def score(self, peer: str) -> dict[str, Any]:
        """``{"records", "checkers", "work", "specific", "factor", "short", "flagged"}``
        for ``peer``, with ``replays_failed`` and ``replay_flagged`` (its failed replay
        checks flag it) where any of its replay checks failed."""
        with self._lock:
            return self._score(peer, self._recent(self._records.get(peer, ())), {})

    def _with_replays(self, peer: str, score: dict[str, Any]) -> dict[str, Any]:
        failed = self._replays.count(peer)
        if not failed:
            return score
        replayed = self._replays.flags(peer)
        return {
            **score,
            "replays_failed": failed,
            "replay_flagged": replayed,
            "factor": 0.0 if replayed else score["factor"],
            "flagged": score["flagged"] or replayed,
        }

    def _score(
        self, peer: str, records: list[_Kept], refs: dict[int, tuple[float | None, float | None]]
    ) -> dict[str, Any]:
        checkers = {k.checker for k in records}
        rounds = {k.round for k in records}
        short = bool(records) and self._short(records, refs)
        robust = short and self._robust(records, refs)
        work, specific = self._pooled(records, refs) if records else (None, None)
        return self._with_replays(
            peer,
            {
                "records": len(records),
                "checkers": len(checkers),
                "work": None if work is None else round(work.ratio, 4),
                "specific": None if specific is None else round(specific.ratio, 4),
                "factor": _factor(None if work is None else work.ratio),
                "short": short,
                "flagged": (
                    len(records) >= self.min_records
                    and len(rounds) >= MIN_ROUNDS
                    and robust
                    and len(checkers) >= 2
                ),
            },
        )

    def _robust(
        self, records: list[_Kept], refs: dict[int, tuple[float | None, float | None]]
    ) -> bool:
        """Whether ``records`` still fall short with any one checker's records left out,
        and with any one round's: one checker, lying or unlucky, and one round that went
        wrong for a peer (a copy a faulty owner shrank, batches the peer's copy had
        already learned) cannot flag it. A round's records all measure one
        contribution, so they agree with each other whatever it was worth, and in a
        pooled ratio the round with the most records would otherwise decide."""
        subsets = [[k for k in records if k.checker != c] for c in {k.checker for k in records}]
        subsets += [[k for k in records if k.round != r] for r in {k.round for k in records}]
        return all(self._short(rest, refs) for rest in subsets if rest)

    def factor(self, peer: str) -> float:
        """The share of its claimed weight ``peer``'s contributions keep (1 with no
        evidence yet)."""
        with self._lock:
            if self._replays.flags(peer):
                return 0.0
            records = self._recent(self._records.get(peer, ()))
            work = self._pooled(records, {})[0] if records else None
        return _factor(None if work is None else work.ratio)

    def flagged(self) -> set[str]:
        """Peers whose records say they do not do the work they claim."""
        with self._lock:
            refs: dict[int, tuple[float | None, float | None]] = {}
            found = {
                p
                for p, r in self._records.items()
                if self._score(p, self._recent(r), refs)["flagged"]
            }
            found |= {p for p in self._replays.peers() if self._replays.flags(p)}
            self._flagged = found
            return set(found)

    def all(self) -> dict[str, dict[str, Any]]:
        """Every scored peer's :meth:`score`."""
        with self._lock:
            refs: dict[int, tuple[float | None, float | None]] = {}
            peers = sorted(set(self._records) | self._replays.peers())
            return {
                p: self._score(p, self._recent(self._records.get(p, deque())), refs) for p in peers
            }


def _ratio(items: list[tuple[float, float, float]]) -> Pooled | None:
    """The ratio estimator ``sum(value) / sum(reference)`` of ``(value, se, reference)``
    items, with the upper end of its one-sided interval (see :class:`Scores`)."""
    if not items:
        return None
    total = math.fsum(r for _, _, r in items)
    ratio = math.fsum(v for v, _, _ in items) / total
    within = math.fsum(se * se for _, se, _ in items) / total**2
    k = len(items)
    between = 0.0
    if k > 1:
        scatter = math.fsum((v - ratio * r) ** 2 for v, _, r in items)
        between = scatter / (k - 1) * k / total**2
    return Pooled(ratio, ratio + Z * math.sqrt(max(within, between)))


def _factor(work: float | None) -> float:
    if work is None:
        return 1.0
    return round(min(1.0, max(0.0, work / WORK_FULL)), 4)
