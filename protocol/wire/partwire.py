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

**Results streamed back while they are reduced.** An owner that reduces block by block
as the parts arrive can send its result's first blocks before it knows the rest, so
before it can name every chunk's hash or who is in the result. Such a result travels
as a head that names neither, the body, and then a *trailer*, a frame of its own::

    wire      = b"ATS1" | u32 head_len | head | signature (64) | body
    meta      = {..., "size": len(body), "chunk": chunk_bytes, "trailer": True}
    trailer   = msgpack([version, digest, {..., "hashes": [h_0, h_1, ...]}])
    trailer_signature = Ed25519(sender's key, b"atoll/trailer/v1\0"
                                + BLAKE3(b"atoll/trailer/v1\0" + trailer))

The trailer names the head's digest, so it binds to that head alone, and every chunk's
hash, so with it every body byte is bound to the signer as in a part; it also carries
what could not be known at the start (contributors, weights, digests, refusals). A
reader hashes each chunk as it arrives and applies nothing until the trailer's
signature, digest and hashes check (:func:`read_part` with ``trailer``); a mismatch is
``bad_chunk`` (a body byte flipped, chunks swapped), ``bad_trailer`` (a trailer of
another head, or malformed) or ``bad_signature``. A trailer that says ``redo`` tells the
reader that the streamed values were given up (a member was screened out at the end)
and the owner holds a corrected result, which it serves as an ordinary part message
(ProtocolError ``redo``, not counted against the owner). The head with its signature and
the trailer is the result's evidence (:meth:`Part.evidence`, :func:`open_evidence`).
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
    "MAX_TRAILER_BYTES",
    "STREAM_MAGIC",
    "Part",
    "SealedPart",
    "StreamHead",
    "chunk_hashes",
    "is_part",
    "open_evidence",
    "open_head",
    "open_part",
    "open_trailer",
    "part_digest",
    "read_part",
    "seal_part",
    "seal_stream_head",
    "seal_trailer",
    "verify_head",
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

