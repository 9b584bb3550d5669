"""Opening a part from bytes: the checks run cheapest first, each refusal with its reason;
evidence and trailers checked without the body."""

from __future__ import annotations

import pytest

from protocol.errors import ProtocolError
from protocol.wire._partformat import PREFIX, Part
from protocol.wire._partopen import (
    is_part,
    merged,
    open_evidence,
    open_head,
    open_part,
    open_trailer,
    part_digest,
    verify_head,
)
from protocol.wire._partseal import seal_part, seal_stream_head, seal_trailer
from protocol.wire.messages import Header
from verification.identity import Identity

ME = Identity.from_seed(b"p" * 32)
OTHER = Identity.from_seed(b"q" * 32)
HEADER = Header("part", "run", 3, 1, 2, ME.peer_id)
BODY = bytes(range(256)) * 40


def _wire(meta: dict | None = None) -> bytes:
    return seal_part(ME, HEADER, meta or {"w": 1}, BODY, chunk_bytes=4096).to_bytes()


def _reason(**kwargs) -> str:
    data = kwargs.pop("data")
    with pytest.raises(ProtocolError) as info:
        open_part(data, max_bytes=1 << 20, **kwargs)
    return info.value.reason


def test_a_sound_part_opens_with_its_fields_and_body() -> None:
    part = open_part(_wire(), max_bytes=1 << 20, expected_sender=ME.peer_id, run_id="run")
    assert part.header == HEADER and part.meta == {"w": 1}
    assert bytes(part.body) == BODY and part.digest == part_digest(_wire())
    assert is_part(_wire()) and not is_part(b"ATS1....")


def test_each_kind_of_damage_has_its_own_reason() -> None:
    wire = _wire()
    flipped = bytearray(wire)
    flipped[-1] ^= 1
    assert _reason(data=bytes(flipped)) == "bad_chunk"
    assert _reason(data=wire[:-1]) == "truncated"
    assert _reason(data=wire + b"x") == "trailing_bytes"
    assert _reason(data=b"ATP2" + wire[4:]) == "bad_version"
    assert _reason(data=b"JUNK" + wire[4:]) == "malformed"
    assert _reason(data=wire, expected_sender=OTHER.peer_id) == "sender_mismatch"
    assert _reason(data=wire, run_id="another") == "wrong_run"
    signature_at = PREFIX.size + int.from_bytes(wire[4:8], "big")
    forged = bytearray(wire)
    forged[signature_at] ^= 1
    assert _reason(data=bytes(forged)) == "bad_signature"
    with pytest.raises(ProtocolError) as info:
        open_part(wire, max_bytes=len(wire) - 1)
    assert info.value.reason == "oversized"


def test_evidence_proves_what_was_signed_without_the_body() -> None:
    sealed = seal_part(ME, HEADER, {"w": 1}, BODY, chunk_bytes=4096)
    part = Part(HEADER, {}, sealed.body, sealed.head, sealed.signature, sealed.digest)
    header, meta = open_evidence(part.evidence(), expected_sender=ME.peer_id)
    assert header == HEADER and meta["w"] == 1 and meta["size"] == len(BODY)
    assert verify_head(ME.peer_id, sealed.head, sealed.signature)
    assert not verify_head(OTHER.peer_id, sealed.head, sealed.signature)
    with pytest.raises(ProtocolError, match="trailing_bytes"):
        open_evidence(sealed.to_bytes())
    with pytest.raises(ProtocolError, match="sender_mismatch"):
        open_head(sealed.head, sealed.signature, expected_sender=OTHER.peer_id)


def test_a_trailer_is_checked_against_its_signer_and_its_head() -> None:
    head = seal_stream_head(ME, HEADER, {"content": "update"}, len(BODY), chunk_bytes=4096)
    frame = seal_trailer(ME, head, {"contributors": ["a"]}, [b"h" * 32] * 3)
    signed = open_trailer(frame, ME.peer_id, head.digest)
    assert signed["contributors"] == ["a"] and len(signed["hashes"]) == 3
    reasons = []
    for data, sender, digest in [
        (frame, OTHER.peer_id, head.digest),
        (frame, ME.peer_id, b"x" * 32),
        (seal_trailer(ME, head, {}, None), ME.peer_id, head.digest),
        (b"short", ME.peer_id, head.digest),
    ]:
        with pytest.raises(ProtocolError) as info:
            open_trailer(data, sender, digest)
        reasons.append(info.value.reason)
    assert reasons == ["bad_signature", "bad_trailer", "redo", "bad_trailer"]


def test_a_streamed_results_fields_are_the_heads_and_the_trailers_without_the_wires() -> None:
    head_meta = {"content": "update", "size": 10, "chunk": 4096, "trailer": True}
    signed = {"contributors": ["a"], "hashes": [b"h" * 32]}
    assert merged(head_meta, signed) == {"content": "update", "contributors": ["a"]}
