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

The format's types and constants are in :mod:`protocol.wire._partformat`, the sender's
side in :mod:`protocol.wire._partseal`, the receiver's in :mod:`protocol.wire._partopen`
(bytes in hand) and :mod:`protocol.wire._partread` (a stream); this module is where the
rest of Atoll imports them from.
"""

from __future__ import annotations

from protocol.wire._partformat import (
    CHUNK_BYTES,
    MAGIC,
    MAX_CHUNK_BYTES,
    MAX_META_ITEMS,
    MAX_TRAILER_BYTES,
    MIN_CHUNK_BYTES,
    STREAM_MAGIC,
    Part,
    SealedPart,
    StreamHead,
    chunk_hashes,
)
from protocol.wire._partopen import (
    is_part,
    open_evidence,
    open_head,
    open_part,
    open_trailer,
    part_digest,
    verify_head,
)
from protocol.wire._partread import read_part
from protocol.wire._partseal import seal_part, seal_stream_head, seal_trailer

__all__ = [
    "CHUNK_BYTES",
    "MAGIC",
    "MAX_CHUNK_BYTES",
    "MAX_META_ITEMS",
    "MAX_TRAILER_BYTES",
    "MIN_CHUNK_BYTES",
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
