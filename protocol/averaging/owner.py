"""The owner side of one all-reduce: the part this node owns, its contributions in, its
result out.

Every member sends its encoded, signed part to the part's owner in one RPC
(:data:`RPC_NAME`), which the service routes to the exchange's runner and its
:class:`OwnedPart`. The owner checks each part on its head before any body byte is
read, takes it if the sender is in its group, committed to it in time and is not late,
waits until every member's part is in or its deadline passes, reduces what it has
(token-weighted mean unless a robust reducer is plugged in), encodes and signs the
result once, and answers every caller with the same bytes. A part refused for the commit
phase or lateness is still answered with the result, which names it and why, so every
member of a part ends with the one result its owner signed.

With ``AllReduceSettings.stream_reduce`` the owner reduces block by block while the
parts arrive (:mod:`protocol.averaging.early`) and at the end only completes that
reduction, or starts over when the parts it streamed are not the ones kept. With raw
float32 results it also streams the reduced blocks back as they are reduced
(:mod:`protocol.averaging.streamback`); when it started over after sending blocks, the
trailer says ``redo`` and members fetch the signed result (:data:`RESULT_RPC`).

In a gather every member owns the whole vector and reduces the group's parts itself; it
answers a part with whether it took it, and keeps the parts it took for the members
that lack one (:mod:`protocol.averaging.gather`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Sequence

import torch

from protocol.averaging.early import EarlyReduction
from protocol.averaging.gather import RPC_NAME, PartRelay, gather_ack, held_wire
from protocol.averaging.parts import Contribution, Planner, Prefix, Reduction
from protocol.averaging.resultmeta import owner_fields, trailer_fields
from protocol.averaging.runner import MIN_CALL_SECONDS, ExchangeRunner
from protocol.errors import ProtocolError
from protocol.p2p.transport import StreamedResponse
from protocol.wire import codec as codecs
from protocol.wire.partwire import Part, SealedPart, chunk_hashes, seal_part

__all__ = ["RESULT_RPC", "RPC_NAME", "Answer", "OwnedPart", "open_part"]

logger = logging.getLogger(__name__)

RESULT_RPC = "atoll.result"
"""A member fetches an owner's signed result after a streamed one said ``redo``."""
_NO_VALUES = torch.empty(0)

Answer = list[bytes | memoryview] | StreamedResponse


