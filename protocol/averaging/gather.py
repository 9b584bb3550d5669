"""A gather's own wire: the answer to a part, and the relay of committed parts.

In a gather (``sync.exchange = "gather"``, :class:`~protocol.averaging.parts.PartPlan`)
each member signs one part, commits to its digest and sends the same bytes to every
other member, which reduces the group's parts itself. A member's answer to a part says
only whether it took it (:func:`gather_ack`).

Honest members must reduce the same parts, or their values part ways. A sender that
commits and then sends some members nothing, or other bytes than it committed to (which
they refuse), would leave them without a part the rest took. So a member keeps every
part it took until the exchange is over and serves it on :data:`RELAY_RPC`; a member
that lacks the part of a member that committed asks the others for it
(:meth:`PartRelay.fill`) and takes it when its sender's signature and committed digest
check out, whoever relays it. If no honest member took the part, none has it to relay,
and all of them leave it out alike.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgpack

from protocol.averaging.context import AllReduceContext
from protocol.averaging.parts import AllReduceKey, Contribution
from protocol.averaging.runner import MIN_CALL_SECONDS, ExchangeRunner, RunnerTable
from protocol.errors import ProtocolError
from protocol.wire.partwire import Part, SealedPart

__all__ = [
    "GATHER",
    "RELAY_RPC",
    "RPC_NAME",
    "PartRelay",
    "deliver",
    "gather_ack",
    "read_gather_ack",
]

RPC_NAME = "atoll.part"
"""A member sends its part to the part's owner (in a gather, to every other member)."""

logger = logging.getLogger(__name__)

GATHER = "gather"
"""A part's ``exchange`` in a gather (signed in its head; absent: reduced by its owner)."""
RELAY_RPC = "atoll.gathered"
"""``msgpack([round, fragment, content, sender])``: the part ``sender`` sent this member
in that gather, if it took it."""

_MAX_ACK_BYTES = 256
_MAX_REQUEST_BYTES = 256
_RETRY_SECONDS = 0.2
HELD, WAITING, NONE = "held", "waiting", "none"


def gather_ack(refused: str = "") -> bytes:
    """A gather member's answer to a part: taken, or refused and why."""
    return msgpack.packb({"taken": not refused, "reason": refused[:64]})


def read_gather_ack(data: bytes, peer: str) -> str:
    """Why ``peer`` refused a part it acknowledged ('' when it took it).

    Raises:
        ProtocolError: ``malformed``.
    """
    try:
        ack = msgpack.unpackb(data) if len(data) <= _MAX_ACK_BYTES else None
    except (ValueError, TypeError, msgpack.ExtraData):
        ack = None
    if not isinstance(ack, dict) or not isinstance(ack.get("taken"), bool):
        raise ProtocolError("malformed", "not a gather acknowledgement", peer)
    reason = ack.get("reason")
    return "" if ack["taken"] else (reason if isinstance(reason, str) else "refused")


async def deliver(
    ctx: AllReduceContext, member: str, part: SealedPart, key: AllReduceKey, by: float
) -> bool:
    """Send ``part`` to ``member`` of a gather until ``by`` (once more if the stream is
    cut): whether it took it (nothing else comes back: it reduces the part itself)."""
    for attempt in (0, 1):
        ctx.tally(key, sent=part.nbytes)
        timeout = max(MIN_CALL_SECONDS, by - time.monotonic())
        try:
            ack = await ctx.transport.call(
                member, RPC_NAME, part.buffers(), timeout=timeout, max_response_bytes=_MAX_ACK_BYTES
            )
            refused = read_gather_ack(ack, member)
        except ProtocolError as exc:
            retry = exc.reason == "connection_lost" and not attempt
            if retry and by - time.monotonic() >= MIN_CALL_SECONDS:
                continue  # the same signed part again is taken once
            logger.warning("round %d fragment %d: member %s did not take this node's part: %s",
                           *key[:2], member[:16], exc)  # fmt: skip
            return False
        if refused:
            logger.warning("round %d fragment %d: member %s refused this node's part: %s",
                           *key[:2], member[:16], refused)  # fmt: skip
        return not refused
    raise AssertionError("unreachable")


def held_wire(env: Part) -> bytes:
    """The part as its sender sent it (to relay; a copy, as its buffer goes back)."""
    return env.evidence() + bytes(env.body)


