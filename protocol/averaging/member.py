"""The member side of this node's all-reduce: one exchange, run from start to end.

A member signs one part per owner (built before anything is sent; each body is a view of
its contribution), commits to their digests when the exchange has a commit phase, then
sends every part to its owner at once and reads each owner's signed result as it
arrives, straight into the output when it is raw float32. It applies nothing it has not
checked: the result's signature and chunks (for a result streamed back, its trailer),
its fields (:mod:`protocol.averaging.resultmeta`), the commitments it names, and its
plausibility against this node's own contribution (the judge). The part this node owns
is reduced by its owner side (:mod:`protocol.averaging.owner`); an owner uses the
decoded bytes it sent, so every member ends with bitwise identical values.

A part whose owner vanished, went silent or answered with something refused is repaired
among the other owners (:mod:`protocol.averaging.repair`) or falls back to this node's
own values, and :class:`~protocol.averaging.parts.AllReduceResult` says exactly which
peers are in which part. A client only ever calls out: it sends its parts and receives
the results on the streams it opened.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field

import msgpack
import torch

from protocol.averaging.context import AllReduceContext
from protocol.averaging.gather import GATHER, deliver
from protocol.averaging.owner import RESULT_RPC, RPC_NAME, PartOwner
from protocol.averaging.parts import (
    CONTENTS,
    AllReduceKey,
    AllReduceResult,
    PartPlan,
    seal_for,
    seal_with,
)
from protocol.averaging.repair import PartRepair
from protocol.averaging.resultmeta import ResultFields, read_result
from protocol.averaging.session import MIN_CALL_SECONDS, Session, SessionTable
from protocol.errors import ProtocolError
from protocol.p2p.transport import Lease, StreamRead, read_frame
from protocol.wire import codec as codecs
from protocol.wire.messages import Header
from protocol.wire.partwire import MAX_TRAILER_BYTES, Part, SealedPart

__all__ = ["PartMember"]

logger = logging.getLogger(__name__)

# refusals of an owner's answer found while reading it (the rest are transport failures)
_REFUSED_RESULT = frozenset(
    {
        "malformed",
        "bad_version",
        "sender_mismatch",
        "bad_signature",
        "wrong_run",
        "wrong_kind",
        "stale_round",
        "truncated",
        "trailing_bytes",
        "bad_chunk",
        "bad_trailer",
    }
)

_PartResult = tuple[int, bool, list[str]]
"""``(part index, whether the reduced values are in the output, who is in them)``."""


@dataclass
class _Run:
    """One all-reduce as this member runs it."""

    key: AllReduceKey
    plan: PartPlan
    session: Session
    vector: torch.Tensor
    weight: int
    out: torch.Tensor
    requests: dict[int, SealedPart]
    started: float
    repaired: list[int] = field(default_factory=list)


class PartMember:
    """Runs this node's all-reduces as a member of their groups.

    Args:
        context: what the node's all-reduce shares.
        sessions: the node's sessions.
        owner: the node's owner side (reduces the part this node owns).
        repair: the node's repair of parts whose owner failed.
    """

    def __init__(
        self,
        context: AllReduceContext,
        sessions: SessionTable,
        owner: PartOwner,
        repair: PartRepair,
    ) -> None:
        self.context = context
        self.sessions = sessions
        self.owner = owner
        self.repair = repair
        self.results_streamed = 0
        """Owners' results this node took as they were reduced (checked by their trailer)."""
        self.results_redone = 0
        """Of those, results whose owner gave its streamed blocks up (fetched again)."""

    async def run(
        self,
        key: AllReduceKey,
        group: Sequence[str],
        vector: torch.Tensor,
        weight: int,
        owners: Sequence[str] | None,
        deadline: float | None,
        out: torch.Tensor | None,
        claim: dict | None = None,
    ) -> AllReduceResult:
        """All-reduce ``vector`` for ``key`` (see :meth:`AllReduceService.run
        <protocol.averaging.allreduce.AllReduceService.run>`)."""
        _check_arguments(key[2], vector, out)
        ctx = self.context
        started = time.monotonic()
        done_by = deadline if deadline is not None else started + ctx.settings.timeout
        me = ctx.identity.peer_id
        gather = ctx.settings.gather and key[2] == "update"
        plan = PartPlan.of(me, group, owners, vector.numel(), ctx.settings.block_size, gather)
        vector = self.context.faults.contribution(key[0], key[1], vector)
        session = self._open(key, plan, vector, weight, done_by)
        if plan.gather:
            # one signed part, this node's whole vector, the same bytes to every member
            # (committed once: no member can be sent other values than the rest)
            header, meta, enc = self._fields(key, plan, plan.index, vector, weight, claim)
            part = seal_with(ctx.faults, ctx.identity, header, meta, enc)
            requests = {
                j: seal_for(ctx.faults, ctx.identity, j, part, header, meta, enc)
                for j in range(len(plan.owners))
                if j != plan.index
            }
            committed = {plan.index: part}
        else:
            requests = {
                j: self.request(key, plan, j, vector[lo:hi], weight, claim)
                for j, (lo, hi) in enumerate(plan.bounds)
                if j != plan.index
            }
            committed = requests
        if ctx.sent is not None:
            own = {}
            if plan.is_owner and not plan.gather:
                lo, hi = plan.bounds[plan.index]
                own[plan.index] = self.request(key, plan, plan.index, vector[lo:hi], weight, claim)
            ctx.sent.keep(key, {**committed, **own})
        await self._commit_phase(session, committed)
        session.schedule()
        if out is None:
            out = torch.empty_like(vector)
        run = _Run(key, plan, session, vector, weight, out, requests, started)
        if plan.gather:
            await self._gather(run)
            return self._gathered(run)
        results = await asyncio.gather(*(self._part(run, j) for j in range(len(plan.owners))))
        return self._assemble(run, results)

    def _open(
        self,
        key: AllReduceKey,
        plan: PartPlan,
        vector: torch.Tensor,
        weight: int,
        done_by: float,
    ) -> Session:
        """This node's session for the exchange, ready for the owners' parts.

        Until the commit phase closes, the owner side accepts parts until ``done_by``;
        :meth:`Session.schedule` then sets the real deadlines."""
        session = self.sessions.open(key)
        self.sessions.moved_on(key)
        session.open(plan, done_by)
        if plan.is_owner:
            self.owner.open(session, vector, weight)
        session.ready.set()
        return session

    def request(
        self,
        at: AllReduceKey,
        plan: PartPlan,
        j: int,
        values: torch.Tensor,
        weight: int,
        claim: dict | None = None,
    ) -> SealedPart:
        """The signed part message for owner ``j`` (built before anything is sent; its
        body is a view of ``values``, not a copy)."""
        ctx = self.context
        header, meta, enc = self._fields(at, plan, j, values, weight, claim)
        return seal_with(ctx.faults, ctx.identity, header, meta, enc)

    def _fields(
        self,
        at: AllReduceKey,
        plan: PartPlan,
        j: int,
        values: torch.Tensor,
        weight: int,
        claim: dict | None,
    ) -> tuple[Header, dict, codecs.Encoded]:
        """The header, fields and encoded values of the part for owner ``j`` (in a gather
        ``j`` is this node's own index, the one part it sends everyone); an ``update``'s
        ``claim`` of work goes into its head."""
        ctx = self.context
        round_, fragment, content = at
        enc = ctx.encode(values, content)
        header = Header("part", ctx.settings.run_id, round_, fragment, j, ctx.identity.peer_id)
        meta = {
            "content": content,
            "group": plan.group,
            "owners": plan.owners,
            "weight": int(weight),
        }
        if claim is not None and content == "update":
            meta["work"] = claim
        if plan.gather:
            meta["exchange"] = GATHER
        return header, meta, enc

    async def _commit_phase(self, session: Session, requests: dict[int, SealedPart]) -> None:
        """Commit to every part's digest and wait for the group's, when commitments are on."""
        round_, fragment, content = session.key
        assert session.plan is not None
        commitments, group = self.context.commitments, session.plan.group
        try:
            if commitments is not None:
                faults = self.context.faults
                digests = {j: request.digest for j, request in requests.items()}
                if faults.commit_delay > 0:
                    await asyncio.sleep(faults.commit_delay)
                for waited, made in faults.commits(group, digests):
                    await commitments.commit(round_, fragment, waited, made, content)
        finally:
            session.closed_at = time.monotonic()
            session.committed.set()

    async def _part(self, run: _Run, j: int) -> _PartResult:
        """Part ``j`` of the output, written as soon as it is accepted (or repaired)."""
        lo, hi = run.plan.bounds[j]
        if j == run.plan.index:
            run.out[lo:hi] = await self.owner.reduce(run.session)
            assert run.session.owned is not None
            return j, True, list(run.session.owned.reply_contributors)
        if self.context.faults.silent_in(run.key[0], run.key[1]):
            return j, False, []
        if run.plan.gather:
            return await self._deliver(run, j)
        result = await self._send_part(run, j)
        if result[1]:
            self.repair.accepted(run.key, j)
        elif self._repairable(run.plan):
            owner, values = run.plan.owners[j], run.vector[lo:hi]
            fixed = await self.repair.run(
                run.key, j, run.plan.owners, owner, values, run.weight, run.session.done_by
            )
            if fixed is not None:
                run.repaired.append(j)
                run.out[lo:hi] = fixed[0]
                return j, True, fixed[1]
        return result

    def _repairable(self, plan: PartPlan) -> bool:
        # Repair is all-to-all among the owners other than the failed one; a client
        # cannot be called by others, so it takes no part in it (it keeps its own values
        # for that part and re-syncs at the round's end).
        return self.context.settings.repair and plan.is_owner and len(plan.owners) > 2

    async def _deliver(self, run: _Run, j: int) -> _PartResult:
        """A gather: this node's whole part to member ``j``, which reduces it itself."""
        member, by = run.plan.owners[j], run.session.replies_by
        return j, await deliver(self.context, member, run.requests[j], run.key, by), []

    async def _gather(self, run: _Run) -> None:
        """A gather: this node's part to every other member while it reduces the group's
        parts itself. Once it has, a part still on its way is given until the members'
        wait for parts ends (they would refuse it as late after that; a member that lacks
        it takes it from another): a silent member does not hold the exchange up."""
        others = [j for j in range(len(run.plan.owners)) if j != run.plan.index]
        deliveries = [asyncio.ensure_future(self._part(run, j)) for j in others]
        try:
            await self._part(run, run.plan.index)
            pending = [d for d in deliveries if not d.done()]
            if pending:
                await asyncio.wait(
                    pending, timeout=max(0.0, run.session.parts_by - time.monotonic())
                )
        finally:
            for delivery in deliveries:
                delivery.cancel()
            await asyncio.gather(*deliveries, return_exceptions=True)

    def _assemble(self, run: _Run, results: list[_PartResult]) -> AllReduceResult:
        contributors: list[list[str]] = []
        fallback: list[int] = []
        for j, done, peers in sorted(results, key=lambda r: r[0]):
            if done:
                contributors.append(peers)
            else:
                lo, hi = run.plan.bounds[j]
                run.out[lo:hi] = run.vector[lo:hi]
                fallback.append(j)
                contributors.append([self.context.identity.peer_id])
        sent, received = self.context.traffic(run.key)
        owned = run.session.owned
        return AllReduceResult(
            vector=run.out,
            group=run.plan.group,
            contributors=contributors,
            fallback_parts=fallback,
            repaired_parts=sorted(run.repaired),
            bytes_sent=sent,
            bytes_received=received,
            seconds=time.monotonic() - run.started,
            owners=run.plan.owners,
            reduce_seconds=owned.reduce_seconds if owned is not None else 0.0,
            streamed_share=owned.streamed_share if owned is not None else 0.0,
        )

    def _gathered(self, run: _Run) -> AllReduceResult:
        """A gather's result: this node's own reduction of the group's parts, one part
        that this node owned (whose part reached whom is the other members' business:
        each reduces what it took)."""
        owned = run.session.owned
        assert owned is not None  # every member of a gather owns the whole vector
        sent, received = self.context.traffic(run.key)
        return AllReduceResult(
            vector=run.out,
            group=run.plan.group,
            contributors=[list(owned.reply_contributors)],
            fallback_parts=[],
            bytes_sent=sent,
            bytes_received=received,
            seconds=time.monotonic() - run.started,
            owners=[self.context.identity.peer_id],
            reduce_seconds=owned.reduce_seconds,
        )

    # ---- one owner ------------------------------------------------------------------------

    async def _call_owner(
        self,
        owner: str,
        request: SealedPart,
        at: AllReduceKey,
        j: int,
        by: float,
        dest: torch.Tensor,
    ) -> Lease:
        """Send a part to its owner and read its signed result as it arrives (into
        ``dest`` itself when it is raw float32), until ``by``; retry once with the same
        bytes if the stream is cut and time is left."""
        transport = self.context.transport
        window = (at[0], at[0])

        def receive(reader: asyncio.StreamReader, length: int) -> Awaitable[Lease]:
            def trailer() -> Awaitable[bytes]:
                return read_frame(reader, MAX_TRAILER_BYTES, owner)

            read = StreamRead(reader)
            return self.context.read_message(read, length, owner, "reduced", window, dest, trailer)

        for attempt in (0, 1):
            self.context.tally(at, sent=request.nbytes)
            timeout = max(MIN_CALL_SECONDS, by - time.monotonic())
            try:
                return await transport.call_into(
                    owner, RPC_NAME, request.buffers(), timeout=timeout, receive=receive
                )
            except ProtocolError as exc:
                if exc.reason == "redo":
                    self.results_redone += 1
                    # the owner gave up the blocks it had streamed: its signed result
                    logger.info("round %d fragment %d part %d: owner %s redid its result",
                                *at[:2], j, owner[:16])  # fmt: skip
                    fetch = msgpack.packb([at[0], at[1], at[2]])
                    timeout = max(MIN_CALL_SECONDS, by - time.monotonic())
                    return await transport.call_into(
                        owner, RESULT_RPC, fetch, timeout=timeout, receive=receive
                    )
                retry = (
                    exc.reason == "connection_lost" and by - time.monotonic() >= MIN_CALL_SECONDS
                )
                if attempt or not retry:
                    raise
            # A stream cut before the answer came: the owner keeps the part, and the same
            # signed part again is answered with the same result.
            logger.info("round %d fragment %d part %d: retrying owner %s", *at[:2], j, owner[:16])
        raise AssertionError("unreachable")

    async def _send_part(self, run: _Run, j: int) -> _PartResult:
        """Send part ``j`` to its owner; write the accepted result into ``run.out``."""
        owner, (lo, hi) = run.plan.owners[j], run.plan.bounds[j]
        round_, fragment, _ = run.key
        by = run.session.replies_by
        try:
            lease = await self._call_owner(owner, run.requests[j], run.key, j, by, run.out[lo:hi])
        except ProtocolError as exc:
            return self._owner_failed(run, j, exc)
        reply: Part = lease.data
        if reply.trailer:
            self.results_streamed += 1
        try:
            self.context.tally(run.key, received=reply.nbytes)
            # decoding checks every value (NaN, inf) and the judge compares norms: off the loop
            own = run.vector[lo:hi]
            part, peers = await self.context.compute(
                self._judge_reduced, reply, owner, run.key, j, hi - lo, own, run.weight
            )
            if part.data_ptr() != run.out[lo:hi].data_ptr():
                run.out[lo:hi] = part
            del part
        except ProtocolError as exc:
            logger.warning(
                "round %d fragment %d part %d: refused reduced part from owner %s: %s",
                *(round_, fragment, j, owner[:16], exc),
            )
            self.context.judge.on_owner_refused(owner, round_, fragment, j, exc.reason)
            return j, False, []  # out[lo:hi] is rewritten with this node's own values
        finally:
            del reply
            lease.release()
        return j, True, peers

    def _owner_failed(self, run: _Run, j: int, exc: ProtocolError) -> _PartResult:
        """Owner ``j`` gave no result this node can take: keep local values there."""
        owner = run.plan.owners[j]
        round_, fragment, _ = run.key
        logger.warning(
            "round %d fragment %d part %d: owner %s: %s; keeping local values",
            *(round_, fragment, j, owner[:16], exc),
        )
        if exc.reason in _REFUSED_RESULT:  # the owner's answer itself was refused as it arrived
            self.context.judge.on_owner_refused(owner, round_, fragment, j, exc.reason)
        if exc.detail.startswith("group_mismatch"):
            run.session.note_mismatch()
        return j, False, []

    def _judge_reduced(
        self,
        reply: Part,
        owner: str,
        at: AllReduceKey,
        j: int,
        numel: int,
        own: torch.Tensor,
        weight: int,
    ) -> tuple[torch.Tensor, list[str]]:
        """An owner's signed result, checked against the commitments and this node's own
        contribution; ProtocolError when it is refused."""
        round_, fragment, content = at
        part, norm, fields = self._check_reduced(reply, owner, at, j, numel)
        peers = fields.contributors
        commitments = self.context.commitments
        if commitments is not None:
            reason = commitments.check_result(
                owner, round_, fragment, j, reply.evidence(), peers, fields.digests, content
            )
            if reason:
                raise ProtocolError(reason, "result names inputs nobody committed", owner)
        spread = min(1000.0, max([1.0, *fields.weights]) / max(1.0, float(weight)))
        included = self.context.identity.peer_id in peers
        reason = self.context.judge.check_reduced(
            owner, round_, fragment, j, part, own, max(1.0, spread), included, norm, content=content
        )
        if reason:
            raise ProtocolError(reason, "reduced part refused", owner)
        return part, peers

    def _check_reduced(
        self, env: Part, owner: str, at: AllReduceKey, part: int, numel: int
    ) -> tuple[torch.Tensor, float, ResultFields]:
        round_, fragment, content = at
        if env.header.fragment != fragment or env.header.part != part:
            raise ProtocolError("wrong_part", "reduced result for another part", owner)
        fields = read_result(env.meta, owner, content)
        me = self.context.identity.peer_id
        if me not in fields.contributors and me not in fields.rejected:
            # Signed before this node's part arrived (a late part): the result stands for
            # every member alike, so it is taken, without this node's contribution.
            logger.info(
                "round %d fragment %d part %d: owner %s's result came without this node's part",
                *(round_, fragment, part, owner[:16]),
            )
        enc = codecs.Encoded.from_meta(env.meta, env.body, max_numel=numel)
        self.context.check_codec(enc, content, result=True)
        # decode refuses NaN, inf and out-of-range scales for every codec; the values
        # stay a view of the received bytes until they are assembled into the output
        vector, norm = codecs.decode_with_norm(enc, expected_numel=numel, copy=False)
        return vector, norm, fields


def _check_arguments(content: str, vector: torch.Tensor, out: torch.Tensor | None) -> None:
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
