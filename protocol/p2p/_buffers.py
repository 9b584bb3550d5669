"""Receive buffers: a body read into a pooled buffer, and the lease that gives it back.

A :class:`BufferPool` keeps large receive buffers for the next message; a
:class:`Lease` holds one until it is released and nothing made of it is alive.
"""

from __future__ import annotations

from typing import Any

from protocol.p2p._frames import CHUNK_BYTES
from protocol.p2p._reading import Read, read_all

__all__ = ["BufferPool", "Lease"]


def _unexported(buffer: bytearray) -> bool:
    """Whether no view or tensor of ``buffer`` is alive (a bytearray with exports cannot
    be resized, so a resize that succeeds proves there are none)."""
    try:
        buffer.append(0)
    except BufferError:
        return False
    del buffer[-1]
    return True


class Lease:
    """One received body: ``data`` is a view of a pooled buffer, plain bytes, or what a
    request reader made of them (a parsed message whose body is a view of the buffer).

    :meth:`release` gives the buffer back; the pool reuses it only once nothing made
    from ``data`` (a slice, a ``torch.frombuffer`` tensor) is alive any more, so a
    consumer that keeps a view past the release keeps its bytes intact.
    """

    def __init__(
        self,
        data: bytes | memoryview,
        pool: BufferPool | None = None,
        buffer: bytearray | None = None,
    ) -> None:
        self.data = data
        self._pool = pool
        self._buffer = buffer

    def release(self) -> None:
        """Hand the buffer back (idempotent)."""
        pool, buffer = self._pool, self._buffer
        self._pool = self._buffer = None
        if isinstance(self.data, memoryview):
            self.data.release()
        self.data = b""
        if pool is not None and buffer is not None:
            pool._give_back(buffer)

    def handed_to(self, data: Any) -> Lease:
        """The same buffer, leased as ``data`` (made from this lease's view: a parsed
        message whose body is that view); this lease no longer holds it."""
        lease = Lease(data, self._pool, self._buffer)
        self._pool = self._buffer = None
        self.data = b""
        return lease

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class BufferPool:
    """Receive buffers for large bodies, reused message after message.

    A body of ``min_bytes`` or more is read into a pooled ``bytearray`` instead of being
    joined into a fresh ``bytes``: above 32 MiB every fresh allocation is a new mapping
    whose pages fault in one by one, about five times the cost of writing into memory
    already mapped. A buffer is handed out again only when nothing holds a view of it
    (see :class:`Lease`); at most ``max_free_bytes`` of idle buffers are kept.

    Used on one event loop only (no lock).
    """

    def __init__(self, max_free_bytes: int = 512 * 2**20, min_bytes: int = CHUNK_BYTES) -> None:
        self.max_free_bytes = max_free_bytes
        self.min_bytes = min_bytes
        self._idle: list[bytearray] = []
        self.allocated = 0
        """Buffers created so far (a pool that works creates few)."""

    def lease(self, nbytes: int) -> Lease:
        """A writable buffer of exactly ``nbytes`` (a reused one when an idle buffer of
        ``nbytes`` to ``2 * nbytes`` is free; a fresh, unpooled one below ``min_bytes``)."""
        if nbytes < self.min_bytes:
            return Lease(memoryview(bytearray(nbytes)))
        best = None
        for buffer in self._idle:
            size = len(buffer)
            fits = nbytes <= size <= 2 * nbytes and (best is None or size < len(best))
            if fits and _unexported(buffer):
                best = buffer
        if best is None:
            best = bytearray(nbytes)
            self.allocated += 1
        else:
            self._idle.remove(best)
        return Lease(memoryview(best)[:nbytes], self, best)

    async def read_request(self, read: Read, length: int, peer: str) -> Lease:
        """A :data:`RequestReader` that reads a large request into one of this pool's buffers."""
        lease = self.lease(length)
        try:
            await read_all(read, length, lease.data)
        except BaseException:
            lease.release()
            raise
        return lease

    def _give_back(self, buffer: bytearray) -> None:
        self._idle.append(buffer)
        # keep the largest buffers within the budget; a buffer still viewed counts too
        # (it is reused once its views are gone)
        self._idle.sort(key=len, reverse=True)
        total = 0
        for i, kept in enumerate(self._idle):
            total += len(kept)
            if total > self.max_free_bytes:
                del self._idle[i:]
                break

    @property
    def idle_bytes(self) -> int:
        """Bytes held by idle buffers."""
        return sum(len(b) for b in self._idle)
