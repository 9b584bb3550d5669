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
from dataclasses import dataclass

import msgpack
import torch

from protocol.averaging.gather import PartRelay, deliver
from protocol.averaging.owner import RESULT_RPC, RPC_NAME, open_part
from protocol.averaging.parts import AllReduceKey, AllReduceResult, PartPlan, Planner
from protocol.averaging.repair import PartRepair
from protocol.averaging.resultmeta import judge_result
from protocol.averaging.runner import MIN_CALL_SECONDS, ExchangeRunner, check_arguments
from protocol.averaging.sealing import sign_parts
from protocol.errors import ProtocolError
from protocol.p2p.transport import Lease, StreamRead, read_frame
from protocol.wire.partwire import MAX_TRAILER_BYTES, Part, SealedPart

__all__ = ["MemberRun", "Sides", "run_exchange"]

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


@dataclass(frozen=True)
class Sides:
    """What every exchange of one node uses besides its context: the repair of parts
    whose owner failed, the relay of a gather's parts, and how the reducer reduces while
    parts arrive (None: once all are in)."""

    repair: PartRepair
    relay: PartRelay
    planner: Planner | None


async def run_exchange(
    runner: ExchangeRunner,
    sides: Sides,
    group: Sequence[str],
    vector: torch.Tensor,
    weight: int,
    owners: Sequence[str] | None,
    deadline: float | None,
    out: torch.Tensor | None,
    claim: dict | None,
) -> AllReduceResult:
    """Run ``runner``'s exchange as a member (see :meth:`AllReduceService.run
    <protocol.averaging.allreduce.AllReduceService.run>`): join with the plan, open the
    owned part, sign the parts, commit to them, then the member side to its result."""
    key, ctx = runner.key, runner.context
    check_arguments(key[2], vector, out)
    started = time.monotonic()
    done_by = deadline if deadline is not None else started + ctx.settings.timeout
    me = ctx.identity.peer_id
    gather = ctx.settings.gather and key[2] == "update"
    plan = PartPlan.of(me, group, owners, vector.numel(), ctx.settings.block_size, gather)
    vector = ctx.faults.contribution(key[0], key[1], vector)
    # until the commit phase closes, the owner side accepts parts until done_by;
    # ExchangeRunner.schedule then sets the real deadlines
    runner.join(plan, done_by)
    if plan.is_owner:
        runner.owned = open_part(runner, vector, weight, sides.planner, sides.relay)
    runner.ready.set()
    requests, committed = sign_parts(ctx, key, plan, vector, weight, claim)
    await _commit_phase(runner, committed)
    runner.schedule()
    if out is None:
        out = torch.empty_like(vector)
    member = MemberRun(runner, sides.repair, vector, weight, out, requests)
    return await member.run(started)


async def _commit_phase(runner: ExchangeRunner, requests: dict[int, SealedPart]) -> None:
    """Commit to every part's digest and wait for the group's, when commitments are on."""
    round_, fragment, content = runner.key
    assert runner.plan is not None
    ctx = runner.context
    try:
        if ctx.commitments is not None:
            faults = ctx.faults
            digests = {j: request.digest for j, request in requests.items()}
            if faults.commit_delay > 0:
                await asyncio.sleep(faults.commit_delay)
            for waited, made in faults.commits(runner.plan.group, digests):
                await ctx.commitments.commit(round_, fragment, waited, made, content)
    finally:
        runner.closed_at = time.monotonic()
        runner.committed.set()