class OwnedPart:
    """The owner side of one exchange: the contributions to this node's part, and the
    result it signs from them. Made by :func:`open_part`.

    Args:
        runner: the exchange.
        expected: members whose parts are waited for (this node's policy refuses the
            others, so it does not wait for them).
        own: this node's own contribution to the part.
        relay: in a gather, fetches the committed parts this node lacks from other
            members (None: none are fetched).
    """

    def __init__(
        self,
        runner: ExchangeRunner,
        expected: set[str],
        own: Contribution,
        relay: PartRelay | None,
    ) -> None:
        self.runner = runner
        self.context = runner.context
        self.numel = own.vector.numel()
        self.expected = expected
        self.relay = relay
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
        self.streamed_share = 0.0
        """The share of the part reduced while parts arrived and kept in the result."""
        self.early: EarlyReduction | None = None
        """The part reduced block by block as parts arrive (with a planner)."""
        self.held: dict[str, bytes] = {}
        """In a gather, the parts taken, as their senders sent them, for members that
        lack one (:mod:`protocol.averaging.gather`); kept until the exchange is over."""

    def note_in(self) -> None:
        """Wake the reduction once every expected part is in or refused."""
        if self.expected <= set(self.contributions) | set(self.refused):
            self.full.set()

    def drop_reply(self) -> None:
        """The exchange is over: nobody gets the result any more."""
        self.reply = None
        self.held = {}
        if self.early is not None:
            self.early.drop()

    # ---- parts in -----------------------------------------------------------------------

    async def take(self, peer: str, env: Part) -> Answer:
        """A member's part (admitted by the runner): this owner's result, or a refusal."""
        ctx = self.context
        h = env.header
        at = (h.round, h.fragment)
        known = self.contributions.get(peer)
        if known is not None and known.digest == env.digest:
            # The same signed part again: the sender lost the answer and retried.
            return await self.answer(peer)
        if known is not None:
            raise ctx.reject(
                "duplicate", "a second part for the same round and fragment", peer, *at
            )
        contribution = ctx.decode(env, self.numel, peer)
        refusal = await self.runner.commitment_refusal(peer, env)
        if refusal:
            ctx.reject(refusal, "part does not match a timely commitment", peer, *at)
            return await self._answer_without(peer, refusal)
        if time.monotonic() > self.runner.parts_by or self.reducing:
            ctx.reject("late", "part arrived after the owner's deadline", peer, *at)
            return await self._answer_without(peer, "late")
        self.contributions[peer] = contribution
        if self.runner.plan is not None and self.runner.plan.gather:
            self.held[peer] = held_wire(env)  # for members that lack it
        self.note_in()
        return await self.answer(peer)

    async def _answer_without(self, peer: str, reason: str) -> Answer:
        """Refuse ``peer``'s part but answer it with the result all the same.

        Every member of a part must end with the one result its owner signed, or honest
        members' values part ways; the result names the refused part and why (a part
        that came after the result was signed is simply not in it)."""
        if not self.reducing:
            self.refused[peer] = reason
            self.note_in()
        return await self.answer(peer, reason)

    def relayed(self, sender: str, contribution: Contribution, wire: bytes) -> None:
        """In a gather, ``sender``'s part as another member relayed it (checked as its
        sender's own would be, :meth:`PartRelay.fill
        <protocol.averaging.gather.PartRelay.fill>`)."""
        self.contributions[sender] = contribution
        self.refused.pop(sender, None)
        self.held[sender] = wire

    async def answer(self, peer: str, refused: str = "") -> Answer:
        """This owner's signed result, once there is one, or the result streamed back as
        it is reduced, once that starts (no longer than its exchange lasts); in a
        gather, where the sender reduces the parts itself, whether its part was taken."""
        if self.runner.plan is not None and self.runner.plan.gather:
            return [gather_ack(refused)]
        left = max(MIN_CALL_SECONDS, self.runner.done_by - time.monotonic())
        await asyncio.wait_for(self.answerable.wait(), left)
        stream = self.early.result_stream if self.early is not None else None
        if not self.reduced.is_set() and stream is not None:
            early = self.early
            assert early is not None
            return stream.response(early.progress, self.runner.done_by, self.context.faults.trailer)
        await asyncio.wait_for(self.reduced.wait(), left)
        if self.reply is None:  # dropped once the exchange was over
            raise ProtocolError("late", "the exchange of that round is over")
        return self.reply.buffers()

    async def result(self, peer: str) -> list[bytes | memoryview]:
        """A member's request for this owner's signed result (after a ``redo``)."""
        plan = self.runner.plan
        if plan is None or peer not in plan.group:
            raise ProtocolError("wrong_part", "not a member of that part's group", peer)
        left = max(MIN_CALL_SECONDS, self.runner.done_by - time.monotonic())
        await asyncio.wait_for(self.reduced.wait(), left)
        if self.reply is None:
            raise ProtocolError("late", "the exchange of that round is over")
        self.context.tally(self.runner.key, sent=self.reply.nbytes)
        return self.reply.buffers()

    async def reduce(self) -> torch.Tensor:
        """Wait for the group's parts (or the deadline), reduce, sign, publish; returns
        the result's values as every member decodes them."""
        ctx = self.context
        await self._wait_for_parts()
        self.waited = True
        if self.relay is not None:
            have = set(self.contributions)
            for sender, contribution, wire in await self.relay.fill(
                self.runner, have, self.runner.replies_by
            ):
                self.relayed(sender, contribution, wire)
        parts_in = time.monotonic()
        self.reducing = True  # parts arriving from now on are late
        prefix = await self.early.stop() if self.early is not None else None
        contributions = _in_group_order(self.runner, self.contributions)
        if self.runner.plan is not None and self.runner.plan.gather:
            return await self._gathered(contributions, parts_in)
        reduction = await self._reduce(contributions, prefix)
        if prefix is not None and reduction.vector is prefix.out and self.numel:
            self.streamed_share = prefix.upto / self.numel
        values = ctx.faults.reduced(reduction.vector)
        enc = await asyncio.wrap_future(
            ctx.worker.submit(ctx.encode, values, self.runner.content, True)
        )
        used = set(reduction.used)
        kept = [c for c in contributions if c.peer in used]
        rejected = {
            **self.refused,
            **{p: r for p, r in reduction.rejected.items() if isinstance(r, str)},
        }
        fields = owner_fields(ctx.commitments, self.runner.key, kept, rejected)
        meta = ctx.faults.reduced_meta(fields)
        streamed = prefix is not None and reduction.vector is prefix.out
        await self._seal(meta, enc, streamed)
        self.reply_contributors = list(meta["contributors"])
        self.reduce_seconds = time.monotonic() - parts_in
        self._publish(len(contributions))
        return codecs.decode(enc, expected_numel=self.numel, copy=False)

    async def _wait_for_parts(self) -> None:
        """Until every expected part is in or the deadline passes; each member still
        missing then is reported to the judge."""
        try:
            left = max(0.0, self.runner.parts_by - time.monotonic())
            await asyncio.wait_for(self.full.wait(), left)
        except asyncio.TimeoutError:
            round_, fragment, content = self.runner.key
            index = self.runner.plan.index if self.runner.plan is not None else -1
            missing = sorted(set(self.expected) - set(self.contributions))
            logger.warning(
                "round %d fragment %d part %d: deadline passed without %s",
                *(round_, fragment, index, ", ".join(p[:16] for p in missing)),
            )
            commitments = self.context.commitments
            for peer in missing:
                committed = commitments is not None and commitments.committed(
                    peer, round_, fragment, content
                )
                self.context.judge.on_missing(peer, round_, fragment, index, committed)

    async def _gathered(
        self,
        contributions: Sequence[Contribution],
        parts_in: float,
    ) -> torch.Tensor:
        """A gather's reduction, which this member keeps for itself: every member reduces
        the same parts, so it is a shared one (the inputs alone decide, as in a repair),
        and it is neither encoded nor sent."""
        reduction = await self._reduce(contributions, None, gathered=True)
        values = self.context.faults.reduced(reduction.vector)
        self.reply_contributors = list(reduction.used)
        self.reduce_seconds = time.monotonic() - parts_in
        self.reduced.set()
        self.answerable.set()
        # the parts taken are relayed to members that lack one until the exchange is over
        self._let_go()
        return values

    async def _reduce(
        self,
        contributions: Sequence[Contribution],
        prefix: Prefix | None,
        gathered: bool = False,
    ) -> Reduction:
        # reducing, encoding and hashing release the GIL: off the loop, which keeps
        # reading the other parts' streams meanwhile
        reducer = functools.partial(
            self.context.reducer,
            content=self.runner.content,
            **({"prefix": prefix} if prefix is not None else {}),
            **({"shared": True, "gathered": True} if gathered else {}),
        )
        round_, fragment, _ = self.runner.key
        index = self.runner.plan.index if self.runner.plan is not None else -1
        reducing = self.context.worker.submit(reducer, round_, fragment, index, contributions)
        return await asyncio.wrap_future(reducing)

    async def _seal(self, meta: dict, enc: codecs.Encoded, streamed: bool) -> None:
        """Sign the result (and the trailer of the one streamed back, ``streamed``: its
        streamed blocks are the result's)."""
        ctx = self.context
        hashes = None
        stream = self.early.result_stream if self.early is not None else None
        if stream is not None:
            # one pass of hashing for the signed result and the streamed one's trailer
            hashes = await asyncio.wrap_future(ctx.worker.submit(chunk_hashes, enc.payload))
            stream.finish(trailer_fields(meta), hashes, enc.payload, streamed)
        sealing = ctx.worker.submit(
            functools.partial(seal_part, hashes=hashes),
            ctx.identity,
            self.runner.header("reduced"),
            {**meta, **enc.meta()},
            enc.payload,
        )
        sealed = await asyncio.wrap_future(sealing)
        self.reply = self.context.faults.reply(sealed)

    def _publish(self, contributors: int) -> None:
        """Answer every member waiting for the result, and let the parts' buffers go."""
        assert self.reply is not None
        # every other contributor is waiting for this one reply; those answered with the
        # streamed result already get it, head and trailer
        stream = self.early.result_stream if self.early is not None else None
        streamed = stream.replies if stream is not None else 0
        sent = self.reply.nbytes * max(0, contributors - 1 - streamed)
        if stream is not None:
            sent += streamed * stream.reply_bytes
        self.context.tally(self.runner.key, sent=sent)
        self.reduced.set()
        self.answerable.set()
        if self.early is not None:
            self.early.close()
        # the result is kept for members that retry until the exchange is over, no longer
        self._let_go()

    def _let_go(self) -> None:
        """The parts are in the result: drop their views, so that their receive buffers go
        back to the pool (a retry is recognised by its digest alone), and drop the result
        and the parts kept for others once the exchange is over."""
        self.contributions = {
            p: dataclasses.replace(c, vector=_NO_VALUES) for p, c in self.contributions.items()
        }
        asyncio.get_running_loop().call_later(
            max(0.0, self.runner.done_by - time.monotonic()), self.drop_reply
        )


