"""The training loop: inner steps, and each fragment's sync when the schedule says.

One loop serves both triggers of ``sync.trigger`` through a
:class:`~node.train.schedule.Schedule`: after every inner step it starts the syncs that are
due, applies the results that are ready, and ends each round whose fragments are all
done (:meth:`node.run.rounds.Rounds.end`). Every network exchange runs on the transport's
loop with a deadline, so a slow or vanished peer costs at most that deadline.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from node.checks.claims import WorkLog
from node.config import AtollConfig
from node.data.corpus import assigned_stream
from node.run.rounds import Rounds
from node.run.state import Running
from node.run.syncevents import Pending
from node.train.schedule import Schedule, StepSchedule, SyncBook, WallSchedule

__all__ = ["LoopSettings", "TrainingLoop", "schedule_of"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoopSettings:
    """What the training loop reads from the configuration, built by
    :func:`node.settings.loop_settings`.

    Attributes:
        run_id: the run (the batches assigned to this node are drawn from it).
        max_rounds: rounds to train (0: no end).
        slowdown: each inner step stretched this many times (a stand-in for slower
            hardware).
        data_slice: this site's slice of the data, and how many there are.
        matchmaking_seconds: an exchange's matchmaking wait.
        round_timeout: the longest an exchange's all-reduce may take.
        alone_rounds: rounds without an exchange before the node says it trains alone.
        commit_seconds: the commit window where the control plane runs a commit phase
            (None: none).
        round_seconds: a round's length on the wall clock (None: the ``steps`` trigger).
    """

    run_id: str
    max_rounds: int
    slowdown: float
    data_slice: tuple[int, int]
    matchmaking_seconds: float
    round_timeout: float
    alone_rounds: int
    commit_seconds: float | None
    round_seconds: float | None

    def build(self, running: Running, rounds: Rounds) -> TrainingLoop:
        """The loop of the node that ``running`` describes."""
        return TrainingLoop(self, running, rounds)

    def exchange_floor(self, commit_window: float | None) -> float:
        """Seconds any exchange needs before its all-reduce: the matchmaking wait and,
        where the control plane runs one, the commit window (the least an adaptive budget
        keeps, :class:`node.train.deadlines.Deadlines`)."""
        floor = self.matchmaking_seconds
        if self.commit_seconds is not None:
            floor += commit_window if commit_window is not None else self.commit_seconds
        return floor

    def exchange_budget(self, commit_window: float | None) -> float:
        """Seconds one exchange may take: matchmaking, the commit phase and the
        all-reduce (``network.round_timeout``); on the wall clock, never past the
        fragment's next sync, so a silent or vanished peer cannot make an exchange
        outlast its round.

        Args:
            commit_window: the control plane's commit window, when it runs.
        """
        budget = self.exchange_floor(commit_window) + self.round_timeout
        if self.round_seconds is not None:
            length = self.round_seconds
            budget = min(budget, length - max(0.5, 0.05 * length))
        return budget


_NEWER_TRIES = 3
"""Tries at a newer state before a node that is a round behind comes in (see
:meth:`TrainingLoop._newer_state`)."""
_NEWER_WAIT = 2.0
"""Seconds between two of those tries (a round's state is settled a few seconds after
its end)."""


class TrainingLoop:
    """Train until ``run.max_rounds`` rounds are done or the node stops.

    Built by :meth:`LoopSettings.build`.

    Args:
        settings: rounds, pace and budgets.
        running: the node's records, its logs and its stop.
        rounds: what happens when a round ends.
    """

    def __init__(self, settings: LoopSettings, running: Running, rounds: Rounds) -> None:
        self.settings = settings
        self.progress = progress = running.progress
        self.training = training = running.training
        self.network = running.network
        self.rounds = rounds
        self.status, self.events = running.status, running.events
        self.stop = running.stop
        self.fragments = len(training.plan)
        self._since = progress.round  # the round rounds alone are counted from
        stream = training.trainer.stream
        self.work = WorkLog(
            self.fragments,
            ranks=training.trainer.ranks,
            data_slice=settings.data_slice,
            batch=stream.batch_size,
        )
        """The batches each fragment's next sync was trained on (its claim)."""

    def run(self, schedule: Schedule) -> None:
        """The loop, then what follows the last round (the site's ranks stopped, and
        lingering while a peer is behind)."""
        site = self.training.site
        self.status.update(force=True, state="training")
        self.progress.train_started = time.monotonic()
        # the ranks start from the leader's state (resumed or taken from the swarm)
        site.share_optimizer(self.training.trainer.optimizer)
        self._loop(schedule)
        if not self.stop.is_set():
            site.pull(stopping=False)  # the final checkpoint holds what the ranks trained
            site.stop()  # on a signal, torchrun stops the ranks itself
        self._linger()

    def _loop(self, schedule: Schedule) -> None:
        book = SyncBook.of(self.fragments)
        wall = schedule if isinstance(schedule, WallSchedule) else None
        if wall is not None:
            self._newer_state(wall)
            self._place(wall, book)
        self._since = self.progress.round  # where the wall clock placed it
        self._assign(self.progress.round + 1)
        max_rounds, trainer = self.settings.max_rounds, self.training.trainer
        while not self.stop.is_set():
            if max_rounds and self.progress.round >= max_rounds:
                break
            self._step(book)
            if wall is not None and wall.behind(self.progress.round):
                self._fell_behind(wall, book)  # frozen, suspended or cut off for a while
            for r, f in schedule.due(time.time()):
                if f == 0:
                    self._assign(r + 1)  # what is trained from now on goes into round r + 1
                if schedule.skips(r) or f in book.pending:
                    # Joining, or the previous sync of f is still in flight: skip this one;
                    # the work stays in the local copy and is folded into the next sync.
                    self._skip(book, r, f)
                    continue
                book.launched(f, self._launch(r, f, book.tokens_since[f]))
            for f, p in list(book.pending.items()):
                if schedule.ready(p, trainer.steps):
                    del book.pending[f]
                    book.finished(p.round, f, ok=self._apply(p) is not None)
            while book.complete(self.progress.round + 1, self.fragments):
                r = self.progress.round + 1
                went_wrong = book.close(r)
                joining = schedule.skips(r)
                if self.rounds.end(r, resync=went_wrong or joining, joining=joining):
                    # a joiner's work of the round it sat out went with the swarm's state
                    book.forget_work()
                    self.work.forget()
                self._alone(r)
                schedule.ended(self.progress.round)
        if self.stop.is_set() and book.pending:
            self._leave(book)
        # what the node trained, and of it what no sync of each fragment carried (the
        # tail of a finished run; an interrupted round's work)
        unsynced = [*book.tokens_since]
        for f, p in book.pending.items():
            unsynced[f] += p.tokens
        self.events.write("unsynced", round=self.progress.round, tokens=trainer.tokens,
                          fragments=unsynced)  # fmt: skip
        for p in book.clear():
            p.future.cancel()  # the interrupted round is abandoned; the last checkpoint stands

    def _leave(self, book: SyncBook) -> None:
        """The node was told to stop with syncs in flight: let each end (by its deadline)
        before the node goes, so that the work in it reaches its group rather than being
        lost with the node, and this node's owned parts are served (a second signal stops
        at once). Nothing is applied: the interrupted round is abandoned, and the last
        checkpoint stands."""
        wait = max(0.0, max(p.deadline for p in book.pending.values()) - time.monotonic())
        logger.info(
            "stopping: letting %d sync(s) in flight end, up to %.0f s (a second signal "
            "stops at once)",
            *(len(book.pending), wait),
        )
        for f, p in sorted(book.pending.items(), key=lambda item: item[1].deadline):
            if self.network.syncer.leave(p) is not None:
                del book.pending[f]  # its work went with its group's result

    def _assign(self, round_: int) -> None:
        """Train the batches assigned to this node for ``round_`` from now on, every rank
        of a site its own, so any peer can draw them again (:mod:`node.checks`)."""
        t = self.training
        s = t.trainer.stream
        peer = self.network.transport.peer_id
        run = self.settings.run_id
        t.trainer.draw_from(assigned_stream(s.data, s.batch_size, s.context, run, peer, round_))
        t.site.assign(round_)
        self.work.assign(round_)

    def _skip(self, book: SyncBook, r: int, f: int) -> None:
        """Fragment ``f`` of round ``r`` is not exchanged: its work goes into the next
        sync, and the round's state is taken from the swarm when it ends."""
        self.network.syncer.skipped(f)
        book.finished(r, f, ok=False)

    def _step(self, book: SyncBook) -> None:
        """One inner step, stretched by ``run.slowdown``; counts busy time."""
        started = time.monotonic()
        trainer, progress = self.training.trainer, self.progress
        tracer = self.network.tracer
        if tracer is not None:
            at = None if self.work.stream is None else (self.work.stream, self.work.position)
            tracer.before(trainer.model, trainer.optimizer, trainer.steps, at)
        result = self.training.site.step(trainer)
        if tracer is not None:
            tracer.after(trainer.model, result.loss)
        slowdown = self.settings.slowdown
        if slowdown > 1.0:
            # Stand in for slower hardware: the extra time is compute time, not idle.
            time.sleep((time.monotonic() - started) * (slowdown - 1.0))
        progress.busy += time.monotonic() - started
        book.trained(result.tokens)
        stream = trainer.stream
        self.work.trained(result.tokens // (stream.batch_size * stream.context * trainer.ranks))
        wall = time.monotonic() - progress.train_started
        self.status.update(
            step=trainer.steps,
            loss=result.loss,
            round=progress.round,
            tokens=trainer.tokens,
            in_flight=[[p.round, p.fragment] for p in book.pending.values()],
            busy_seconds=progress.busy,
            idle_seconds=max(0.0, wall - progress.busy),
        )

    def _launch(self, r: int, f: int, tokens: int) -> Pending:
        """Start the sync of fragment ``f`` for round ``r`` with the tokens trained for it."""
        self.rounds.pull()
        self.progress.clock.start(r)
        verifier = self.network.verifier
        # Wait for every live peer, suspects included: they count in everyone's view of
        # the round, and whether they are left out is decided by vote (voted_out).
        expected = self.network.live_peers()
        excludes = verifier.excluded(list(expected), r)
        control = self.network.control
        window = control.commit_window if control else None
        ceiling = self.settings.exchange_budget(window)
        budget = self.network.deadlines.budget(ceiling, self.settings.exchange_floor(window))
        steps = self.training.trainer.steps
        claim = self.work.take(f)
        tracer = self.network.tracer
        if tracer is not None:
            if claim is not None:
                claim = tracer.claim(claim, r, f)
            tracer.keep(self.work.open_spans())
        syncer = self.network.syncer
        return syncer.launch(r, f, tokens, steps, expected, excludes, budget, claim)

    def _apply(self, pending: Pending) -> dict[str, Any] | None:
        """Apply a finished sync; None when it failed or averaged alone while peers live."""
        self.rounds.pull()
        network, progress = self.network, self.progress
        if network.tracer is not None:
            network.tracer.seal()  # the sync is about to change the model
        record = network.syncer.apply(pending, self.training.trainer.steps)
        self.training.site.model_changed()
        if record is None:
            return None  # nothing applied: its claim's batches go into the next claim
        self.work.settled(pending.fragment)
        progress.bytes_sent += record["bytes_sent"]
        self.status.update(peers=len(record["group"]), bytes_sent=progress.bytes_sent)
        others = network.live_peers() | network.heard()
        if len(record["group"]) == 1 and others:
            # peers are live (in the registry, or heard on the control channel): this
            # node is cut off from their exchanges; it takes their state at round end
            progress.alone_syncs += 1
            warning = (
                f"round {pending.round} fragment {pending.fragment}: averaged alone while "
                f"{len(others)} peer(s) are live"
            )
            logger.warning("%s", warning)
            self.status.update(alone_syncs=progress.alone_syncs, alone_warning=warning)
            return None
        if len(record["group"]) > 1:
            progress.exchanges += 1
            progress.last_exchange = max(progress.last_exchange, pending.round)
            if progress.first_exchange is None:
                self._first_exchange(pending.round)
        if record["fallback_parts"] and network.live_peers():
            # Parts kept at local values drift from the swarm: take its state at round end.
            return None
        return record

    def _first_exchange(self, round_: int) -> None:
        """The node's first exchange with a peer: how long it took from launch (in the
        status, the metrics and a ``first_exchange`` event)."""
        seconds = round(time.time() - self.progress.launched, 2)
        self.progress.first_exchange = seconds
        logger.info("first exchange with a peer (round %d), %.1f s after launch", round_, seconds)
        self.status.update(first_exchange_s=seconds)
        self.events.write("first_exchange", round=round_, seconds=seconds)

    def _alone(self, round_: int) -> None:
        """Say so (at WARN once per stretch, and in the status file every round) when
        ``network.alone_rounds`` rounds in a row went by without an exchange with any
        peer: the node trains, but nobody else's work reaches it, nor its theirs."""
        alone = round_ - max(self.progress.last_exchange, self._since)
        threshold = self.settings.alone_rounds
        self.status.update(alone_rounds=alone, training_alone=alone >= threshold)
        if alone == threshold:
            live = len(self.network.live_peers())
            logger.warning(
                "training alone: no exchange with any peer in the last %d rounds (%d live "
                "peer(s) of this run; peers on another spec are listed in `atoll status`)",
                alone,
                live,
            )
            self.events.write("alone", round=round_, rounds=alone, live_peers=live)

    def _newer_state(self, wall: WallSchedule) -> None:
        """A node about to train whose state is older than the round before the one in
        progress (a joiner whose catch-up took a state the swarm left as it took it, a
        restart) would sit that round out and drop what it trains in it: it takes the
        newer state first, a few tries apart while that round's last sync is still
        ahead, and comes in during the round instead."""
        clock, lead = wall.clock, self.settings.matchmaking_seconds
        for attempt in range(_NEWER_TRIES):
            if attempt:
                self.stop.wait(_NEWER_WAIT)
            r = clock.round_at(wall.now())
            if self.stop.is_set() or self.progress.round >= r - 1:
                return
            if wall.now() >= clock.sync_time(r, clock.fragments - 1) - lead:
                return  # too late to sync in this round anyway
            if self.rounds.resync.catch_up(min_round=r - 1):
                logger.info("took round %d's state before coming in", self.progress.round)
                return

    def _place(self, wall: WallSchedule, book: SyncBook) -> None:
        """Where this node comes in on the wall clock, from the state round it holds."""
        held = self.progress.round
        place = wall.place(held, lead=self.settings.matchmaking_seconds)
        self.progress.clock.finish(place.round_)
        if place.joins is None:
            return
        if place.contributes_from is not None:
            self.events.write(
                "join", round=place.joins, state_round=held, contributes_from=place.contributes_from
            )
            return
        for f in place.skipped:
            self._skip(book, place.joins, f)
        self.events.write(
            "join", round=place.joins, state_round=held, from_fragment=place.from_fragment
        )

    def _fell_behind(self, wall: WallSchedule, book: SyncBook) -> None:
        """Rounds went by without this node (it was frozen, suspended or cut off): drop
        what is in flight, take the swarm's newest state, keeping the local work, and
        come in again as a joining node does. Parts it sent late were refused by their
        owners at no cost to it."""
        behind = wall.behind(self.progress.round)
        logger.warning("%d rounds behind the swarm's clock: re-joining", behind)
        self.events.write("behind", round=self.progress.round, rounds=behind)
        for p in book.clear():
            p.future.cancel()
        self.rounds.resync.catch_up(min_round=self.progress.round + 1, rebase=True)
        self._place(wall, book)

    def _linger(self) -> None:
        """After the last round of a run with an end, stay reachable while a live peer
        is still behind (:meth:`node.run.resync.Resync.linger`)."""
        if not self.stop.is_set() and self.settings.max_rounds:
            self.rounds.resync.linger()


def schedule_of(cfg: AtollConfig, round_: int, clock: Any = None) -> Schedule:
    """The schedule of ``sync.trigger`` for a node whose last finished round is ``round_``
    (``clock``: the run's round clock, for ``seconds``)."""
    if cfg.sync.trigger == "seconds":
        return WallSchedule(clock, cfg.sync.tau)
    return StepSchedule(cfg.sync.inner_steps, cfg.sync.fragments, cfg.sync.tau, round_)
