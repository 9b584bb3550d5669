"""The part format's constants, digests and message types, shared by both sides.

What the bytes are is described in :mod:`protocol.wire.partwire`; the sender's side is
:mod:`protocol.wire._partseal`, the receiver's :mod:`protocol.wire._partopen` (bytes in
hand) and :mod:`protocol.wire._partread` (bytes from a stream).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import blake3

from protocol.wire.messages import Header
from verification.identity import Domain

__all__ = [
    "CHUNK_BYTES",
    "DOMAIN",
    "PART",
    "TRAILER",
    "HASH_LEN",
    "MAGIC",
    "MAX_CHUNK_BYTES",
    "MAX_HEAD_BYTES",
    "MAX_META_ITEMS",
    "MAX_TRAILER_BYTES",
    "MIN_CHUNK_BYTES",
    "PREFIX",
    "RESERVED",
    "SIGNATURE_LEN",
    "STREAM_MAGIC",
    "TRAILER_DOMAIN",
    "TRAILER_LEN",
    "VERSION",
    "Part",
    "SealedPart",
    "StreamHead",
    "as_bytes_view",
    "chunk_hashes",
    "hash_chunks",
    "head_digest",
    "trailer_digest",
]

MAGIC = b"ATP1"
"""First bytes of every part message; an envelope starts with msgpack's 0x93 instead."""
STREAM_MAGIC = b"ATS1"
"""First bytes of a result streamed back while it is reduced (its hashes in a trailer)."""
MAX_TRAILER_BYTES = 1 << 20
"""A trailer names 32 bytes per MiB chunk and a few hundred bytes per contributor."""
CHUNK_BYTES = 1 << 20
"""Body bytes per hashed chunk: small enough to hash as it arrives, large enough that
the hash list stays a few kilobytes for a 256 MiB body."""
MIN_CHUNK_BYTES = 1 << 12
MAX_CHUNK_BYTES = 1 << 26
MAX_META_ITEMS = 4096
"""Map entries and list items in a head, hashes excluded (contributors, weights, ...)."""

PREFIX = struct.Struct(">4sI")
TRAILER_LEN = struct.Struct(">I")
SIGNATURE_LEN = 64
HASH_LEN = 32
VERSION = 1
DOMAIN = b"atoll/part/v1\0"
TRAILER_DOMAIN = b"atoll/trailer/v1\0"
PART = Domain(DOMAIN)
"""A part's or a result's signature: over its head's digest (:func:`head_digest`)."""
TRAILER = Domain(TRAILER_DOMAIN)
"""A streamed result's trailer's signature: over :func:`trailer_digest`."""
RESERVED = ("size", "chunk", "hashes", "trailer", "redo")
MAX_HEAD_BYTES = 1 << 20  # a head names 32 bytes per MiB chunk: 8 KiB for 256 MiB


@dataclass(frozen=True)
class SealedPart:
    """A signed part ready to send: its pieces, written one after the other.

    Attributes:
        head: the signed head.
        signature: the 64-byte signature over ``digest``.
        body: the raw body (a view of the sender's buffer; not copied).
        digest: what the signature covers, named by commitments and results.
    """

    head: bytes
    signature: bytes
    body: memoryview
    digest: bytes

    def buffers(self) -> list[bytes | memoryview]:
        """The wire bytes as a list of buffers (the body is not copied)."""
        return [PREFIX.pack(MAGIC, len(self.head)), self.head, self.signature, self.body]

    @property
    def nbytes(self) -> int:
        return PREFIX.size + len(self.head) + SIGNATURE_LEN + self.body.nbytes

    def to_bytes(self) -> bytes:
        """The whole message in one buffer (tests and fault injection; copies the body)."""
        return b"".join(self.buffers())


@dataclass(frozen=True)
class Part:
    """A received part whose signature and every chunk have been checked.

    Attributes:
        header: the signed header fields.
        meta: the signed fields besides the header (``size``, ``chunk`` and ``hashes``
            removed): weights, groups, codec, contributors, ...
        body: the body, a view into the received bytes.
        head: the exact signed head: with ``signature``, evidence anyone can re-check.
        signature: the sender's signature over ``digest``.
        digest: BLAKE3 of the domain-tagged head.
        trailer: for a result streamed back, its signed trailer (with its signature);
            its fields are in ``meta``. Empty for a part message.
    """

    header: Header
    meta: dict[str, Any]
    body: memoryview
    head: bytes
    signature: bytes
    digest: bytes
    trailer: bytes = b""

    @property
    def nbytes(self) -> int:
        """The message's size, its trailer included (framing not counted)."""
        return PREFIX.size + len(self.head) + SIGNATURE_LEN + self.body.nbytes + len(self.trailer)

    def evidence(self) -> bytes:
        """The head and signature (and trailer) without the body: proof of what the
        sender signed, kilobytes whatever the body's size (:func:`open_evidence` checks it)."""
        if not self.trailer:
            return PREFIX.pack(MAGIC, len(self.head)) + self.head + self.signature
        return (
            PREFIX.pack(STREAM_MAGIC, len(self.head))
            + self.head
            + self.signature
            + TRAILER_LEN.pack(len(self.trailer))
            + self.trailer
        )


@dataclass(frozen=True)
class StreamHead:
    """The signed head of a result streamed back while it is reduced.

    Attributes:
        head: the signed head (its meta names the body's size and chunk size).
        signature: the sender's signature over ``digest``.
        digest: what the trailer names.
        size: body bytes that follow it.
        chunk: body bytes per hashed chunk.
    """

    head: bytes
    signature: bytes
    digest: bytes
    size: int
    chunk: int

    def buffers(self) -> list[bytes]:
        """The bytes before the body."""
        return [PREFIX.pack(STREAM_MAGIC, len(self.head)), self.head, self.signature]

    @property
    def nbytes(self) -> int:
        """The message's size on the wire, body included (its first frame)."""
        return PREFIX.size + len(self.head) + SIGNATURE_LEN + self.size


def head_digest(head: bytes | memoryview) -> bytes:
    return blake3.blake3(DOMAIN + bytes(head)).digest()


def hash_chunks(body: memoryview, chunk: int) -> list[bytes]:
    return [blake3.blake3(body[i : i + chunk]).digest() for i in range(0, body.nbytes, chunk)]


def chunk_hashes(
    body: bytes | bytearray | memoryview, chunk_bytes: int = CHUNK_BYTES
) -> list[bytes]:
    """BLAKE3 of each ``chunk_bytes`` of ``body``: what a head or trailer names."""
    return hash_chunks(as_bytes_view(body), chunk_bytes)


def as_bytes_view(data: Any) -> memoryview:
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def trailer_digest(trailer: bytes | memoryview) -> bytes:
    return blake3.blake3(TRAILER_DOMAIN + bytes(trailer)).digest()
