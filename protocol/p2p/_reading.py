"""Reading a frame's body as its bytes arrive, held to a pace.

A body is read as its bytes arrive, never into a buffer sized by the length a peer
announced: a stream that announces 256 MiB and sends nothing costs nothing. A
:class:`Pace` bounds how slowly a caller may send; a body that falls below it is
dropped as ``too_slow``, so silent streams cannot hold a callee's slots. A
:class:`StreamRead` can also fill a caller's buffer straight from the socket (the
direct plane's :class:`~protocol.p2p._into.IntoReader`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from protocol.errors import ProtocolError
from protocol.p2p._frames import CHUNK_BYTES

__all__ = ["Pace", "Read", "StreamRead", "read_all", "read_body", "read_into", "read_paced"]

T = TypeVar("T")

_MERGE_FRACTION = 16  # rate samples closer than window/16 are merged: at most ~2*16 per window


@dataclass(frozen=True)
class Pace:
    """How slowly a caller may send its request before the stream is dropped as ``too_slow``.

    Attributes:
        header_timeout: seconds from the stream's opening to its 8-byte request header.
        min_bytes_per_second: least rate of the request body, averaged over every sliding
            ``window`` seconds from the body's start; 0 turns the check off.
        window: seconds the rate is averaged over.
    """

    header_timeout: float
    min_bytes_per_second: float
    window: float


class _Pacer:
    """Watches one body read against a :class:`Pace`: cancels the reading task once fewer
    than ``min_bytes_per_second * window`` bytes arrived over the last ``window`` seconds.

    ``samples`` holds ``(time, bytes so far)``; the oldest kept is the first whose count
    is still within the last window's quota, so the stream is too slow from that
    sample's time plus the window on, unless more bytes come. One timer, re-armed only
    when it fires early, keeps the per-chunk cost to a few list operations.
    """

    def __init__(self, pace: Pace) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._window = pace.window
        self._need = pace.min_bytes_per_second * pace.window
        now = self._loop.time()
        self._samples: deque[tuple[float, int]] = deque([(now, 0)])
        self._received = 0
        self.deadline = now + pace.window
        self.expired = False
        self._timer = self._loop.call_at(self.deadline, self._check)

    def add(self, nbytes: int) -> None:
        now = self._loop.time()
        self._received += nbytes
        samples = self._samples
        # merging drops an intermediate sample, which only makes the stream look faster
        if len(samples) > 1 and now - samples[-2][0] < self._window / _MERGE_FRACTION:
            samples.pop()
        samples.append((now, self._received))
        floor = self._received - self._need
        while samples[0][1] <= floor:  # the newest sample is above it: never empties
            samples.popleft()
        self.deadline = samples[0][0] + self._window

    def _check(self) -> None:
        if self._loop.time() < self.deadline:
            self._timer = self._loop.call_at(self.deadline, self._check)
            return
        self.expired = True
        self._task.cancel()

    def owns_cancel(self) -> bool:
        """After a CancelledError: whether it came from this pacer alone (not a shutdown)."""
        if not self.expired:
            return False
        uncancel = getattr(self._task, "uncancel", None)  # Python 3.11+ counts cancel requests
        return uncancel is None or uncancel() == 0

    def close(self) -> None:
        self._timer.cancel()


Read = Callable[[int], Awaitable[bytes]]
"""Reads up to ``n`` bytes of a stream (``b""`` at its end). A :class:`StreamRead` can
also read into a caller's buffer (see :func:`read_into`)."""


class StreamRead:
    """A :data:`Read` over a stream reader that can also fill a caller's buffer:
    straight from the socket when the reader is an :class:`~protocol.p2p._into.IntoReader`
    (the direct plane's), through ``read`` and one copy otherwise (a p2pd stream).

    Args:
        reader: the stream.
        counted: told how many bytes each read took.
    """

    def __init__(
        self, reader: asyncio.StreamReader, counted: Callable[[int], None] | None = None
    ) -> None:
        self.reader = reader
        self._counted = counted
        self._readinto = getattr(reader, "readinto", None)

    async def __call__(self, n: int) -> bytes:
        chunk = await self.reader.read(n)
        if self._counted is not None:
            self._counted(len(chunk))
        return chunk

    async def into(self, view: memoryview) -> int:
        """Read up to ``view.nbytes`` bytes into ``view``; how many (0 at the stream's end)."""
        if self._readinto is not None:
            n = await self._readinto(view)
        else:
            chunk = await self.reader.read(view.nbytes)
            n = len(chunk)
            view[:n] = chunk
        if self._counted is not None:
            self._counted(n)
        return n


async def read_into(read: Read, view: memoryview) -> int:
    """Read up to ``view.nbytes`` bytes through ``read`` into ``view``; how many (0 at
    the stream's end): without a copy when ``read`` is a :class:`StreamRead` over a
    reader that can, through one copy otherwise."""
    into = getattr(read, "into", None)
    if into is not None:
        return await into(view)  # type: ignore[no-any-return]
    chunk = await read(view.nbytes)
    view[: len(chunk)] = chunk
    return len(chunk)


async def read_paced(
    reader: asyncio.StreamReader,
    length: int,
    pace: Pace | None,
    consume: Callable[[Read], Awaitable[T]],
) -> T:
    """Run ``consume(read)`` over a body of ``length`` bytes, ``read`` held to ``pace``.

    Raises:
        ProtocolError: ``too_slow``, when the body falls below ``pace``; else what
            ``consume`` raises.
    """
    pacer = _Pacer(pace) if pace is not None and pace.min_bytes_per_second > 0 else None
    received = 0

    def counted(n: int) -> None:
        nonlocal received
        received += n
        if pacer is not None:
            pacer.add(n)

    try:
        return await consume(StreamRead(reader, counted))
    except asyncio.CancelledError:
        if pacer is None or not pacer.owns_cancel():
            raise
        assert pace is not None
        detail = (
            f"{received} of {length} bytes; under {pace.min_bytes_per_second:.0f} B/s "
            f"over {pace.window:.1f}s"
        )
        raise ProtocolError("too_slow", detail) from None
    finally:
        if pacer is not None:
            pacer.close()


async def read_body(reader: asyncio.StreamReader, length: int, pace: Pace | None = None) -> bytes:
    """Read exactly ``length`` bytes; the caller has already checked ``length`` against its limit.

    Memory grows with the bytes that arrived, never with the announced ``length``, and
    never past it: each read asks for at most what is still missing.

    Raises:
        asyncio.IncompleteReadError: the stream ended early.
        ProtocolError: ``too_slow``, when ``pace`` is given and the body falls below it.
    """
    body = await read_paced(reader, length, pace, lambda read: read_all(read, length, None))
    return body  # type: ignore[return-value]  # joined bytes without ``into``


async def read_all(read: Read, length: int, into: memoryview | None) -> bytes | memoryview:
    """Exactly ``length`` bytes through ``read``: written into ``into``, or joined."""
    received = 0
    if into is not None:
        while received < length:
            n = await read_into(read, into[received : received + CHUNK_BYTES])
            if not n:
                raise asyncio.IncompleteReadError(b"", length)
            received += n
        return into
    chunks: list[bytes] = []
    while received < length:
        chunk = await read(min(CHUNK_BYTES, length - received))
        if not chunk:
            raise asyncio.IncompleteReadError(b"".join(chunks), length)
        chunks.append(chunk)
        received += len(chunk)
    # one copy, as the preallocated buffer had; a single chunk needs none
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)  # b"" for an empty body
