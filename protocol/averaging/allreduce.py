"""Butterfly all-reduce of one fragment inside one group, over signed messages.

The fragment's vector is cut into one contiguous part per *owner*: every member of
the group except clients (nodes others cannot dial, see :class:`~protocol.averaging.parts.PartPlan`).
Every member sends its encoded, signed part ``j`` to owner ``j`` in one RPC; the owner
waits until every member's part is in or its deadline passes, reduces what it has
(token-weighted mean unless a robust reducer is plugged in), encodes and signs the
result once, and answers every caller with the same bytes. With
``AllReduceSettings.stream_reduce`` the owner reduces block by block while the parts
arrive instead (:mod:`protocol.averaging.streaming`) and at the end only completes
that reduction, or starts over when the parts it streamed are not the ones kept. With
raw float32 results it then also streams the reduced blocks back while the parts still
arrive (a head without hashes, the body as it is reduced, then a signed trailer that
names every chunk's hash and the contributors: :mod:`protocol.wire.partwire`); a member
applies nothing until the trailer checks, and when the owner started over after
sending blocks, the trailer says ``redo`` and the member fetches the corrected result
(``atoll.result``). Each member assembles the
full vector from the reduced parts; an owner uses the decoded bytes it sent, so every
member ends with bitwise identical values. A client only ever calls out: it sends its
parts and receives the results on the streams it opened.

Nothing outlasts the exchange's deadline (the caller derives it from the round): once
the commit phase is over, owners wait for parts during the first half of the time
left, members wait for owners' answers until three quarters of it, and repair gets
the rest. A member that vanishes, or announces and then sends nothing, costs only its
contribution; a part whose owner vanished or went silent (or answered with something
refused) is repaired among the other owners (:mod:`protocol.averaging.repair`) or falls back to
this node's own value, and :class:`~protocol.averaging.parts.AllReduceResult` says exactly which
peers are in which part.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import msgpack
import torch

from protocol.averaging.parts import (
    CONTENTS,
    AllReduceResult,
    AllReduceSettings,
    Commitments,
    Contribution,
    Exchange,
    FaultInjection,
    Judge,
    PartExchange,
    PartPlan,
    Planner,
    Reducer,
    weighted_mean_plan,
    weighted_mean_reducer,
)
from protocol.averaging.repair import PartRepair
from protocol.averaging.streamback import StreamedResult
from protocol.averaging.streaming import StreamingReduction
from protocol.errors import ProtocolError
from protocol.p2p.transport import (
    BufferPool,
    Lease,
    Read,
    StreamedResponse,
    StreamRead,
    Transport,
    read_frame,
)
from protocol.wire import codec as codecs
from protocol.wire.messages import Header
from protocol.wire.partwire import (
    MAX_TRAILER_BYTES,
    Part,
    SealedPart,
    chunk_hashes,
    read_part,
    seal_part,
)
from verification.identity import Identity

__all__ = ["RESULT_RPC", "RPC_NAME", "AllReduceService"]

logger = logging.getLogger(__name__)

RPC_NAME = "atoll.part"
RESULT_RPC = "atoll.result"
"""A member fetches an owner's signed result after a streamed one said ``redo``."""
_SESSION_ROUNDS_KEPT = 3
_PARTS_SHARE = 0.5  # of the time left after the commit phase: owners take parts
_REPLIES_SHARE = 0.75  # members wait for owners' results; repair gets the rest
_MIN_CALL_SECONDS = 0.5
_NO_VALUES = torch.empty(0)
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
class _Session:
    """This node's side of one ``(round, fragment)``: the plan, and as an owner the
    contributions to its part."""

    created: float
    content: str = "update"
    key: Exchange = (0, 0, "update")
    """``(round, fragment, content)``."""
    plan: PartPlan | None = None
    numel: int = 0
    deadline: float = 0.0
    """Owner side: parts arriving after this (``time.monotonic()``) are late."""
    replies_by: float = 0.0
    """Member side: owners' answers are awaited until this."""
    done_by: float = 0.0
    """The whole exchange, repair included, ends by this."""
    contributions: dict[str, Contribution] = field(default_factory=dict)
    expected: set[str] = field(default_factory=set)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    full: asyncio.Event = field(default_factory=asyncio.Event)
    reduced: asyncio.Event = field(default_factory=asyncio.Event)
    committed: asyncio.Event = field(default_factory=asyncio.Event)
    refused: dict[str, str] = field(default_factory=dict)
    """Parts taken in but left out of the result, with why (commit phase, lateness)."""
    closed_at: float = 0.0
    mismatches: int = 0
    reducing: bool = False
    """Owner side: the result is being computed from the parts in by then."""
    reply: SealedPart | None = None
    """Owner side: the signed result every member of the part is answered with."""
    reply_contributors: list[str] = field(default_factory=list)
    reduce_seconds: float = 0.0
    """Owner side: from the last part in (or the deadline) to the signed result."""
    streaming: StreamingReduction | None = None
    """Owner side: the part reduced block by block as parts arrive."""
    weights: dict[str, float] = field(default_factory=dict)
    """Owner side: members' capped weights, read from their parts' heads."""
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    stream_task: asyncio.Future | None = None
    streamed_share: float = 0.0
    answerable: asyncio.Event = field(default_factory=asyncio.Event)
    """Owner side: a member can be answered: the result is signed, or it is streamed."""
    result_stream: StreamedResult | None = None
    """Owner side: the result sent back while it is reduced (raw float32 only)."""


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
    ) -> None:
        self.wire = PartExchange(transport, identity, settings, reducer, judge or Judge())
        if planner is None and reducer is weighted_mean_reducer:
            planner = weighted_mean_plan
        self.planner = planner if settings.stream_reduce else None
        self.settings = settings
        self.identity = identity
        self.faults = faults or FaultInjection()
        self.commitments = commitments
        self.repair = PartRepair(self.wire)
        self.pool = BufferPool()
        """Buffers large parts and results are received into, reused round after round."""
        self.results_streamed = 0
        """Owners' results this node took as they were reduced (checked by their trailer)."""
        self.results_redone = 0
        """Of those, results whose owner gave its streamed blocks up (fetched again)."""
        self._sessions: dict[Exchange, _Session] = {}
        # Rounds in the replay window times fragments and contents, plus the kept history.
        rounds = settings.round_window + _SESSION_ROUNDS_KEPT + 2
        self._max_sessions = settings.fragments * len(CONTENTS) * rounds

    # ---- counters, shared with repair ------------------------------------------------

    @property
    def current_round(self) -> int:
        """The newest round this node works on; parts far outside it are refused."""
        return self.wire.current_round

    @current_round.setter
    def current_round(self, value: int) -> None:
        self.wire.current_round = value

    @property
    def transport(self) -> Transport:
        return self.wire.transport

    @property
    def bytes_sent(self) -> int:
        return self.wire.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self.wire.bytes_received

    @property
    def rejected(self) -> dict[str, int]:
        """Refusals of peers' messages so far, by reason."""
        return self.wire.rejected

    def register(self) -> None:
        """Start serving part requests (and repairs)."""
        self.wire.transport.add_handler(
            RPC_NAME,
            self._handle,  # type: ignore[arg-type]  # gets the Part _read_part made
            max_request_bytes=self.settings.max_message_bytes,
            timeout=self.settings.timeout * 2 + 5.0,
            receive=self._read_part,
        )
        self.wire.transport.add_handler(
            RESULT_RPC,
            self._handle_result,
            max_request_bytes=1024,
            timeout=self.settings.timeout + 5,
        )
        self.repair.register()

    def unregister(self) -> None:
        """Stop serving (the handlers :meth:`register` added)."""
        for name in (RPC_NAME, RESULT_RPC):
            self.wire.transport.remove_handler(name)
        self.repair.unregister()

    # ---- owner side -------------------------------------------------------------------

    def _session(self, round_: int, fragment: int, content: str) -> _Session:
        key = (round_, fragment, content)
        if key not in self._sessions:
            self._sessions[key] = _Session(created=time.monotonic(), content=content, key=key)
        horizon = self.current_round - _SESSION_ROUNDS_KEPT
        for old in [k for k in self._sessions if k[0] < horizon]:
            del self._sessions[old]
        self.wire.forget_before(horizon)
        return self._sessions[key]

    async def _read_part(self, read: Read, length: int, peer: str) -> Lease:
        """A member's part as it arrives on this owner's stream (:meth:`_read_message`);
        a refusal is counted against the member."""
        self.wire.tally(None, received=length)
        lo = max(0, self.current_round - 1)
        window = (lo, self.current_round + self.settings.round_window)
        try:
            return await self._read_message(read, length, peer, "part", window)
        except ProtocolError as exc:
            raise self.wire.reject(exc.reason, exc.detail, peer) from None

    async def _read_message(
        self,
        read: Read,
        length: int,
        sender: str,
        kind: str,
        round_window: tuple[int, int],
        dest: torch.Tensor | None = None,
        trailer: Callable[[], Awaitable[bytes]] | None = None,
    ) -> Lease:
        """A part or result as it arrives: refused on its head (signature, run, kind,
        round window) before any body byte is read, each chunk checked against its hash
        as it comes (for a result streamed back, against its trailer, read by
        ``trailer``). Raw float32 of ``dest``'s size goes straight into ``dest``; any other
        body into a pooled buffer, which goes back to the pool with the returned lease
        (whose data is the :class:`Part`)."""
        held: Lease | None = None
        followed: _Session | None = None

        def into(header: Header, meta: dict, size: int) -> memoryview:
            nonlocal held, followed
            if dest is not None and meta.get("c") == "none" and size == dest.numel() * 4:
                return memoryview(dest.numpy()).cast("B")
            held = self.pool.lease(size)
            if kind == "part":
                followed = self._follow(header, meta, sender, held.data)
            return held.data  # type: ignore[no-any-return]

        def progress(nbytes: int) -> None:
            if followed is not None and followed.streaming is not None:
                followed.streaming.arrived(sender, nbytes)
                followed.wake.set()

        try:
            part = await read_part(
                read,
                length,
                into,
                max_bytes=self.settings.max_message_bytes,
                expected_sender=sender,
                run_id=self.settings.run_id,
                kinds=(kind,),
                round_window=round_window,
                progress=progress,
                trailer=trailer,
            )
        except BaseException:
            if followed is not None and followed.streaming is not None:
                # before its buffer can be handed to anyone else
                followed.streaming.detach(sender)
            if held is not None:
                held.release()
            raise
        # a pooled body goes back to the pool with the part
        return held.handed_to(part) if held is not None else Lease(part)

    def _follow(self, h: Header, meta: dict, peer: str, body: memoryview) -> _Session | None:
        """The session whose streamed reduction follows this part's body as it arrives
        (its head is checked, its body not yet), or None when none does."""
        session = self._sessions.get((h.round, h.fragment, meta.get("content")))
        if session is None or session.streaming is None or session.plan is None:
            return None
        weight = meta.get("weight")
        if (
            h.part != session.plan.index
            or peer not in session.expected
            or not isinstance(weight, int)
            or isinstance(weight, bool)
            or weight < 0
        ):
            return None
        try:
            # a view of its own: releasing the lease's view never waits for this one, and
            # the pool reuses the buffer only once this one is dropped (close())
            enc = codecs.Encoded.from_meta(meta, body[:], max_numel=session.numel)
        except ProtocolError:
            return None  # refused in full once it is in
        if not session.streaming.attach(peer, enc):
            return None
        session.weights[peer] = float(min(weight, self.settings.max_tokens))
        session.wake.set()
        return session

    async def _stream(self, session: _Session, at: Exchange) -> None:
        """Reduce the owner's part block by block while parts arrive, until the reduction
        proper starts (or the exchange is over)."""
        streaming, plan = session.streaming, session.plan
        assert streaming is not None and plan is not None and self.planner is not None
        me = self.identity.peer_id
        members = [p for p in plan.group if p in session.expected]
        try:
            while not session.reducing and not streaming.broken:
                left = session.done_by - time.monotonic()
                if left <= 0:
                    return
                try:
                    await asyncio.wait_for(session.wake.wait(), left)
                except asyncio.TimeoutError:
                    return
                session.wake.clear()
                if session.reducing:
                    return
                if streaming.plan is None:
                    if not {p for p in members if p != me} <= streaming.attached():
                        continue
                    weights = {**session.weights, me: session.contributions[me].weight}
                    stream_plan = self.planner(at[0], [(p, weights[p]) for p in members], at[2])
                    if stream_plan is None:
                        return
                    streaming.start(stream_plan)
                    self._start_streamed_result(session, at)
                hi = streaming.ready()
                if hi > streaming.upto:
                    await self.wire.compute(streaming.reduce_to, hi)
                    if session.result_stream is not None:
                        session.result_stream.advance()
        except Exception:  # the reduction proper still runs from scratch
            logger.exception("round %d fragment %d: streamed reduction failed", *at[:2])
            streaming.broken = True

    async def _handle(self, peer: str, env: Part) -> list[bytes | memoryview]:
        h = env.header
        session = self._sessions.get((h.round, h.fragment, env.meta.get("content")))
        try:
            return await self._take(peer, env)
        finally:
            # a part that is not in the contributions will not be read again
            if (
                session is not None
                and session.streaming is not None
                and peer not in session.contributions
            ):
                session.streaming.detach(peer)

    async def _take(self, peer: str, env: Part) -> list[bytes | memoryview]:
        wire = self.wire
        if self.faults.silent:
            await asyncio.sleep(self.settings.timeout * 2)  # never answers in time
            raise ProtocolError("timeout", "silent", peer)
        h = env.header
        at = (h.round, h.fragment)
        blocked = wire.judge.blocks(peer, h.round)
        if blocked:
            raise wire.reject(blocked, "refused by this node's trust policy", peer, *at)
        if h.fragment >= self.settings.fragments:
            raise wire.reject("wrong_part", f"no fragment {h.fragment}", peer, *at)
        content = wire.content_of(env, peer)
        key = (h.round, h.fragment, content)
        if key not in self._sessions and len(self._sessions) >= self._max_sessions:
            raise wire.reject("busy", "too many rounds in flight", peer, *at)
        session = self._session(*key)
        wire.tally(key, received=env.nbytes, totals=False)
        try:
            await asyncio.wait_for(session.ready.wait(), self.settings.timeout)
        except asyncio.TimeoutError:
            raise wire.reject(
                "not_in_round", "this node did not join that round", peer, *at
            ) from None
        plan = session.plan
        assert plan is not None  # set before ready
        group, owners = env.meta.get("group"), env.meta.get("owners", env.meta.get("group"))
        if group != plan.group or owners != plan.owners:
            raise wire.reject(
                "group_mismatch", "sender's group differs from the owner's", peer, *at
            )
        if peer not in plan.group or h.part != plan.index or not plan.is_owner:
            raise wire.reject("wrong_part", f"part {h.part} is not owned here", peer, *at)
        known = session.contributions.get(peer)
        if known is not None and known.digest == env.digest:
            # The same signed part again: the sender lost the answer and retried.
            return await self._reply(session)
        if known is not None:
            raise wire.reject(
                "duplicate", "a second part for the same round and fragment", peer, *at
            )
        contribution = wire.decode(env, session.numel, peer)
        if self.commitments is not None:
            try:
                await asyncio.wait_for(session.committed.wait(), self.settings.timeout)
            except asyncio.TimeoutError:
                raise wire.reject("not_in_round", "commit phase never closed", peer, *at) from None
            refusal = await self.commitments.check(
                peer, h.round, h.fragment, h.part, env.digest, session.closed_at, content
            )
            if refusal:
                wire.reject(refusal, "part does not match a timely commitment", peer, *at)
                return await self._answer_without(session, peer, refusal)
        if time.monotonic() > session.deadline or session.reducing:
            wire.reject("late", "part arrived after the owner's deadline", peer, *at)
            return await self._answer_without(session, peer, "late")
        session.contributions[peer] = contribution
        if session.expected <= set(session.contributions) | set(session.refused):
            session.full.set()
        return await self._reply(session)

    async def _answer_without(
        self, session: _Session, peer: str, reason: str
    ) -> list[bytes | memoryview]:
        """Refuse ``peer``'s part but answer it with the result all the same.

        Every member of a part must end with the one result its owner signed, or honest
        members' values part ways; the result names the refused part and why (a part
        that came after the result was signed is simply not in it)."""
        if not session.reducing:
            session.refused[peer] = reason
            if session.expected <= set(session.contributions) | set(session.refused):
                session.full.set()
        return await self._reply(session)

    async def _reply(self, session: _Session) -> list[bytes | memoryview] | StreamedResponse:
        """This owner's signed result, once there is one, or the result streamed back as
        it is reduced, once that starts (no longer than its exchange lasts)."""
        left = max(_MIN_CALL_SECONDS, session.done_by - time.monotonic())
        await asyncio.wait_for(session.answerable.wait(), left)
        stream = session.result_stream
        if not session.reduced.is_set() and stream is not None:
            return stream.response(functools.partial(_progress, session), session.done_by,
                                   self.faults.trailer)  # fmt: skip
        await asyncio.wait_for(session.reduced.wait(), left)
        if session.reply is None:  # dropped once the exchange was over
            raise ProtocolError("late", "the exchange of that round is over")
        return session.reply.buffers()

    def _streams_results(self, session: _Session) -> bool:
        return (
            self.settings.codec_for(session.content) == "none"
            and self.faults.stream_results
            and session.plan is not None
        )

    def _start_streamed_result(self, session: _Session, at: Exchange) -> None:
        """Sign the head of the result sent back while it is reduced, from now on."""
        if not self._streams_results(session):
            return
        assert session.plan is not None
        round_, fragment, content = at
        me = self.identity.peer_id
        header = Header("reduced", self.settings.run_id, round_, fragment, session.plan.index, me)
        session.result_stream = StreamedResult(
            self.identity, header, content, session.numel, self.settings.block_size
        )
        session.answerable.set()

    async def _handle_result(self, peer: str, data: bytes) -> list[bytes | memoryview]:
        """A member's request for this owner's signed result (after a ``redo``)."""
        try:
            round_, fragment, content = msgpack.unpackb(data)
            key = (int(round_), int(fragment), str(content))
        except (ValueError, TypeError, msgpack.ExtraData) as exc:
            raise self.wire.reject("malformed", f"result request: {exc}", peer) from None
        session = self._sessions.get(key)
        if session is None or session.plan is None or not session.plan.is_owner:
            raise ProtocolError("not_in_round", "no result of that exchange here", peer)
        if peer not in session.plan.group:
            raise ProtocolError("wrong_part", "not a member of that part's group", peer)
        left = max(_MIN_CALL_SECONDS, session.done_by - time.monotonic())
        await asyncio.wait_for(session.reduced.wait(), left)
        if session.reply is None:
            raise ProtocolError("late", "the exchange of that round is over")
        self.wire.tally(key, sent=session.reply.nbytes)
        return session.reply.buffers()

    async def _reduce_own_part(self, session: _Session, h: Header) -> torch.Tensor:
        """Wait for the group's parts (or the deadline), reduce, sign, publish."""
        try:
            await asyncio.wait_for(
                session.full.wait(), max(0.0, session.deadline - time.monotonic())
            )
        except asyncio.TimeoutError:
            missing = sorted(set(session.expected) - set(session.contributions))
            logger.warning(
                "round %d fragment %d part %d: deadline passed without %s",
                *(h.round, h.fragment, h.part, ", ".join(p[:16] for p in missing)),
            )
            for peer in missing:
                committed = self.commitments is not None and self.commitments.committed(
                    peer, h.round, h.fragment, session.content
                )
                self.wire.judge.on_missing(peer, h.round, h.fragment, h.part, committed)
        parts_in = time.monotonic()
        session.reducing = True  # parts arriving from now on are late
        prefix = None
        if session.stream_task is not None:
            session.wake.set()
            await session.stream_task  # never raises; no block is being reduced after this
            prefix = session.streaming.prefix() if session.streaming is not None else None
        # in group order, as the streamed reduction took them
        order = {p: i for i, p in enumerate(session.plan.group if session.plan else ())}
        contributions = sorted(
            session.contributions.values(), key=lambda c: order.get(c.peer, len(order))
        )
        # reducing, encoding and hashing release the GIL: off the loop, which keeps
        # reading the other parts' streams meanwhile
        reducer = functools.partial(
            self.wire.reducer,
            content=session.content,
            **({"prefix": prefix} if prefix is not None else {}),
        )
        reduction = await self.wire.compute(reducer, h.round, h.fragment, h.part, contributions)
        if prefix is not None and reduction.vector is prefix.out and session.numel:
            session.streamed_share = prefix.upto / session.numel
        enc = await self.wire.compute(
            self.wire.encode, self.faults.reduced(reduction.vector), session.content
        )
        used = set(reduction.used)
        kept = [c for c in contributions if c.peer in used]
        meta = {
            "content": session.content,
            "contributors": [c.peer for c in kept],
            "weights": [c.weight for c in kept],
            "digests": [c.digest for c in kept],
            "rejected": {
                **session.refused,
                **{p: r for p, r in reduction.rejected.items() if isinstance(r, str)},
            },
        }
        if self.commitments is not None:
            # what each contributor committed to, as this owner holds it (see evidence())
            meta["commits"] = [
                self.commitments.evidence(c.peer, h.round, h.fragment, session.content)
                for c in kept
            ]
        meta = self.faults.reduced_meta(meta)
        header = Header("reduced", *_fields(h))
        hashes = None
        stream = session.result_stream
        if stream is not None:
            # one pass of hashing for the signed result and the streamed one's trailer
            hashes = await self.wire.compute(chunk_hashes, enc.payload)
            signed = {k: v for k, v in meta.items() if k != "content"}
            used = prefix is not None and reduction.vector is prefix.out
            stream.finish(signed, hashes, enc.payload, used)
        sealed = await self.wire.compute(
            functools.partial(seal_part, hashes=hashes),
            self.identity,
            header,
            {**meta, **enc.meta()},
            enc.payload,
        )
        session.reply = self.faults.reply(sealed)
        session.reply_contributors = list(meta["contributors"])
        session.reduce_seconds = time.monotonic() - parts_in
        # every other contributor is waiting for this one reply
        key = (h.round, h.fragment, session.content)
        # those answered with the streamed result already get it, head and trailer
        streamed = stream.replies if stream is not None else 0
        sent = session.reply.nbytes * max(0, len(contributions) - 1 - streamed)
        if stream is not None:
            sent += streamed * stream.reply_bytes
        self.wire.tally(key, sent=sent)
        session.reduced.set()
        session.answerable.set()
        # the parts are in the result: drop their views so their receive buffers go back
        # to the pool (a retry is recognised by its digest alone)
        session.contributions = {
            p: dataclasses.replace(c, vector=_NO_VALUES) for p, c in session.contributions.items()
        }
        if session.streaming is not None:
            session.streaming.close()
        # the result is kept for members that retry until the exchange is over, no longer
        asyncio.get_running_loop().call_later(
            max(0.0, session.done_by - time.monotonic()), _drop_reply, session
        )
        return codecs.decode(enc, expected_numel=session.numel, copy=False)

    # ---- member side ------------------------------------------------------------------

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
        """
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
        started = time.monotonic()
        done_by = deadline if deadline is not None else started + self.settings.timeout
        me = self.identity.peer_id
        plan = PartPlan.of(me, group, owners, vector.numel(), self.settings.block_size)
        vector = self.faults.contribution(round_, fragment, vector)
        at = (round_, fragment, content)
        session = self._open(at, plan, vector, weight, done_by)
        requests = {
            j: self._request(at, plan, j, vector[lo:hi], weight)
            for j, (lo, hi) in enumerate(plan.bounds)
            if j != plan.index
        }
        await self._commit_phase(session, at, plan.group, requests)
        self._schedule(session)

        if out is None:
            out = torch.empty_like(vector)

        async def part(j: int) -> _PartResult:
            # each part is written into ``out`` as soon as it is accepted
            lo, hi = plan.bounds[j]
            if j == plan.index:
                header = Header("part", self.settings.run_id, round_, fragment, j, me)
                out[lo:hi] = await self._reduce_own_part(session, header)
                return j, True, list(session.reply_contributors)
            if self.faults.silent:
                return j, False, []
            result = await self._send_part(
                at, plan, j, weight, requests[j], session.replies_by, vector, out
            )
            if result[1]:
                self.repair.accepted(at, j)
            elif self._repairable(plan):
                owner = plan.owners[j]
                fixed = await self.repair.run(
                    at, j, plan.owners, owner, vector[lo:hi], weight, session.done_by
                )
                if fixed is not None:
                    repaired.append(j)
                    out[lo:hi] = fixed[0]
                    return j, True, fixed[1]
            return result

        repaired: list[int] = []
        results = await asyncio.gather(*(part(j) for j in range(len(plan.owners))))
        return self._assemble(plan, vector, out, results, at, repaired, started)

    def _repairable(self, plan: PartPlan) -> bool:
        # Repair is all-to-all among the owners other than the failed one; a client
        # cannot be called by others, so it takes no part in it (it keeps its own values
        # for that part and re-syncs at the round's end).
        return self.settings.repair and plan.is_owner and len(plan.owners) > 2

    def _open(
        self,
        at: Exchange,
        plan: PartPlan,
        vector: torch.Tensor,
        weight: int,
        done_by: float,
    ) -> _Session:
        """This node's session for the exchange, ready for the owners' parts.

        Until the commit phase closes, the owner side accepts parts until ``done_by``;
        :meth:`_schedule` then sets the real deadlines."""
        me = self.identity.peer_id
        round_, fragment, content = at
        session = self._session(*at)
        for (r, f, c), older in self._sessions.items():
            if (f, c) == (fragment, content) and r < round_:
                _drop_reply(older)  # this node moved on: nobody gets that result any more
        session.plan = plan
        session.deadline = session.replies_by = session.done_by = done_by
        if plan.is_owner:
            start, end = plan.bounds[plan.index]
            session.numel = end - start
            own = seal_part(
                self.identity,
                Header("part", self.settings.run_id, round_, fragment, plan.index, me),
                {"content": content},
                b"",
            )
            session.contributions[me] = Contribution(
                peer=me,
                vector=vector[start:end],  # read only; the caller's vector stays as it is
                weight=float(min(weight, self.settings.max_tokens)),
                digest=own.digest,
                tokens=int(weight),
            )
        # Members this node's policy refuses will not be waited for.
        session.expected = {
            p for p in plan.group if p == me or not self.wire.judge.refusal(p, round_)
        }
        if session.expected <= set(session.contributions):
            session.full.set()
        elif plan.is_owner and self.planner is not None and session.numel:
            session.streaming = StreamingReduction(session.numel, (me, vector[start:end]))
            session.stream_task = asyncio.ensure_future(self._stream(session, at))
        session.ready.set()
        return session

    @staticmethod
    def _schedule(session: _Session) -> None:
        """Split the time left after the commit phase: parts, answers, repair."""
        now = time.monotonic()
        left = max(0.0, session.done_by - now)
        session.deadline = now + _PARTS_SHARE * left
        session.replies_by = now + _REPLIES_SHARE * left

    def _assemble(
        self,
        plan: PartPlan,
        vector: torch.Tensor,
        out: torch.Tensor,
        results: list[_PartResult],
        at: Exchange,
        repaired: list[int],
        started: float,
    ) -> AllReduceResult:
        contributors: list[list[str]] = []
        fallback: list[int] = []
        for j, done, peers in sorted(results, key=lambda r: r[0]):
            if done:
                contributors.append(peers)
            else:
                lo, hi = plan.bounds[j]
                out[lo:hi] = vector[lo:hi]
                fallback.append(j)
                contributors.append([self.identity.peer_id])
        sent, received = self.wire.traffic(at)
        return AllReduceResult(
            vector=out,
            group=plan.group,
            contributors=contributors,
            fallback_parts=fallback,
            repaired_parts=sorted(repaired),
            bytes_sent=sent,
            bytes_received=received,
            seconds=time.monotonic() - started,
            owners=plan.owners,
            reduce_seconds=self._sessions[at].reduce_seconds if at in self._sessions else 0.0,
            streamed_share=self._sessions[at].streamed_share if at in self._sessions else 0.0,
        )

    def _request(
        self, at: Exchange, plan: PartPlan, j: int, values: torch.Tensor, weight: int
    ) -> SealedPart:
        """The signed part message for owner ``j`` (built before anything is sent; its
        body is a view of ``values``, not a copy)."""
        round_, fragment, content = at
        enc = self.wire.encode(values, content)
        header = Header("part", self.settings.run_id, round_, fragment, j, self.identity.peer_id)
        meta = {
            "content": content,
            "group": plan.group,
            "owners": plan.owners,
            "weight": int(weight),
        }
        return self.faults.request(self.identity, header, meta, enc)

    async def _commit_phase(
        self,
        session: _Session,
        at: Exchange,
        group: list[str],
        requests: dict[int, SealedPart],
    ) -> None:
        """Commit to every part's digest and wait for the group's, when commitments are on."""
        round_, fragment, content = at
        try:
            if self.commitments is not None:
                digests = {j: request.digest for j, request in requests.items()}
                await self.faults.commit(
                    self.commitments, round_, fragment, group, digests, content
                )
        finally:
            session.closed_at = time.monotonic()
            session.committed.set()

    def _note_mismatch(self, at: Exchange, plan: PartPlan) -> None:
        """An owner said this node's group is not its own. When every other owner says
        so, no one shares this node's view of the round and no part will come for the
        part it owns: stop waiting for them now rather than at the deadline."""
        session = self._sessions.get(at)
        if session is None:
            return
        session.mismatches += 1
        if session.mismatches >= len(plan.owners) - (1 if plan.is_owner else 0):
            session.full.set()

    async def _call_owner(
        self,
        owner: str,
        request: SealedPart,
        at: Exchange,
        j: int,
        by: float,
        dest: torch.Tensor,
    ) -> Lease:
        """Send a part to its owner and read its signed result as it arrives (into
        ``dest`` itself when it is raw float32), until ``by``; retry once with the same
        bytes if the stream is cut and time is left."""
        transport = self.wire.transport
        window = (at[0], at[0])

        def receive(reader: asyncio.StreamReader, length: int) -> Awaitable[Lease]:
            def trailer() -> Awaitable[bytes]:
                return read_frame(reader, MAX_TRAILER_BYTES, owner)

            read = StreamRead(reader)
            return self._read_message(read, length, owner, "reduced", window, dest, trailer)

        for attempt in (0, 1):
            self.wire.tally(at, sent=request.nbytes)
            timeout = max(_MIN_CALL_SECONDS, by - time.monotonic())
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
                    timeout = max(_MIN_CALL_SECONDS, by - time.monotonic())
                    return await transport.call_into(
                        owner, RESULT_RPC, fetch, timeout=timeout, receive=receive
                    )
                retry = (
                    exc.reason == "connection_lost" and by - time.monotonic() >= _MIN_CALL_SECONDS
                )
                if attempt or not retry:
                    raise
            # A stream cut before the answer came: the owner keeps the part, and the same
            # signed part again is answered with the same result.
            logger.info("round %d fragment %d part %d: retrying owner %s", *at[:2], j, owner[:16])
        raise AssertionError("unreachable")

    async def _send_part(
        self,
        at: Exchange,
        plan: PartPlan,
        j: int,
        weight: int,
        request: SealedPart,
        by: float,
        vector: torch.Tensor,
        out: torch.Tensor,
    ) -> _PartResult:
        """Send part ``j`` to its owner; write the accepted result into ``out``."""
        owner, (lo, hi) = plan.owners[j], plan.bounds[j]
        round_, fragment, _ = at
        try:
            lease = await self._call_owner(owner, request, at, j, by, out[lo:hi])
        except ProtocolError as exc:
            refused = exc.reason in _REFUSED_RESULT
            logger.warning(
                "round %d fragment %d part %d: owner %s: %s; keeping local values",
                *(round_, fragment, j, owner[:16], exc),
            )
            if refused:  # the owner's answer itself was refused as it arrived
                self.wire.judge.on_owner_refused(owner, round_, fragment, j, exc.reason)
            if exc.detail.startswith("group_mismatch"):
                self._note_mismatch(at, plan)
            return j, False, []
        reply: Part = lease.data
        if reply.trailer:
            self.results_streamed += 1
        try:
            self.wire.tally(at, received=reply.nbytes)
            # decoding checks every value (NaN, inf) and the judge compares norms: off the loop
            part, peers = await self.wire.compute(
                self._judge_reduced, reply, owner, at, j, hi - lo, vector[lo:hi], weight
            )
            if part.data_ptr() != out[lo:hi].data_ptr():
                out[lo:hi] = part
            del part
        except ProtocolError as exc:
            logger.warning(
                "round %d fragment %d part %d: refused reduced part from owner %s: %s",
                *(round_, fragment, j, owner[:16], exc),
            )
            self.wire.judge.on_owner_refused(owner, round_, fragment, j, exc.reason)
            return j, False, []  # out[lo:hi] is rewritten with this node's own values
        finally:
            del reply
            lease.release()
        return j, True, peers

    def _judge_reduced(
        self,
        reply: Part,
        owner: str,
        at: Exchange,
        j: int,
        numel: int,
        own: torch.Tensor,
        weight: int,
    ) -> tuple[torch.Tensor, list[str]]:
        """An owner's signed result, checked against the commitments and this node's own
        contribution; ProtocolError when it is refused."""
        round_, fragment, content = at
        part, norm, peers, weights, digests = self._check_reduced(reply, owner, at, j, numel)
        if self.commitments is not None:
            reason = self.commitments.check_result(
                owner, round_, fragment, j, reply.evidence(), peers, digests, content
            )
            if reason:
                raise ProtocolError(reason, "result names inputs nobody committed", owner)
        spread = min(1000.0, max([1.0, *weights]) / max(1.0, float(weight)))
        included = self.identity.peer_id in peers
        reason = self.wire.judge.check_reduced(
            owner, round_, fragment, j, part, own, max(1.0, spread), included, norm, content=content
        )
        if reason:
            raise ProtocolError(reason, "reduced part refused", owner)
        return part, peers

    def _check_reduced(
        self, env: Part, owner: str, at: Exchange, part: int, numel: int
    ) -> tuple[torch.Tensor, float, list[str], list[float], list[bytes]]:
        round_, fragment, content = at
        if env.header.fragment != fragment or env.header.part != part:
            raise ProtocolError("wrong_part", "reduced result for another part", owner)
        if env.meta.get("content") != content:
            raise ProtocolError("wrong_part", f"a result of {env.meta.get('content')!r}", owner)
        peers = env.meta.get("contributors")
        if not isinstance(peers, list) or not all(isinstance(p, str) for p in peers):
            raise ProtocolError("malformed", "contributors must be a list of PeerIDs", owner)
        rejected = env.meta.get("rejected", {})
        me = self.identity.peer_id
        if me not in peers and not (isinstance(rejected, dict) and me in rejected):
            # Signed before this node's part arrived (a late part): the result stands for
            # every member alike, so it is taken, without this node's contribution.
            logger.info(
                "round %d fragment %d part %d: owner %s's result came without this node's part",
                round_,
                fragment,
                part,
                owner[:16],
            )
        weights = env.meta.get("weights", [])
        if not isinstance(weights, list) or not all(
            isinstance(w, (int, float)) and not isinstance(w, bool) and w >= 0 for w in weights
        ):
            raise ProtocolError("malformed", "weights must be non-negative numbers", owner)
        digests = env.meta.get("digests", [])
        if not (
            isinstance(digests, list)
            and len(digests) == len(peers)
            and all(isinstance(d, bytes) for d in digests)
        ):
            raise ProtocolError("malformed", "digests must name one input per contributor", owner)
        enc = codecs.Encoded.from_meta(env.meta, env.body, max_numel=numel)
        # decode refuses NaN, inf and out-of-range scales for every codec; the values
        # stay a view of the received bytes until they are assembled into the output
        vector, norm = codecs.decode_with_norm(enc, expected_numel=numel, copy=False)
        return vector, norm, peers, [float(w) for w in weights], digests


def _drop_reply(session: _Session) -> None:
    session.reply = None
    session.streaming = None  # its output was the reply's body
    if session.result_stream is not None:
        session.result_stream.drop()


def _progress(session: _Session) -> tuple[torch.Tensor | None, int]:
    """The owner's streamed reduction so far (see :data:`~protocol.averaging.streamback.Progress`)."""
    streaming = session.streaming
    if streaming is None or streaming.broken or streaming.out is None:
        return None, 0
    return streaming.out, streaming.upto


def _fields(h: Header) -> tuple[str, int, int, int, str]:
    return h.run_id, h.round, h.fragment, h.part, h.sender
