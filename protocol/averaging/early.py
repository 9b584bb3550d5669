"""An owner's reduction started early: block by block while the members' parts arrive.

With ``AllReduceSettings.stream_reduce`` and a reducer that has a
:data:`~protocol.averaging.parts.Planner`, the owner follows each member's body as its
checked chunks come in (:meth:`EarlyReduction.follow`), asks the planner how to reduce
once every expected member's body is being received, and reduces each block every
member has in (:class:`~protocol.averaging.streaming.StreamingReduction`, in the
worker thread). With a raw float32 result it also signs the head of the result sent
back as it is reduced (:mod:`protocol.averaging.streamback`), so members can be
answered before the last part is in. When the reduction proper starts
(:meth:`~protocol.averaging.owner.PartOwner.reduce`) it completes what was reduced
here, or starts over.
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from protocol.averaging.context import AllReduceContext, part_weight
from protocol.averaging.parts import Planner
from protocol.averaging.session import OwnedPart, Session, SessionTable
from protocol.averaging.streamback import StreamedResult
from protocol.averaging.streaming import StreamingReduction
from protocol.errors import ProtocolError
from protocol.wire import codec as codecs
from protocol.wire.messages import Header

__all__ = ["EarlyReduction"]

logger = logging.getLogger(__name__)


class EarlyReduction:
    """Reduces this node's owned parts while the members' parts arrive.

    Args:
        context: what the node's all-reduce shares.
        sessions: the node's sessions.
        planner: how the reducer reduces block by block.
    """

    def __init__(self, context: AllReduceContext, sessions: SessionTable, planner: Planner) -> None:
        self.context = context
        self.sessions = sessions
        self.planner = planner

    def start(self, session: Session, part: OwnedPart, own: torch.Tensor) -> None:
        """Follow ``part``'s parts from now on (``own``: this node's values for it)."""
        me = self.context.identity.peer_id
        part.streaming = StreamingReduction(part.numel, (me, own))
        part.stream_task = asyncio.ensure_future(self._run(session, part))

    def follow(self, h: Header, meta: dict, peer: str, body: memoryview) -> OwnedPart | None:
        """The owned part whose streamed reduction follows this part's body as it
        arrives (its head is checked, its body not yet), or None when none does."""
        session = self.sessions.get((h.round, h.fragment, meta.get("content")))
        part = session.owned if session is not None else None
        if part is None or part.streaming is None or session is None or session.plan is None:
            return None
        weight = part_weight(meta)
        if h.part != session.plan.index or peer not in part.expected or weight is None:
            return None
        try:
            # a view of its own: releasing the lease's view never waits for this one, and
            # the pool reuses the buffer only once this one is dropped (close())
            enc = codecs.Encoded.from_meta(meta, body[:], max_numel=part.numel)
        except ProtocolError:
            return None  # refused in full once it is in
        if not part.streaming.attach(peer, enc):
            return None
        part.weights[peer] = float(min(weight, self.context.settings.max_tokens))
        part.wake.set()
        return part

    async def _run(self, session: Session, part: OwnedPart) -> None:
        """Reduce the owner's part block by block while parts arrive, until the reduction
        proper starts (or the exchange is over)."""
        streaming = part.streaming
        assert streaming is not None
        try:
            while not part.reducing and not streaming.broken:
                if not await _woken(session, part):
                    return
                if streaming.plan is None:
                    if not self._all_attached(session, part):
                        continue
                    if not self._start_plan(session, part):
                        return
                hi = streaming.ready()
                if hi > streaming.upto:
                    await self.context.compute(streaming.reduce_to, hi)
                    if part.result_stream is not None:
                        part.result_stream.advance()
        except Exception:  # the reduction proper still runs from scratch
            logger.exception("round %d fragment %d: streamed reduction failed", *session.key[:2])
            streaming.broken = True

    def _all_attached(self, session: Session, part: OwnedPart) -> bool:
        assert session.plan is not None and part.streaming is not None
        me = self.context.identity.peer_id
        others = {p for p in session.plan.group if p in part.expected and p != me}
        return others <= part.streaming.attached()

    def _start_plan(self, session: Session, part: OwnedPart) -> bool:
        """Ask the planner how to reduce while parts arrive; False when it will not."""
        assert session.plan is not None and part.streaming is not None
        me = self.context.identity.peer_id
        members = [p for p in session.plan.group if p in part.expected]
        weights = {**part.weights, me: part.contributions[me].weight}
        round_, _, content = session.key
        stream_plan = self.planner(round_, [(p, weights[p]) for p in members], content)
        if stream_plan is None:
            return False
        part.streaming.start(stream_plan)
        self._start_streamed_result(session, part)
        return True

    def _start_streamed_result(self, session: Session, part: OwnedPart) -> None:
        """Sign the head of the result sent back while it is reduced, from now on."""
        ctx = self.context
        streams = ctx.settings.codec_for(session.content) == "none" and ctx.faults.stream_results
        if not streams or session.plan is None:
            return
        header = session.header("reduced", ctx.settings.run_id, ctx.identity.peer_id)
        part.result_stream = StreamedResult(
            ctx.identity, header, session.content, part.numel, ctx.settings.block_size
        )
        part.answerable.set()


async def _woken(session: Session, part: OwnedPart) -> bool:
    """Wait for more of the parts; False when streaming is over (the exchange's end, or
    the reduction proper started)."""
    left = session.done_by - time.monotonic()
    if left <= 0:
        return False
    try:
        await asyncio.wait_for(part.wake.wait(), left)
    except asyncio.TimeoutError:
        return False
    part.wake.clear()
    return not part.reducing
