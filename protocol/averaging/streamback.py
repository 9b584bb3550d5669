"""An owner's result sent back while it is reduced (hivemind's shape, with a signature).

An owner that reduces its part block by block as the parts arrive
(:mod:`protocol.averaging.streaming`) can answer a member whose part is in before the
result is complete: the signed head of a streamed result first (it names the body's
size, not its hashes), then each block as soon as it is reduced, then, once the owner
has signed the whole result, the trailer (:func:`~protocol.wire.partwire.seal_trailer`)
that names every chunk's hash and who is in the result. Blocks the owner gave up
(screening left a member out once every part was in, so it reduced from scratch) are
followed by the rest of the corrected values and a ``redo`` trailer: the member then
fetches the signed result.

One :class:`StreamedResult` per exchange serves every member; each reply is a
:class:`~protocol.p2p.transport.StreamedResponse` that the transport writes as it is
produced. Raw float32 results only: their bytes are the reduced values themselves.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import torch

from protocol.averaging.resultmeta import head_fields
from protocol.errors import ProtocolError
from protocol.p2p.transport import StreamedResponse
from protocol.wire.messages import Header
from protocol.wire.partwire import seal_stream_head, seal_trailer
from verification.identity import Identity

__all__ = ["Progress", "StreamedResult"]

Progress = Callable[[], tuple[torch.Tensor | None, int]]
"""The owner's streamed reduction so far: ``(values, upto)``, values ``[:upto]`` final
unless given up (``(None, 0)`` when there is none or it broke)."""


class StreamedResult:
    """One owner's result of one exchange, sent back while it is reduced.

    Args:
        identity: the owner's key.
        header: the result's header (kind ``reduced``).
        content: what the exchange averages.
        numel: values in the owner's part.
        block_size: the codec block size named in the head.
    """

    def __init__(
        self, identity: Identity, header: Header, content: str, numel: int, block_size: int
    ) -> None:
        codec = {"c": "none", "n": numel, "b": block_size}
        self.head = seal_stream_head(identity, header, {**head_fields(content), **codec}, numel * 4)
        self.identity = identity
        self.numel = numel
        self.replies = 0
        """Members answered with it."""
        self.done = asyncio.Event()
        """The result is signed (or the exchange is over)."""
        self._final: memoryview | None = None
        self._prefix_used = False
        self._trailer = b""
        self._redo = b""
        self._advanced = asyncio.Event()

    def advance(self) -> None:
        """More values are ready: wake every reply waiting for them (each waits on the
        event it found, so none misses a wake-up between looking and waiting)."""
        woken, self._advanced = self._advanced, asyncio.Event()
        woken.set()

    def finish(
        self, meta: dict, hashes: list[bytes], final: bytes | memoryview, prefix_used: bool
    ) -> None:
        """The signed result: its fields besides the head's (``meta``), the hashes of its
        body's chunks, its body (the raw float32 the whole result carries), and whether
        its values complete the streamed blocks."""
        self._trailer = seal_trailer(self.identity, self.head, meta, hashes)
        self._redo = seal_trailer(self.identity, self.head, {}, None)
        view = memoryview(final)
        self._final = view if view.format == "B" and view.ndim == 1 else view.cast("B")
        self._prefix_used = prefix_used
        self.done.set()
        self.advance()

    def drop(self) -> None:
        """The exchange is over: replies still under way end without their trailer."""
        self._final = None
        self.done.set()
        self.advance()

    @property
    def reply_bytes(self) -> int:
        """One reply, trailer included (once finished; framing not counted, as for a
        whole result)."""
        return self.head.nbytes + len(self._trailer)

    def response(
        self,
        progress: Progress,
        done_by: float,
        tamper: Callable[[bytes], bytes] = lambda frame: frame,
    ) -> StreamedResponse:
        """A reply to one member: the head, each block as soon as it is reduced (the rest
        from the signed result once there is one), then the trailer: as signed when
        every block sent is in the result, ``redo`` when blocks sent were given up.
        ``tamper`` is the fault-injection hook for the trailer on the wire."""
        self.replies += 1
        speculative = 0  # values sent before the result was signed

        async def body() -> AsyncIterator[bytes | memoryview]:
            nonlocal speculative
            for buffer in self.head.buffers():
                yield buffer
            sent = 0
            while sent < self.numel:
                if self.done.is_set():
                    if self._final is None:
                        raise ProtocolError("late", "the exchange of that round is over")
                    yield self._final[4 * sent :]
                    return
                woken = self._advanced
                values, upto = progress()
                if values is not None and upto > sent:
                    yield _raw(values[sent:upto])
                    sent = speculative = upto
                    continue
                left = done_by - time.monotonic()
                if left <= 0:
                    raise ProtocolError("late", "the exchange of that round is over")
                await asyncio.wait_for(woken.wait(), left)

        async def trailer() -> bytes:
            await asyncio.wait_for(self.done.wait(), max(0.5, done_by - time.monotonic()))
            if not self._trailer:
                raise ProtocolError("late", "the exchange of that round is over")
            return tamper(self._trailer if self._prefix_used or not speculative else self._redo)

        return StreamedResponse(self.head.nbytes, body, trailer)


def _raw(values: torch.Tensor) -> memoryview:
    """The bytes of float32 ``values`` (a view: they must not change until written)."""
    return memoryview(values.numpy()).cast("B")