class PartRelay:
    """Serves the gathered parts this node took; fetches the ones it lacks.

    Args:
        context: what the node's all-reduce shares.
        runners: the node's exchanges.
    """

    def __init__(self, context: AllReduceContext, runners: RunnerTable) -> None:
        self.context = context
        self.runners = runners
        self.relayed = 0
        """Parts this node took from another member than their sender."""

    def register(self) -> None:
        self.context.transport.add_handler(
            RELAY_RPC,
            self.serve,
            max_request_bytes=_MAX_REQUEST_BYTES,
            timeout=self.context.settings.timeout + 5,
        )

    def unregister(self) -> None:
        self.context.transport.remove_handler(RELAY_RPC)

    async def serve(self, peer: str, data: bytes) -> bytes:
        """:data:`RELAY_RPC`: ``[state, part]``: ``held`` and the part's bytes, ``waiting``
        (its sender may still send it here) or ``none`` (its wait for parts is over)."""
        try:
            round_, fragment, content, sender = msgpack.unpackb(data)
            key = (int(round_), int(fragment), str(content))
            sender = str(sender)
        except (ValueError, TypeError, msgpack.ExtraData) as exc:
            raise self.context.reject("malformed", f"relay request: {exc}", peer) from None
        runner = self.runners.get(key)
        plan = runner.plan if runner is not None else None
        part = runner.owned if runner is not None else None
        if plan is None or part is None or not plan.gather:
            raise ProtocolError("not_in_round", "no gather of that exchange here", peer)
        if peer not in plan.group:
            raise ProtocolError("wrong_part", "not a member of that gather", peer)
        wire = part.held.get(sender)
        if wire is not None:
            self.context.tally(key, sent=len(wire))
            return msgpack.packb([HELD, wire])
        # once its own wait is over no part comes to it from its sender any more: two
        # members that both lack a part tell each other so at once
        return msgpack.packb([NONE if part.waited else WAITING, b""])

    async def fill(
        self, runner: ExchangeRunner, have: set[str], by: float
    ) -> list[tuple[str, Contribution, bytes]]:
        """Fetch, from the other members, the part of every member that committed and
        is not in ``have``, until ``by``: each part that came, as ``(sender,
        contribution, wire)`` for the owned part to take."""
        ctx, plan = self.context, runner.plan
        if ctx.commitments is None or plan is None:
            return []  # nothing says which bytes a relayed part must be
        round_, fragment, content = runner.key
        me = ctx.identity.peer_id
        lacking = [
            p
            for p in plan.group
            if p != me
            and p not in have
            and ctx.commitments.committed(p, round_, fragment, content)
            and not ctx.judge.listed(p, round_)
        ]
        if not lacking:
            return []
        found = await asyncio.gather(*(self._fetch(runner, p, by) for p in lacking))
        return [(p, *taken) for p, taken in zip(lacking, found) if taken is not None]

    async def _fetch(
        self, runner: ExchangeRunner, sender: str, by: float
    ) -> tuple[Contribution, bytes] | None:
        """``sender``'s committed part from any other member that took it."""
        plan = runner.plan
        assert plan is not None
        me = self.context.identity.peer_id
        holders = [p for p in plan.group if p not in (me, sender)]
        request = msgpack.packb([*runner.key, sender])
        while holders and time.monotonic() < by:
            for holder in list(holders):
                state, env = await self._ask(runner.key, holder, sender, request, by)
                if state == NONE:
                    holders.remove(holder)
                taken = await self._check(runner, sender, env) if env is not None else None
                if taken is not None:
                    self.relayed += 1
                    logger.info(
                        "round %d fragment %d: took %s's part from %s",
                        *runner.key[:2], sender[:16], holder[:16],
                    )  # fmt: skip
                    return taken
            if holders:
                await asyncio.sleep(min(_RETRY_SECONDS, max(0.0, by - time.monotonic())))
        return None

    async def _ask(
        self, key: AllReduceKey, holder: str, sender: str, request: bytes, by: float
    ) -> tuple[str, Part | None]:
        """``holder``'s answer: its state, and ``sender``'s part opened, if it sent one."""
        ctx = self.context
        timeout = max(MIN_CALL_SECONDS, by - time.monotonic())
        try:
            data = await ctx.transport.call(
                holder,
                RELAY_RPC,
                request,
                timeout=timeout,
                max_response_bytes=ctx.settings.max_message_bytes + _MAX_REQUEST_BYTES,
            )
            state, wire = msgpack.unpackb(data)
            if state != HELD or not isinstance(wire, bytes):
                return (NONE if state == NONE else WAITING), None
            ctx.tally(key, received=len(data))
            env = await ctx.open(wire, sender, kinds=("part",))
        except (ProtocolError, ValueError, TypeError, msgpack.ExtraData) as exc:
            logger.info("relay of %s's part from %s: %s", sender[:16], holder[:16], exc)
            return NONE, None  # a holder that cannot answer is not asked again
        return HELD, env

    async def _check(
        self, runner: ExchangeRunner, sender: str, env: Part
    ) -> tuple[Contribution, bytes] | None:
        """A relayed part checked as its sender's own would be: of this exchange and this
        node's group, the sender's own index, and the digest it committed to."""
        ctx, plan = self.context, runner.plan
        assert plan is not None and ctx.commitments is not None
        h = env.header
        if (h.round, h.fragment, env.meta.get("content")) != runner.key:
            return None
        if env.meta.get("group") != plan.group or env.meta.get("exchange") != GATHER:
            return None
        if h.part != plan.owners.index(sender):
            return None
        refusal = await runner.commitment_refusal(sender, env)  # its commit phase is over
        owned = runner.owned
        if refusal or owned is None or sender in owned.contributions:
            return None
        try:
            contribution = ctx.decode(env, owned.numel, sender)
        except ProtocolError:
            return None
        return contribution, held_wire(env)
