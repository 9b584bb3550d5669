"""Butterfly all-reduce of one fragment inside one group, over signed messages.

The fragment's vector is cut into one contiguous part per *owner*: every member of the
group except clients (nodes others cannot dial, see
:class:`~protocol.averaging.parts.PartPlan`). Every member sends its encoded, signed
part ``j`` to owner ``j`` in one RPC; the owner reduces the parts it takes and answers
every caller with the same signed result; each member assembles the full vector from
the reduced parts. :class:`AllReduceService` is this node's endpoint and client: it
registers the handlers and routes every call by its key to the exchange's runner
(:class:`~protocol.averaging.runner.ExchangeRunner`, one per all-reduce), whose two
sides hold everything of that exchange:

* the owner side (:class:`~protocol.averaging.owner.OwnedPart`): parts in, the part
  reduced (while they arrive, with ``stream_reduce``), the result answered or streamed
  back;
* the member side (:class:`~protocol.averaging.member.MemberRun`): the exchange run from
  its commit phase to the checked results, and repair (:mod:`protocol.averaging.repair`)
  of the parts whose owner failed.

Every runner of a node shares its :class:`~protocol.averaging.context.AllReduceContext`
(transport, key, settings, clock and counters).

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

import asyncio
from collections.abc import Sequence

import msgpack
import torch

from protocol.averaging.context import AllReduceContext, Follower
from protocol.averaging.contributions import CONTRIBUTION_RPC, SentParts
from protocol.averaging.gather import GATHER, PartRelay
from protocol.averaging.hooks import Hooks
from protocol.averaging.member import Sides, run_exchange
from protocol.averaging.owner import RESULT_RPC, RPC_NAME, Answer, OwnedPart
from protocol.averaging.parts import (
    AllReduceResult,
    AllReduceSettings,
)
from protocol.averaging.repair import PartRepair
from protocol.averaging.runner import ExchangeRunner, RunnerTable
from protocol.errors import ProtocolError
from protocol.p2p.transport import Lease, Read, Transport
from protocol.wire.messages import Header
from protocol.wire.partwire import Part
from verification.identity import Identity
from verification.rounds import RoundClock

__all__ = ["RESULT_RPC", "RPC_NAME", "AllReduceService", "AllReduceSettings"]


class AllReduceService:
    """This node's all-reduce endpoint and client.

    Args:
        transport: the node's transport.
        identity: the node's key (signs every part and every reduced result).
        settings: encoding, limits and deadlines.
        hooks: how owners reduce, trust decisions, the commit phase and fault injection
            (:class:`~protocol.averaging.hooks.Hooks`; each neutral by default).
        clock: the node's round clock (default: one of its own).
    """

    def __init__(
        self,
        transport: Transport,
        identity: Identity,
        settings: AllReduceSettings,
        hooks: Hooks | None = None,
        clock: RoundClock | None = None,
    ) -> None:
        hooks = hooks if hooks is not None else Hooks()
        self.settings = settings
        self.identity = identity
        self.context = AllReduceContext(transport, identity, settings, hooks, clock)
        self.clock = self.context.clock
        """The node's round clock: an exchange starts its round on it."""
        self.transport = transport
        self.runners = RunnerTable(self.context)
        """This node's exchanges by key: every incoming call is routed to one."""
        self.repair = PartRepair(self.context)
        self.relay = PartRelay(self.context, self.runners)
        planner = hooks.stream_planner() if settings.stream_reduce else None
        self._sides = Sides(self.repair, self.relay, planner)
        self._relaying = False

    def keep_contributions(self) -> SentParts:
        """Keep this node's sent parts for a few rounds and serve them to the group members
        that check them (:mod:`protocol.averaging.contributions`); idempotent."""
        if self.context.sent is None:
            self.context.sent = SentParts()
            self.transport.add_handler(
                CONTRIBUTION_RPC, self.context.sent.serve, max_request_bytes=64
            )
        return self.context.sent

    # ---- handlers ---------------------------------------------------------------------

    def register(self) -> None:
        """Start serving part requests (and repairs)."""
        transport, settings = self.context.transport, self.settings
        transport.add_handler(
            RPC_NAME,
            self.handle_part,  # type: ignore[arg-type]  # gets the Part read_part made
            max_request_bytes=settings.max_message_bytes,
            timeout=settings.timeout * 2 + 5.0,
            receive=self.read_part,
        )
        transport.add_handler(
            RESULT_RPC,
            self.handle_result,
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
        self.clock.start(round_)
        runner = self.runners.open(key)
        self.runners.moved_on(key)
        return await run_exchange(
            runner, self._sides, group, vector, weight, owners, deadline, out, claim
        )

    # ---- routing: every incoming call to its exchange's runner ----------------------------

    async def read_part(self, read: Read, length: int, peer: str) -> Lease:
        """A member's part as it arrives on this owner's stream (followed by the owned
        part's early reduction, if it has one); a refusal is counted against the member."""
        ctx = self.context
        ctx.tally(None, received=length)
        lo = max(0, ctx.clock.current - 1)
        window = (lo, ctx.clock.current + ctx.settings.round_window)
        try:
            return await ctx.read_message(read, length, peer, "part", window, follow=self._follow)
        except ProtocolError as exc:
            raise ctx.reject(exc.reason, exc.detail, peer) from None

    def _follow(self, h: Header, meta: dict, peer: str, body: memoryview) -> Follower | None:
        """Who follows a part's body as it arrives: its owned part's early reduction."""
        runner = self.runners.get((h.round, h.fragment, meta.get("content")))
        owned = runner.owned if runner is not None else None
        if owned is None or owned.early is None:
            return None
        return owned.early.follow(h, meta, peer, body)

    async def handle_part(self, peer: str, env: Part) -> Answer:
        """A member's part (read by :meth:`read_part`): the owner's result, or a refusal."""
        try:
            owned = await self._admit(peer, env)
            return await owned.take(peer, env)
        finally:
            # a part that is not in the contributions will not be read again (the early
            # reduction may follow it even where it was refused before its owned part)
            h = env.header
            runner = self.runners.get((h.round, h.fragment, env.meta.get("content")))
            part = runner.owned if runner is not None else None
            if part is not None and part.early is not None and peer not in part.contributions:
                part.early.detach(peer)

    async def _admit(self, peer: str, env: Part) -> OwnedPart:
        """The owned part ``env`` is for, once this node joined its exchange; refusals
        (and silence, as a fault) before the part's values are looked at."""
        ctx = self.context
        h = env.header
        at = (h.round, h.fragment)
        if ctx.faults.silent_in(*at):
            await asyncio.sleep(ctx.settings.timeout * 2)  # never answers in time
            raise ProtocolError("timeout", "silent", peer)
        gather = ctx.settings.gather and env.meta.get("content") == "update"
        blocked = (ctx.judge.listed if gather else ctx.judge.blocks)(peer, h.round)
        if blocked:
            raise ctx.reject(blocked, "refused by this node's trust policy", peer, *at)
        if h.fragment >= ctx.settings.fragments:
            raise ctx.reject("wrong_part", f"no fragment {h.fragment}", peer, *at)
        key = (h.round, h.fragment, ctx.content_of(env, peer))
        if not self.runners.has_room(key):
            raise ctx.reject("busy", "too many rounds in flight", peer, *at)
        runner = self.runners.open(key)
        ctx.tally(key, received=env.nbytes, totals=False)
        try:
            await asyncio.wait_for(runner.ready.wait(), ctx.settings.timeout)
        except asyncio.TimeoutError:
            raise ctx.reject(
                "not_in_round", "this node did not join that round", peer, *at
            ) from None
        return _owned_part_for(runner, peer, env, gather)

    async def handle_result(self, peer: str, data: bytes) -> list[bytes | memoryview]:
        """A member's request for an owner's signed result (after a ``redo``)."""
        try:
            round_, fragment, content = msgpack.unpackb(data)
            key = (int(round_), int(fragment), str(content))
        except (ValueError, TypeError, msgpack.ExtraData) as exc:
            raise self.context.reject("malformed", f"result request: {exc}", peer) from None
        runner = self.runners.get(key)
        owned = runner.owned if runner is not None else None
        if owned is None:
            raise ProtocolError("not_in_round", "no result of that exchange here", peer)
        return await owned.result(peer)


def _owned_part_for(runner: ExchangeRunner, peer: str, env: Part, gather: bool) -> OwnedPart:
    """The owned part of ``runner`` that ``peer``'s part is for, when its group, exchange
    and index are this node's."""
    ctx, plan, h = runner.context, runner.plan, env.header
    at = (h.round, h.fragment)
    assert plan is not None  # set before ready
    group, owners = env.meta.get("group"), env.meta.get("owners", env.meta.get("group"))
    if group != plan.group or owners != plan.owners:
        raise ctx.reject("group_mismatch", "sender's group differs from the owner's", peer, *at)
    blocked = None if plan.gather or not gather else ctx.judge.blocks(peer, h.round)
    if blocked:  # a group with a client reduces by owner after all
        raise ctx.reject(blocked, "refused by this node's trust policy", peer, *at)
    if (env.meta.get("exchange") == GATHER) != plan.gather:
        raise ctx.reject("group_mismatch", "sender's exchange differs from the owner's", peer, *at)
    # in a gather a member sends everyone its one part, under its own index
    wanted = plan.owners.index(peer) if plan.gather and peer in plan.owners else plan.index
    if peer not in plan.group or h.part != wanted or runner.owned is None:
        raise ctx.reject("wrong_part", f"part {h.part} is not owned here", peer, *at)
    return runner.owned
