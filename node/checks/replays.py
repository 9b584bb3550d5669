"""The replay side of a node's checks, run by the checks' worker (:mod:`node.checks.work`).

- A check this node made of a contribution (:meth:`ReplayChecks.check`): every checker
  the seed draws for it makes the sent check (:mod:`verification.binding`) at once, and
  the first one also replays a window of the contribution's trace
  (:meth:`ReplayChecks.replay`, :mod:`node.checks.replay`) once the checks' budget
  allows; a failure is signed and gossiped on the ``check`` topic.
- Another checker's failed replay (:meth:`ReplayChecks.judge`): replayed here where its
  evidence allows (the member's signed trace and the window's start state, served by
  the member; for a sent check, the trace and the contribution): a failure here too
  proves the member; a check that passes here makes the record false and charges its
  checker. Without evidence a failure counts as its
  checker's word (:meth:`verification.workscores.Scores.replay_failed`).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from node.checks.inputs import CheckSettings, RoundInputs
from node.checks.parts import CheckHooks, CheckParts
from node.checks.records import Records
from node.checks.replay import NotKept, Unavailable
from protocol.errors import ProtocolError
from verification.replay import ReplayRecord, open_replay_record
from verification.traces import ReplayError, Trace

__all__ = ["Pending", "ReplayChecks"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pending:
    """A replay this node was drawn to make: the member's opened trace (and its bytes)
    and the exchange's seed, which draws the window."""

    trace: Trace
    data: bytes
    seed: bytes


