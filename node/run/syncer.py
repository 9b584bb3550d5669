"""One fragment sync, split in two so the exchange overlaps with training.

:meth:`Syncer.launch` runs on the training thread: it takes the fragment's
pseudo-gradient (global - local), encodes it with error feedback and hands the
exchange (:class:`~protocol.averaging.exchange.FragmentExchange`: matchmaking, groups,
all-reduce) to the transport's loop, returning at once. :meth:`Syncer.apply` runs
later on the training thread: the outer optimizer steps the fragment's global copy
and merges it into the local copy (:meth:`~node.train.outer.OuterOptimizer.merge_local`),
keeping the inner steps taken while the exchange ran for the next sync.

A sync that fails (no group, deadline, transport error) applies nothing; the node's
global copy of that fragment then lags the swarm's, so the round is marked for a
re-sync from a peer, and the work already done stays in the local copy and is
contributed at the next sync (see :func:`staleness_weight`).

When a round's group does not span the whole swarm, the group also averages its
members' global copies (:mod:`protocol.averaging.exchange`):

* ``allreduce`` mode (butterfly mixing across groups, Moshpit SGD): the group adopts
  its mean global copy, then steps it with its mean pseudo-gradient; with the
  butterfly layout the swarm holds the exact global mean after ``rounds_to_mix``
  rounds (:mod:`protocol.averaging.grouping`).
* ``gossip`` mode (NoLoCo, Kolehmainen et al., 2025): pairs, and a modified Nesterov
  outer step whose gradient is the pair's mean pseudo-gradient plus
  ``gamma / lr * (own - mean)`` of the global copies.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from node.checks.inputs import ExchangeBase
from node.run.metrics import EventLog
from node.run.syncevents import Pending, applied_record, outcome_record
from node.run.syncevents import digest as fingerprint
from node.train.deadlines import Deadlines
from node.train.outer import OuterOptimizer
from protocol.averaging.contributions import WorkClaim
from protocol.averaging.exchange import ExchangeOutcome, FragmentExchange
from protocol.wire import codec as codecs
from protocol.wire.feedback import ErrorFeedback
from verification.usefulness import fragment_digest

if TYPE_CHECKING:
    from node.checks import UsefulWork

__all__ = ["Copies", "SyncSettings", "SyncWatchers", "Syncer", "staleness_weight"]

logger = logging.getLogger(__name__)

_DEADLINE_SLACK_SECONDS = 5.0  # an exchange past its deadline is wound up within this

Submit = Callable[[Coroutine[Any, Any, ExchangeOutcome]], concurrent.futures.Future]
"""Runs a coroutine on the transport's loop (:meth:`protocol.p2p.transport.Transport.submit`)."""


def staleness_weight(tokens: int, missed: int) -> int:
    """Token weight of work that spans ``missed`` skipped syncs: ``tokens / (1 + missed)``.

    Work folded in from earlier rounds was done against an older global value; it
    still counts, but less than fresh work, so one node that fell behind cannot
    dominate the round it catches up in.
    """
    return int(tokens / (1 + max(0, missed)))


@dataclass(frozen=True)
class SyncSettings:
    """What a sync reads from the configuration (``sync`` and ``outer``), built by
    :func:`node.settings.sync_settings`.

    Attributes:
        codec: the pseudo-gradient's codec.
        codec_args: its arguments (:meth:`~node.config_network.SyncConfig.codec_args`).
        error_feedback: whether the codec's error is carried into the next sync.
        mix_codec: the codec of the global copy a mixing group averages.
        block_size: that codec's block.
        alpha: how much of the new global copy the local copy takes (``merge_local``).
        gossip_pull: ``gamma / lr`` in gossip mode (NoLoCo's pull toward the pair's
            mean copy), None otherwise.
    """

    codec: str
    codec_args: dict[str, int]
    error_feedback: bool
    mix_codec: str
    block_size: int
    alpha: float
    gossip_pull: float | None

    def build(
        self,
        copies: Copies,
        exchange: FragmentExchange,
        submit: Submit,
        events: EventLog,
        watchers: SyncWatchers | None = None,
    ) -> Syncer:
        """The syncer of ``copies``, exchanging through ``exchange`` on ``submit``'s loop."""
        return Syncer(self, copies, exchange, submit, events, watchers or SyncWatchers())