def _in_group_order(runner: ExchangeRunner, taken: dict[str, Contribution]) -> list[Contribution]:
    """The contributions in group order, as the streamed reduction took them."""
    order = {p: i for i, p in enumerate(runner.plan.group if runner.plan else ())}
    return sorted(taken.values(), key=lambda c: order.get(c.peer, len(order)))


def open_part(
    runner: ExchangeRunner,
    vector: torch.Tensor,
    weight: int,
    planner: Planner | None,
    relay: PartRelay | None,
) -> OwnedPart:
    """The owner side of ``runner`` (whose plan makes this node an owner), ready for
    the members' parts: this node's own contribution, whom to wait for, and the
    streamed reduction when the reducer has a ``planner``."""
    ctx, plan = runner.context, runner.plan
    assert plan is not None and plan.is_owner
    me = ctx.identity.peer_id
    round_ = runner.key[0]
    start, end = plan.bounds[plan.index]
    own = seal_part(ctx.identity, runner.header("part"), {"content": runner.content}, b"")
    contribution = Contribution(
        peer=me,
        vector=vector[start:end],  # read only; the caller's vector stays as it is
        weight=float(min(weight, ctx.settings.max_tokens)),
        digest=own.digest,
        tokens=int(weight),
    )
    # Members this node's policy refuses will not be waited for; in a gather, only
    # those its lists refuse (every member must reduce the same parts)
    refusal = ctx.judge.listed if plan.gather else ctx.judge.refusal
    expected = {p for p in plan.group if p == me or not refusal(p, round_)}
    part = OwnedPart(runner, expected, contribution, relay if plan.gather else None)
    part.note_in()
    if not part.full.is_set() and planner is not None and part.numel and not plan.gather:
        part.early = EarlyReduction(runner, expected, contribution, part.answerable, planner)
    return part
