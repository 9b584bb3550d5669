"""The wire format of all-reduce parts and results: a small signed head, then the raw body.

A part of a fragment is megabytes of tensor bytes plus a few fields. Packing the bytes
inside a msgpack envelope costs a copy to pack, one to unpack and one SHA-256 pass over
the whole payload before anything can be sent. Here the body travels raw, next to a
head that binds it::

    wire      = b"ATP1" | u32 head_len | head | signature (64) | body
    head      = msgpack([version, kind, run_id, round, fragment, part, sender, meta])
    meta      = {..., "size": len(body), "chunk": chunk_bytes, "hashes": [h_0, h_1, ...]}
    h_k       = BLAKE3(body[k * chunk : (k + 1) * chunk])            # 32 bytes each
    digest    = BLAKE3(b"atoll/part/v1\\0" + head)                    # 32 bytes
    signature = Ed25519(sender's key, b"atoll/part/v1\\0" + digest)

The signature covers the head; the head names every chunk's hash, so every body byte
is bound to the signer. ``digest`` is what commitments, audit rows and results name,
and a head with its signature (kilobytes, whatever the body's size) is enough for
anyone to re-check what the sender said: :func:`verify_head`. BLAKE3 rather than
SHA-256 because it hashes these bodies about 2x faster here (``python -m benchmarks
verification`` measures both); the domain tag keeps a part signature from ever
passing as an envelope signature (:mod:`protocol.wire.messages`) or the other way round.

:func:`open_part` is the gate for these bytes from peers: the size before anything is
parsed, the head with hard msgpack limits, the signature before the body is looked
at, then each chunk against its hash. It refuses with a
:class:`~protocol.errors.ProtocolError` whose reason is one of ``oversized``,
``malformed``, ``bad_version``, ``sender_mismatch``, ``bad_signature``, ``wrong_run``,
``wrong_kind``, ``stale_round``, ``truncated`` (fewer body bytes than signed),
``trailing_bytes`` (more) or ``bad_chunk`` (a chunk that does not match its hash:
a flipped byte, two chunks swapped). The body is handed on as a view of the received
bytes, never copied.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any

import blake3
import msgpack

from protocol.errors import ProtocolError
from protocol.wire._limits import bounded_unpackb
from protocol.wire.messages import MAX_NAME_CHARS, Header, check_header, header_problem
from verification.identity import Identity, verify

__all__ = [
    "CHUNK_BYTES",
    "MAGIC",
    "Part",
    "SealedPart",
    "is_part",
    "open_evidence",
    "open_head",
    "open_part",
    "part_digest",
    "read_part",
    "seal_part",
    "verify_head",
]

MAGIC = b"ATP1"
"""First bytes of every part message; an envelope starts with msgpack's 0x93 instead."""
CHUNK_BYTES = 1 << 20
"""Body bytes per hashed chunk: small enough to hash as it arrives, large enough that
the hash list stays a few kilobytes for a 256 MiB body."""
MIN_CHUNK_BYTES = 1 << 12
MAX_CHUNK_BYTES = 1 << 26
MAX_META_ITEMS = 4096
"""Map entries and list items in a head, hashes excluded (contributors, weights, ...)."""

_PREFIX = struct.Struct(">4sI")
_SIGNATURE_LEN = 64
_HASH_LEN = 32
_VERSION = 1
_DOMAIN = b"atoll/part/v1\0"
_RESERVED = ("size", "chunk", "hashes")
_MAX_HEAD_BYTES = 1 << 20  # a head names 32 bytes per MiB chunk: 8 KiB for 256 MiB


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
        return [_PREFIX.pack(MAGIC, len(self.head)), self.head, self.signature, self.body]

    @property
    def nbytes(self) -> int:
        return _PREFIX.size + len(self.head) + _SIGNATURE_LEN + self.body.nbytes

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
    """

    header: Header
    meta: dict[str, Any]
    body: memoryview
    head: bytes
    signature: bytes
    digest: bytes

    @property
    def nbytes(self) -> int:
        """The message's size on the wire."""
        return _PREFIX.size + len(self.head) + _SIGNATURE_LEN + self.body.nbytes

    def evidence(self) -> bytes:
        """The head and signature without the body: proof of what the sender signed,
        kilobytes whatever the body's size (:func:`open_evidence` checks it)."""
        return _PREFIX.pack(MAGIC, len(self.head)) + self.head + self.signature


