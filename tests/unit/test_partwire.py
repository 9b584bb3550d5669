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


def test_a_stream_is_refused_for_the_same_reasons_as_a_message(me) -> None:
    body = _body()
    wire = _sealed(me, body)
    start = len(wire) - len(body)
    flipped = bytearray(wire)
    flipped[start + 2 * CHUNK + 5] ^= 0x01
    swapped = bytearray(wire)
    swapped[start : start + CHUNK], swapped[start + CHUNK : start + 2 * CHUNK] = (
        wire[start + CHUNK : start + 2 * CHUNK],
        wire[start : start + CHUNK],
    )
    head = bytearray(wire)
    head[8 + 10] ^= 0x01
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
