"""Streams that receive a body straight into the buffer its reader holds out.

An ``asyncio.StreamReader`` copies every byte twice before a reader sees it: the socket
read makes a fresh ``bytes``, which is appended to the reader's own buffer, and each
``read(n)`` cuts another ``bytes`` out of that buffer, which the caller then copies
into its destination. For the tens of megabytes of a part that is most of what
receiving costs. :class:`IntoReader` is a ``StreamReader`` with one more method,
:meth:`IntoReader.readinto`: while it waits and nothing is buffered, its protocol
(:class:`IntoProtocol`, an ``asyncio.BufferedProtocol``) hands the transport the
caller's buffer itself, so the kernel's bytes land where they belong in one copy
(decrypted into it, on a TLS connection). Everything else (``read``,
``readexactly``, flow control, end of stream, errors) is the ``StreamReader``'s own;
bytes that come while no ``readinto`` waits are buffered as before.

:func:`open_connection` and :func:`start_server` are ``asyncio``'s, with these two in
place of the plain reader and protocol.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["IntoProtocol", "IntoReader", "open_connection", "start_server"]

_SCRATCH_BYTES = 256 * 1024  # what one socket read takes while no readinto waits


class IntoReader(asyncio.StreamReader):
    """A ``StreamReader`` that can also read into a caller's buffer (:meth:`readinto`)."""

    def __init__(self, limit: int = 2**16, loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(limit=limit, loop=loop)
        self._into: memoryview | None = None
        self._into_got = 0

    async def readinto(self, view: memoryview) -> int:
        """Read up to ``view.nbytes`` bytes into ``view``; how many (0 at the end of
        the stream). Buffered bytes are taken first; with none, the next bytes go from
        the socket straight into ``view``.

        Raises:
            what the stream was ended with (a lost connection), as ``read`` does.
        """
        if self._exception is not None:
            raise self._exception
        if not view.nbytes:
            return 0
        if not self._buffer and not self._eof:
            self._into, self._into_got = view, 0
            try:
                await self._wait_for_data("readinto")
            finally:
                got, self._into = self._into_got, None
            if got:
                return got
        n = min(len(self._buffer), view.nbytes)
        if n:
            with memoryview(self._buffer) as buffered:
                view[:n] = buffered[:n]
            del self._buffer[:n]
            self._maybe_resume_transport()
        return n

    def _hold_out(self) -> memoryview | None:
        """The part of a waiting ``readinto``'s buffer still to fill, or None."""
        into = self._into
        if into is None or self._into_got >= into.nbytes:
            return None
        return into[self._into_got :]

    def _filled(self, nbytes: int) -> None:
        self._into_got += nbytes
        self._wakeup_waiter()


class IntoProtocol(asyncio.StreamReaderProtocol, asyncio.BufferedProtocol):
    """The transport's side of an :class:`IntoReader`: a buffered protocol whose buffer
    is a waiting ``readinto``'s destination, else a scratch buffer fed to the reader."""

    def __init__(
        self,
        reader: IntoReader,
        connected: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Any] | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(reader, connected, loop=loop)
        self._scratch = memoryview(bytearray(_SCRATCH_BYTES))
        self._direct = False  # whether the last buffer handed out was a readinto's

    def get_buffer(self, sizehint: int) -> memoryview:
        reader = self._stream_reader
        held = reader._hold_out() if isinstance(reader, IntoReader) else None
        self._direct = held is not None
        return held if held is not None else self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        reader = self._stream_reader
        if reader is None or not nbytes:
            return
        if self._direct:
            reader._filled(nbytes)
        else:
            reader.feed_data(self._scratch[:nbytes])


async def open_connection(
    host: str, port: int, *, limit: int = 2**16, **kwargs: Any
) -> tuple[IntoReader, asyncio.StreamWriter]:
    """``asyncio.open_connection`` with an :class:`IntoReader`."""
    loop = asyncio.get_running_loop()
    reader = IntoReader(limit=limit, loop=loop)
    protocol = IntoProtocol(reader, loop=loop)
    transport, _ = await loop.create_connection(lambda: protocol, host, port, **kwargs)
    return reader, asyncio.StreamWriter(transport, protocol, reader, loop)


async def start_server(
    connected: Callable[[IntoReader, asyncio.StreamWriter], Awaitable[None]],
    host: str,
    port: int,
    *,
    limit: int = 2**16,
    **kwargs: Any,
) -> asyncio.base_events.Server:
    """``asyncio.start_server`` whose connections read through an :class:`IntoReader`."""
    loop = asyncio.get_running_loop()

    def factory() -> IntoProtocol:
        return IntoProtocol(IntoReader(limit=limit, loop=loop), connected, loop=loop)

    return await loop.create_server(factory, host, port, **kwargs)