def _head_digest(head: bytes | memoryview) -> bytes:
    return blake3.blake3(_DOMAIN + bytes(head)).digest()


def _chunk_hashes(body: memoryview, chunk: int) -> list[bytes]:
    return [blake3.blake3(body[i : i + chunk]).digest() for i in range(0, body.nbytes, chunk)]


def _as_bytes_view(data: Any) -> memoryview:
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def seal_part(
    identity: Identity,
    header: Header,
    meta: dict[str, Any],
    body: bytes | bytearray | memoryview,
    chunk_bytes: int = CHUNK_BYTES,
) -> SealedPart:
    """Sign ``meta`` and ``body`` as one part message.

    Raises:
        ValueError: the sender is not ``identity``, a header field is out of range,
            ``meta`` uses a reserved key (``size``, ``chunk``, ``hashes``) or non-str
            keys, or ``chunk_bytes`` is outside ``[2**12, 2**26]``.
    """
    if header.sender != identity.peer_id:
        raise ValueError(f"header.sender {header.sender!r} is not this identity")
    problem = header_problem(header)
    if problem:
        raise ValueError(problem)
    if not all(isinstance(k, str) for k in meta) or any(k in meta for k in _RESERVED):
        raise ValueError(f"meta keys must be str and none of {_RESERVED}")
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}]")
    view = _as_bytes_view(body)
    signed_meta = dict(
        meta, size=view.nbytes, chunk=chunk_bytes, hashes=_chunk_hashes(view, chunk_bytes)
    )
    head = msgpack.packb(
        [
            _VERSION,
            header.kind,
            header.run_id,
            header.round,
            header.fragment,
            header.part,
            header.sender,
            signed_meta,
        ],
        use_bin_type=True,
    )
    digest = _head_digest(head)
    return SealedPart(head, identity.sign(_DOMAIN + digest), view, digest)


def is_part(data: bytes | bytearray | memoryview) -> bool:
    """Whether ``data`` starts like a part message (it may still be refused)."""
    return bytes(memoryview(data)[: len(MAGIC)]) == MAGIC


def _split(view: memoryview, peer: str | None) -> tuple[memoryview, bytes, memoryview]:
    if view.nbytes < _PREFIX.size + _SIGNATURE_LEN:
        raise ProtocolError("malformed", f"part message of {view.nbytes} bytes", peer)
    magic, head_len = _PREFIX.unpack(view[: _PREFIX.size])
    if magic != MAGIC:
        # b"ATP" and another digit: a later layout; anything else is not a part at all
        reason = "bad_version" if magic[:3] == MAGIC[:3] else "malformed"
        raise ProtocolError(reason, f"part magic {magic!r}, expected {MAGIC!r}", peer)
    end = _PREFIX.size + head_len
    if head_len == 0 or end + _SIGNATURE_LEN > view.nbytes:
        raise ProtocolError("malformed", f"head of {head_len} bytes", peer)
    return (
        view[_PREFIX.size : end],
        bytes(view[end : end + _SIGNATURE_LEN]),
        view[end + _SIGNATURE_LEN :],
    )


