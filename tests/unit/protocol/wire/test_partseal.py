"""Sealing parts, streamed heads and trailers: what a sender signs, and what it refuses
to sign."""

from __future__ import annotations

import msgpack
import pytest

from protocol.wire._partformat import DOMAIN, MAX_TRAILER_BYTES, TRAILER_DOMAIN, trailer_digest
from protocol.wire._partseal import seal_part, seal_stream_head, seal_trailer
from protocol.wire.messages import Header
from verification.identity import Identity, verify

ME = Identity.from_seed(b"s" * 32)
HEADER = Header("part", "run", 3, 1, 2, ME.peer_id)


def test_a_part_signs_its_header_meta_size_and_chunk_hashes() -> None:
    sealed = seal_part(ME, HEADER, {"weight": 2.0}, bytes(10_000), chunk_bytes=4096)
    version, kind, run, r, f, p, sender, meta = msgpack.unpackb(sealed.head)
    assert (version, kind, run, r, f, p, sender) == (1, "part", "run", 3, 1, 2, ME.peer_id)
    assert meta["weight"] == 2.0 and meta["size"] == 10_000 and meta["chunk"] == 4096
    assert len(meta["hashes"]) == 3
    assert verify(ME.peer_id, DOMAIN + sealed.digest, sealed.signature)


def test_a_sender_signs_only_as_itself_and_only_sound_fields() -> None:
    other = Header("part", "run", 3, 1, 2, Identity.from_seed(b"o" * 32).peer_id)
    with pytest.raises(ValueError, match="not this identity"):
        seal_part(ME, other, {}, b"x")
    with pytest.raises(ValueError, match="reserved|must be str"):
        seal_part(ME, HEADER, {"size": 1}, b"x")
    with pytest.raises(ValueError, match="chunk_bytes"):
        seal_part(ME, HEADER, {}, b"x", chunk_bytes=100)
    with pytest.raises(ValueError, match="2 hashes"):
        seal_part(ME, HEADER, {}, b"x", hashes=[b"h" * 32, b"h" * 32])


def test_a_streamed_head_names_its_trailer_and_no_hashes() -> None:
    head = seal_stream_head(ME, HEADER, {"content": "update"}, 5000, chunk_bytes=4096)
    meta = msgpack.unpackb(head.head)[-1]
    assert meta == {"content": "update", "size": 5000, "chunk": 4096, "trailer": True}
    assert (head.size, head.chunk) == (5000, 4096)
    with pytest.raises(ValueError, match="size"):
        seal_stream_head(ME, HEADER, {}, -1)


def test_a_trailer_binds_the_head_and_a_redo_trailer_carries_nothing_else() -> None:
    head = seal_stream_head(ME, HEADER, {}, 5000, chunk_bytes=4096)
    frame = seal_trailer(ME, head, {"contributors": ["a"]}, [b"1" * 32, b"2" * 32])
    trailer, signature = frame[:-64], frame[-64:]
    version, digest, signed = msgpack.unpackb(trailer)
    assert (version, digest) == (1, head.digest)
    assert signed == {"contributors": ["a"], "hashes": [b"1" * 32, b"2" * 32]}
    assert verify(ME.peer_id, TRAILER_DOMAIN + trailer_digest(trailer), signature)
    assert msgpack.unpackb(seal_trailer(ME, head, {"ignored": 1}, None)[:-64])[2] == {"redo": True}
    with pytest.raises(ValueError, match="1 hashes"):
        seal_trailer(ME, head, {}, [b"1" * 32])
    chunks = MAX_TRAILER_BYTES // 32 + 1  # more hashes than a trailer may hold
    big = seal_stream_head(ME, HEADER, {}, chunks * 4096, chunk_bytes=4096)
    with pytest.raises(ValueError, match=str(MAX_TRAILER_BYTES)):
        seal_trailer(ME, big, {}, [b"h" * 32] * chunks)
