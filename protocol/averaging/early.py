"""An owner's reduction started early: block by block while the members' parts arrive.

With ``AllReduceSettings.stream_reduce`` and a reducer that has a
:data:`~protocol.averaging.parts.Planner`, an owned part
(:class:`~protocol.averaging.owner.OwnedPart`) starts one :class:`EarlyReduction`. It
follows each member's body as its checked chunks come in (:meth:`EarlyReduction.follow`),
asks the planner how to reduce once every expected member's body is being received, and
reduces each block every member has in
(:class:`~protocol.averaging.streaming.StreamingReduction`, in the worker thread). With a
raw float32 result it also signs the head of the result sent back as it is reduced
(:mod:`protocol.averaging.streamback`), so members can be answered before the last part
is in. When the reduction proper starts (:meth:`EarlyReduction.stop`) the owner
completes what was reduced here, or starts over.
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from protocol.averaging.context import part_weight
from protocol.averaging.parts import Contribution, Planner, Prefix
from protocol.averaging.runner import ExchangeRunner
from protocol.averaging.streamback import StreamedResult
from protocol.averaging.streaming import StreamingReduction
from protocol.errors import ProtocolError
from protocol.wire import codec as codecs
from protocol.wire.messages import Header

__all__ = ["EarlyReduction"]

logger = logging.getLogger(__name__)


class EarlyReduction:
    """Reduces one owned part while the members' parts arrive.

    Args:
        runner: the exchange.
        expected: the members whose parts are waited for.
        own: this node's own contribution to the part.
        answerable: set once members can be answered (the streamed result's head is
            signed).
        planner: how the reducer reduces block by block.
    """

    def __init__(
        self,
        runner: ExchangeRunner,
        expected: set[str],
        own: Contribution,
        answerable: asyncio.Event,
        planner: Planner,
    ) -> None:
        self.runner = runner
        self.expected = expected
        self.own = own
        self.planner = planner
        self._answerable = answerable
        self.numel = own.vector.numel()
        self.streaming: StreamingReduction | None = StreamingReduction(
            self.numel, (own.peer, own.vector)
        )
        """The part reduced block by block as parts arrive (None once dropped)."""
        self.weights: dict[str, float] = {}
        """Members' capped weights, read from their parts' heads (for the plan)."""
        self.result_stream: StreamedResult | None = None
        """The result sent back while it is reduced (raw float32 only)."""
        self._wake = asyncio.Event()
        self._stopped = False
        self._task = asyncio.ensure_future(self._run())

    # ---- the parts as they arrive ----------------------------------------------------------

    def follow(self, h: Header, meta: dict, peer: str, body: memoryview) -> EarlyReduction | None:
        """Follow this part's body as it arrives (its head is checked, its body not yet),
        or None when it is not one this reduction follows."""
        streaming, plan = self.streaming, self.runner.plan
        weight = part_weight(meta)
        if streaming is None or plan is None or weight is None:
            return None
        key = (h.round, h.fragment, meta.get("content"))
        if key != self.runner.key or h.part != plan.index or peer not in self.expected:
            return None
        try:
            # a view of its own: releasing the lease's view never waits for this one, and
            # the pool reuses the buffer only once this one is dropped (close())
            enc = codecs.Encoded.from_meta(meta, body[:], max_numel=self.numel)
        except ProtocolError:
            return None  # refused in full once it is in
        if not streaming.attach(peer, enc):
            return None
        self.weights[peer] = float(min(weight, self.runner.context.settings.max_tokens))
        self._wake.set()
        return self

    def arrived(self, peer: str, nbytes: int) -> None:
        """The first ``nbytes`` of ``peer``'s part are in and checked."""
        if self.streaming is not None:
            self.streaming.arrived(peer, nbytes)
            self._wake.set()

    def detach(self, peer: str) -> None:
        """``peer``'s part will not be read any further: stop reducing from its buffer."""
        if self.streaming is not None:
            self.streaming.detach(peer)

    def progress(self) -> tuple[torch.Tensor | None, int]:
        """The streamed reduction so far (:data:`~protocol.averaging.streamback.Progress`)."""
        streaming = self.streaming
        if streaming is None or streaming.broken or streaming.out is None:
            return None, 0
        return streaming.out, streaming.upto

    # ---- the owner's reduction proper --------------------------------------------------

    async def stop(self) -> Prefix | None:
        """The reduction proper starts: no block is reduced here after this; what was."""
        self._stopped = True
        self._wake.set()
        await self._task  # never raises
        return self.streaming.prefix() if self.streaming is not None else None

    def close(self) -> None:
        """The result is out: let the parts' buffers go."""
        if self.streaming is not None:
            self.streaming.close()

    def drop(self) -> None:
        """The exchange is over: nobody gets the streamed result any more."""
        self.streaming = None  # its output was the reply's body
        if self.result_stream is not None:
            self.result_stream.drop()

    # ---- the reduction while parts arrive -------------------------------------------------

    async def _run(self) -> None:
        """Reduce block by block while parts arrive, until the reduction proper starts
        (or the exchange is over)."""
        streaming = self.streaming
        assert streaming is not None
        try:
            while not self._stopped and not streaming.broken:
                if not await self._woken():
                    return
                if streaming.plan is None:
                    if not self._all_attached():
                        continue
                    if not self._start_plan():
                        return
                hi = streaming.ready()
                if hi > streaming.upto:
                    worker = self.runner.context.worker
                    await asyncio.wrap_future(worker.submit(streaming.reduce_to, hi))
                    if self.result_stream is not None:
                        self.result_stream.advance()
        except Exception:  # the reduction proper still runs from scratch
            logger.exception(
                "round %d fragment %d: streamed reduction failed", *self.runner.key[:2]
            )
            streaming.broken = True

    async def _woken(self) -> bool:
        """Wait for more of the parts; False when streaming is over (the exchange's end,
        or the reduction proper started)."""
        left = self.runner.done_by - time.monotonic()
        if left <= 0:
            return False
        try:
            await asyncio.wait_for(self._wake.wait(), left)
        except asyncio.TimeoutError:
            return False
        self._wake.clear()
        return not self._stopped

    def _all_attached(self) -> bool:
        assert self.runner.plan is not None and self.streaming is not None
        others = {p for p in self.runner.plan.group if p in self.expected and p != self.own.peer}
        return others <= self.streaming.attached()

    def _start_plan(self) -> bool:
        """Ask the planner how to reduce while parts arrive; False when it will not."""
        runner = self.runner
        assert runner.plan is not None and self.streaming is not None
        members = [p for p in runner.plan.group if p in self.expected]
        weights = {**self.weights, self.own.peer: self.own.weight}
        round_, _, content = runner.key
        stream_plan = self.planner(round_, [(p, weights[p]) for p in members], content)
        if stream_plan is None:
            return False
        self.streaming.start(stream_plan)
        self._start_streamed_result()
        return True

    def _start_streamed_result(self) -> None:
        """Sign the head of the result sent back while it is reduced, from now on."""
        runner, ctx = self.runner, self.runner.context
        streams = ctx.settings.codec_for(runner.content) == "none" and ctx.faults.stream_results
        if not streams or runner.plan is None:
            return
        self.result_stream = StreamedResult(
            ctx.identity,
            runner.header("reduced"),
            runner.content,
            self.numel,
            ctx.settings.block_size,
        )
        self._answerable.set()