@dataclass(frozen=True)
class Copies:
    """What a sync reads and writes on the training side.

    Attributes:
        model: the local model.
        outer: global copies and the outer optimizer.
        feedback: one error-feedback codec per fragment.
        device: where the model lives.
    """

    model: torch.nn.Module
    outer: OuterOptimizer
    feedback: list[ErrorFeedback]
    device: torch.device


@dataclass
class SyncWatchers:
    """Who hears of each exchange besides the event log.

    Attributes:
        checks: useful-work checks, handed each exchange applied (None: no checks).
        deadlines: told how long each exchange took (None: nobody listens).
    """

    checks: UsefulWork | None = None
    deadlines: Deadlines | None = None


class Syncer:
    """Launches and applies fragment syncs for one node (built by :meth:`SyncSettings.build`).

    Args:
        settings: the codecs and the merge.
        copies: the model, its global copies, the error feedback.
        exchange: runs an exchange on the network.
        submit: hands a coroutine to the transport's loop.
        events: the node's event log (one ``sync`` or ``sync_failed`` line per sync).
        watchers: the useful-work checks and the deadlines.
    """

    def __init__(
        self,
        settings: SyncSettings,
        copies: Copies,
        exchange: FragmentExchange,
        submit: Submit,
        events: EventLog,
        watchers: SyncWatchers,
    ) -> None:
        self.settings = settings
        self.model = copies.model
        self.outer = copies.outer
        self.feedback = copies.feedback
        self.device = copies.device
        self.exchange = exchange
        self.submit = submit
        self.events = events
        self.watchers = watchers
        self.missed = [0] * len(copies.feedback)
        self.outcomes: dict[str, int] = {"complete": 0, "partial": 0, "failed": 0}
        """Syncs so far by outcome (partial: some parts kept this node's own values)."""
        self.refused: dict[str, str] = {}
        """Peers the latest exchanges left out for running another spec, with why."""

    def skipped(self, f: int) -> None:
        """Fragment ``f``'s sync was not made: its work goes into the next one, which then
        counts as spanning one more sync (:func:`staleness_weight`)."""
        self.missed[f] += 1

    def launch(
        self,
        r: int,
        f: int,
        tokens: int,
        step: int,
        expected: set[str],
        excludes: set[str],
        budget: float,
        claim: WorkClaim | None = None,
    ) -> Pending:
        """Start syncing fragment ``f`` for round ``r`` in the background.

        Args:
            tokens: tokens trained since the fragment's last sync.
            budget: seconds the whole exchange may take (it ends then, whatever its
                peers do).
            step: the inner step count now (when the result may be applied: ``sync.tau``).
            expected: peers believed alive, waited for in matchmaking (suspects
                included: whether they are left out is decided by vote).
            excludes: peers this node votes to leave out of the round.
            claim: the batches the pseudo-gradient was trained on (:mod:`node.checks.claims`).
        """
        sync = self.settings
        sent_from = self.outer.local_vector(self.model, f)
        pg = self.outer.pseudo_gradient(self.model, f)
        if sync.error_feedback:
            enc = self.feedback[f].encode(pg)
        else:
            enc = codecs.encode(pg, sync.codec, **sync.codec_args)
        contribution = codecs.decode(enc, expected_numel=pg.numel())
        weight = staleness_weight(tokens, self.missed[f])
        # Whether the group mixes weights is decided from the announced peers; the copy
        # is taken now, on the training thread, in case it does.
        own = self.outer.global_vector(f)
        mix = codecs.encode(own, sync.mix_codec, block_size=sync.block_size)
        weights = codecs.decode(mix, expected_numel=pg.numel())
        started = time.monotonic()
        deadline = started + budget
        wire = claim.to_wire() if claim is not None else None
        # the group mixes when its members' copies differ: each announces its own
        base = fragment_digest(own)
        ended: list[float] = []
        running = self.exchange.run(
            r, f, weight, contribution, weights, expected, excludes, deadline, base, wire
        )
        future = self.submit(_timed(running, ended))
        return Pending(r, f, weight, step, started, future, weights, deadline, sent_from, ended)

    def leave(self, pending: Pending) -> dict[str, Any] | None:
        """A sync in flight as the node stops: wait for it (until its deadline), so that
        its group takes this node's contribution and this node serves the parts it owns,
        and write a ``sync_left`` event; nothing is applied (the node's copies stay as
        its last checkpoint has them). None when it failed (a ``sync_failed`` event)."""
        done = self._wait(pending)
        if done is None:
            return None
        record = outcome_record(pending, done)
        self.events.write("sync_left", **record)
        return record

    def apply(self, pending: Pending, step: int) -> dict[str, Any] | None:
        """Wait for ``pending`` (until its deadline), apply it; None when the sync failed.

        Args:
            step: the inner step count now (for the record's overlap).
        """
        f = pending.fragment
        done = self._wait(pending)
        self._timed(pending, done)
        if done is None:
            return None
        self.refused.update(done.refused)
        result = done.result
        checks = self.watchers.checks
        checking = checks is not None and _checkable(done)
        # the value the group held before the step: its mean copy, or every member's own
        base = None
        if checking:
            base = done.mixed.vector if done.mixed is not None else self.outer.global_vector(f)
        self._step(pending, done)
        self.outer.merge_local(self.model, f, self.settings.alpha, pending.sent_from)
        self.missed[f] = 0
        self.outcomes["complete" if result.complete else "partial"] += 1
        # members of a group that adopt its mean copy and step it alike hold equal ones
        digest = fingerprint(self.outer.global_vector(f))
        record = applied_record(pending, done, digest, step)
        self.events.write("sync", **record)
        if checking and checks is not None and base is not None:
            contributors = tuple(sorted({p for part in result.contributors for p in part}))
            base = base.detach().cpu()
            step = self.outer.step_scale(pending.round)
            mixed = done.mixed is not None
            group = tuple(sorted(done.group))
            exchange = ExchangeBase(
                pending.round, f, base, result.vector, contributors, step, mixed, group=group
            )
            checks.exchange_applied(exchange)
        return record

    def _wait(self, pending: Pending) -> ExchangeOutcome | None:
        """The exchange's outcome, or None (counted, logged, an event) when it failed."""
        try:
            wait = max(0.0, pending.deadline - time.monotonic()) + _DEADLINE_SLACK_SECONDS
            return pending.future.result(wait)
        except Exception as exc:  # any failure of the exchange: nothing to apply
            pending.future.cancel()
            f = pending.fragment
            self.skipped(f)
            self.outcomes["failed"] += 1
            logger.warning("round %d fragment %d: sync failed: %r", pending.round, f, exc)
            self.events.write(
                "sync_failed",
                round=pending.round,
                fragment=f,
                error=repr(exc),
                tokens=pending.tokens,
                step=pending.step,
            )
            return None

    def _timed(self, pending: Pending, done: ExchangeOutcome | None) -> None:
        """Tell the deadlines how long the exchange took and whether it completed."""
        deadlines = self.watchers.deadlines
        if deadlines is None:
            return
        ended = pending.ended[0] if pending.ended else time.monotonic()
        complete = done is not None and all(
            r.complete for r in (done.result, done.mixed) if r is not None
        )
        deadlines.finished(ended - pending.started, pending.deadline - pending.started, complete)

    def _step(self, pending: Pending, done: ExchangeOutcome) -> None:
        """The outer step on the group's mean, or on it and the mixed copies."""
        f, mixed = pending.fragment, done.mixed
        averaged = done.result.vector.to(self.device)
        if mixed is None:
            self.outer.step(f, averaged, pending.round)
            return
        pull = self.settings.gossip_pull
        self.outer.step_mixed(
            f, averaged, pending.weights, mixed.vector.to(self.device), pull, pending.round
        )


async def _timed(running: Coroutine[Any, Any, ExchangeOutcome], ended: list[float]) -> Any:
    """``running``'s outcome; the time it ended (returned or raised) goes into ``ended``."""
    try:
        return await running
    finally:
        ended.append(time.monotonic())


def _checkable(done: ExchangeOutcome) -> bool:
    """Whether useful-work checks may judge this exchange: every part of it (and of the
    group's mean copy, where it mixed) came back reduced, so every member holds the same
    result and base, and with them the checks' seed."""
    results = [done.result] if done.mixed is None else [done.result, done.mixed]
    return len(done.group) > 1 and not any(r.fallback_parts or r.repaired_parts for r in results)
