"""Tests for protocol.wire.messages: sealing, opening and refusing wire envelopes."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.errors import ProtocolError
from protocol.wire.messages import (
    ENVELOPE,
    MAX_BODY_ITEMS,
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    Envelope,
    Header,
    open_envelope,
    seal,
    verify_signed,
)
from verification.identity import Identity, verify

ALICE = Identity.from_seed(b"a" * 32)
BOB = Identity.from_seed(b"b" * 32)
BODY = {"values": b"\x00\x01\x02" * 10, "tokens": 4096, "names": ["w", "b"], "scale": 0.5}


def _header(identity: Identity = ALICE, **changes: Any) -> Header:
    header = Header(
        kind="part", run_id="run-1", round=7, fragment=2, part=1, sender=identity.peer_id
    )
    return replace(header, **changes)


def _forge(
    fields: list[Any],
    *,
    signer: Identity = ALICE,
    version: Any = PROTOCOL_VERSION,
    signature: bytes | None = None,
) -> bytes:
    """Wire bytes around arbitrary signed fields, signed properly unless told otherwise."""
    signed = msgpack.packb(fields, use_bin_type=True)
    sig = ENVELOPE.sign(signer, hashlib.sha256(signed).digest()) if signature is None else signature
    return msgpack.packb([version, signed, sig], use_bin_type=True)


def _fields(identity: Identity = ALICE, **changes: Any) -> list[Any]:
    h = {
        "version": PROTOCOL_VERSION,
        "kind": "part",
        "run_id": "run-1",
        "round": 7,
        "fragment": 2,
        "part": 1,
        "sender": identity.peer_id,
        "body": dict(BODY),
    }
    h.update(changes)
    return list(h.values())


def _reason(data: Any, **kwargs: Any) -> str:
    with pytest.raises(ProtocolError) as info:
        open_envelope(data, **kwargs)
    return info.value.reason


# --- Round trip --------------------------------------------------------------------


def test_round_trip() -> None:
    wire = seal(ALICE, _header(), BODY)
    env = open_envelope(
        wire,
        expected_sender=ALICE.peer_id,
        run_id="run-1",
        kinds={"part", "reduced"},
        round_window=(7, 7),
    )
    assert isinstance(env, Envelope)
    assert env.header == _header()
    assert env.body == BODY
    assert verify_signed(ALICE.peer_id, env.raw_signed, env.signature)
    assert not verify(
        ALICE.peer_id, env.raw_signed, env.signature
    )  # the digest is signed, with a domain tag
    assert env.digest == hashlib.sha256(env.raw_signed).digest()


def test_round_trip_accepts_bytearray_and_memoryview() -> None:
    wire = seal(ALICE, _header(), BODY)
    assert open_envelope(bytearray(wire)).body == BODY
    assert open_envelope(memoryview(wire)).body == BODY


def test_tuples_arrive_as_lists() -> None:
    env = open_envelope(seal(ALICE, _header(), {"shape": (3, 4)}))
    assert env.body == {"shape": [3, 4]}


def test_digest_stable_and_content_sensitive() -> None:
    first = open_envelope(seal(ALICE, _header(), BODY))
    again = open_envelope(seal(ALICE, _header(), dict(BODY)))
    assert first.digest == again.digest  # Ed25519 is deterministic
    other_body = open_envelope(seal(ALICE, _header(), {**BODY, "tokens": 4097}))
    other_round = open_envelope(seal(ALICE, _header(round=8), BODY))
    other_sender = open_envelope(seal(BOB, _header(BOB), BODY))
    digests = {first.digest, other_body.digest, other_round.digest, other_sender.digest}
    assert len(digests) == 4
    assert all(len(d) == 32 for d in digests)


# --- seal refuses what a receiver would refuse -----------------------------------


@pytest.mark.parametrize(
    ("header", "body"),
    [
        (_header(BOB), BODY),  # sender is not the signing identity
        (_header(round=-1), BODY),
        (_header(fragment=True), BODY),
        (_header(part=2**63), BODY),
        (_header(kind=""), BODY),
        (_header(run_id="r" * 129), BODY),
        (_header(), {1: "int key"}),
        (_header(), ["not", "a", "dict"]),
        (_header(), {"many": [0] * MAX_BODY_ITEMS}),
        (_header(), {"big": b"\x00" * MAX_MESSAGE_BYTES}),
    ],
)
def test_seal_refuses_bad_input(header: Header, body: Any) -> None:
    with pytest.raises(ValueError):
        seal(ALICE, header, body)


def test_seal_refuses_unencodable_values() -> None:
    with pytest.raises(TypeError):
        seal(ALICE, _header(), {"obj": object()})


# --- Every rejection reason ----------------------------------------------------------


def test_oversized_is_checked_before_parsing() -> None:
    wire = seal(ALICE, _header(), BODY)
    assert _reason(wire, max_bytes=len(wire) - 1) == "oversized"
    assert _reason(b"\xff" * 100, max_bytes=99) == "oversized"
    assert open_envelope(wire, max_bytes=len(wire)).body == BODY


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # reserved msgpack byte
        b"\x93\x01",  # truncated
        msgpack.packb(None),
        msgpack.packb([]),
        msgpack.packb({"a": 1}),
        msgpack.packb([True, b"", b""]),
        msgpack.packb([1, b"", b""]) + b"\x00",  # trailing bytes
        msgpack.packb([1, b""]),
        msgpack.packb([1, "signed as str", b"\x00" * 64], use_bin_type=True),
        msgpack.packb([1, msgpack.ExtType(5, b"xx"), b""], use_bin_type=True),
        msgpack.packb([1, b"\xc1", b"\x00" * 64], use_bin_type=True),
        "not bytes",
        None,
    ],
)
def test_malformed_frames(data: Any) -> None:
    assert _reason(data) == "malformed"


@pytest.mark.parametrize(
    "fields",
    [
        _fields()[:-1],  # 7 fields
        _fields() + [None],  # 9 fields
        _fields(version=2),  # inner version differs from the frame's
        _fields(kind=5),
        _fields(kind=""),
        _fields(run_id="r" * 129),
        _fields(round=-1),
        _fields(round=True),
        _fields(round=1.0),
        _fields(fragment=2**64 - 1),
        _fields(part="1"),
        _fields(sender="not a peer id"),
        _fields(sender="QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"),
        _fields(body=[1, 2]),
        _fields(body={b"bin": 1}),
        _fields(body={"deep": [[[[[[[[[[]]]]]]]]]] * 8000}),  # total items over budget
        _fields(
            body={"empties": [{}] * (MAX_BODY_ITEMS // 2 + 1), "x": [{}] * (MAX_BODY_ITEMS // 2)}
        ),
        _fields(body={"t": msgpack.Timestamp(0)}),
    ],
)
def test_malformed_signed_payloads(fields: list[Any]) -> None:
    assert _reason(_forge(fields)) == "malformed"


def test_bad_version() -> None:
    assert _reason(_forge(_fields(), version=2)) == "bad_version"
    assert _reason(msgpack.packb([0])) == "bad_version"
    assert _reason(msgpack.packb([99, "future", "layout", 1, 2])) == "bad_version"


def test_wrong_run() -> None:
    wire = seal(ALICE, _header(run_id="other-run"), BODY)
    assert _reason(wire, run_id="run-1") == "wrong_run"


def test_wrong_kind() -> None:
    wire = seal(ALICE, _header(kind="state_chunk"), BODY)
    assert _reason(wire, kinds={"part", "reduced"}) == "wrong_kind"
    assert _reason(wire, kinds=()) == "wrong_kind"


@pytest.mark.parametrize(("round_", "window"), [(6, (7, 9)), (10, (7, 9)), (0, (1, 1))])
def test_stale_round(round_: int, window: tuple[int, int]) -> None:
    wire = seal(ALICE, _header(round=round_), BODY)
    assert _reason(wire, round_window=window) == "stale_round"


@pytest.mark.parametrize("round_", [7, 8, 9])
def test_round_window_is_inclusive(round_: int) -> None:
    assert open_envelope(seal(ALICE, _header(round=round_), BODY), round_window=(7, 9))


def test_inverted_window_is_a_caller_error() -> None:
    with pytest.raises(ValueError):
        open_envelope(seal(ALICE, _header(), BODY), round_window=(9, 7))


def test_sender_mismatch() -> None:
    # Bob relays Alice's genuinely signed message over his own stream.
    wire = seal(ALICE, _header(), BODY)
    with pytest.raises(ProtocolError) as info:
        open_envelope(wire, expected_sender=BOB.peer_id)
    assert info.value.reason == "sender_mismatch"
    assert info.value.peer == BOB.peer_id


@pytest.mark.parametrize(
    "wire",
    [
        _forge(_fields(), signature=b"\x00" * 64),
        _forge(_fields(), signature=b"\x00" * 63),
        _forge(_fields(), signature=b""),
        _forge(_fields(ALICE), signer=BOB),  # claims Alice, signed by Bob
    ],
)
def test_bad_signature(wire: bytes) -> None:
    with pytest.raises(ProtocolError) as info:
        open_envelope(wire)
    assert info.value.reason == "bad_signature"
    assert info.value.peer == ALICE.peer_id


def test_signature_checked_before_header_expectations() -> None:
    # An unsigned claim must not be blamed on the peer it names as wrong_run.
    wire = _forge(_fields(run_id="other"), signature=b"\x00" * 64)
    assert _reason(wire, run_id="run-1") == "bad_signature"


def test_smaller_max_bytes_is_honoured_for_parts() -> None:
    wire = seal(ALICE, _header(), {"values": b"\x00" * 10_000})
    assert _reason(wire, max_bytes=4096) == "oversized"


# --- Tampering -----------------------------------------------------------------------


def test_every_single_bit_flip_is_rejected() -> None:
    wire = seal(ALICE, _header(), {"v": b"\x01\x02", "n": 3})
    for i in range(len(wire)):
        for bit in range(8):
            flipped = bytearray(wire)
            flipped[i] ^= 1 << bit
            with pytest.raises(ProtocolError):
                open_envelope(bytes(flipped))


def test_truncations_are_rejected() -> None:
    wire = seal(ALICE, _header(), BODY)
    for end in range(len(wire)):
        with pytest.raises(ProtocolError):
            open_envelope(wire[:end])


# --- Fuzzing -------------------------------------------------------------------------

_FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=20)
    | st.binary(max_size=70)
)
_values = st.recursive(
    _scalars,
    lambda children: (
        st.lists(children, max_size=6)
        | st.dictionaries(st.text(max_size=8) | st.binary(max_size=8), children, max_size=6)
    ),
    max_leaves=30,
)


@_FUZZ
@given(st.binary(max_size=400))
def test_fuzz_arbitrary_bytes(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        open_envelope(data)


@_FUZZ
@given(_values)
def test_fuzz_arbitrary_msgpack_frames(value: Any) -> None:
    with pytest.raises(ProtocolError):
        open_envelope(msgpack.packb(value, use_bin_type=True))


@_FUZZ
@given(st.lists(_values, max_size=10), st.binary(max_size=70))
def test_fuzz_arbitrary_signed_payloads(fields: list[Any], signature: bytes) -> None:
    signed = msgpack.packb(fields, use_bin_type=True)
    with pytest.raises(ProtocolError):
        open_envelope(msgpack.packb([PROTOCOL_VERSION, signed, signature], use_bin_type=True))


@_FUZZ
@given(
    kind=_values,
    run_id=_values,
    round_=_values,
    fragment=_values,
    part=_values,
    body=_values,
    signed_properly=st.booleans(),
)
def test_fuzz_header_fields(
    kind: Any, run_id: Any, round_: Any, fragment: Any, part: Any, body: Any, signed_properly: bool
) -> None:
    fields = [PROTOCOL_VERSION, kind, run_id, round_, fragment, part, ALICE.peer_id, body]
    wire = _forge(fields, signature=None if signed_properly else b"\x00" * 64)
    try:
        env = open_envelope(wire)
    except ProtocolError:
        return
    # Anything accepted must be a well-typed, validly signed header.
    assert signed_properly
    assert isinstance(env.header.kind, str) and isinstance(env.body, dict)
    assert all(
        type(v) is int and v >= 0 for v in (env.header.round, env.header.fragment, env.header.part)
    )


@_FUZZ
@given(st.dictionaries(st.text(max_size=10), _values, max_size=5), st.integers(0, 2**63 - 1))
def test_fuzz_round_trip(body: dict[str, Any], round_: int) -> None:
    env = open_envelope(seal(ALICE, _header(round=round_), body), expected_sender=ALICE.peer_id)
    assert env.header.round == round_
    assert msgpack.packb(env.body, use_bin_type=True) == msgpack.packb(body, use_bin_type=True)
