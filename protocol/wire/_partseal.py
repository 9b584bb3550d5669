"""The sender's side of the part format: a part, or a streamed result's head and trailer, signed.

The layout is described in :mod:`protocol.wire.partwire`.
"""

from __future__ import annotations

from typing import Any

import msgpack

from protocol.wire._partformat import (
    CHUNK_BYTES,
    MAX_CHUNK_BYTES,
    MAX_TRAILER_BYTES,
    MIN_CHUNK_BYTES,
    PART,
    RESERVED,
    SIGNATURE_LEN,
    TRAILER,
    VERSION,
    SealedPart,
    StreamHead,
    as_bytes_view,
    hash_chunks,
    head_digest,
    trailer_digest,
)
from protocol.wire.messages import Header, header_problem
from verification.identity import Identity

__all__ = ["seal_part", "seal_stream_head", "seal_trailer"]


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
    view = as_bytes_view(body)
    if hashes is None:
        hashes = hash_chunks(view, chunk_bytes)
    elif len(hashes) != -(-view.nbytes // chunk_bytes):
        raise ValueError(f"{len(hashes)} hashes for a body of {view.nbytes} bytes")
    signed_meta = dict(meta, size=view.nbytes, chunk=chunk_bytes, hashes=list(hashes))
    head = _pack_head(header, signed_meta)
    digest = head_digest(head)
    return SealedPart(head, PART.sign(identity, digest), view, digest)


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
    digest = head_digest(head)
    return StreamHead(head, PART.sign(identity, digest), digest, size, chunk_bytes)


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
    trailer = msgpack.packb([VERSION, head.digest, signed], use_bin_type=True)
    if len(trailer) + SIGNATURE_LEN > MAX_TRAILER_BYTES:
        raise ValueError(f"trailer of {len(trailer)} bytes exceeds {MAX_TRAILER_BYTES}")
    return trailer + TRAILER.sign(identity, trailer_digest(trailer))


def _check_meta(meta: dict[str, Any]) -> None:
    if not all(isinstance(k, str) for k in meta) or any(k in meta for k in RESERVED):
        raise ValueError(f"meta keys must be str and none of {RESERVED}")


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
            VERSION,
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
