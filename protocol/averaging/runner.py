"""One all-reduce as this node lives it, and the table that routes to it.

An :class:`ExchangeRunner` is one ``(round, fragment, content)``: its plan, its
deadlines and commit phase, and the part this node owns (its owner side,
:class:`~protocol.averaging.owner.OwnedPart`); its member side
(:class:`~protocol.averaging.member.MemberRun`) runs on it. hivemind builds one
``AllReduceRunner`` per group the same way, and its averager only routes to it: here the
service (:mod:`protocol.averaging.allreduce`) routes every incoming call by key to the
runner in :class:`RunnerTable`. A runner is opened by whichever side meets the exchange
first: this node's own start (:func:`~protocol.averaging.member.run_exchange`), or a
member's part that arrives before it, which waits for the plan
(:attr:`ExchangeRunner.ready`). Its values and the parts it took are let go once the
exchange is over (:meth:`~protocol.averaging.owner.OwnedPart.drop_reply`); the table
keeps its record a few rounds more, so that a late part is told it is late.

The time an all-reduce has left once its commit phase is over is split
(:meth:`ExchangeRunner.schedule`): owners wait for parts during the first half, members
wait for owners' answers until three quarters of it, and repair gets the rest.
"""

from __future__ import annotations

import asyncio
import time

import torch

from protocol.averaging.context import AllReduceContext
from protocol.averaging.parts import CONTENTS, AllReduceKey, PartPlan
from protocol.wire.messages import Header
from protocol.wire.partwire import Part

__all__ = ["MIN_CALL_SECONDS", "ExchangeRunner", "RunnerTable", "check_arguments"]

MIN_CALL_SECONDS = 0.5
"""The shortest time a call or an answer is given, however late it starts."""
_RUNNER_ROUNDS_KEPT = 3
_PARTS_SHARE = 0.5  # of the time left after the commit phase: owners take parts
_REPLIES_SHARE = 0.75  # members wait for owners' results; repair gets the rest


class ExchangeRunner:
    """One all-reduce ``(round, fragment, content)`` on this node.

    Args:
        key: the all-reduce.
        context: what the node's all-reduce shares.
    """

    def __init__(self, key: AllReduceKey, context: AllReduceContext) -> None:
        self.key = key
        self.context = context
        self.plan: PartPlan | None = None
        self.parts_by = 0.0
        """Owner side: parts arriving after this (``time.monotonic()``) are late."""
        self.replies_by = 0.0
        """Member side: owners' answers are awaited until this."""
        self.done_by = 0.0
        """The whole all-reduce, repair included, ends by this."""
        self.ready = asyncio.Event()
        """This node joined: the plan is set (and the owned part, if any)."""
        self.committed = asyncio.Event()
        """The commit phase is over (at ``closed_at``)."""
        self.closed_at = 0.0
        self.mismatches = 0
        """Owners that said this node's group is not theirs."""
        self.owned = None  # the OwnedPart; None for a client
        """The owner side: the part this node owns (None for a client)."""

    @property
    def content(self) -> str:
        return self.key[2]

    def header(self, kind: str) -> Header:
        """The header of this node's ``part`` or ``reduced`` message for the part it owns."""
        assert self.plan is not None
        round_, fragment, _ = self.key
        ctx = self.context
        return Header(
            kind, ctx.settings.run_id, round_, fragment, self.plan.index, ctx.identity.peer_id
        )

    async def commitment_refusal(self, peer: str, env: Part) -> str | None:
        """Why ``peer``'s part ``env`` does not match a timely commitment of ``peer``
        (None: it does, or the exchange has no commit phase), once this node's commit
        phase is over.

        Raises:
            ProtocolError: ``not_in_round``: this node's commit phase never closed.
        """
        ctx = self.context
        if ctx.commitments is None:
            return None
        h = env.header
        try:
            await asyncio.wait_for(self.committed.wait(), ctx.settings.timeout)
        except asyncio.TimeoutError:
            raise ctx.reject(
                "not_in_round", "commit phase never closed", peer, h.round, h.fragment
            ) from None
        return await ctx.commitments.check(
            peer, h.round, h.fragment, h.part, env.digest, self.closed_at, self.content
        )

    def join(self, plan: PartPlan, done_by: float) -> None:
        """This node runs the exchange with ``plan``: until :meth:`schedule`, everything
        waits until ``done_by``."""
        self.plan = plan
        self.parts_by = self.replies_by = self.done_by = done_by

    def schedule(self) -> None:
        """Split the time left after the commit phase: parts, answers, repair."""
        now = time.monotonic()
        left = max(0.0, self.done_by - now)
        self.parts_by = now + _PARTS_SHARE * left
        self.replies_by = now + _REPLIES_SHARE * left

    def note_mismatch(self) -> None:
        """An owner said this node's group is not its own. When every other owner says
        so, no one shares this node's view of the round and no part will come for the
        part it owns: stop waiting for them now rather than at the deadline."""
        assert self.plan is not None
        self.mismatches += 1
        bound = len(self.plan.owners) - (1 if self.plan.is_owner else 0)
        if self.mismatches >= bound and self.owned is not None:
            self.owned.full.set()


class RunnerTable:
    """This node's runners by key, kept for the rounds in the replay window and a few more.

    Args:
        context: the node's all-reduce context (its clock and byte counts).
    """

    def __init__(self, context: AllReduceContext) -> None:
        self._context = context
        self._runners: dict[AllReduceKey, ExchangeRunner] = {}
        # Rounds in the replay window times fragments and contents, plus the kept history.
        settings = context.settings
        rounds = settings.round_window + _RUNNER_ROUNDS_KEPT + 2
        self._max_runners = settings.fragments * len(CONTENTS) * rounds

    def get(self, key: AllReduceKey) -> ExchangeRunner | None:
        return self._runners.get(key)

    def has_room(self, key: AllReduceKey) -> bool:
        """Whether a runner for ``key`` exists or may be opened (a peer cannot make this
        node hold runners for arbitrarily many rounds)."""
        return key in self._runners or len(self._runners) < self._max_runners

    def open(self, key: AllReduceKey) -> ExchangeRunner:
        """The runner for ``key``, new if need be; runners (and byte counts) of rounds
        long past are dropped."""
        if key not in self._runners:
            self._runners[key] = ExchangeRunner(key, self._context)
        horizon = self._context.clock.current - _RUNNER_ROUNDS_KEPT
        for old in [k for k in self._runners if k[0] < horizon]:
            del self._runners[old]
        self._context.forget_before(horizon)
        return self._runners[key]

    def moved_on(self, key: AllReduceKey) -> None:
        """This node runs ``key`` now: nobody gets the results of that fragment and
        content from earlier rounds any more."""
        round_, fragment, content = key
        for (r, f, c), older in self._runners.items():
            if (f, c) == (fragment, content) and r < round_ and older.owned is not None:
                older.owned.drop_reply()


def check_arguments(content: str, vector: torch.Tensor, out: torch.Tensor | None) -> None:
    """Refuse an unknown ``content``, or an ``out`` that does not fit ``vector``."""
    if content not in CONTENTS:
        raise ValueError(f"content must be one of {CONTENTS}, got {content!r}")
    if out is not None and (
        out.shape != vector.shape
        or out.dtype != vector.dtype
        or not out.is_contiguous()
        or out.data_ptr() == vector.data_ptr()
    ):
        raise ValueError(
            f"out must be a {vector.dtype} tensor of shape {tuple(vector.shape)} "
            "that is not the contribution itself"
        )
