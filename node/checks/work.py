"""The node's useful-work checks, run by one worker thread beside training.

The worker owns the queues and the order of the tasks, and the budget; the checks
themselves are made by its pieces, built here from what the node hands over
(:mod:`node.checks.parts`): this node's own checks (:mod:`node.checks.own`), the
ledger of records (:mod:`node.checks.records`) and the replay checks
(:mod:`node.checks.replays`).

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

from node.checks.inputs import CheckSettings, ExchangeBase, RoundBook, RoundInputs
from node.checks.own import Costly, Drawn, OwnChecks
from node.checks.parts import CheckHooks, CheckParts
from node.checks.records import ROUNDS_KEPT, Records
from node.checks.replays import Pending, ReplayChecks
from verification.replay import is_replay_record

__all__ = ["UsefulWork"]

logger = logging.getLogger(__name__)

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
        fragments: fragments in the model.
        parts: the checks' collaborators (:class:`~node.checks.parts.CheckParts`).
        hooks: the node's side: gossip, event log, time in inner steps
            (:class:`~node.checks.parts.CheckHooks`).
    """

    def __init__(
        self, settings: CheckSettings, fragments: int, parts: CheckParts, hooks: CheckHooks
    ) -> None:
        self.settings = settings
        self.parts = parts
        self.hooks = hooks
        self.records = Records(settings, fragments, parts, hooks)
        """Every record counted, others' believed or refused; the counters."""
        self.counts = self.records.counts
        self.scores = self.records.scores
        self.replays = ReplayChecks(settings, parts, hooks, self.records)
        """Replay checks: this node's, and other checkers' failed ones."""
        self.own = OwnChecks(settings, parts, hooks, self.records, self.replays)
        """The checks this node was drawn to make."""
        self.book = RoundBook(fragments)
        self.seconds = 0.0
        """Time the worker spent checking (fetching, measuring, judging), in total."""
        self._inputs: dict[int, RoundInputs | None] = {}
        """Rounds that ended here: their inputs, or None (went wrong, or incomplete)."""
        self._own: deque[RoundInputs] = deque()
        """Rounds whose seeds this node's trace has not been told yet."""
        self._rounds: deque[RoundInputs] = deque()
        """Rounds whose checks are not drawn yet."""
        self._todo: deque[Drawn] = deque()
        """Drawn checks not started yet: a round's inputs, a fragment and a peer."""
        self._costly: deque[Costly] = deque()
        """Checks whose sent check is made, waiting for the budget: the replay to make
        (None: none), then the record."""
        self._inbox: deque[tuple[str, bytes]] = deque(maxlen=_INBOX)
        self._waiting: list[tuple[int, str, bytes]] = []
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
            for old in [r for r in self._inputs if r <= round_ - ROUNDS_KEPT]:
                del self._inputs[old]
            if inputs is not None:
                self._rounds.append(inputs)
                if self.parts.tracer is not None:
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
        spent = self.compute_seconds() + self._tracing()
        return budget >= 1 or spent <= budget * self.hooks.training_seconds()

    def compute_seconds(self) -> float:
        """Time the checks' forward passes and replayed steps took so far."""
        replayer = self.replays.replayer
        measured = self.parts.measurer.seconds
        return measured + (replayer.seconds if replayer is not None else 0.0)

    def _tracing(self) -> float:
        """Time this node's own trace took so far (it counts in the budget)."""
        return self.parts.tracer.spent() if self.parts.tracer is not None else 0.0

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
                return lambda: self.own.release(own.prepare())
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

    def _draw(self, inputs: RoundInputs) -> None:
        """Queue every check of round ``inputs.round`` this node was drawn to."""
        drawn_checks = self.own.draw(inputs, inputs.round - ROUNDS_KEPT)
        with self._wake:
            self._todo.extend(drawn_checks)
            self._drop_behind()

    def _sent(self, inputs: RoundInputs, fragment: int, peer: str) -> None:
        """A drawn check's cheap part, made at once; the replay and the record wait for
        the budget."""
        costly = self.own.sent(inputs, fragment, peer)
        if costly is not None:
            with self._wake:
                self._costly.append(costly)

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
        self.own.record(inputs, fragment, peer)

    # ---- others' records ----------------------------------------------------------------

    def _judge(self, sender: str, data: bytes) -> None:
        """Judge a record gossiped by ``sender``: one of a round this node has not closed
        yet waits for it (a few rounds ahead at most)."""
        if is_replay_record(data):
            self.replays.judge(sender, data)
            return
        record = self.records.opened(sender, data)
        if record is None:
            return
        with self._wake:
            closed = self._closed()
            if record.round > closed:
                if record.round <= closed + _WAITING_ROUNDS:
                    self._waiting.append((record.round, sender, data))
                    del self._waiting[:-_INBOX]
                return
            inputs = self._inputs.get(record.round)
        self.records.weigh(record, inputs, self.own.measure)

    # ---- reports ------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """Counts, time spent, bytes fetched and the peers flagged, for the round event."""
        return {
            **self.counts,
            "regrouped": self.book.regrouped,
            "bytes_fetched": self.parts.fetcher.bytes_fetched,
            "forwards": self.parts.measurer.forwards,
            "replayed_steps": self.replays.replayer.steps if self.replays.replayer else 0,
            "seconds": round(self.seconds, 3),
            "compute_seconds": round(self.compute_seconds(), 3),
            "trace_seconds": round(self._tracing(), 3),
            "flagged": sorted(self.scores.flagged()),
        }