def _parse_head(head: memoryview | bytes, peer: str | None) -> tuple[Header, dict[str, Any]]:
    try:
        fields = bounded_unpackb(
            head,
            max_container=MAX_META_ITEMS + 2**16,
            max_str_len=max(MAX_NAME_CHARS, 1 << 16),
            max_items=MAX_META_ITEMS + 2**16,
        )
    except ValueError as e:
        raise ProtocolError("malformed", f"part head: {e}", peer) from None
    if not isinstance(fields, list) or len(fields) != 8:
        raise ProtocolError("malformed", "part head is not an 8-item array", peer)
    version, *header_fields, meta = fields
    if type(version) is not int or version != _VERSION:
        raise ProtocolError("bad_version", f"part version {version!r}, expected {_VERSION}", peer)
    header = Header(*header_fields)
    problem = header_problem(header)
    if problem:
        raise ProtocolError("malformed", problem, peer)
    if not isinstance(meta, dict) or not all(isinstance(k, str) for k in meta):
        raise ProtocolError("malformed", "part meta must be a map with str keys", peer)
    size, chunk, hashes = meta.get("size"), meta.get("chunk"), meta.get("hashes")
    if type(size) is not int or size < 0:
        raise ProtocolError("malformed", "part size must be a non-negative int", peer)
    if type(chunk) is not int or not MIN_CHUNK_BYTES <= chunk <= MAX_CHUNK_BYTES:
        raise ProtocolError("malformed", f"part chunk size {chunk!r}", peer)
    if not (
        isinstance(hashes, list)
        and len(hashes) == -(-size // chunk)
        and all(isinstance(h, bytes) and len(h) == _HASH_LEN for h in hashes)
    ):
        raise ProtocolError("malformed", "part hashes must be one 32-byte hash per chunk", peer)
    return header, meta


def verify_head(sender: str, head: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is ``sender``'s part signature over ``head`` (evidence)."""
    if not isinstance(head, bytes) or not isinstance(signature, bytes):
        return False
    return len(signature) == _SIGNATURE_LEN and verify(
        sender, _DOMAIN + _head_digest(head), signature
    )


def open_head(
    head: bytes, signature: bytes, *, expected_sender: str | None = None
) -> tuple[Header, dict[str, Any]]:
    """Parse and authenticate a head kept as evidence (no body needed).

    Raises:
        ProtocolError: ``malformed``, ``bad_version``, ``sender_mismatch`` or
            ``bad_signature``.
    """
    header, meta = _parse_head(head, expected_sender)
    if expected_sender is not None and header.sender != expected_sender:
        raise ProtocolError("sender_mismatch", f"signed by {header.sender}", expected_sender)
    if not verify_head(header.sender, bytes(head), signature):
        raise ProtocolError("bad_signature", f"{header.kind} r{header.round}", header.sender)
    return header, meta


def open_evidence(
    data: bytes, *, expected_sender: str | None = None
) -> tuple[Header, dict[str, Any]]:
    """Check :meth:`Part.evidence` bytes: the signed head of a part whose body is not
    needed to prove what its sender said.

    Raises:
        ProtocolError: ``malformed``, ``bad_version``, ``sender_mismatch`` or
            ``bad_signature``.
    """
    if not isinstance(data, bytes):
        raise ProtocolError("malformed", "evidence must be bytes", expected_sender)
    head, signature, rest = _split(memoryview(data), expected_sender)
    if rest.nbytes:
        raise ProtocolError("trailing_bytes", "evidence holds body bytes", expected_sender)
    return open_head(bytes(head), signature, expected_sender=expected_sender)


def part_digest(data: bytes | bytearray | memoryview | SealedPart) -> bytes:
    """The digest a part's signature covers, without checking anything else.

    Raises:
        ProtocolError: ``malformed`` bytes.
    """
    if isinstance(data, SealedPart):
        return data.digest
    head, _, _ = _split(_as_bytes_view(data), None)
    return _head_digest(head)


def _authenticate(
    head: bytes,
    signature: bytes,
    body_len: int,
    expected_sender: str | None,
    run_id: str | None,
    kinds: Collection[str] | None,
    round_window: tuple[int, int] | None,
) -> tuple[Header, dict[str, Any], bytes, int, list[bytes]]:
    """The checks of a part's head, before any body byte is looked at: its fields, its
    sender, its signature, the header against what the caller expects, and the body's
    length against the signed size. Returns the header, the meta without ``size``,
    ``chunk`` and ``hashes``, the digest, the chunk size and the chunk hashes.

    Raises:
        ProtocolError: ``malformed``, ``bad_version``, ``sender_mismatch``,
            ``bad_signature``, ``wrong_run``, ``wrong_kind``, ``stale_round``,
            ``truncated`` or ``trailing_bytes``.
    """
    peer = expected_sender
    header, meta = _parse_head(head, peer)
    if expected_sender is not None and header.sender != expected_sender:
        raise ProtocolError(
            "sender_mismatch", f"signed sender {header.sender} is not the stream peer", peer
        )
    peer = header.sender
    digest = _head_digest(head)
    if not verify(header.sender, _DOMAIN + digest, signature):
        raise ProtocolError("bad_signature", f"{header.kind} r{header.round}", peer)
    check_header(header, run_id=run_id, kinds=kinds, round_window=round_window)
    size, chunk, hashes = meta.pop("size"), meta.pop("chunk"), meta.pop("hashes")
    if body_len < size:
        raise ProtocolError("truncated", f"body of {body_len} bytes, signed {size}", peer)
    if body_len > size:
        raise ProtocolError("trailing_bytes", f"body of {body_len} bytes, signed {size}", peer)
    return header, meta, digest, chunk, hashes


def open_part(
    data: bytes | bytearray | memoryview,
    *,
    max_bytes: int,
    expected_sender: str | None = None,
    run_id: str | None = None,
    kinds: Collection[str] | None = None,
    round_window: tuple[int, int] | None = None,
) -> Part:
    """Parse, authenticate and check one part message from a peer.

    The checks run cheapest first: size, head, signature, the header against what the
    caller expects, then the body's length and each chunk's hash.

    Raises:
        ProtocolError: for any refused input, with the reasons the module lists.
    """
    peer = expected_sender
    view = _as_bytes_view(data)
    if view.nbytes > max_bytes:
        raise ProtocolError("oversized", f"{view.nbytes} bytes > {max_bytes}", peer)
    raw_head, signature, body = _split(view, peer)
    head = bytes(raw_head)
    header, meta, digest, chunk, hashes = _authenticate(
        head, signature, body.nbytes, expected_sender, run_id, kinds, round_window
    )
    peer = header.sender
    for k, expected in enumerate(hashes):
        if blake3.blake3(body[k * chunk : (k + 1) * chunk]).digest() != expected:
            raise ProtocolError("bad_chunk", f"chunk {k} of {len(hashes)} does not match", peer)
    return Part(header, meta, body, head, signature, digest)


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
) -> Part:
    """Read a part message of ``length`` bytes from a stream, checking as it comes.

    ``read(n)`` returns up to ``n`` of the stream's next bytes (``b""`` at its end):
    a ``StreamReader``'s ``read``, or a framing's paced reader.

    The same checks as :func:`open_part`, in stream order: the head and its signature
    before any body byte is read, the body's length against the signed size before it
    is read, then each chunk against its hash as soon as it is in. The body is read
    into the buffer ``into(header, meta, size)`` returns (a writable view of ``size``
    bytes: the destination itself, when the caller can take the raw bytes as they are).
    ``progress(n)``, if given, is told each time the body's first ``n`` bytes are in and
    checked against their hashes. A refused message leaves the stream partly read: close it.

    Raises:
        ProtocolError: for any refused input, with the reasons the module lists.
        asyncio.IncompleteReadError: the stream ended early.
    """
    peer = expected_sender
    if length > max_bytes:
        raise ProtocolError("oversized", f"{length} bytes > {max_bytes}", peer)
    if length < _PREFIX.size + _SIGNATURE_LEN:
        raise ProtocolError("malformed", f"part message of {length} bytes", peer)
    magic, head_len = _PREFIX.unpack(await _exactly(read, _PREFIX.size))
    if magic != MAGIC:
        reason = "bad_version" if magic[:3] == MAGIC[:3] else "malformed"
        raise ProtocolError(reason, f"part magic {magic!r}, expected {MAGIC!r}", peer)
    body_len = length - _PREFIX.size - head_len - _SIGNATURE_LEN
    if head_len == 0 or head_len > _MAX_HEAD_BYTES or body_len < 0:
        raise ProtocolError("malformed", f"head of {head_len} bytes", peer)
    head = await _exactly(read, head_len)
    signature = await _exactly(read, _SIGNATURE_LEN)
    header, meta, digest, chunk, hashes = _authenticate(
        head, signature, body_len, expected_sender, run_id, kinds, round_window
    )
    peer = header.sender
    size = body_len
    body = into(header, meta, size)
    if body.nbytes != size:
        raise ValueError(f"into() gave {body.nbytes} bytes for a body of {size}")
    received = checked = 0
    while received < size:
        piece = await read(min(chunk, size - received))
        if not piece:
            raise asyncio.IncompleteReadError(b"", size - received)
        body[received : received + len(piece)] = piece
        received += len(piece)
        while checked < len(hashes) and min((checked + 1) * chunk, size) <= received:
            lo = checked * chunk
            if blake3.blake3(body[lo : lo + chunk]).digest() != hashes[checked]:
                raise ProtocolError(
                    "bad_chunk", f"chunk {checked} of {len(hashes)} does not match", peer
                )
            checked += 1
            if progress is not None:
                progress(min(checked * chunk, size))
    return Part(header, meta, body, head, signature, digest)