class MemberRun:
    """One exchange as this node runs it as a member: its parts out, the owners' results
    in (or repaired), assembled into the output.

    Args:
        runner: the exchange (joined, its commit phase over).
        repair: the node's repair of parts whose owner failed.
        vector: this node's contribution.
        weight: its token weight.
        out: where the result is written.
        requests: the signed part for each other owner.
    """

    def __init__(
        self,
        runner: ExchangeRunner,
        repair: PartRepair,
        vector: torch.Tensor,
        weight: int,
        out: torch.Tensor,
        requests: dict[int, SealedPart],
    ) -> None:
        assert runner.plan is not None
        self.runner = runner
        self.context = runner.context
        self.key = runner.key
        self.plan = runner.plan
        self.repair = repair
        self.vector = vector
        self.weight = weight
        self.out = out
        self.requests = requests
        self.repaired: list[int] = []

    async def run(self, started: float) -> AllReduceResult:
        """Every part of the output, then the result (``started``: ``time.monotonic()``
        when the exchange began)."""
        if self.plan.gather:
            await self._gather()
            return self._gathered(started)
        results = await asyncio.gather(*(self._part(j) for j in range(len(self.plan.owners))))
        return self._assemble(results, started)

    async def _part(self, j: int) -> _PartResult:
        """Part ``j`` of the output, written as soon as it is accepted (or repaired)."""
        lo, hi = self.plan.bounds[j]
        if j == self.plan.index:
            owned = self.runner.owned
            assert owned is not None
            self.out[lo:hi] = await owned.reduce()
            return j, True, list(owned.reply_contributors)
        if self.context.faults.silent_in(self.key[0], self.key[1]):
            return j, False, []
        if self.plan.gather:
            return await self._deliver(j)
        result = await self._send_part(j)
        if result[1]:
            self.repair.accepted(self.key, j)
        elif self._repairable(self.plan):
            owner, values = self.plan.owners[j], self.vector[lo:hi]
            fixed = await self.repair.run(
                self.key, j, self.plan.owners, owner, values, self.weight, self.runner.done_by
            )
            if fixed is not None:
                self.repaired.append(j)
                self.out[lo:hi] = fixed[0]
                return j, True, fixed[1]
        return result

    def _repairable(self, plan: PartPlan) -> bool:
        # Repair is all-to-all among the owners other than the failed one; a client
        # cannot be called by others, so it takes no part in it (it keeps its own values
        # for that part and re-syncs at the round's end).
        return self.context.settings.repair and plan.is_owner and len(plan.owners) > 2

    async def _deliver(self, j: int) -> _PartResult:
        """A gather: this node's whole part to member ``j``, which reduces it itself."""
        member, by = self.plan.owners[j], self.runner.replies_by
        return j, await deliver(self.context, member, self.requests[j], self.key, by), []

    async def _gather(self) -> None:
        """A gather: this node's part to every other member while it reduces the group's
        parts itself. Once it has, a part still on its way is given until the members'
        wait for parts ends (they would refuse it as late after that; a member that lacks
        it takes it from another): a silent member does not hold the exchange up."""
        others = [j for j in range(len(self.plan.owners)) if j != self.plan.index]
        deliveries = [asyncio.ensure_future(self._part(j)) for j in others]
        try:
            await self._part(self.plan.index)
            pending = [d for d in deliveries if not d.done()]
            if pending:
                await asyncio.wait(
                    pending, timeout=max(0.0, self.runner.parts_by - time.monotonic())
                )
        finally:
            for delivery in deliveries:
                delivery.cancel()
            await asyncio.gather(*deliveries, return_exceptions=True)

    def _assemble(self, results: list[_PartResult], started: float) -> AllReduceResult:
        contributors: list[list[str]] = []
        fallback: list[int] = []
        for j, done, peers in sorted(results, key=lambda r: r[0]):
            if done:
                contributors.append(peers)
            else:
                lo, hi = self.plan.bounds[j]
                self.out[lo:hi] = self.vector[lo:hi]
                fallback.append(j)
                contributors.append([self.context.identity.peer_id])
        sent, received = self.context.traffic(self.key)
        owned = self.runner.owned
        return AllReduceResult(
            vector=self.out,
            group=self.plan.group,
            contributors=contributors,
            fallback_parts=fallback,
            repaired_parts=sorted(self.repaired),
            bytes_sent=sent,
            bytes_received=received,
            seconds=time.monotonic() - started,
            owners=self.plan.owners,
            reduce_seconds=owned.reduce_seconds if owned is not None else 0.0,
            streamed_share=owned.streamed_share if owned is not None else 0.0,
        )

    def _gathered(self, started: float) -> AllReduceResult:
        """A gather's result: this node's own reduction of the group's parts, one part
        that this node owned (whose part reached whom is the other members' business:
        each reduces what it took)."""
        owned = self.runner.owned
        assert owned is not None  # every member of a gather owns the whole vector
        sent, received = self.context.traffic(self.key)
        return AllReduceResult(
            vector=self.out,
            group=self.plan.group,
            contributors=[list(owned.reply_contributors)],
            fallback_parts=[],
            bytes_sent=sent,
            bytes_received=received,
            seconds=time.monotonic() - started,
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
        ``dest`` itself when it is raw float32), until ``by``; after a ``redo``, fetch the
        signed result; retry once with the same bytes if a stream is cut (the part's, or
        the fetch's) and time is left."""
        transport = self.context.transport
        window = (at[0], at[0])

        def receive(reader: asyncio.StreamReader, length: int) -> Awaitable[Lease]:
            def trailer() -> Awaitable[bytes]:
                return read_frame(reader, MAX_TRAILER_BYTES, owner)

            read = StreamRead(reader)
            return self.context.read_message(read, length, owner, "reduced", window, dest, trailer)

        rpc, payload = RPC_NAME, request.buffers()
        retried = False
        for _ in range(3):  # the part, the signed result after a redo, one retry
            if rpc == RPC_NAME:
                self.context.tally(at, sent=request.nbytes)
            timeout = max(MIN_CALL_SECONDS, by - time.monotonic())
            try:
                return await transport.caller.call_into(
                    owner, rpc, payload, timeout=timeout, receive=receive
                )
            except ProtocolError as exc:
                if exc.reason == "redo" and rpc == RPC_NAME:
                    self.context.results_redone += 1
                    # the owner gave up the blocks it had streamed: its signed result
                    logger.info("round %d fragment %d part %d: owner %s redid its result",
                                *at[:2], j, owner[:16])  # fmt: skip
                    rpc, payload = RESULT_RPC, msgpack.packb([at[0], at[1], at[2]])
                    continue
                retry = (
                    exc.reason == "connection_lost" and by - time.monotonic() >= MIN_CALL_SECONDS
                )
                if retried or not retry:
                    raise
                retried = True
            # A stream cut before the answer came: the owner keeps the part (and, after a
            # redo, its signed result), and the same request again is answered alike.
            logger.info("round %d fragment %d part %d: retrying owner %s (%s)",
                        *at[:2], j, owner[:16], rpc)  # fmt: skip
        raise AssertionError("unreachable")

    async def _send_part(self, j: int) -> _PartResult:
        """Send part ``j`` to its owner; write the accepted result into ``self.out``."""
        owner, (lo, hi) = self.plan.owners[j], self.plan.bounds[j]
        round_, fragment, _ = self.key
        by = self.runner.replies_by
        try:
            lease = await self._call_owner(
                owner, self.requests[j], self.key, j, by, self.out[lo:hi]
            )
        except ProtocolError as exc:
            return self._owner_failed(j, exc)
        reply: Part = lease.data
        if reply.trailer:
            self.context.results_streamed += 1
        try:
            self.context.tally(self.key, received=reply.nbytes)
            # decoding checks every value (NaN, inf) and the judge compares norms: off the loop
            own = self.vector[lo:hi]
            judged = self.context.worker.submit(
                judge_result, self.context, reply, owner, self.key, j, hi - lo, own, self.weight
            )
            part, peers = await asyncio.wrap_future(judged)
            if part.data_ptr() != self.out[lo:hi].data_ptr():
                self.out[lo:hi] = part
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

    def _owner_failed(self, j: int, exc: ProtocolError) -> _PartResult:
        """Owner ``j`` gave no result this node can take: keep local values there."""
        owner = self.plan.owners[j]
        round_, fragment, _ = self.key
        logger.warning(
            "round %d fragment %d part %d: owner %s: %s; keeping local values",
            *(round_, fragment, j, owner[:16], exc),
        )
        if exc.reason in _REFUSED_RESULT:  # the owner's answer itself was refused as it arrived
            self.context.judge.on_owner_refused(owner, round_, fragment, j, exc.reason)
        if exc.detail.startswith("group_mismatch"):
            self.runner.note_mismatch()
        return j, False, []
