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


# ---- the same message read off a stream ----------------------------------------------------


def _read(data: bytes | bytearray, feed: int | None = None, **kw) -> tuple[object, bytearray]:
    """read_part over a stream fed ``data[:feed]`` (all of it, then EOF, by default)."""
    import asyncio

    from protocol.wire.partwire import read_part

    dest = bytearray()

    def into(header, meta, size) -> memoryview:
        dest.extend(bytes(size))
        return memoryview(dest)

    async def main() -> object:
        reader = asyncio.StreamReader()
        reader.feed_data(bytes(data[:feed]))
        if feed is None:
            reader.feed_eof()
        return await asyncio.wait_for(
            read_part(reader.read, len(data), into, max_bytes=kw.pop("max_bytes", MAX), **kw), 5
        )

    return asyncio.run(main()), dest


def _read_reason(data: bytes | bytearray, **kw) -> str:
    with pytest.raises(ProtocolError) as info:
        _read(data, **kw)
    return info.value.reason


def test_a_part_read_off_a_stream_lands_in_the_callers_buffer(me) -> None:
    body = _body()
    part, dest = _read(_sealed(me, body, group=["a"]), expected_sender=me.peer_id)
    assert bytes(dest) == body and part.body.obj is dest
    assert part.meta == {"weight": 7, "group": ["a"]}


def _tampered(wire: bytes, body_len: int) -> tuple[bytearray, bytearray, bytearray]:
    """``wire`` with one body byte flipped, its first two chunks swapped, one head byte
    flipped."""
    start = len(wire) - body_len
    flipped = bytearray(wire)
    flipped[start + 2 * CHUNK + 5] ^= 0x01
    swapped = bytearray(wire)
    swapped[start : start + CHUNK], swapped[start + CHUNK : start + 2 * CHUNK] = (
        wire[start + CHUNK : start + 2 * CHUNK],
        wire[start : start + CHUNK],
    )
    head = bytearray(wire)
    head[8 + 10] ^= 0x01
    return flipped, swapped, head


def test_a_stream_is_refused_for_the_same_reasons_as_a_message(me) -> None:
    body = _body()
    wire = _sealed(me, body)
    flipped, swapped, head = _tampered(wire, len(body))
    for data, kw, reason in [
        (flipped, {}, "bad_chunk"),
        (swapped, {}, "bad_chunk"),
        (wire[:-1], {}, "truncated"),
        (wire + b"\0", {}, "trailing_bytes"),
        (wire, {"expected_sender": Identity.generate().peer_id}, "sender_mismatch"),
        (wire, {"run_id": "another"}, "wrong_run"),
        (wire, {"kinds": ("reduced",)}, "wrong_kind"),
        (wire, {"round_window": (4, 6)}, "stale_round"),
        (wire, {"max_bytes": len(wire) - 1}, "oversized"),
        (b"ATP2" + wire[4:], {}, "bad_version"),
        (b"junk" + bytes(80), {}, "malformed"),
    ]:
        assert _read_reason(data, **kw) == reason, reason
    assert _read_reason(head) in {"bad_signature", "malformed"}


def test_a_bad_signature_is_refused_before_any_body_byte_is_read(me) -> None:
    body = _body()
    wire = bytearray(_sealed(me, body))
    start = len(wire) - len(body)
    wire[start - 1] ^= 0x01  # the signature's last byte
    # only the head and signature arrive (the body never does, the stream stays open):
    # the refusal comes anyway, and no destination was asked for
    with pytest.raises(ProtocolError) as info:
        _read(wire, feed=start)
    assert info.value.reason == "bad_signature"


def test_a_stream_that_ends_mid_body_is_incomplete(me) -> None:
    import asyncio

    wire = _sealed(me, _body())
    with pytest.raises(asyncio.IncompleteReadError):
        _read_eof_early(wire)


def _read_eof_early(wire: bytes) -> None:
    import asyncio

    from protocol.wire.partwire import read_part

    async def main() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(wire[:-100])
        reader.feed_eof()
        await read_part(
            reader.read, len(wire), lambda h, m, n: memoryview(bytearray(n)), max_bytes=MAX
        )

    asyncio.run(main())


# ---- results streamed back: a head without hashes, the body, a signed trailer ----------


def _streamed(me: Identity, body: bytes, signed: dict | None = None, redo: bool = False):
    """(first frame, trailer frame, head) of a result streamed back."""
    from protocol.wire.partwire import chunk_hashes, seal_stream_head, seal_trailer

    header = Header("reduced", "run", 3, 1, 2, me.peer_id)
    head = seal_stream_head(me, header, {"content": "update"}, len(body), chunk_bytes=CHUNK)
    meta = {"contributors": ["a", "b"], "weights": [1.0, 2.0]} if signed is None else signed
    hashes = None if redo else chunk_hashes(body, CHUNK)
    trailer = seal_trailer(me, head, meta, hashes)
    return b"".join(head.buffers()) + body, trailer, head


