"""Butterfly all-reduce of one fragment inside one group, over signed messages.

The fragment's vector is cut into one contiguous part per *owner*: every member of the
group except clients (nodes others cannot dial, see
:class:`~protocol.averaging.parts.PartPlan`). Every member sends its encoded, signed
part ``j`` to owner ``j`` in one RPC; the owner reduces the parts it takes and answers
every caller with the same signed result; each member assembles the full vector from
the reduced parts. :class:`AllReduceService` is this node's endpoint and client: it
registers the handlers and routes to the two sides,

* the owner side (:mod:`protocol.averaging.owner`): parts in, the part reduced
  (while they arrive, with ``stream_reduce``), the result answered or streamed back;
* the member side (:mod:`protocol.averaging.member`): one exchange run from its commit
  phase to the checked results, and repair (:mod:`protocol.averaging.repair`) of the
  parts whose owner failed;

which share this node's :class:`~protocol.averaging.context.AllReduceContext` and its
sessions (:mod:`protocol.averaging.session`).

Nothing outlasts the exchange's deadline (the caller derives it from the round): once
the commit phase is over, owners wait for parts during the first half of the time
left, members wait for owners' answers until three quarters of it, and repair gets
the rest. A member that vanishes, or announces and then sends nothing, costs only its
contribution; a part whose owner vanished or went silent (or answered with something
refused) is repaired among the other owners or falls back to this node's own value,
and :class:`~protocol.averaging.parts.AllReduceResult` says exactly which peers are in
which part.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from protocol.averaging.context import AllReduceContext
from protocol.averaging.contributions import CONTRIBUTION_RPC, SentParts
from protocol.averaging.gather import PartRelay
from protocol.averaging.member import PartMember
from protocol.averaging.owner import RESULT_RPC, RPC_NAME, PartOwner
from protocol.averaging.parts import (
    AllReduceResult,
    AllReduceSettings,
    Commitments,
    FaultInjection,
    Judge,
    Planner,
    Reducer,
    weighted_mean_plan,
    weighted_mean_reducer,
)
from protocol.averaging.repair import PartRepair
from protocol.averaging.session import SessionTable
from protocol.p2p.transport import BufferPool, Transport
from verification.identity import Identity
from verification.rounds import RoundClock

__all__ = ["RESULT_RPC", "RPC_NAME", "AllReduceService", "AllReduceSettings"]


class AllReduceService:
    """This node's all-reduce endpoint and client.

    Args:
        transport: the node's transport.
        identity: the node's key (signs every part and every reduced result).
        settings: encoding, limits and deadlines.
        reducer: how an owner combines contributions (weighted mean by default).
        judge: trust decisions: refusals and their cost, plausibility of results
            (accepts everything by default).
        faults: fault injection for tests (honest by default).
        commitments: the commit phase (none by default: parts are sent at once).
        planner: how ``reducer`` reduces block by block while parts arrive
            (:data:`~protocol.averaging.parts.Planner`); by default the weighted mean's
            own, and none for any other reducer (it then reduces once all are in).
        clock: the node's round clock (default: one of its own).
    """

    def __init__(
        self,
        transport: Transport,
        identity: Identity,
        settings: AllReduceSettings,
        reducer: Reducer = weighted_mean_reducer,
        judge: Judge | None = None,
        faults: FaultInjection | None = None,
        commitments: Commitments | None = None,
        planner: Planner | None = None,
        clock: RoundClock | None = None,
    ) -> None:
        if planner is None and reducer is weighted_mean_reducer:
            planner = weighted_mean_plan
        self.settings = settings
        self.identity = identity
        self.context = AllReduceContext(
            transport, identity, settings, reducer, judge or Judge(), faults, commitments, clock
        )
        self.clock = self.context.clock
        """The node's round clock: an exchange starts its round on it."""
        self.repair = PartRepair(self.context)
        sessions = SessionTable(self.context)
        self.relay = PartRelay(self.context, sessions)
        self._relaying = False
        self.owner = PartOwner(
            self.context, sessions, planner if settings.stream_reduce else None, self.relay
        )
        self.member = PartMember(self.context, sessions, self.owner, self.repair)

    def keep_contributions(self) -> SentParts:
        """Keep this node's sent parts for a few rounds and serve them to the group members
        that check them (:mod:`protocol.averaging.contributions`); idempotent."""
        if self.context.sent is None:
            self.context.sent = SentParts()
            self.transport.add_handler(
                CONTRIBUTION_RPC, self.context.sent.serve, max_request_bytes=64
            )
        return self.context.sent

    # ---- counters, shared with repair ------------------------------------------------

    @property
    def faults(self) -> FaultInjection:
        """How this node acts in an all-reduce (tests swap in a faulty one)."""
        return self.context.faults

    @faults.setter
    def faults(self, value: FaultInjection) -> None:
        self.context.faults = value

    @property
    def commitments(self) -> Commitments | None:
        """The commit phase, or None."""
        return self.context.commitments

    @property
    def transport(self) -> Transport:
        return self.context.transport

    @property
    def bytes_sent(self) -> int:
        return self.context.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self.context.bytes_received

    @property
    def rejected(self) -> dict[str, int]:
        """Refusals of peers' messages so far, by reason."""
        return self.context.rejected

    @property
    def pool(self) -> BufferPool:
        """Buffers large parts and results are received into, reused round after round."""
        return self.context.pool

    @property
    def results_streamed(self) -> int:
        """Owners' results this node took as they were reduced (checked by their trailer)."""
        return self.member.results_streamed

    @property
    def results_redone(self) -> int:
        """Of those, results whose owner gave its streamed blocks up (fetched again)."""
        return self.member.results_redone

    # ---- handlers ---------------------------------------------------------------------

    def register(self) -> None:
        """Start serving part requests (and repairs)."""
        transport, settings = self.context.transport, self.settings
        transport.add_handler(
            RPC_NAME,
            self.owner.handle,  # type: ignore[arg-type]  # gets the Part read_part made
            max_request_bytes=settings.max_message_bytes,
            timeout=settings.timeout * 2 + 5.0,
            receive=self.owner.read_part,
        )
        transport.add_handler(
            RESULT_RPC,
            self.owner.handle_result,
            max_request_bytes=1024,
            timeout=settings.timeout + 5,
        )
        self.repair.register()
        self._relaying = settings.gather
        if self._relaying:
            self.relay.register()

    def unregister(self) -> None:
        """Stop serving (the handlers :meth:`register` added)."""
        for name in (RPC_NAME, RESULT_RPC):
            self.context.transport.remove_handler(name)
        self.repair.unregister()
        if self._relaying:
            self.relay.unregister()
            self._relaying = False

    # ---- one exchange ------------------------------------------------------------------

    async def run(
        self,
        round_: int,
        fragment: int,
        group: Sequence[str],
        vector: torch.Tensor,
        weight: int,
        owners: Sequence[str] | None = None,
        deadline: float | None = None,
        out: torch.Tensor | None = None,
        content: str = "update",
        claim: dict | None = None,
    ) -> AllReduceResult:
        """All-reduce ``vector`` with ``group`` for ``(round, fragment, content)``.

        Args:
            group: the members in group order; must contain this node.
            vector: this node's (already quantized) flat float32 contribution.
            weight: tokens this node processed for it (capped by the owner).
            owners: the members that own a part (default: all of them); a node not
                among them is a client: it sends every part and owns none.
            deadline: ``time.monotonic()`` by which the exchange, repair included, is
                over (default: ``settings.timeout`` from now).
            out: where to write the result (a float32 tensor shaped like ``vector``, not
                ``vector`` itself); a caller that averages the same fragment round after
                round passes the same tensor each time, as hivemind's averager averages
                into its own tensors, and saves a fresh allocation per round (above
                32 MiB each one is a new mapping whose pages fault in one by one).
                Default: a new tensor.
            content: what ``vector`` is (:data:`~protocol.averaging.parts.Content`):
                ``update`` (a pseudo-gradient) or ``weights`` (a global copy, when the
                group mixes); the two exchanges of a fragment run side by side.
            claim: what the pseudo-gradient was trained on (plain msgpack-able data),
                signed into the head of every part of an ``update`` as ``work``.

        Raises:
            ValueError: an unknown ``content``, or an ``out`` that does not fit.
        """
        key = (round_, fragment, content)
        return await self.member.run(key, group, vector, weight, owners, deadline, out, claim)
