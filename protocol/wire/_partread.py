"""The receiver's side of the part format for bytes from a stream: :func:`read_part`.

The same checks as :func:`protocol.wire._partopen.open_part`, in stream order, with
the body read straight into the caller's buffer and each chunk checked as it is in.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection
from typing import Any

import blake3

from protocol.errors import ProtocolError
from protocol.wire._partformat import (
    MAGIC,
    MAX_HEAD_BYTES,
    PREFIX,
    SIGNATURE_LEN,
    STREAM_MAGIC,
    Part,
)
from protocol.wire._partopen import authenticate, merged, open_trailer
from protocol.wire.messages import Header

__all__ = ["read_part"]


async def _exactly(read: Callable[[int], Awaitable[bytes]], n: int) -> bytes:
    pieces, got = [], 0
    while got < n:
        piece = await read(n - got)
        if not piece:
            raise asyncio.IncompleteReadError(b"".join(pieces), n)
        pieces.append(piece)
        got += len(piece)
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


async def read_part(
    read: Callable[[int], Awaitable[bytes]],
    length: int,
    into: Callable[[Header, dict[str, Any], int], memoryview],
    *,
    max_bytes: int,
    expected_sender: str | None = None,
    run_id: str | None = None,
    kinds: Collection[str] | None = None,
    round_window: tuple[int, int] | None = None,
    progress: Callable[[int], None] | None = None,
    trailer: Callable[[], Awaitable[bytes | memoryview]] | None = None,
) -> Part:
    """Read a part message of ``length`` bytes from a stream, checking as it comes.

    ``read(n)`` returns up to ``n`` of the stream's next bytes (``b""`` at its end):
    a ``StreamReader``'s ``read``, or a framing's paced reader. When ``read`` also has
    ``into(view)`` (reads up to ``view.nbytes`` bytes into ``view``, returns how many),
    the body goes through it straight into its destination.

    The same checks as :func:`~protocol.wire.partwire.open_part`, in stream order: the
    head and its signature before any body byte is read, the body's length against the
    signed size before it is read, then each chunk against its hash as soon as it is
    in. The body is read into the buffer ``into(header, meta, size)`` returns (a
    writable view of ``size`` bytes: the destination itself, when the caller can take
    the raw bytes as they are).
    ``progress(n)``, if given, is told each time the body's first ``n`` bytes are in and
    checked against their hashes. A refused message leaves the stream partly read: close it.

    With ``trailer`` (a function returning the next frame of the stream), a result
    streamed back (``ATS1``) is accepted too: each chunk is hashed as it arrives, then
    the trailer is read and checked against the head, the signer and those hashes
    before the part is returned; until then the bytes in ``into``'s buffer are
    unchecked (``progress`` is not called for them).

    Raises:
        ProtocolError: for any refused input, with the reasons the module lists
            (``redo`` when a streamed result's trailer says it was given up).
        asyncio.IncompleteReadError: the stream ended early.
    """
    head, signature, body_len, streamed = await _read_head(
        read, length, max_bytes, expected_sender, may_stream=trailer is not None
    )
    header, meta, digest, chunk, hashes = authenticate(
        head, signature, body_len, expected_sender, run_id, kinds, round_window, streamed
    )
    peer = header.sender
    body = into(header, meta, body_len)
    if body.nbytes != body_len:
        raise ValueError(f"into() gave {body.nbytes} bytes for a body of {body_len}")
    computed = await _read_body(read, body, chunk, hashes, peer, progress)
    if not streamed:
        return Part(header, meta, body, head, signature, digest)
    assert trailer is not None
    frame = bytes(await trailer())
    signed = _check_trailer(frame, peer, digest, computed)
    return Part(header, merged(meta, signed), body, head, signature, digest, frame)


async def _read_head(
    read: Callable[[int], Awaitable[bytes]],
    length: int,
    max_bytes: int,
    peer: str | None,
    may_stream: bool,
) -> tuple[bytes, bytes, int, bool]:
    """The head and signature of a message of ``length`` bytes, checked for size and
    magic before they are read; returns them, the body's length and whether the
    message is a streamed result (accepted only when ``may_stream``)."""
    if length > max_bytes:
        raise ProtocolError("oversized", f"{length} bytes > {max_bytes}", peer)
    if length < PREFIX.size + SIGNATURE_LEN:
        raise ProtocolError("malformed", f"part message of {length} bytes", peer)
    magic, head_len = PREFIX.unpack(await _exactly(read, PREFIX.size))
    streamed = magic == STREAM_MAGIC and may_stream
    if magic != MAGIC and not streamed:
        if magic == STREAM_MAGIC:
            raise ProtocolError("wrong_kind", "a streamed result where a part is due", peer)
        reason = "bad_version" if magic[:3] == MAGIC[:3] else "malformed"
        raise ProtocolError(reason, f"part magic {magic!r}, expected {MAGIC!r}", peer)
    body_len = length - PREFIX.size - head_len - SIGNATURE_LEN
    if head_len == 0 or head_len > MAX_HEAD_BYTES or body_len < 0:
        raise ProtocolError("malformed", f"head of {head_len} bytes", peer)
    head = await _exactly(read, head_len)
    signature = await _exactly(read, SIGNATURE_LEN)
    return head, signature, body_len, streamed


async def _read_body(
    read: Callable[[int], Awaitable[bytes]],
    body: memoryview,
    chunk: int,
    hashes: list[bytes] | None,
    peer: str,
    progress: Callable[[int], None] | None,
) -> list[bytes]:
    """Fill ``body`` through ``read``, each chunk checked against ``hashes`` as soon as
    it is in; with ``hashes`` None (a streamed result), returns the chunks' hashes for
    the trailer to be checked against."""
    size = body.nbytes
    chunks = -(-size // chunk)
    computed: list[bytes] = []
    received = checked = 0
    fill = getattr(read, "into", None)  # reads into a buffer without a copy of its own
    while received < size:
        window = body[received : received + min(chunk, size - received)]
        if fill is not None:
            n = await fill(window)
        else:
            piece = await read(window.nbytes)
            n = len(piece)
            window[:n] = piece
        if not n:
            raise asyncio.IncompleteReadError(b"", size - received)
        received += n
        while checked < chunks and min((checked + 1) * chunk, size) <= received:
            lo = checked * chunk
            digest_k = blake3.blake3(body[lo : lo + chunk]).digest()
            checked += 1
            if hashes is None:
                computed.append(digest_k)
                continue
            if digest_k != hashes[checked - 1]:
                raise ProtocolError(
                    "bad_chunk", f"chunk {checked - 1} of {len(hashes)} does not match", peer
                )
            if progress is not None:
                progress(min(checked * chunk, size))
    return computed


def _check_trailer(frame: bytes, peer: str, digest: bytes, computed: list[bytes]) -> dict[str, Any]:
    """A streamed result's trailer, checked against its head's ``digest``, its signer
    and the hashes of the chunks as they arrived; returns its signed fields."""
    signed = open_trailer(frame, peer, digest)
    named = signed["hashes"]
    if len(named) != len(computed):
        detail = f"the trailer names {len(named)} chunks, the body has {len(computed)}"
        raise ProtocolError("bad_chunk", detail, peer)
    for k, (expected, got) in enumerate(zip(named, computed, strict=True)):
        if expected != got:
            raise ProtocolError("bad_chunk", f"chunk {k} of {len(named)} does not match", peer)
    return signed
