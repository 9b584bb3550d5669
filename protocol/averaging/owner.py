"""The owner side of this node's all-reduce: its part's contributions in, its result out.

Every member sends its encoded, signed part to the part's owner in one RPC
(:data:`RPC_NAME`). The owner checks each part on its head before any body byte is
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
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Sequence

import msgpack
import torch

from protocol.averaging.context import AllReduceContext
from protocol.averaging.early import EarlyReduction
from protocol.averaging.gather import GATHER, RPC_NAME, PartRelay, gather_ack, held_wire
from protocol.averaging.parts import (
    Contribution,
    Planner,
    Prefix,
    Reduction,
)
from protocol.averaging.resultmeta import result_fields, trailer_fields
from protocol.averaging.session import MIN_CALL_SECONDS, OwnedPart, Session, SessionTable
from protocol.errors import ProtocolError
from protocol.p2p.transport import Lease, Read, StreamedResponse
from protocol.wire import codec as codecs
from protocol.wire.partwire import Part, chunk_hashes, seal_part

__all__ = ["RESULT_RPC", "RPC_NAME", "PartOwner"]

logger = logging.getLogger(__name__)

RESULT_RPC = "atoll.result"
"""A member fetches an owner's signed result after a streamed one said ``redo``."""
_NO_VALUES = torch.empty(0)

Answer = list[bytes | memoryview] | StreamedResponse