_PREFIX = struct.Struct(">4sI")
_TRAILER_LEN = struct.Struct(">I")
_SIGNATURE_LEN = 64
_HASH_LEN = 32
_VERSION = 1
_DOMAIN = b"atoll/part/v1\0"
_TRAILER_DOMAIN = b"atoll/trailer/v1\0"
_RESERVED = ("size", "chunk", "hashes", "trailer", "redo")
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
        return _PREFIX.size + len(self.head) + _SIGNATURE_LEN + self.body.nbytes + len(self.trailer)

    def evidence(self) -> bytes:
        """The head and signature (and trailer) without the body: proof of what the
        sender signed, kilobytes whatever the body's size (:func:`open_evidence` checks it)."""
        if not self.trailer:
            return _PREFIX.pack(MAGIC, len(self.head)) + self.head + self.signature
        return (
            _PREFIX.pack(STREAM_MAGIC, len(self.head))
            + self.head
            + self.signature
            + _TRAILER_LEN.pack(len(self.trailer))
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
        return [_PREFIX.pack(STREAM_MAGIC, len(self.head)), self.head, self.signature]

    @property
    def nbytes(self) -> int:
        """The message's size on the wire, body included (its first frame)."""
        return _PREFIX.size + len(self.head) + _SIGNATURE_LEN + self.size


def _head_digest(head: bytes | memoryview) -> bytes:
    return blake3.blake3(_DOMAIN + bytes(head)).digest()


def _chunk_hashes(body: memoryview, chunk: int) -> list[bytes]:
    return [blake3.blake3(body[i : i + chunk]).digest() for i in range(0, body.nbytes, chunk)]


def chunk_hashes(
    body: bytes | bytearray | memoryview, chunk_bytes: int = CHUNK_BYTES
) -> list[bytes]:
    """BLAKE3 of each ``chunk_bytes`` of ``body``: what a head or trailer names."""
    return _chunk_hashes(_as_bytes_view(body), chunk_bytes)


def _as_bytes_view(data: Any) -> memoryview:
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def seal_part(
    identity: Identity,
    header: Header,
    meta: dict[str, Any],
    body: bytes | bytearray | memoryview,
    chunk_bytes: int = CHUNK_BYTES,
    hashes: list[bytes] | None = None,
) -> SealedPart:
    """Sign ``meta`` and ``body`` as one part message (``hashes``: the body's chunk
    hashes when the caller has them already, :func:`chunk_hashes`).

    Raises:
        ValueError: the sender is not ``identity``, a header field is out of range,
            ``meta`` uses a reserved key (``size``, ``chunk``, ``hashes``, ``trailer``,
            ``redo``) or non-str keys, or ``chunk_bytes`` is outside ``[2**12, 2**26]``.
    """
    _check_seal(identity, header, meta, chunk_bytes)
    view = _as_bytes_view(body)
    if hashes is None:
        hashes = _chunk_hashes(view, chunk_bytes)
    elif len(hashes) != -(-view.nbytes // chunk_bytes):
        raise ValueError(f"{len(hashes)} hashes for a body of {view.nbytes} bytes")
    signed_meta = dict(meta, size=view.nbytes, chunk=chunk_bytes, hashes=list(hashes))
    head = _pack_head(header, signed_meta)
    digest = _head_digest(head)
    return SealedPart(head, identity.sign(_DOMAIN + digest), view, digest)


def seal_stream_head(
    identity: Identity,
    header: Header,
    meta: dict[str, Any],
    size: int,
    chunk_bytes: int = CHUNK_BYTES,
) -> StreamHead:
    """Sign the head of a result whose ``size`` body bytes follow as they are reduced,
    and whose chunk hashes come in its trailer (:func:`seal_trailer`).

    Raises:
        ValueError: as :func:`seal_part`, or a negative ``size``.
    """
    _check_seal(identity, header, meta, chunk_bytes)
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    head = _pack_head(header, dict(meta, size=size, chunk=chunk_bytes, trailer=True))
    digest = _head_digest(head)
    return StreamHead(head, identity.sign(_DOMAIN + digest), digest, size, chunk_bytes)


def seal_trailer(
    identity: Identity,
    head: StreamHead,
    meta: dict[str, Any],
    hashes: list[bytes] | None = None,
) -> bytes:
    """The signed trailer of a streamed result: ``meta`` and the hash of every chunk of
    the body as sent (:func:`chunk_hashes`), or, with ``hashes`` None, a ``redo``
    trailer (the streamed values were given up). Returns the trailer frame's bytes
    (trailer, then its 64-byte signature).

    Raises:
        ValueError: a reserved or non-str key in ``meta``, hashes that do not cover
            ``head.size`` bytes, or a trailer above :data:`MAX_TRAILER_BYTES`.
    """
    _check_meta(meta)
    if hashes is None:
        signed: dict[str, Any] = {"redo": True}
    else:
        if len(hashes) != -(-head.size // head.chunk):
            raise ValueError(f"{len(hashes)} hashes for a body of {head.size} bytes")
        signed = dict(meta, hashes=list(hashes))
    trailer = msgpack.packb([_VERSION, head.digest, signed], use_bin_type=True)
    if len(trailer) + _SIGNATURE_LEN > MAX_TRAILER_BYTES:
        raise ValueError(f"trailer of {len(trailer)} bytes exceeds {MAX_TRAILER_BYTES}")
    return trailer + identity.sign(_TRAILER_DOMAIN + _trailer_digest(trailer))


def _trailer_digest(trailer: bytes | memoryview) -> bytes:
    return blake3.blake3(_TRAILER_DOMAIN + bytes(trailer)).digest()


def _check_meta(meta: dict[str, Any]) -> None:
    if not all(isinstance(k, str) for k in meta) or any(k in meta for k in _RESERVED):
        raise ValueError(f"meta keys must be str and none of {_RESERVED}")


def _check_seal(identity: Identity, header: Header, meta: dict[str, Any], chunk_bytes: int) -> None:
    if header.sender != identity.peer_id:
        raise ValueError(f"header.sender {header.sender!r} is not this identity")
    problem = header_problem(header)
    if problem:
        raise ValueError(problem)
    _check_meta(meta)
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}]")


def _pack_head(header: Header, signed_meta: dict[str, Any]) -> bytes:
    return msgpack.packb(
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


def _unpack_signed(data: memoryview | bytes) -> Any:
    """A head or trailer, under hard msgpack limits (ValueError otherwise)."""
    return bounded_unpackb(
        data,
        max_container=MAX_META_ITEMS + 2**16,
        max_str_len=max(MAX_NAME_CHARS, 1 << 16),
        max_items=MAX_META_ITEMS + 2**16,
    )


def _parse_head(
    head: memoryview | bytes, peer: str | None, streamed: bool = False
) -> tuple[Header, dict[str, Any]]:
    try:
        fields = _unpack_signed(head)
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
    if "redo" in meta:
        raise ProtocolError("malformed", "a head says nothing of redo", peer)
    if streamed:
        if meta.get("trailer") is not True or "hashes" in meta:
            raise ProtocolError("malformed", "a streamed head names its trailer, no hashes", peer)
        return header, meta
    if "trailer" in meta:
        raise ProtocolError("malformed", "a part's head names no trailer", peer)
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
    head: bytes, signature: bytes, *, expected_sender: str | None = None, streamed: bool = False
) -> tuple[Header, dict[str, Any]]:
    """Parse and authenticate a head kept as evidence (no body needed); ``streamed``
    for the head of a result streamed back (:func:`seal_stream_head`).

    Raises:
        ProtocolError: ``malformed``, ``bad_version``, ``sender_mismatch`` or
            ``bad_signature``.
    """
    header, meta = _parse_head(head, expected_sender, streamed)
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
    if data[: len(STREAM_MAGIC)] == STREAM_MAGIC:
        return _open_streamed_evidence(data, expected_sender)
    head, signature, rest = _split(memoryview(data), expected_sender)
    if rest.nbytes:
        raise ProtocolError("trailing_bytes", "evidence holds body bytes", expected_sender)
    return open_head(bytes(head), signature, expected_sender=expected_sender)


def _open_streamed_evidence(
    data: bytes, expected_sender: str | None
) -> tuple[Header, dict[str, Any]]:
    peer = expected_sender
    view = memoryview(data)
    if view.nbytes < _PREFIX.size:
        raise ProtocolError("malformed", f"evidence of {view.nbytes} bytes", peer)
    _, head_len = _PREFIX.unpack(view[: _PREFIX.size])
    at = _PREFIX.size + head_len + _SIGNATURE_LEN
    if head_len == 0 or at + _TRAILER_LEN.size > view.nbytes:
        raise ProtocolError("malformed", f"head of {head_len} bytes", peer)
    head = bytes(view[_PREFIX.size : _PREFIX.size + head_len])
    signature = bytes(view[_PREFIX.size + head_len : at])
    (trailer_len,) = _TRAILER_LEN.unpack(view[at : at + _TRAILER_LEN.size])
    trailer = bytes(view[at + _TRAILER_LEN.size :])
    if len(trailer) != trailer_len:
        raise ProtocolError(
            "malformed", f"trailer of {len(trailer)} bytes, said {trailer_len}", peer
        )
    header, meta = open_head(head, signature, expected_sender=expected_sender, streamed=True)
    signed = open_trailer(trailer, header.sender, _head_digest(head))
    return header, _merged(meta, signed)


def open_trailer(data: bytes | memoryview, sender: str, digest: bytes) -> dict[str, Any]:
    """Check a streamed result's trailer frame (trailer, then signature) against the
    sender and the digest of the head it must name; returns its signed fields, the
    chunk hashes included.

    Raises:
        ProtocolError: ``bad_signature``, ``bad_trailer`` (malformed, or naming another
            head) or ``redo`` (the streamed values were given up: fetch the result).
    """
    view = _as_bytes_view(data)
    if not _SIGNATURE_LEN < view.nbytes <= MAX_TRAILER_BYTES:
        raise ProtocolError("bad_trailer", f"trailer frame of {view.nbytes} bytes", sender)
    trailer, signature = view[:-_SIGNATURE_LEN], bytes(view[-_SIGNATURE_LEN:])
    if not verify(sender, _TRAILER_DOMAIN + _trailer_digest(trailer), signature):
        raise ProtocolError("bad_signature", "trailer", sender)
    try:
        fields = _unpack_signed(trailer)
    except ValueError as e:
        raise ProtocolError("bad_trailer", f"trailer: {e}", sender) from None
    if not (isinstance(fields, list) and len(fields) == 3 and isinstance(fields[2], dict)):
        raise ProtocolError("bad_trailer", "trailer is not a 3-item array", sender)
    version, named, signed = fields
    if type(version) is not int or version != _VERSION:
        raise ProtocolError("bad_trailer", f"trailer version {version!r}", sender)
    if named != digest:
        raise ProtocolError("bad_trailer", "the trailer names another head", sender)
    if not all(isinstance(k, str) for k in signed):
        raise ProtocolError("bad_trailer", "trailer keys must be str", sender)
    if signed.get("redo") is True:
        raise ProtocolError("redo", "the owner gave its streamed values up", sender)
    hashes = signed.get("hashes")
    if "redo" in signed or not (
        isinstance(hashes, list)
        and all(isinstance(h, bytes) and len(h) == _HASH_LEN for h in hashes)
    ):
        raise ProtocolError("bad_trailer", "trailer hashes must be 32-byte hashes", sender)
    return signed


def _merged(head_meta: dict[str, Any], signed: dict[str, Any]) -> dict[str, Any]:
    """A streamed result's fields: the head's and the trailer's, the wire's own removed."""
    out = {k: v for k, v in head_meta.items() if k not in _RESERVED}
    out.update((k, v) for k, v in signed.items() if k not in _RESERVED)
    return out


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
    streamed: bool = False,
) -> tuple[Header, dict[str, Any], bytes, int, list[bytes] | None]:
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
    header, meta = _parse_head(head, peer, streamed)
    if expected_sender is not None and header.sender != expected_sender:
        raise ProtocolError(
            "sender_mismatch", f"signed sender {header.sender} is not the stream peer", peer
        )
    peer = header.sender
    digest = _head_digest(head)
    if not verify(header.sender, _DOMAIN + digest, signature):
        raise ProtocolError("bad_signature", f"{header.kind} r{header.round}", peer)
    check_header(header, run_id=run_id, kinds=kinds, round_window=round_window)
    size, chunk, hashes = meta.pop("size"), meta.pop("chunk"), meta.pop("hashes", None)
    meta.pop("trailer", None)
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
    assert hashes is not None  # a part's head always names them
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
    trailer: Callable[[], Awaitable[bytes | memoryview]] | None = None,
) -> Part:
    """Read a part message of ``length`` bytes from a stream, checking as it comes.

    ``read(n)`` returns up to ``n`` of the stream's next bytes (``b""`` at its end):
    a ``StreamReader``'s ``read``, or a framing's paced reader. When ``read`` also has
    ``into(view)`` (reads up to ``view.nbytes`` bytes into ``view``, returns how many),
    the body goes through it straight into its destination.

    The same checks as :func:`open_part`, in stream order: the head and its signature
    before any body byte is read, the body's length against the signed size before it
    is read, then each chunk against its hash as soon as it is in. The body is read
    into the buffer ``into(header, meta, size)`` returns (a writable view of ``size``
    bytes: the destination itself, when the caller can take the raw bytes as they are).
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
    peer = expected_sender
    if length > max_bytes:
        raise ProtocolError("oversized", f"{length} bytes > {max_bytes}", peer)
    if length < _PREFIX.size + _SIGNATURE_LEN:
        raise ProtocolError("malformed", f"part message of {length} bytes", peer)
    magic, head_len = _PREFIX.unpack(await _exactly(read, _PREFIX.size))
    streamed = magic == STREAM_MAGIC and trailer is not None
    if magic != MAGIC and not streamed:
        if magic == STREAM_MAGIC:
            raise ProtocolError("wrong_kind", "a streamed result where a part is due", peer)
        reason = "bad_version" if magic[:3] == MAGIC[:3] else "malformed"
        raise ProtocolError(reason, f"part magic {magic!r}, expected {MAGIC!r}", peer)
    body_len = length - _PREFIX.size - head_len - _SIGNATURE_LEN
    if head_len == 0 or head_len > _MAX_HEAD_BYTES or body_len < 0:
        raise ProtocolError("malformed", f"head of {head_len} bytes", peer)
    head = await _exactly(read, head_len)
    signature = await _exactly(read, _SIGNATURE_LEN)
    header, meta, digest, chunk, hashes = _authenticate(
        head, signature, body_len, expected_sender, run_id, kinds, round_window, streamed
    )
    peer = header.sender
    size = body_len
    body = into(header, meta, size)
    if body.nbytes != size:
        raise ValueError(f"into() gave {body.nbytes} bytes for a body of {size}")
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
    if not streamed:
        return Part(header, meta, body, head, signature, digest)
    assert trailer is not None
    frame = bytes(await trailer())
    signed = open_trailer(frame, peer, digest)
    named = signed["hashes"]
    if len(named) != len(computed):
        detail = f"the trailer names {len(named)} chunks, the body has {len(computed)}"
        raise ProtocolError("bad_chunk", detail, peer)
    for k, (expected, got) in enumerate(zip(named, computed, strict=True)):
        if expected != got:
            raise ProtocolError("bad_chunk", f"chunk {k} of {len(named)} does not match", peer)
    return Part(header, _merged(meta, signed), body, head, signature, digest, frame)
