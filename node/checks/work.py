"""The node's useful-work checks, run by one worker thread beside training.

The training thread only hands things over: each applied exchange
(:meth:`UsefulWork.exchange_applied`) and each round's end (:meth:`UsefulWork.round_ended`)
are stored and queued in constant time, and records gossiped by other checkers come in
on the control channel's thread (:meth:`UsefulWork.receive`). The worker then, one task
at a time:

- judges other checkers' records (:mod:`node.checks.judge`): recomputes the ones it
  must, charges a false one's signer a ``bad_check_record`` violation, and counts the
  rest in the verifier's :class:`~verification.workscores.Scores`, whose work ratios
  set each peer's weight in this node's aggregates; a peer the scores flag gets a
  ``useless_work`` violation once per round, unless replay and sent checks both run
  (``records_charge`` false: there only their failures charge);
- for every round that ended well here, with every fragment exchanged: tells the node's
  own trace which windows its checkers will replay, so that it keeps only their start
  states (:meth:`node.checks.trace.Tracer.drawn`); then draws the contributions this node
  checks (:mod:`verification.usefulness`), fetches each (:mod:`node.checks.fetch`; the
  fetch runs on the transport's loop) and makes its sent check at once (a sketch of it,
  :mod:`node.checks.replays`);
- within the budget: replays a window of each contribution it is the first checker of,
  then measures the contribution's work ratios (:mod:`node.checks.measure`), signs the
  record, gossips it on the control channel's ``check`` topic and counts it. The record
  is made with what the budget leaves after the replay (a replay proves, a record only
  weighs).

The worker starts each costly check (a replay, a measured record) only while its forward
passes and replays so far, with the node's own trace (:mod:`node.checks.trace`), took at most
``trust.check_budget`` of the node's time in inner steps (a fetch's wait is not
counted), give or take one check. Costly checks more than two rounds behind are dropped
(``skipped``, once per round). Judging records and sent checks are not held back
(audits count in the same budget).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from node.checks.fetch import Fetcher
from node.checks.inputs import CheckSettings, ExchangeBase, RoundBook, RoundInputs
from node.checks.judge import believe
from node.checks.measure import Checked, Measurer
from node.checks.replay import Replayer
from node.checks.replays import Outlets, Pending, ReplayChecks
from protocol.errors import ProtocolError
from verification.gains import Verdict, judge
from verification.identity import Identity
from verification.replay import ReplayRecord, is_replay_record
from verification.usefulness import (
    CheckRecord,
    RecordError,
    open_record,
    reproduces,
)
from verification.verifier import Verifier

__all__ = ["UsefulWork"]

logger = logging.getLogger(__name__)

_ROUNDS_KEPT = 2
"""Rounds of inputs kept to judge records that come in late (each a model's values)."""
_BEHIND = 2
"""Rounds of checks queued at most; older ones are dropped."""
_INBOX = 4096
"""Records waiting to be judged at most (older ones are dropped)."""
_WAITING_ROUNDS = 3
"""How many rounds ahead of this node a record may wait for this node to get there."""
_IDLE_WAIT = 0.5
"""Seconds between two looks at the budget while a round waits for it."""


class UsefulWork:
    """This node's useful-work checks (see the module docstring).

    Args:
        settings: the check settings.
        identity: this node's key (signs records).
        verifier: where violations go; its ``work`` scores take the records.
        measurer: measures contributions on a round's base.
        fetcher: fetches contributions.
        fragments: fragments in the model.
        publish: gossips a signed record; ``events``: the node's event log writer.
        training_seconds: the time the node spent in inner steps so far.
        replayer: replays windows of checked members' traces (``trust.replay_steps``;
            None: no replay checks).
        tracing: the time this node's own trace took so far
            (:meth:`node.checks.trace.Tracer.spent`; it counts in the budget).
        drawn: tells this node's trace, once a round's seed is known, the checker that
            replays its contribution to an exchange, ``(round, fragment, seed, checker)``
            (None: no one does) (:meth:`node.checks.trace.Tracer.drawn`).
    """

    def __init__(
        self,
        settings: CheckSettings,
        identity: Identity,
        verifier: Verifier,
        measurer: Measurer,
        fetcher: Fetcher,
        fragments: int,
        publish: Callable[[bytes], bool],
        events: Callable[..., None],
        training_seconds: Callable[[], float],
        replayer: Replayer | None = None,
        tracing: Callable[[], float] | None = None,
        drawn: Callable[[int, int, bytes, str | None], None] | None = None,
    ) -> None:
        if verifier.work is None:
            raise ValueError("useful-work checks need trust.checkers > 0")
        self.settings = settings
        self.identity = identity
        self.me = identity.peer_id
        self.verifier = verifier
        self.scores = verifier.work
        self.measurer = measurer
        self.fetcher = fetcher
        self.fragments = fragments
        self.publish = publish
        self.events = events
        self.training_seconds = training_seconds
        self.tracing = tracing or (lambda: 0.0)
        self.drawn = drawn
        self.book = RoundBook(fragments)
        names = "made taken recomputed refused unserved skipped replayed replay_failed"
        names += " replays_confirmed replay_unserved replay_unanswered sent_checked"
        self.counts = dict.fromkeys([*names.split(), "sent_failed", "unmeasured"], 0)
        self.seconds = 0.0
        """Time the worker spent checking (fetching, measuring, judging), in total."""
        self.replays = ReplayChecks(
            replayer,
            identity,
            settings,
            verifier,
            fetcher,
            self.counts,
            Outlets(publish, events, self._charge, self._refuse),
        )
        """Replay checks: this node's, and other checkers' failed ones."""
        self._inputs: dict[int, RoundInputs | None] = {}
        """Rounds that ended here: their inputs, or None (went wrong, or incomplete)."""
        self._own: deque[RoundInputs] = deque()
        """Rounds whose seeds this node's trace has not been told yet."""
        self._rounds: deque[RoundInputs] = deque()
        """Rounds whose checks are not drawn yet."""
        self._todo: deque[tuple[RoundInputs, int, str]] = deque()
        """Drawn checks not started yet: a round's inputs, a fragment and a peer."""
        self._costly: deque[tuple[RoundInputs, int, str, Pending | None]] = deque()
        """Checks whose sent check is made, waiting for the budget: the replay to make
        (None: none), then the record."""
        self._inbox: deque[tuple[str, bytes]] = deque(maxlen=_INBOX)
        self._waiting: list[tuple[int, str, bytes]] = []
        self._charged: set[tuple[str, int]] = set()
        self._wake = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="atoll-checks", daemon=True)

    # ---- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the worker (the task in hand ends first, within ``timeout``)."""
        self._stop.set()
        with self._wake:
            self._wake.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- inputs (any thread; constant time) ------------------------------------------

    def exchange_applied(self, exchange: ExchangeBase) -> None:
        """An exchange whose every part came back reduced was applied (training thread)."""
        # replay and sent checks need no warm-up: they run from the first round
        first = 1 if self.replays.replayer is not None else self.settings.from_round
        if exchange.round >= first:
            self.book.applied(exchange)

    def round_ended(self, round_: int, went_wrong: bool) -> None:
        """Round ``round_`` ended here; when it went wrong (a sync failed, the node took
        the swarm's state) nothing of it is checked, and records of it cannot be
        verified here."""
        if went_wrong:
            self.book.drop(round_)
            inputs = None
        else:
            inputs = self.book.close(round_)
        with self._wake:
            self._inputs[round_] = inputs
            for old in [r for r in self._inputs if r <= round_ - _ROUNDS_KEPT]:
                del self._inputs[old]
            if inputs is not None:
                self._rounds.append(inputs)
                if self.drawn is not None:
                    self._own.append(inputs)
                self._drop_behind()
            closed = self._closed()
            ready = [(s, d) for r, s, d in self._waiting if r <= closed]
            self._waiting = [w for w in self._waiting if w[0] > closed]
            self._inbox.extend(ready)
            self._wake.notify_all()

    def _closed(self) -> int:
        """The newest round whose inputs this node closed (0: none yet); called with the
        lock held."""
        return max(self._inputs, default=0)

    def receive(self, sender: str, data: bytes) -> None:
        """A record gossiped by ``sender`` (the control channel's thread)."""
        with self._wake:
            self._inbox.append((sender, data))
            self._wake.notify_all()

    # ---- the worker ---------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            task = self._next()
            if task is None:
                continue
            started = time.monotonic()
            try:
                task()
            except Exception:  # a bug in one check must not end the node's checks
                logger.exception("useful-work check failed")
            self.seconds += time.monotonic() - started

    def within_budget(self) -> bool:
        """Whether the checks' forwards and replays so far, and the trace's time, are
        within their share of training."""
        budget = self.settings.budget
        spent = self.compute_seconds() + self.tracing()
        return budget >= 1 or spent <= budget * self.training_seconds()

    def compute_seconds(self) -> float:
        """Time the checks' forward passes and replayed steps took so far."""
        replayer = self.replays.replayer
        return self.measurer.seconds + (replayer.seconds if replayer is not None else 0.0)

    def _drop_behind(self) -> None:
        """Drop the costly checks of rounds more than :data:`_BEHIND` behind the newest
        that has any (each such round counted once as skipped). Holds ``_wake``."""
        pending = sorted(
            {i.round for i in self._rounds}
            | {t[0].round for t in self._todo}
            | {t[0].round for t in self._costly}
        )
        stale = set(pending[:-_BEHIND])
        if stale:
            self.counts["skipped"] += len(stale)
            self._rounds = deque(i for i in self._rounds if i.round not in stale)
            self._todo = deque(t for t in self._todo if t[0].round not in stale)
            self._costly = deque(t for t in self._costly if t[0].round not in stale)

    def _next(self) -> Callable[[], None] | None:
        """The next task: a record to judge whenever one is in; a round's seed for the
        node's own trace; the sent checks drawn; the next round's draw once those are
        made; a costly check while the checks are within their budget (see the module
        docstring)."""
        with self._wake:
            if self._inbox:
                sender, data = self._inbox.popleft()
                return lambda: self._judge(sender, data)
            if self._own:
                own = self._own.popleft()
                return lambda: self._release(own.prepare())
            if self._todo:
                inputs, fragment, peer = self._todo.popleft()
                return lambda: self._sent(inputs, fragment, peer)
            if self._rounds:
                inputs = self._rounds.popleft()
                return lambda: self._draw(inputs.prepare())
            if self._costly and self.within_budget():
                inputs, fragment, peer, pending = self._costly.popleft()
                return lambda: self._check(inputs, fragment, peer, pending)
            self._wake.wait(_IDLE_WAIT if self._costly else 1.0)
        return None

    # ---- this node's checks -------------------------------------------------------------

    def _release(self, inputs: RoundInputs) -> None:
        """Tell this node's trace who replays its contribution to each exchange of round
        ``inputs.round``, as its checkers draw it (the same inputs on every member of
        its group): the trace keeps only those windows' start states."""
        assert self.drawn is not None
        s = self.settings
        for f, exchange in enumerate(inputs.exchanges):
            mine = self.me in exchange.contributors
            drawn = inputs.checkers(s, f, self.me) if mine else []
            self.drawn(inputs.round, f, inputs.seed(s.run_id, f), drawn[0] if drawn else None)

    def _draw(self, inputs: RoundInputs) -> None:
        """Queue every check of round ``inputs.round`` this node was drawn to."""
        drawn_checks = []
        for f, exchange in enumerate(inputs.exchanges):
            if self.me not in exchange.contributors:
                continue  # a member left out of the exchange checks no one in it
            for peer in exchange.contributors:
                if peer != self.me and self.me in inputs.checkers(self.settings, f, peer):
                    drawn_checks.append((inputs, f, peer))
        self.fetcher.forget(inputs.round - _ROUNDS_KEPT)
        with self._wake:
            self._todo.extend(drawn_checks)
            self._drop_behind()

    def _sent(self, inputs: RoundInputs, fragment: int, peer: str) -> None:
        """A drawn check's cheap part, made at once: the contribution fetched and its
        sent check; the replay and the record wait for the budget."""
        try:
            pending = self.replays.check(inputs, fragment, peer)
        except (ProtocolError, TimeoutError) as exc:  # not served: against no one
            self.counts["unserved"] += 1
            logger.info(
                "round %d fragment %d: contribution of %s not checked: %s",
                *(inputs.round, fragment, peer[:16], exc),
            )
            return
        if pending is not None or inputs.round >= self.settings.from_round:
            with self._wake:
                self._costly.append((inputs, fragment, peer, pending))

    def _check(
        self, inputs: RoundInputs, fragment: int, peer: str, pending: Pending | None
    ) -> None:
        """A drawn check's costly part: its replay, then its record (before the records'
        warm-up ends, only the replay; after a replay, the record only where the budget
        is left for it)."""
        if pending is not None:
            self.replays.replay(pending)
        if inputs.round < self.settings.from_round:
            return
        if pending is not None and not self.within_budget():
            self.counts["unmeasured"] += 1
            return
        record = self._measure(inputs, fragment, peer, self.me)
        if record is None:
            return
        record = record.signed(self.identity)
        self.counts["made"] += 1
        self.publish(record.to_bytes())
        self._count(record)

    def _measure(
        self, inputs: RoundInputs, fragment: int, peer: str, checker: str
    ) -> CheckRecord | None:
        """``checker``'s record of ``peer`` in exchange ``(inputs.round, fragment)``, as
        this node measures it; None when a contribution could not be had (logged,
        counted against no one)."""
        mixed = inputs.exchanges[fragment].mixed
        get = self.fetcher.get
        try:
            checked, reference = (
                Checked(
                    get(who, inputs.round, fragment),
                    get(who, inputs.round, fragment, "weights") if mixed else None,
                )
                for who in (peer, checker)
            )
        except (ProtocolError, TimeoutError) as exc:
            self.counts["unserved"] += 1
            logger.warning(
                "round %d fragment %d: contribution of %s not checked: %s",
                *(inputs.round, fragment, peer[:16], exc),
            )
            return None
        return self.measurer.record(inputs, fragment, peer, checker, checked, reference)

    # ---- others' records ----------------------------------------------------------------

    def _judge(self, sender: str, data: bytes) -> None:
        if is_replay_record(data):
            self.replays.judge(sender, data)
            return
        s = self.settings
        try:
            record = open_record(data, s.run_id)
        except RecordError as exc:
            self.counts["refused"] += 1
            logger.warning("check record from %s refused: %s", sender[:16], exc)
            return
        if record.checker != sender or record.round < s.from_round:
            return
        if self.verifier.blocks(record.checker, record.round) is not None:
            return  # a quarantined or banned checker's word counts for nothing
        with self._wake:
            closed = self._closed()
            if record.round > closed:
                if record.round <= closed + _WAITING_ROUNDS:
                    self._waiting.append((record.round, sender, data))
                    del self._waiting[:-_INBOX]
                return
            inputs = self._inputs.get(record.round)
        if inputs is not None:
            inputs.prepare()
        belief = believe(record, inputs, s, self.me, self.fragments, self.scores)
        if belief.action == "recompute":
            assert inputs is not None
            self.counts["recomputed"] += 1
            mine = self._measure(inputs, record.fragment, record.peer, record.checker)
            if mine is None:
                return  # cannot tell
            if not reproduces(record, mine):
                belief = type(belief)("false", "its losses do not reproduce")
        if belief.action == "false":
            self._refuse(record, belief.why)
            return
        self.counts["taken"] += 1
        self._count(record)

    def _refuse(self, record: CheckRecord | ReplayRecord, why: str) -> None:
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

    def _count(self, record: CheckRecord) -> None:
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
        self._charge(record.peer, record.round, record.fragment, why)

    def _charge(self, peer: str, round_: int, fragment: int, why: str) -> None:
        """A ``useless_work`` violation for a flagged peer, once per round."""
        key = (peer, round_)
        if key in self._charged or peer == self.me:
            return
        self._charged.add(key)
        self._charged = {k for k in self._charged if k[1] > round_ - _ROUNDS_KEPT}
        self.verifier.standings.violation(peer, round_, fragment, "useless_work", why)

    # ---- reports ------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """Counts, time spent, bytes fetched and the peers flagged, for the round event."""
        return {
            **self.counts,
            "regrouped": self.book.regrouped,
            "bytes_fetched": self.fetcher.bytes_fetched,
            "forwards": self.measurer.forwards,
            "replayed_steps": self.replays.replayer.steps if self.replays.replayer else 0,
            "seconds": round(self.seconds, 3),
            "compute_seconds": round(self.compute_seconds(), 3),
            "trace_seconds": round(self.tracing(), 3),
            "flagged": sorted(self.scores.flagged()),
        }


def _measured(verdict: Verdict) -> dict[str, list[float] | None]:
    """A verdict's estimates as ``[mean, standard error]``, for the event log."""
    out: dict[str, list[float] | None] = {}
    for name in ("gain", "ref_gain", "lift", "ref_lift"):
        e = getattr(verdict, name)
        out[name] = None if e is None else [round(e.mean, 6), round(e.se, 6)]
    return out
