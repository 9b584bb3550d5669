"""The receiver's side of the part format for bytes in hand: a part, a head, a trailer.

:func:`open_part` is the gate for a part from a peer; the checks run cheapest first
and refuse with the reasons :mod:`protocol.wire.partwire` lists.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import blake3

from protocol.errors import ProtocolError
from protocol.wire._limits import bounded_unpackb
from protocol.wire._partformat import (
    HASH_LEN,
    MAGIC,
    MAX_CHUNK_BYTES,
    MAX_META_ITEMS,
    MAX_TRAILER_BYTES,
    MIN_CHUNK_BYTES,
    PART,
    PREFIX,
    RESERVED,
    SIGNATURE_LEN,
    STREAM_MAGIC,
    TRAILER,
    TRAILER_LEN,
    VERSION,
    Part,
    SealedPart,
    as_bytes_view,
    head_digest,
    trailer_digest,
)
from protocol.wire.messages import MAX_NAME_CHARS, Header, check_header, header_problem

__all__ = [
    "authenticate",
    "is_part",
    "merged",
    "open_evidence",
    "open_head",
    "open_part",
    "open_trailer",
    "part_digest",
    "verify_head",
]


def is_part(data: bytes | bytearray | memoryview) -> bool:
    """Whether ``data`` starts like a part message (it may still be refused)."""
    return bytes(memoryview(data)[: len(MAGIC)]) == MAGIC


def _split(view: memoryview, peer: str | None) -> tuple[memoryview, bytes, memoryview]:
    if view.nbytes < PREFIX.size + SIGNATURE_LEN:
        raise ProtocolError("malformed", f"part message of {view.nbytes} bytes", peer)
    magic, head_len = PREFIX.unpack(view[: PREFIX.size])
    if magic != MAGIC:
        # b"ATP" and another digit: a later layout; anything else is not a part at all
        reason = "bad_version" if magic[:3] == MAGIC[:3] else "malformed"
        raise ProtocolError(reason, f"part magic {magic!r}, expected {MAGIC!r}", peer)
    end = PREFIX.size + head_len
    if head_len == 0 or end + SIGNATURE_LEN > view.nbytes:
        raise ProtocolError("malformed", f"head of {head_len} bytes", peer)
    return (
        view[PREFIX.size : end],
        bytes(view[end : end + SIGNATURE_LEN]),
        view[end + SIGNATURE_LEN :],
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
    if type(version) is not int or version != VERSION:
        raise ProtocolError("bad_version", f"part version {version!r}, expected {VERSION}", peer)
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
        and all(isinstance(h, bytes) and len(h) == HASH_LEN for h in hashes)
    ):
        raise ProtocolError("malformed", "part hashes must be one 32-byte hash per chunk", peer)
    return header, meta


def verify_head(sender: str, head: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is ``sender``'s part signature over ``head`` (evidence)."""
    if not isinstance(head, bytes) or not isinstance(signature, bytes):
        return False
    return PART.verify(sender, head_digest(head), signature)


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
    if view.nbytes < PREFIX.size:
        raise ProtocolError("malformed", f"evidence of {view.nbytes} bytes", peer)
    _, head_len = PREFIX.unpack(view[: PREFIX.size])
    at = PREFIX.size + head_len + SIGNATURE_LEN
    if head_len == 0 or at + TRAILER_LEN.size > view.nbytes:
        raise ProtocolError("malformed", f"head of {head_len} bytes", peer)
    head = bytes(view[PREFIX.size : PREFIX.size + head_len])
    signature = bytes(view[PREFIX.size + head_len : at])
    (trailer_len,) = TRAILER_LEN.unpack(view[at : at + TRAILER_LEN.size])
    trailer = bytes(view[at + TRAILER_LEN.size :])
    if len(trailer) != trailer_len:
        raise ProtocolError(
            "malformed", f"trailer of {len(trailer)} bytes, said {trailer_len}", peer
        )
    header, meta = open_head(head, signature, expected_sender=expected_sender, streamed=True)
    signed = open_trailer(trailer, header.sender, head_digest(head))
    return header, merged(meta, signed)


def open_trailer(data: bytes | memoryview, sender: str, digest: bytes) -> dict[str, Any]:
    """Check a streamed result's trailer frame (trailer, then signature) against the
    sender and the digest of the head it must name; returns its signed fields, the
    chunk hashes included.

    Raises:
        ProtocolError: ``bad_signature``, ``bad_trailer`` (malformed, or naming another
            head) or ``redo`` (the streamed values were given up: fetch the result).
    """
    view = as_bytes_view(data)
    if not SIGNATURE_LEN < view.nbytes <= MAX_TRAILER_BYTES:
        raise ProtocolError("bad_trailer", f"trailer frame of {view.nbytes} bytes", sender)
    trailer, signature = view[:-SIGNATURE_LEN], bytes(view[-SIGNATURE_LEN:])
    if not TRAILER.verify(sender, trailer_digest(trailer), signature):
        raise ProtocolError("bad_signature", "trailer", sender)
    try:
        fields = _unpack_signed(trailer)
    except ValueError as e:
        raise ProtocolError("bad_trailer", f"trailer: {e}", sender) from None
    if not (isinstance(fields, list) and len(fields) == 3 and isinstance(fields[2], dict)):
        raise ProtocolError("bad_trailer", "trailer is not a 3-item array", sender)
    version, named, signed = fields
    if type(version) is not int or version != VERSION:
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
        and all(isinstance(h, bytes) and len(h) == HASH_LEN for h in hashes)
    ):
        raise ProtocolError("bad_trailer", "trailer hashes must be 32-byte hashes", sender)
    return signed


def merged(head_meta: dict[str, Any], signed: dict[str, Any]) -> dict[str, Any]:
    """A streamed result's fields: the head's and the trailer's, the wire's own removed."""
    out = {k: v for k, v in head_meta.items() if k not in RESERVED}
    out.update((k, v) for k, v in signed.items() if k not in RESERVED)
    return out


def part_digest(data: bytes | bytearray | memoryview | SealedPart) -> bytes:
    """The digest a part's signature covers, without checking anything else.

    Raises:
        ProtocolError: ``malformed`` bytes.
    """
    if isinstance(data, SealedPart):
        return data.digest
    head, _, _ = _split(as_bytes_view(data), None)
    return head_digest(head)


def authenticate(
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
    digest = head_digest(head)
    if not PART.verify(header.sender, digest, signature):
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
    view = as_bytes_view(data)
    if view.nbytes > max_bytes:
        raise ProtocolError("oversized", f"{view.nbytes} bytes > {max_bytes}", peer)
    raw_head, signature, body = _split(view, peer)
    head = bytes(raw_head)
    header, meta, digest, chunk, hashes = authenticate(
        head, signature, body.nbytes, expected_sender, run_id, kinds, round_window
    )
    assert hashes is not None  # a part's head always names them
    peer = header.sender
    for k, expected in enumerate(hashes):
        if blake3.blake3(body[k * chunk : (k + 1) * chunk]).digest() != expected:
            raise ProtocolError("bad_chunk", f"chunk {k} of {len(hashes)} does not match", peer)
    return Part(header, meta, body, head, signature, digest)
