"""The ledger of check records on the node: every record, this node's own or another
checker's, counted in the verifier's :class:`~verification.workscores.Scores` (whose
work ratios set each peer's weight in this node's aggregates), a false one's signer
charged a ``bad_check_record`` violation, and a peer the scores flag a ``useless_work``
violation once per round, unless replay and sent checks both run (``records_charge``
false: there only their failures charge).

Another checker's record is opened and believed or refused here
(:mod:`node.checks.judge`), recomputed where it must be with the measure this node's own
checks use (:meth:`node.checks.own.OwnChecks.measure`). The counters of every check
kind live here, shared with the worker and the replay checks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from node.checks.inputs import CheckSettings, RoundInputs
from node.checks.judge import believe
from node.checks.parts import CheckHooks, CheckParts
from verification.gains import Verdict, judge
from verification.replay import ReplayRecord
from verification.usefulness import CheckRecord, RecordError, open_record, reproduces

__all__ = ["Records"]

logger = logging.getLogger(__name__)

ROUNDS_KEPT = 2
"""Rounds of inputs kept to judge records that come in late (each a model's values), and
of charges remembered (one a peer and round)."""

Measure = Callable[[RoundInputs, int, str, str], CheckRecord | None]
"""``(inputs, fragment, peer, checker)`` to ``checker``'s record of ``peer`` as this
node measures it (None: a contribution could not be had)."""


class Records:
    """This node's ledger of check records (see the module docstring).

    Args:
        settings: the check settings.
        fragments: fragments in the model.
        parts: the checks' collaborators (this node's key, the verifier).
        hooks: the node's event log.
    """

    def __init__(
        self, settings: CheckSettings, fragments: int, parts: CheckParts, hooks: CheckHooks
    ) -> None:
        if parts.verifier.work is None:
            raise ValueError("useful-work checks need trust.checkers > 0")
        self.settings = settings
        self.fragments = fragments
        self.me = parts.identity.peer_id
        self.verifier = parts.verifier
        self.scores = parts.verifier.work
        self.events = hooks.events
        names = "made taken recomputed refused unserved skipped replayed replay_failed"
        names += " replays_confirmed replay_unserved replay_unanswered sent_checked"
        self.counts = dict.fromkeys([*names.split(), "sent_failed", "unmeasured"], 0)
        """Counters of every check kind (the round event's ``checks``)."""
        self._charged: set[tuple[str, int]] = set()

    def opened(self, sender: str, data: bytes) -> CheckRecord | None:
        """The record gossiped by ``sender``, where it is one to judge: None where it is
        malformed (refused, logged), of another signer than its sender, of a round before
        the records' warm-up, or by a checker whose word counts for nothing."""
        try:
            record = open_record(data, self.settings.run_id)
        except RecordError as exc:
            self.counts["refused"] += 1
            logger.warning("check record from %s refused: %s", sender[:16], exc)
            return None
        if record.checker != sender or record.round < self.settings.from_round:
            return None
        if self.verifier.blocks(record.checker, record.round) is not None:
            return None  # a quarantined or banned checker's word counts for nothing
        return record

    def weigh(self, record: CheckRecord, inputs: RoundInputs | None, measure: Measure) -> None:
        """Believe and count another checker's ``record``, or refuse it: recomputed with
        ``measure`` where this node must (``inputs``: its inputs of the record's round;
        None: it holds none)."""
        if inputs is not None:
            inputs.prepare()
        s = self.settings
        belief = believe(record, inputs, s, self.me, self.fragments, self.scores)
        if belief.action == "recompute":
            assert inputs is not None
            self.counts["recomputed"] += 1
            mine = measure(inputs, record.fragment, record.peer, record.checker)
            if mine is None:
                return  # cannot tell
            if not reproduces(record, mine):
                belief = type(belief)("false", "its losses do not reproduce")
        if belief.action == "false":
            self.refuse(record, belief.why)
            return
        self.counts["taken"] += 1
        self.count(record)

    def refuse(self, record: CheckRecord | ReplayRecord, why: str) -> None:
        """``record`` is false: its checker is charged for it."""
        self.counts["refused"] += 1
        what = "replay record" if isinstance(record, ReplayRecord) else "record"
        self.verifier.standings.violation(
            record.checker,
            record.round,
            record.fragment,
            "bad_check_record",
            f"its {what} of {record.peer[:16]}: {why}",
        )
        self.events(
            "check_refused",
            checker=record.checker,
            peer=record.peer,
            round=record.round,
            fragment=record.fragment,
            why=why,
        )

    def count(self, record: CheckRecord) -> None:
        """Count a believed record in the scores, and charge a peer they flag."""
        verdict = judge(record)
        if not self.scores.add(record, verdict):
            return
        score = self.scores.score(record.peer)
        work, specific = self.scores.relative(verdict, record.round)
        self.events(
            "check",
            checker=record.checker,
            peer=record.peer,
            round=record.round,
            fragment=record.fragment,
            claimed=record.claimed,
            work=None if work is None else round(work, 4),
            specific=None if specific is None else round(specific, 4),
            measured=_measured(verdict),
            short=self.scores.short(verdict, record.round),
            factor=score["factor"],
            flagged=score["flagged"],
        )
        if score.get("replay_flagged"):
            why = f"{score['replays_failed']} failed replay or sent checks"
        elif score["flagged"] and self.settings.records_charge:
            why = (
                f"pooled work ratio {score['work']} and specific ratio {score['specific']} "
                f"over {score['records']} records from {score['checkers']} checkers"
            )
        else:
            return
        self.charge(record.peer, record.round, record.fragment, why)

    def charge(self, peer: str, round_: int, fragment: int, why: str) -> None:
        """A ``useless_work`` violation for a flagged peer, once per round."""
        key = (peer, round_)
        if key in self._charged or peer == self.me:
            return
        self._charged.add(key)
        self._charged = {k for k in self._charged if k[1] > round_ - ROUNDS_KEPT}
        self.verifier.standings.violation(peer, round_, fragment, "useless_work", why)


def _measured(verdict: Verdict) -> dict[str, list[float] | None]:
    """A verdict's estimates as ``[mean, standard error]``, for the event log."""
    out: dict[str, list[float] | None] = {}
    for name in ("gain", "ref_gain", "lift", "ref_lift"):
        e = getattr(verdict, name)
        out[name] = None if e is None else [round(e.mean, 6), round(e.se, 6)]
    return out
