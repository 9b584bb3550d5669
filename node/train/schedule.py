"""When a fragment's sync starts, when its result is taken, and when a round ends.

The two triggers of ``sync.trigger`` are two :class:`Schedule` classes behind one
interface, so the training loop (:mod:`node.run.loop`) is one loop:

* :class:`StepSchedule` (``steps``): every node takes ``H = sync.inner_steps`` inner
  steps per round; fragment ``f`` syncs after step ``ceil((f + 1) * H / F)`` of the
  round (:func:`node.train.outer.sync_schedule`), its result is taken ``sync.tau`` steps later
  or at the round's last step, and the round ends when every fragment's result is in.
  Fast nodes wait for slow ones at the end of each round.
* :class:`WallSchedule` (``seconds``): the swarm's wall clock
  (:class:`node.train.clock.SecondsClock`) says when each fragment syncs; a result is taken
  once it has arrived and ``sync.tau`` steps have passed since its sync started, and a
  round ends once every fragment of it was synced or skipped. No node waits for another.

:class:`SyncBook` is the bookkeeping both share: the work trained since each
fragment's last sync, the syncs in flight, and which rounds are done or went wrong.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from node.train.clock import SecondsClock
from node.train.outer import sync_schedule

__all__ = ["Schedule", "StepSchedule", "SyncBook", "WallSchedule"]

BEHIND_ROUNDS = 2
"""More rounds than this between the clock and a node's last round: it fell behind
(normally the gap is one round, two while the last fragment's exchange finishes)."""


@dataclass
class SyncBook:
    """The syncs of a training loop: what is in flight and which rounds are done.

    Attributes:
        tokens_since: tokens trained since each fragment's last sync.
        pending: the sync in flight of each fragment (a :class:`node.run.syncevents.Pending`).
        done: fragments of each round whose sync was applied, failed or skipped.
        failed: rounds with a sync that failed or was skipped: the node takes the
            swarm's state when such a round ends.
    """

    tokens_since: list[int]
    pending: dict[int, Any] = field(default_factory=dict)
    done: dict[int, set[int]] = field(default_factory=dict)
    failed: set[int] = field(default_factory=set)

    @classmethod
    def of(cls, fragments: int) -> SyncBook:
        return cls(tokens_since=[0] * fragments)

    def trained(self, tokens: int) -> None:
        """An inner step's tokens count towards every fragment's next sync."""
        for f in range(len(self.tokens_since)):
            self.tokens_since[f] += tokens

    def launched(self, f: int, pending: Any) -> None:
        self.pending[f] = pending
        self.tokens_since[f] = 0

    def forget_work(self) -> None:
        """The tokens trained so far were dropped (a joiner's round sat out): no fragment's
        next sync counts them."""
        self.tokens_since = [0] * len(self.tokens_since)

    def finished(self, r: int, f: int, ok: bool) -> None:
        """Fragment ``f`` of round ``r`` is over: applied (``ok``), failed or skipped."""
        self.done.setdefault(r, set()).add(f)
        if not ok:
            self.failed.add(r)

    def complete(self, r: int, fragments: int) -> bool:
        return self.done.get(r, set()) >= set(range(fragments))

    def close(self, r: int) -> bool:
        """Forget round ``r``; whether one of its syncs went wrong."""
        self.done.pop(r, None)
        went_wrong = r in self.failed
        self.failed.discard(r)
        return went_wrong

    def clear(self) -> list[Any]:
        """Drop everything in flight (the node fell behind); the dropped syncs."""
        dropped = list(self.pending.values())
        self.pending.clear()
        self.done.clear()
        self.failed.clear()
        return dropped


class Schedule(Protocol):
    """What the training loop asks of a trigger, after every inner step."""

    def due(self, now: float) -> list[tuple[int, int]]:
        """The ``(round, fragment)`` syncs whose time has come, in order."""
        ...

    def ready(self, pending: Any, steps: int) -> bool:
        """Whether the result of ``pending`` is taken now (``steps``: inner steps so far)."""
        ...

    def skips(self, r: int) -> bool:
        """Whether syncs of round ``r`` are skipped (the node is joining)."""
        ...

    def ended(self, round_: int) -> None:
        """A round ended; the node's last finished round is now ``round_``."""
        ...


class StepSchedule:
    """``sync.trigger = "steps"``: ``inner_steps`` inner steps a round.

    Args:
        inner_steps: ``H``, inner steps per round.
        fragments: ``F``, fragments of the model.
        tau: steps after a sync starts before its result is taken.
        round_: the last round the node finished.
    """

    def __init__(self, inner_steps: int, fragments: int, tau: int, round_: int) -> None:
        self.inner_steps = inner_steps
        self.tau = tau
        self._after = sync_schedule(inner_steps, fragments)
        self._round = round_ + 1  # the round being trained
        self._step = 0  # inner steps taken in it

    def due(self, now: float) -> list[tuple[int, int]]:
        self._step += 1
        return [(self._round, f) for f in self._after.get(self._step, [])]

    def ready(self, pending: Any, steps: int) -> bool:
        # the round ends with every sync applied: its last step waits for them
        return self._step >= self.inner_steps or steps - pending.step >= self.tau

    def skips(self, r: int) -> bool:
        return False

    def ended(self, round_: int) -> None:
        """Count the steps of the round after ``round_``."""
        self._round = round_ + 1
        self._step = 0


class WallSchedule:
    """``sync.trigger = "seconds"``: the swarm's wall clock.

    Args:
        clock: the run's round clock.
        tau: steps after a sync starts before its result is taken.
        now: where the time comes from (tests pass their own).
    """

    def __init__(self, clock: SecondsClock, tau: int, now: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.tau = tau
        self.now = now
        self.last = (0, clock.fragments - 1)  # the last (round, fragment) handed out
        self.join_round = 0  # syncs of earlier rounds are skipped

    def due(self, now: float) -> list[tuple[int, int]]:
        out = self.clock.due(now, self.last)
        if out:
            self.last = out[-1]
        return out

    def ready(self, pending: Any, steps: int) -> bool:
        return pending.future.done() and steps - pending.step >= self.tau

    def skips(self, r: int) -> bool:
        return r < self.join_round

    def ended(self, round_: int) -> None:
        pass  # the clock, not the round count, says when syncs are due

    def behind(self, round_: int) -> int:
        """Rounds the clock is ahead of ``round_`` when that is more than a node can be
        while current (it was frozen, suspended or cut off for a while), else 0."""
        gap = self.clock.round_at(self.now()) - round_
        return gap if gap > BEHIND_ROUNDS else 0

    def place(self, round_: int, lead: float) -> Placement:
        """Where a node holding the state of round ``round_`` comes in on the clock.

        Args:
            lead: seconds of matchmaking before a sync (``network.matchmaking_seconds``):
                a sync whose matchmaking already began is skipped.
        """
        fragments = self.clock.fragments
        in_progress = self.clock.round_at(self.now())
        self.last = (round_, fragments - 1)
        if round_ < in_progress - 1:
            # Behind the swarm (joining, back from a restart or a freeze): sit out the
            # round in progress, training all the same, and take the swarm's state when
            # it ends; the work done meanwhile is rebased onto it and contributed from
            # the next round.
            self.join_round = in_progress + 1
            self.last = (in_progress - 1, fragments - 1)
            return Placement(
                round_=in_progress - 1,
                joins=in_progress,
                state_round=round_,
                contributes_from=self.join_round,
            )
        if round_ == in_progress - 1:
            # Current, but the round has begun: contribute from the first fragment whose
            # matchmaking is still ahead; the ones under way are skipped (their work goes
            # into the next sync) and the round's state is taken from the swarm at its end.
            now = self.now()
            ahead = [
                f for f in range(fragments) if self.clock.sync_time(in_progress, f) - lead > now
            ]
            first = ahead[0] if ahead else fragments
            if first > 0:
                self.last = (in_progress, first - 1)
                return Placement(
                    round_=round_,
                    joins=in_progress,
                    state_round=round_,
                    from_fragment=first,
                )
        return Placement(round_=round_)


@dataclass(frozen=True)
class Placement:
    """Where :meth:`WallSchedule.place` put a node.

    Attributes:
        round_: the node's round from now on (its last finished one).
        joins: the round it joins in, when it does not simply go on (else None).
        state_round: the round of the state it holds.
        from_fragment: in the round it joins, the first fragment it syncs (earlier
            ones are skipped); None when it sits the whole round out.
        contributes_from: when it sits rounds out, the first round it syncs in.
    """

    round_: int
    joins: int | None = None
    state_round: int | None = None
    from_fragment: int | None = None
    contributes_from: int | None = None

    @property
    def skipped(self) -> list[int]:
        """Fragments of round ``joins`` this node does not sync."""
        if self.joins is None or self.from_fragment is None:
            return []
        return list(range(self.from_fragment))