def _read_streamed(first: bytes | bytearray, trailer: bytes | bytearray, **kw):
    import asyncio

    from protocol.wire.partwire import read_part

    dest = bytearray()

    def into(header, meta, size) -> memoryview:
        dest.extend(bytes(size))
        return memoryview(dest)

    async def frame() -> bytes:
        return bytes(trailer)

    async def main():
        reader = asyncio.StreamReader()
        reader.feed_data(bytes(first))
        reader.feed_eof()
        return await read_part(reader.read, len(first), into, max_bytes=MAX, trailer=frame, **kw)

    return asyncio.run(main()), dest


def _streamed_reason(first, trailer, **kw) -> str:
    with pytest.raises(ProtocolError) as info:
        _read_streamed(first, trailer, **kw)
    return info.value.reason


def test_a_streamed_result_reads_to_its_head_and_trailer_fields(me) -> None:
    from protocol.wire.partwire import open_evidence

    body = _body()
    first, trailer, head = _streamed(me, body)
    part, dest = _read_streamed(first, trailer, expected_sender=me.peer_id, kinds=("reduced",))
    assert bytes(dest) == body and part.digest == head.digest
    assert part.meta == {"content": "update", "contributors": ["a", "b"], "weights": [1.0, 2.0]}
    # head, signature and trailer, without the body: evidence anyone can check
    evidence = part.evidence()
    assert len(evidence) < 1000 < len(body)
    h, meta = open_evidence(evidence, expected_sender=me.peer_id)
    assert (h.kind, h.round, h.part) == ("reduced", 3, 2) and meta == part.meta


def test_the_trailer_binds_every_body_byte_and_the_head(me) -> None:
    body = _body()
    first, trailer, _ = _streamed(me, body)
    flipped, swapped, head_byte = _tampered(first, len(body))
    trailer_byte = bytearray(trailer)
    trailer_byte[20] ^= 0x01
    # a trailer signed by the same key for another result (another body, another head)
    other_first, other_trailer, _ = _streamed(me, _body(2.5))
    forger = Identity.generate()
    _, forged, _ = _streamed(forger, body)  # the right hashes, the wrong key
    for data, tail, reason in [
        (flipped, trailer, "bad_chunk"),
        (swapped, trailer, "bad_chunk"),
        (first, trailer_byte, "bad_signature"),
        (first, other_trailer, "bad_trailer"),
        (first, forged, "bad_signature"),
        (first, trailer[:-1], "bad_signature"),
        (first, b"", "bad_trailer"),
    ]:
        assert _streamed_reason(data, tail) == reason, reason
    assert _streamed_reason(head_byte, trailer) in {"bad_signature", "malformed"}
    # a frame of fewer or more bytes than the head signed
    assert _streamed_reason(first[:-1], trailer) == "truncated"
    assert _streamed_reason(first + b"\0", trailer) == "trailing_bytes"


def test_a_redo_trailer_says_so_and_is_no_evidence(me) -> None:
    from protocol.wire.partwire import open_evidence

    body = _body()
    first, redo, _ = _streamed(me, body, redo=True)
    assert _streamed_reason(first, redo) == "redo"
    first, trailer, head = _streamed(me, body)
    evidence = b"".join(head.buffers()[:3]) + len(redo).to_bytes(4, "big") + redo
    with pytest.raises(ProtocolError) as info:
        open_evidence(evidence)
    assert info.value.reason == "redo"


def test_a_streamed_result_is_refused_where_a_part_is_due(me) -> None:
    first, _, _ = _streamed(me, _body())
    assert _read_reason(first) == "wrong_kind"
    # nor does a streamed head pass as a part's head, or a part's head as a streamed one
    wire = _sealed(me, _body())
    assert _streamed_reason(b"ATS1" + wire[4:], b"x" * 80) == "malformed"
    assert _reason(b"ATP1" + first[4:]) == "malformed"


def test_streamed_heads_and_trailers_refuse_bad_arguments(me) -> None:
    from protocol.wire.partwire import seal_stream_head, seal_trailer

    header = Header("reduced", "run", 3, 1, 2, me.peer_id)
    with pytest.raises(ValueError, match="reserved|none of"):
        seal_stream_head(me, header, {"hashes": []}, 10, chunk_bytes=CHUNK)
    with pytest.raises(ValueError, match="size"):
        seal_stream_head(me, header, {}, -1, chunk_bytes=CHUNK)
    head = seal_stream_head(me, header, {}, 3 * CHUNK, chunk_bytes=CHUNK)
    with pytest.raises(ValueError, match="hashes for a body"):
        seal_trailer(me, head, {}, [bytes(32)] * 2)
    with pytest.raises(ValueError, match="none of"):
        seal_trailer(me, head, {"redo": False}, [bytes(32)] * 3)
