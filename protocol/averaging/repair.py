"""Repairing a part whose owner vanished or answered with something refused.

In butterfly all-reduce one member reduces each part. When that owner dies mid-round,
or its signed result is refused (a Byzantine owner), the other members would each
keep their own value for the part and drift apart. Instead they exchange their
contributions for that part directly, all-to-all among themselves (the owner
excluded), and each reduces the same set with the same reducer in the same order
(sorted by PeerID), so every honest member ends with the same values again. The cost
is ``G - 2`` extra transfers of one part per member, paid only when an owner fails.

Every repair message is a signed ``repair`` part (:mod:`protocol.wire.partwire`) checked
like any part; a member
that never repairs the part answers ``not_in_repair`` and is simply left out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import torch

from protocol.averaging.context import AllReduceContext
from protocol.averaging.parts import AllReduceKey, Contribution
from protocol.errors import ProtocolError
from protocol.wire.messages import Header
from protocol.wire.partwire import SealedPart, seal_part

__all__ = ["REPAIR_RPC", "PartRepair"]

logger = logging.getLogger(__name__)

REPAIR_RPC = "atoll.repair"


@dataclass
class _Repair:
    group: list[str] | None = None
    reply: SealedPart | None = None
    contributions: dict[str, Contribution] = field(default_factory=dict)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    declined: set[str] = field(default_factory=set)  # members that do not repair this part
    accepted: bool = False  # this node took the owner's result for the part
    decided: asyncio.Event = field(default_factory=asyncio.Event)  # repairing, or accepted


class PartRepair:
    """The repair of parts whose owner failed, for one node; shares its
    :class:`~protocol.averaging.context.AllReduceContext` (transport, key, counters,
    refusals) with the node's all-reduce."""

    def __init__(self, context: AllReduceContext) -> None:
        self.context = context
        self._repairs: dict[tuple[AllReduceKey, int], _Repair] = {}
        """Keyed by the all-reduce and the part."""

    def register(self) -> None:
        s = self.context.settings
        self.context.transport.add_handler(
            REPAIR_RPC, self._handle, max_request_bytes=s.max_message_bytes, timeout=s.timeout + 5.0
        )

    def unregister(self) -> None:
        self.context.transport.remove_handler(REPAIR_RPC)

    def _slot(self, key: tuple[AllReduceKey, int]) -> _Repair:
        current = self.context.clock.current
        for old in [k for k in self._repairs if k[0][0] < current - 2]:
            del self._repairs[old]
        return self._repairs.setdefault(key, _Repair())

    async def _handle(self, peer: str, data: bytes) -> list[bytes | memoryview]:
        ctx = self.context
        try:
            env = await ctx.open(
                data,
                peer,
                kinds=("repair",),
                round_window=(max(0, ctx.clock.current - 1), ctx.clock.current + 1),
            )
        except ProtocolError as exc:
            raise ctx.reject(exc.reason, exc.detail, peer) from None
        h = env.header
        at = (h.round, h.fragment)
        blocked = ctx.judge.blocks(peer, h.round)
        if blocked:
            raise ctx.reject(blocked, "refused by this node's trust policy", peer, *at)
        if (
            h.fragment >= ctx.settings.fragments
            or len(self._repairs) > 4 * ctx.settings.fragments * 8
        ):
            raise ctx.reject("busy", "no such repair", peer, *at)
        content = ctx.content_of(env, peer)
        key = (h.round, h.fragment, content)
        slot = self._slot((key, h.part))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(slot.decided.wait(), ctx.settings.timeout)
        if not slot.ready.is_set():
            why = "it took the owner's result" if slot.accepted else "it does not repair that part"
            raise ProtocolError("not_in_repair", f"this node does not repair: {why}", peer)
        if env.meta.get("group") != slot.group or peer not in (slot.group or ()):
            raise ctx.reject("group_mismatch", "repair from outside the group", peer, *at)
        known = slot.contributions.get(peer)
        if known is not None:
            # Both sides call each other; the answer to this node's own call may have
            # brought the same contribution already. Anything else is equivocation.
            if known.digest != env.digest:
                raise ctx.reject("equivocation", "two different repair messages", peer, *at)
        else:
            numel = next(iter(slot.contributions.values())).vector.numel()
            slot.contributions[peer] = ctx.decode(env, numel, peer)
        assert slot.reply is not None  # set before ready
        ctx.tally(key, sent=slot.reply.nbytes, received=len(data))
        return slot.reply.buffers()

    def accepted(self, at: AllReduceKey, part: int) -> None:
        """This node took the owner's result for ``part``: it will not repair it, and
        says so at once to members that ask."""
        slot = self._slot((at, part))
        slot.accepted = True
        slot.decided.set()

    async def run(
        self,
        at: AllReduceKey,
        part: int,
        group: list[str],
        owner: str,
        values: torch.Tensor,
        weight: int,
        deadline: float | None = None,
    ) -> tuple[torch.Tensor, list[str]] | None:
        """Repair ``part``: exchange contributions with the group minus the owner, reduce,
        by ``deadline`` (``time.monotonic()``; default: the settings' timeout from now).

        Returns:
            The reduced values and who is in them, or None when no other member joined.
        """
        ctx = self.context
        me = ctx.identity.peer_id
        round_, fragment, content = at
        enc = ctx.encode(values, content)
        header = Header("repair", ctx.settings.run_id, round_, fragment, part, me)
        meta = {"content": content, "group": group, "weight": int(weight), **enc.meta()}
        reply = seal_part(ctx.identity, header, meta, enc.payload)
        slot = self._slot((at, part))
        slot.group, slot.reply = group, reply
        # Every member uses the decoded bytes it sent, exactly as the others will see them.
        own = await ctx.open(reply.to_bytes(), me)
        slot.contributions[me] = ctx.decode(own, values.numel(), me)
        slot.ready.set()
        slot.decided.set()
        others = [p for p in group if p not in (me, owner)]
        if deadline is None:
            deadline = time.monotonic() + ctx.settings.timeout
        await asyncio.gather(
            *(self._call_member(p, reply, slot, deadline, values.numel(), at) for p in others)
        )
        if len(slot.contributions) < 2:
            return None
        if slot.declined:
            # Some members took the owner's result and repair nothing: a repair without
            # them would leave this node's values unlike theirs. Keep local values; the
            # round's end re-syncs from the swarm.
            logger.info(
                "round %d fragment %d part %d: %d member(s) kept the owner's result; not repaired",
                *(round_, fragment, part, len(slot.declined)),
            )
            return None
        ordered = [slot.contributions[p] for p in sorted(slot.contributions)]
        reduction = ctx.reducer(round_, fragment, part, ordered, shared=True, content=content)
        logger.info(
            "round %d fragment %d part %d repaired without owner %s from %d members",
            *(round_, fragment, part, owner[:16], len(ordered)),
        )
        return reduction.vector, list(reduction.used)

    async def _call_member(
        self,
        peer: str,
        request: SealedPart,
        slot: _Repair,
        deadline: float,
        numel: int,
        at: AllReduceKey,
    ) -> None:
        """Send this node's repair message to ``peer`` and take its own from the answer."""
        ctx = self.context
        ctx.tally(at, sent=request.nbytes)
        try:
            reply = await ctx.transport.call(
                peer, REPAIR_RPC, request.buffers(), timeout=max(0.5, deadline - time.monotonic())
            )
            ctx.tally(at, received=len(reply))
            env = await ctx.open(reply, peer, kinds=("repair",))
            if (
                ctx.content_of(env, peer) != at[2]
                or (env.header.round, env.header.fragment) != at[:2]
            ):
                raise ctx.reject(
                    "wrong_part", "a repair message of another exchange", peer, *at[:2]
                )
            known = slot.contributions.get(peer)
            if known is None:
                slot.contributions[peer] = ctx.decode(env, numel, peer)
            elif known.digest != env.digest:
                ctx.reject("equivocation", "two different repair messages", peer)
        except ProtocolError as exc:
            if "not_in_repair" in exc.detail:
                slot.declined.add(peer)
            logger.info("repair exchange with %s: %s", peer[:16], exc)