class ReplayChecks:
    """Replay checks of one node (see the module docstring).

    Args:
        settings: the check settings.
        parts: the checks' collaborators: its ``replayer`` replays windows (None: this
            node replays nothing, and counts others' failures on their checkers' word),
            its ``verifier``'s ``work`` scores take the outcomes and its standings say
            whose word counts, its ``fetcher`` asks members for their start states.
        hooks: where a failure is gossiped, and the event log.
        records: the checks' counters, and where a flagged peer is charged and a false
            record's checker refused (:class:`~node.checks.records.Records`).
    """

    def __init__(
        self, settings: CheckSettings, parts: CheckParts, hooks: CheckHooks, records: Records
    ) -> None:
        assert parts.verifier.work is not None
        self.replayer = parts.replayer
        self.identity = parts.identity
        self.me = parts.identity.peer_id
        self.settings = settings
        self.verifier = parts.verifier
        self.scores = parts.verifier.work
        self.fetcher = parts.fetcher
        self.hooks = hooks
        self.records = records
        self.counts = records.counts

    def check(self, inputs: RoundInputs, fragment: int, peer: str) -> Pending | None:
        """Check ``peer``'s contribution to exchange ``(inputs.round, fragment)`` against
        its trace (this node is one of its checkers): the replay to make where this node
        is the first checker the seed draws for it and the sent check passed (one replay
        a contribution: a window the member skipped fails whoever replays it).

        Raises:
            ProtocolError, TimeoutError: the contribution was not served.
        """
        if self.replayer is None:
            return None
        drawn = inputs.checkers(self.settings, fragment, peer)
        fetched = self.fetcher.get(peer, inputs.round, fragment)  # fetched: cached
        if fetched.claim is None or self.me not in drawn:
            return None  # nothing claimed, nothing to replay (a member without assigned data)
        first = drawn[:1] == [self.me]
        try:
            opened = self.replayer.opened(self.me, peer, (inputs.round, fragment), fetched.claim)
        except Unavailable as exc:
            if first:
                self._unserved(peer, inputs.round, fragment, exc)
            return None
        if not isinstance(opened, tuple):
            self._made(opened)  # false on its face
            return None
        trace, data = opened
        bound = self.replayer.sent_check(self.me, trace, data, fetched.vector)
        if bound is not None:
            self._made(bound)
        if first and (bound is None or bound.passed):
            return Pending(trace, data, inputs.seed(self.settings.run_id, fragment))
        return None

    def replay(self, pending: Pending) -> None:
        """Make a replay :meth:`check` left to make."""
        assert self.replayer is not None
        trace = pending.trace
        try:
            replayed = self.replayer.drawn(self.me, trace, pending.data, pending.seed)
        except Unavailable as exc:
            self._unserved(trace.peer, trace.round, trace.fragment, exc)
        else:
            self._made(replayed)

    def _unserved(self, peer: str, round_: int, fragment: int, exc: Unavailable) -> None:
        """A replay this node was drawn to make was not served: counted against no one,
        as a contribution not served (``replay_unserved`` where the member answered that
        it keeps none, ``replay_unanswered`` where it did not answer)."""
        kept = isinstance(exc, NotKept)
        self.counts["replay_unserved" if kept else "replay_unanswered"] += 1
        self.hooks.events("unserved", peer=peer, round=round_, fragment=fragment, why=str(exc))

    def _made(self, made: ReplayRecord) -> None:
        """Sign, count and (a failure) gossip a check this node made."""
        self.counts["sent_checked" if made.sent else "replayed"] += 1
        record = made.signed(self.identity)
        if record.passed:
            self._counted(record, proven=False)
            return
        self.counts["sent_failed" if made.sent else "replay_failed"] += 1
        self.hooks.publish(record.to_bytes())
        # this node checked it: where the trace and state were served, that is proof
        self._counted(record, proven=bool(record.trace and record.state))

    def judge(self, sender: str, data: bytes) -> None:
        """Another checker's failed replay, gossiped by ``sender``."""
        try:
            record = open_replay_record(data, self.settings.run_id)
        except ReplayError as exc:
            self.counts["refused"] += 1
            logger.warning("replay record from %s refused: %s", sender[:16], exc)
            return
        if record.checker != sender or record.passed or record.peer in (sender, self.me):
            return  # only failures are gossiped, by their checker, of someone else
        if self.verifier.blocks(record.checker, record.round) is not None:
            return  # a quarantined or banned checker's word counts for nothing
        if self.scores.proven(record.peer):
            return  # already proven here: nothing to add
        self.counts["taken"] += 1
        mine = self._confirm(record) if self.replayer and record.proof else None
        if mine is None:
            self._counted(record, proven=False)  # no evidence to be had: its word
        elif not mine.passed:
            self.counts["replays_confirmed"] += 1
            self._counted(mine, proven=True, checker=record.checker)
        else:
            self.records.refuse(record, f"its failed {_what(record)} does not reproduce here")

    def _confirm(self, record: ReplayRecord) -> ReplayRecord | None:
        """This node's own check of another checker's failed ``record``; None where the
        evidence could not be had."""
        assert self.replayer is not None and record.opened is not None
        why = self.replayer.inconsistent(record.opened)
        if why:  # false on its face: nothing to fetch
            return dataclasses.replace(record, checker=self.me, why=why)
        if not record.sent:
            return self.replayer.confirm(record, self.me)
        try:
            sent = self.fetcher.get(record.peer, record.round, record.fragment).vector
        except (ProtocolError, TimeoutError):
            return None
        return self.replayer.sent_check(self.me, record.opened, record.trace, sent)

    def _counted(self, record: ReplayRecord, proven: bool, checker: str | None = None) -> None:
        """Count a replay check's outcome (``checker``: whose record this node's replay
        confirmed), and charge a peer its failures flag."""
        checker = checker or record.checker
        flagged = False
        if not record.passed:
            flagged = self.scores.replay_failed(record.peer, checker, record.round, proven)
        self.hooks.events(
            "replay",
            checker=checker,
            peer=record.peer,
            round=record.round,
            fragment=record.fragment,
            window=record.window,
            passed=record.passed,
            sent=record.sent,
            distance=None if record.distance == float("inf") else round(record.distance, 6),
            loss=round(record.loss, 6),
            why=record.why,
            proven=proven,
            flagged=flagged,
        )
        if flagged:
            how = "checked here" if proven else f"on the word of {checker[:16]} and others"
            what = "its sent contribution" if record.sent else f"window {record.window}"
            why = f"{what} fails the {_what(record)} ({how}): {record.why}"
            self.records.charge(record.peer, record.round, record.fragment, why)


def _what(record: ReplayRecord) -> str:
    return "sent check" if record.sent else "replay"