class PartOwner:
    """Takes the parts of the part this node owns, reduces them, answers with the result.

    Args:
        context: what the node's all-reduce shares.
        sessions: the node's sessions.
        planner: how the reducer reduces while parts arrive, or None.
    """

    def __init__(
        self,
        context: AllReduceContext,
        sessions: SessionTable,
        planner: Planner | None,
        relay: PartRelay | None = None,
    ) -> None:
        self.context = context
        self.sessions = sessions
        self.relay = relay
        """In a gather, fetches the committed parts this node lacks from other members."""
        self.early = EarlyReduction(context, sessions, planner) if planner else None
        """Reduces while the parts arrive (when the reducer has a planner)."""

    # ---- parts in -----------------------------------------------------------------------

    async def read_part(self, read: Read, length: int, peer: str) -> Lease:
        """A member's part as it arrives on this owner's stream; a refusal is counted
        against the member."""
        ctx = self.context
        ctx.tally(None, received=length)
        lo = max(0, ctx.clock.current - 1)
        window = (lo, ctx.clock.current + ctx.settings.round_window)
        try:
            follow = self.early.follow if self.early is not None else None
            return await ctx.read_message(read, length, peer, "part", window, follow=follow)
        except ProtocolError as exc:
            raise ctx.reject(exc.reason, exc.detail, peer) from None

    async def handle(self, peer: str, env: Part) -> Answer:
        """A member's part (read by :meth:`read_part`): this owner's result, or a refusal."""
        h = env.header
        session = self.sessions.get((h.round, h.fragment, env.meta.get("content")))
        try:
            return await self._take(peer, env)
        finally:
            # a part that is not in the contributions will not be read again
            part = session.owned if session is not None else None
            if part is not None and part.streaming is not None and peer not in part.contributions:
                part.streaming.detach(peer)

    async def _admit(self, peer: str, env: Part) -> tuple[Session, OwnedPart]:
        """The session ``env`` is for, once this node joined it; refusals (and silence,
        as a fault) before the part's values are looked at."""
        ctx = self.context
        h = env.header
        at = (h.round, h.fragment)
        if self.context.faults.silent_in(*at):
            await asyncio.sleep(ctx.settings.timeout * 2)  # never answers in time
            raise ProtocolError("timeout", "silent", peer)
        gather = ctx.settings.gather and env.meta.get("content") == "update"
        blocked = (ctx.judge.listed if gather else ctx.judge.blocks)(peer, h.round)
        if blocked:
            raise ctx.reject(blocked, "refused by this node's trust policy", peer, *at)
        if h.fragment >= ctx.settings.fragments:
            raise ctx.reject("wrong_part", f"no fragment {h.fragment}", peer, *at)
        key = (h.round, h.fragment, ctx.content_of(env, peer))
        if not self.sessions.has_room(key):
            raise ctx.reject("busy", "too many rounds in flight", peer, *at)
        session = self.sessions.open(key)
        ctx.tally(key, received=env.nbytes, totals=False)
        try:
            await asyncio.wait_for(session.ready.wait(), ctx.settings.timeout)
        except asyncio.TimeoutError:
            raise ctx.reject(
                "not_in_round", "this node did not join that round", peer, *at
            ) from None
        plan = session.plan
        assert plan is not None  # set before ready
        group, owners = env.meta.get("group"), env.meta.get("owners", env.meta.get("group"))
        if group != plan.group or owners != plan.owners:
            raise ctx.reject("group_mismatch", "sender's group differs from the owner's", peer, *at)
        blocked = None if plan.gather or not gather else ctx.judge.blocks(peer, h.round)
        if blocked:  # a group with a client reduces by owner after all
            raise ctx.reject(blocked, "refused by this node's trust policy", peer, *at)
        if (env.meta.get("exchange") == GATHER) != plan.gather:
            raise ctx.reject(
                "group_mismatch", "sender's exchange differs from the owner's", peer, *at
            )
        # in a gather a member sends everyone its one part, under its own index
        wanted = plan.owners.index(peer) if plan.gather and peer in plan.owners else plan.index
        if peer not in plan.group or h.part != wanted or session.owned is None:
            raise ctx.reject("wrong_part", f"part {h.part} is not owned here", peer, *at)
        return session, session.owned

    async def _take(self, peer: str, env: Part) -> Answer:
        ctx = self.context
        session, part = await self._admit(peer, env)
        h = env.header
        at = (h.round, h.fragment)
        known = part.contributions.get(peer)
        if known is not None and known.digest == env.digest:
            # The same signed part again: the sender lost the answer and retried.
            return await self._reply(session, part, peer)
        if known is not None:
            raise ctx.reject(
                "duplicate", "a second part for the same round and fragment", peer, *at
            )
        contribution = ctx.decode(env, part.numel, peer)
        refusal = await self._commitment_refusal(session, peer, env)
        if refusal:
            ctx.reject(refusal, "part does not match a timely commitment", peer, *at)
            return await self._answer_without(session, part, peer, refusal)
        if time.monotonic() > session.parts_by or part.reducing:
            ctx.reject("late", "part arrived after the owner's deadline", peer, *at)
            return await self._answer_without(session, part, peer, "late")
        part.contributions[peer] = contribution
        if session.plan is not None and session.plan.gather:
            part.held[peer] = held_wire(env)  # for members that lack it
        part.note_in()
        return await self._reply(session, part, peer)

    async def _commitment_refusal(self, session: Session, peer: str, env: Part) -> str | None:
        """Why ``env`` does not match a timely commitment of ``peer`` (None: it does, or
        the exchange has no commit phase), once this node's commit phase is over."""
        ctx = self.context
        if ctx.commitments is None:
            return None
        h = env.header
        try:
            await asyncio.wait_for(session.committed.wait(), ctx.settings.timeout)
        except asyncio.TimeoutError:
            raise ctx.reject(
                "not_in_round", "commit phase never closed", peer, h.round, h.fragment
            ) from None
        return await ctx.commitments.check(
            peer, h.round, h.fragment, h.part, env.digest, session.closed_at, session.content
        )

    async def _answer_without(
        self, session: Session, part: OwnedPart, peer: str, reason: str
    ) -> Answer:
        """Refuse ``peer``'s part but answer it with the result all the same.

        Every member of a part must end with the one result its owner signed, or honest
        members' values part ways; the result names the refused part and why (a part
        that came after the result was signed is simply not in it)."""
        if not part.reducing:
            part.refused[peer] = reason
            part.note_in()
        return await self._reply(session, part, peer, reason)

    async def _reply(
        self, session: Session, part: OwnedPart, peer: str, refused: str = ""
    ) -> Answer:
        """This owner's signed result, once there is one, or the result streamed back as
        it is reduced, once that starts (no longer than its exchange lasts); in a
        gather, where the sender reduces the parts itself, whether its part was taken."""
        if session.plan is not None and session.plan.gather:
            return [gather_ack(refused)]
        left = max(MIN_CALL_SECONDS, session.done_by - time.monotonic())
        await asyncio.wait_for(part.answerable.wait(), left)
        stream = part.result_stream
        if not part.reduced.is_set() and stream is not None:
            return stream.response(part.progress, session.done_by, self.context.faults.trailer)
        await asyncio.wait_for(part.reduced.wait(), left)
        if part.reply is None:  # dropped once the exchange was over
            raise ProtocolError("late", "the exchange of that round is over")
        return part.reply.buffers()

    async def handle_result(self, peer: str, data: bytes) -> list[bytes | memoryview]:
        """A member's request for this owner's signed result (after a ``redo``)."""
        try:
            round_, fragment, content = msgpack.unpackb(data)
            key = (int(round_), int(fragment), str(content))
        except (ValueError, TypeError, msgpack.ExtraData) as exc:
            raise self.context.reject("malformed", f"result request: {exc}", peer) from None
        session = self.sessions.get(key)
        part = session.owned if session is not None else None
        if session is None or session.plan is None or part is None:
            raise ProtocolError("not_in_round", "no result of that exchange here", peer)
        if peer not in session.plan.group:
            raise ProtocolError("wrong_part", "not a member of that part's group", peer)
        left = max(MIN_CALL_SECONDS, session.done_by - time.monotonic())
        await asyncio.wait_for(part.reduced.wait(), left)
        if part.reply is None:
            raise ProtocolError("late", "the exchange of that round is over")
        self.context.tally(key, sent=part.reply.nbytes)
        return part.reply.buffers()

    # ---- this node's own part -------------------------------------------------------------

    def open(self, session: Session, vector: torch.Tensor, weight: int) -> None:
        """Make ``session`` (whose plan makes this node an owner) ready for the members'
        parts: this node's own contribution, whom to wait for, and the streamed
        reduction when the reducer has a planner."""
        ctx, plan = self.context, session.plan
        assert plan is not None and plan.is_owner
        me = ctx.identity.peer_id
        round_, _, content = session.key
        start, end = plan.bounds[plan.index]
        header = session.header("part", ctx.settings.run_id, me)
        own = seal_part(ctx.identity, header, {"content": content}, b"")
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
        part = session.owned = OwnedPart(end - start, expected, contribution)
        part.note_in()
        if not part.full.is_set() and self.early is not None and part.numel and not plan.gather:
            self.early.start(session, part, vector[start:end])

    async def reduce(self, session: Session) -> torch.Tensor:
        """Wait for the group's parts (or the deadline), reduce, sign, publish; returns
        the result's values as every member decodes them."""
        ctx, part = self.context, session.owned
        assert part is not None
        await self._wait_for_parts(session, part)
        part.waited = True
        if self.relay is not None and session.plan is not None and session.plan.gather:
            await self.relay.fill(session, part, session.replies_by)
        parts_in = time.monotonic()
        part.reducing = True  # parts arriving from now on are late
        prefix = None
        if part.stream_task is not None:
            part.wake.set()
            await part.stream_task  # never raises; no block is being reduced after this
            prefix = part.streaming.prefix() if part.streaming is not None else None
        contributions = self._in_group_order(session, part)
        if session.plan is not None and session.plan.gather:
            return await self._gathered(session, part, contributions, parts_in)
        reduction = await self._reduce(session, contributions, prefix)
        if prefix is not None and reduction.vector is prefix.out and part.numel:
            part.streamed_share = prefix.upto / part.numel
        values = ctx.faults.reduced(reduction.vector)
        enc = await ctx.compute(ctx.encode, values, session.content, True)
        used = set(reduction.used)
        kept = [c for c in contributions if c.peer in used]
        meta = ctx.faults.reduced_meta(self._result_meta(session, part, kept, reduction))
        streamed = prefix is not None and reduction.vector is prefix.out
        await self._seal(session, part, meta, enc, streamed)
        part.reply_contributors = list(meta["contributors"])
        part.reduce_seconds = time.monotonic() - parts_in
        self._publish(session, part, len(contributions))
        return codecs.decode(enc, expected_numel=part.numel, copy=False)

    async def _wait_for_parts(self, session: Session, part: OwnedPart) -> None:
        """Until every expected part is in or the deadline passes; each member still
        missing then is reported to the judge."""
        try:
            await asyncio.wait_for(part.full.wait(), max(0.0, session.parts_by - time.monotonic()))
        except asyncio.TimeoutError:
            round_, fragment, content = session.key
            index = session.plan.index if session.plan is not None else -1
            missing = sorted(set(part.expected) - set(part.contributions))
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

    @staticmethod
    def _in_group_order(session: Session, part: OwnedPart) -> list[Contribution]:
        # in group order, as the streamed reduction took them
        order = {p: i for i, p in enumerate(session.plan.group if session.plan else ())}
        return sorted(part.contributions.values(), key=lambda c: order.get(c.peer, len(order)))

    async def _gathered(
        self,
        session: Session,
        part: OwnedPart,
        contributions: Sequence[Contribution],
        parts_in: float,
    ) -> torch.Tensor:
        """A gather's reduction, which this member keeps for itself: every member reduces
        the same parts, so it is a shared one (the inputs alone decide, as in a repair),
        and it is neither encoded nor sent."""
        reduction = await self._reduce(session, contributions, None, gathered=True)
        values = self.context.faults.reduced(reduction.vector)
        part.reply_contributors = list(reduction.used)
        part.reduce_seconds = time.monotonic() - parts_in
        part.reduced.set()
        part.answerable.set()
        part.contributions = {
            p: dataclasses.replace(c, vector=_NO_VALUES) for p, c in part.contributions.items()
        }
        # the parts taken are relayed to members that lack one until the exchange is over
        asyncio.get_running_loop().call_later(
            max(0.0, session.done_by - time.monotonic()), part.drop_reply
        )
        return values

    async def _reduce(
        self,
        session: Session,
        contributions: Sequence[Contribution],
        prefix: Prefix | None,
        gathered: bool = False,
    ) -> Reduction:
        # reducing, encoding and hashing release the GIL: off the loop, which keeps
        # reading the other parts' streams meanwhile
        reducer = functools.partial(
            self.context.reducer,
            content=session.content,
            **({"prefix": prefix} if prefix is not None else {}),
            **({"shared": True, "gathered": True} if gathered else {}),
        )
        round_, fragment, _ = session.key
        index = session.plan.index if session.plan is not None else -1
        return await self.context.compute(reducer, round_, fragment, index, contributions)

    def _result_meta(
        self,
        session: Session,
        part: OwnedPart,
        kept: Sequence[Contribution],
        reduction: Reduction,
    ) -> dict:
        rejected = {
            **part.refused,
            **{p: r for p, r in reduction.rejected.items() if isinstance(r, str)},
        }
        commits, commitments = None, self.context.commitments
        if commitments is not None:
            # what each contributor committed to, as this owner holds it (see evidence())
            round_, fragment, content = session.key
            commits = [commitments.evidence(c.peer, round_, fragment, content) for c in kept]
        return result_fields(session.content, kept, rejected, commits)

    async def _seal(
        self,
        session: Session,
        part: OwnedPart,
        meta: dict,
        enc: codecs.Encoded,
        streamed: bool,
    ) -> None:
        """Sign the result (and the trailer of the one streamed back, ``streamed``: its
        streamed blocks are the result's)."""
        ctx = self.context
        hashes = None
        stream = part.result_stream
        if stream is not None:
            # one pass of hashing for the signed result and the streamed one's trailer
            hashes = await ctx.compute(chunk_hashes, enc.payload)
            stream.finish(trailer_fields(meta), hashes, enc.payload, streamed)
        sealed = await ctx.compute(
            functools.partial(seal_part, hashes=hashes),
            ctx.identity,
            session.header("reduced", ctx.settings.run_id, ctx.identity.peer_id),
            {**meta, **enc.meta()},
            enc.payload,
        )
        part.reply = self.context.faults.reply(sealed)

    def _publish(self, session: Session, part: OwnedPart, contributors: int) -> None:
        """Answer every member waiting for the result, and let the parts' buffers go."""
        assert part.reply is not None
        # every other contributor is waiting for this one reply; those answered with the
        # streamed result already get it, head and trailer
        stream = part.result_stream
        streamed = stream.replies if stream is not None else 0
        sent = part.reply.nbytes * max(0, contributors - 1 - streamed)
        if stream is not None:
            sent += streamed * stream.reply_bytes
        self.context.tally(session.key, sent=sent)
        part.reduced.set()
        part.answerable.set()
        # the parts are in the result: drop their views so their receive buffers go back
        # to the pool (a retry is recognised by its digest alone)
        part.contributions = {
            p: dataclasses.replace(c, vector=_NO_VALUES) for p, c in part.contributions.items()
        }
        if part.streaming is not None:
            part.streaming.close()
        # the result is kept for members that retry until the exchange is over, no longer
        asyncio.get_running_loop().call_later(
            max(0.0, session.done_by - time.monotonic()), part.drop_reply
        )
