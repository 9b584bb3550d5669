"""This node's state in one all-reduce, and the table of them.

A :class:`Session` is one ``(round, fragment, content)`` as this node lives it: the
plan, the deadlines and the commit phase. When the node owns a part, its
:class:`OwnedPart` holds the contributions to that part and, once reduced, the signed
result every member of the part is answered with (hivemind keeps the same split: the
state of a part apart from the runner of one all-reduce). A session is opened by
whichever side meets the exchange first: the member side when this node runs it, or the
owner side when a member's part arrives before that (it then waits for the plan).

The time an all-reduce has left once its commit phase is over is split
(:meth:`Session.schedule`): owners wait for parts during the first half, members wait
for owners' answers until three quarters of it, and repair gets the rest.
"""

from __future__ import annotations

import asyncio
import time

import torch

from protocol.averaging.context import AllReduceContext
from protocol.averaging.parts import CONTENTS, AllReduceKey, Contribution, PartPlan
from protocol.averaging.streamback import StreamedResult
from protocol.averaging.streaming import StreamingReduction
from protocol.wire.messages import Header
from protocol.wire.partwire import SealedPart

__all__ = ["MIN_CALL_SECONDS", "OwnedPart", "Session", "SessionTable"]

MIN_CALL_SECONDS = 0.5
"""The shortest time a call or an answer is given, however late it starts."""
_SESSION_ROUNDS_KEPT = 3
_PARTS_SHARE = 0.5  # of the time left after the commit phase: owners take parts
_REPLIES_SHARE = 0.75  # members wait for owners' results; repair gets the rest


class OwnedPart:
    """The owner side of one all-reduce: the contributions to this node's part, and
    the result it signs from them.

    Args:
        numel: values in the part.
        expected: members whose parts are waited for (this node's policy refuses the
            others, so it does not wait for them).
        own: this node's own contribution to the part.
    """

    def __init__(self, numel: int, expected: set[str], own: Contribution) -> None:
        self.numel = numel
        self.expected = expected
        self.contributions: dict[str, Contribution] = {own.peer: own}
        self.refused: dict[str, str] = {}
        """Parts taken in but left out of the result, with why (commit phase, lateness)."""
        self.full = asyncio.Event()
        """Every expected part is in (or refused): reduce now, not at the deadline."""
        self.reducing = False
        """The result is being computed from the parts in by then."""
        self.waited = False
        """The wait for the members' parts is over: no more come from their senders."""
        self.reduced = asyncio.Event()
        self.answerable = asyncio.Event()
        """A member can be answered: the result is signed, or it is streamed."""
        self.reply: SealedPart | None = None
        """The signed result every member of the part is answered with."""
        self.reply_contributors: list[str] = []
        self.reduce_seconds = 0.0
        """From the last part in (or the deadline) to the signed result."""
        self.streaming: StreamingReduction | None = None
        """The part reduced block by block as parts arrive."""
        self.weights: dict[str, float] = {}
        """Members' capped weights, read from their parts' heads (for the streamed plan)."""
        self.wake = asyncio.Event()
        """More of the parts arrived (or the reduction proper starts)."""
        self.stream_task: asyncio.Future | None = None
        self.streamed_share = 0.0
        """The share of the part reduced while parts arrived and kept in the result."""
        self.result_stream: StreamedResult | None = None
        """The result sent back while it is reduced (raw float32 only)."""
        self.held: dict[str, bytes] = {}
        """In a gather, the parts taken, as their senders sent them, for members that
        lack one (:mod:`protocol.averaging.gather`); kept until the exchange is over."""

    def note_in(self) -> None:
        """Wake the reduction once every expected part is in or refused."""
        if self.expected <= set(self.contributions) | set(self.refused):
            self.full.set()

    def arrived(self, peer: str, nbytes: int) -> None:
        """The first ``nbytes`` of ``peer``'s part are in and checked."""
        if self.streaming is not None:
            self.streaming.arrived(peer, nbytes)
            self.wake.set()

    def detach(self, peer: str) -> None:
        """``peer``'s part will not be read any further: stop reducing from its buffer."""
        if self.streaming is not None:
            self.streaming.detach(peer)

    def progress(self) -> tuple[torch.Tensor | None, int]:
        """The streamed reduction so far (:data:`~protocol.averaging.streamback.Progress`)."""
        streaming = self.streaming
        if streaming is None or streaming.broken or streaming.out is None:
            return None, 0
        return streaming.out, streaming.upto

    def drop_reply(self) -> None:
        """The exchange is over: nobody gets the result any more."""
        self.reply = None
        self.held = {}
        self.streaming = None  # its output was the reply's body
        if self.result_stream is not None:
            self.result_stream.drop()


class Session:
    """This node's side of one all-reduce ``(round, fragment, content)``.

    Args:
        key: the all-reduce.
    """

    def __init__(self, key: AllReduceKey) -> None:
        self.key = key
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
        self.owned: OwnedPart | None = None
        """The part this node owns (None for a client)."""

    @property
    def content(self) -> str:
        return self.key[2]

    def header(self, kind: str, run_id: str, sender: str) -> Header:
        """The header of this node's ``part`` or ``reduced`` message for the part it owns."""
        assert self.plan is not None
        round_, fragment, _ = self.key
        return Header(kind, run_id, round_, fragment, self.plan.index, sender)

    def open(self, plan: PartPlan, done_by: float) -> None:
        """Join with ``plan``: until :meth:`schedule`, everything waits until ``done_by``."""
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


class SessionTable:
    """This node's sessions, kept for the rounds in the replay window and a few more.

    Args:
        context: the node's all-reduce context (its current round and byte counts).
    """

    def __init__(self, context: AllReduceContext) -> None:
        self._context = context
        self._sessions: dict[AllReduceKey, Session] = {}
        # Rounds in the replay window times fragments and contents, plus the kept history.
        settings = context.settings
        rounds = settings.round_window + _SESSION_ROUNDS_KEPT + 2
        self._max_sessions = settings.fragments * len(CONTENTS) * rounds

    def get(self, key: AllReduceKey) -> Session | None:
        return self._sessions.get(key)

    def has_room(self, key: AllReduceKey) -> bool:
        """Whether a session for ``key`` exists or may be opened (a peer cannot make
        this node hold sessions for arbitrarily many rounds)."""
        return key in self._sessions or len(self._sessions) < self._max_sessions

    def open(self, key: AllReduceKey) -> Session:
        """The session for ``key``, new if need be; sessions (and byte counts) of rounds
        long past are dropped."""
        if key not in self._sessions:
            self._sessions[key] = Session(key)
        horizon = self._context.clock.current - _SESSION_ROUNDS_KEPT
        for old in [k for k in self._sessions if k[0] < horizon]:
            del self._sessions[old]
        self._context.forget_before(horizon)
        return self._sessions[key]

    def moved_on(self, key: AllReduceKey) -> None:
        """This node runs ``key`` now: nobody gets the results of that fragment and
        content from earlier rounds any more."""
        round_, fragment, content = key
        for (r, f, c), older in self._sessions.items():
            if (f, c) == (fragment, content) and r < round_ and older.owned is not None:
                older.owned.drop_reply()
