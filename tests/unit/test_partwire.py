"""The part wire format: the signed head binds every body byte."""

from __future__ import annotations

import pytest
import torch

from protocol.errors import ProtocolError
from protocol.wire.messages import Header
from protocol.wire.partwire import (
    MIN_CHUNK_BYTES,
    is_part,
    open_head,
    open_part,
    part_digest,
    seal_part,
    verify_head,
)
from verification.identity import Identity

CHUNK = MIN_CHUNK_BYTES
MAX = 2**26


@pytest.fixture(scope="module")
def me() -> Identity:
    return Identity.generate()


def _body(n_chunks: float = 3.5) -> bytes:
    g = torch.Generator().manual_seed(0)
    n = int(n_chunks * CHUNK) // 4
    return torch.randn(n, generator=g).numpy().tobytes()


def _sealed(me: Identity, body: bytes, **meta) -> bytes:
    header = Header("part", "run", 3, 1, 2, me.peer_id)
    return seal_part(me, header, {"weight": 7, **meta}, body, chunk_bytes=CHUNK).to_bytes()


def _reason(data: bytes | bytearray, **kw) -> str:
    with pytest.raises(ProtocolError) as info:
        open_part(bytes(data), max_bytes=MAX, **kw)
    return info.value.reason


def test_a_sealed_part_opens_to_the_same_fields_and_body_without_a_copy(me) -> None:
    body = _body()
    wire = bytearray(_sealed(me, body, group=["a", "b"]))
    part = open_part(
        wire,
        max_bytes=MAX,
        expected_sender=me.peer_id,
        run_id="run",
        kinds=("part",),
        round_window=(2, 4),
    )
    assert (part.header.round, part.header.fragment, part.header.part) == (3, 1, 2)
    assert part.meta == {"weight": 7, "group": ["a", "b"]}
    assert bytes(part.body) == body
    wire[-1] ^= 0xFF  # the body is a view into the received buffer
    assert part.body[-1] == wire[-1]
    assert part.digest == part_digest(bytes(wire)) and is_part(wire)


def test_every_body_byte_is_bound(me) -> None:
    body = _body()
    wire = _sealed(me, body)
    start = len(wire) - len(body)
    flipped = bytearray(wire)
    flipped[start + 2 * CHUNK + 5] ^= 0x01
    assert _reason(flipped) == "bad_chunk"
    swapped = bytearray(wire)
    first = bytes(swapped[start : start + CHUNK])
    swapped[start : start + CHUNK] = swapped[start + CHUNK : start + 2 * CHUNK]
    swapped[start + CHUNK : start + 2 * CHUNK] = first
    assert _reason(swapped) == "bad_chunk"
    assert _reason(wire[:-1]) == "truncated"
    assert _reason(wire + b"\0") == "trailing_bytes"


def test_every_head_byte_is_bound(me) -> None:
    wire = _sealed(me, _body(1))
    head_at = 8 + 10  # inside the head, past its first fields
    flipped = bytearray(wire)
    flipped[head_at] ^= 0x01
    assert _reason(flipped) in {"bad_signature", "malformed"}
    sig = bytearray(wire)
    sig[len(wire) - len(_body(1)) - 1] ^= 0x01  # last byte of the signature
    assert _reason(sig) == "bad_signature"


def test_header_checks_name_their_reason(me) -> None:
    wire = _sealed(me, _body(1))
    other = Identity.generate().peer_id
    assert _reason(wire, expected_sender=other) == "sender_mismatch"
    assert _reason(wire, run_id="another") == "wrong_run"
    assert _reason(wire, kinds=("reduced",)) == "wrong_kind"
    assert _reason(wire, round_window=(4, 6)) == "stale_round"
    with pytest.raises(ProtocolError) as info:
        open_part(wire, max_bytes=len(wire) - 1)
    assert info.value.reason == "oversized"
    assert _reason(b"ATP2" + wire[4:]) == "bad_version"
    assert _reason(b"junk") == "malformed"
    assert _reason(wire[:8] + b"\x93" * 80) == "malformed"


def test_the_head_alone_is_evidence(me) -> None:
    header = Header("reduced", "run", 3, 1, 2, me.peer_id)
    sealed = seal_part(me, header, {"contributors": [me.peer_id]}, _body(2), chunk_bytes=CHUNK)
    assert verify_head(me.peer_id, sealed.head, sealed.signature)
    h, meta = open_head(sealed.head, sealed.signature, expected_sender=me.peer_id)
    assert h == header and meta["contributors"] == [me.peer_id]
    assert not verify_head(Identity.generate().peer_id, sealed.head, sealed.signature)
    with pytest.raises(ProtocolError) as info:
        open_head(sealed.head, bytes(64))
    assert info.value.reason == "bad_signature"


def test_an_empty_body_and_bad_arguments(me) -> None:
    part = open_part(_sealed(me, b""), max_bytes=MAX)
    assert part.body.nbytes == 0
    header = Header("part", "run", 0, 0, 0, me.peer_id)
    with pytest.raises(ValueError, match="reserved|none of"):
        seal_part(me, header, {"hashes": []}, b"")
    with pytest.raises(ValueError, match="chunk_bytes"):
        seal_part(me, header, {}, b"", chunk_bytes=1)
    with pytest.raises(ValueError, match="identity"):
        seal_part(Identity.generate(), header, {}, b"")
