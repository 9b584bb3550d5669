"""The part format's records: a sealed part's wire bytes, a received part's evidence,
a streamed head's size, and the hashes that bind a body."""

from __future__ import annotations

import blake3

from protocol.wire._partformat import (
    CHUNK_BYTES,
    DOMAIN,
    MAGIC,
    PREFIX,
    SIGNATURE_LEN,
    STREAM_MAGIC,
    TRAILER_LEN,
    Part,
    SealedPart,
    StreamHead,
    chunk_hashes,
    head_digest,
    trailer_digest,
)
from protocol.wire.messages import Header


def test_a_sealed_part_is_prefix_head_signature_body_without_copying_the_body() -> None:
    body = bytearray(b"body bytes")
    sealed = SealedPart(b"HEAD", b"s" * SIGNATURE_LEN, memoryview(body), b"d" * 32)
    buffers = sealed.buffers()
    assert buffers[0] == PREFIX.pack(MAGIC, 4) and buffers[1:3] == [b"HEAD", b"s" * 64]
    assert buffers[3].obj is body  # a view of the sender's buffer
    assert sealed.to_bytes() == b"ATP1\x00\x00\x00\x04HEAD" + b"s" * 64 + b"body bytes"
    assert sealed.nbytes == len(sealed.to_bytes())


def test_evidence_is_the_signed_head_without_the_body() -> None:
    header = Header("reduced", "run", 1, 0, 2, "peer")
    part = Part(header, {}, memoryview(bytes(1 << 16)), b"HEAD", b"s" * 64, b"d" * 32)
    assert part.evidence() == PREFIX.pack(MAGIC, 4) + b"HEAD" + b"s" * 64
    assert part.nbytes == PREFIX.size + 4 + 64 + (1 << 16)
    streamed = Part(header, {}, memoryview(b""), b"HEAD", b"s" * 64, b"d" * 32, b"TRAILER")
    assert streamed.evidence() == (
        PREFIX.pack(STREAM_MAGIC, 4) + b"HEAD" + b"s" * 64 + TRAILER_LEN.pack(7) + b"TRAILER"
    )
    assert streamed.nbytes == PREFIX.size + 4 + 64 + 7


def test_a_stream_head_counts_the_body_that_follows_it() -> None:
    head = StreamHead(b"HEAD", b"s" * 64, b"d" * 32, size=1000, chunk=4096)
    assert b"".join(head.buffers()) == PREFIX.pack(STREAM_MAGIC, 4) + b"HEAD" + b"s" * 64
    assert head.nbytes == PREFIX.size + 4 + 64 + 1000


def test_one_hash_per_chunk_and_domain_tagged_digests() -> None:
    body = bytes(range(256)) * 40  # 10 240 bytes
    hashes = chunk_hashes(body, 4096)
    assert len(hashes) == 3 and hashes[2] == blake3.blake3(body[8192:]).digest()
    assert chunk_hashes(memoryview(body).cast("I"), 4096) == hashes  # any buffer, as bytes
    assert len(chunk_hashes(b"x", CHUNK_BYTES)) == 1 and chunk_hashes(b"") == []
    assert head_digest(b"h") == blake3.blake3(DOMAIN + b"h").digest()
    assert trailer_digest(b"h") != head_digest(b"h")  # a trailer never passes as a head
