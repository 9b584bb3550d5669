"""Tests for protocol.wire.codec: exact layouts, error bounds, unbiasedness and hostile payloads."""

from __future__ import annotations

import math
import struct

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.errors import ProtocolError
from protocol.wire.codec import (
    DENSE,
    CodecError,
    Encoded,
    decode,
    decode_with_norm,
    encode,
    encoded_size,
)

QMAX = {"int8": 127, "int4": 7}


def _randn(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _scales(enc: Encoded) -> torch.Tensor:
    """Reads the float32 block scales off the front of an int8/int4 payload."""
    n_blocks = -(-enc.numel // enc.block_size)
    return torch.tensor(struct.unpack(f"<{n_blocks}f", enc.payload[: 4 * n_blocks]))


def _per_value(scales: torch.Tensor, numel: int, block_size: int) -> torch.Tensor:
    return scales.repeat_interleave(block_size)[:numel]


def _with_payload(enc: Encoded, payload: bytes) -> Encoded:
    return Encoded(enc.codec, enc.numel, enc.block_size, payload)


# --- sizes and layouts -------------------------------------------------------


@pytest.mark.parametrize(
    ("numel", "codec", "block_size", "want"),
    [
        (10, "none", 4, 40),
        (10, "fp16", 4, 20),
        (10, "bf16", 4, 20),
        (10, "int8", 4, 3 * 4 + 10),
        (10, "int4", 4, 3 * 4 + 5),
        (9, "int4", 4, 3 * 4 + 5),
        (256, "int8", 256, 4 + 256),
        (0, "int8", 256, 0),
        (0, "none", 1, 0),
    ],
)
def test_encoded_size_hand_values(numel: int, codec: str, block_size: int, want: int) -> None:
    assert encoded_size(numel, codec, block_size) == want


@pytest.mark.parametrize(
    ("numel", "codec", "block_size"),
    [(-1, "int8", 4), (4, "int2", 4), (4, "int8", 0), (4, "int8", 2**20 + 1), (True, "none", 4)],
)
def test_encoded_size_rejects_bad_args(numel: int, codec: str, block_size: int) -> None:
    with pytest.raises(ValueError):
        encoded_size(numel, codec, block_size)


def test_none_round_trip_is_bit_exact() -> None:
    x = torch.cat([_randn(1000), torch.tensor([-0.0, 1e-45, -3.4e38, 3.4028235e38])])
    enc = encode(x, "none")
    assert enc.payload == struct.pack(f"<{x.numel()}f", *x.tolist())
    y = decode(enc)
    assert y.dtype == torch.float32 and y.shape == (x.numel(),)
    assert torch.equal(y.view(torch.int32), x.view(torch.int32))


def test_decode_returns_a_fresh_writable_tensor() -> None:
    enc = encode(torch.ones(8), "none")
    y = decode(enc)
    y.add_(1.0)
    torch.testing.assert_close(decode(enc), torch.ones(8))


def test_int8_hand_computed_example() -> None:
    # Block 1: absmax 127 -> scale 1.0, codes 127, round(-50.4) = -50, round(3.6) = 4, 0.
    # Block 2 (partial): absmax 254 -> scale 2.0, codes -127, round(31.7) = 32.
    x = torch.tensor([127.0, -50.4, 3.6, 0.0, -254.0, 63.4])
    enc = encode(x, "int8", block_size=4)
    scales = struct.pack("<2f", 1.0, 2.0)
    assert scales == bytes.fromhex("0000803f00000040")
    assert enc.payload == scales + bytes([0x7F, 0xCE, 0x04, 0x00, 0x81, 0x20])
    assert (enc.codec, enc.numel, enc.block_size) == ("int8", 6, 4)
    want = torch.tensor([127.0, -50.0, 4.0, 0.0, -254.0, 64.0])
    torch.testing.assert_close(decode(enc), want, rtol=0, atol=0)


def test_int4_hand_computed_example() -> None:
    # Block 1: scale 1.0, codes 7, -3, 2, 0 -> nibbles (code + 8) 15, 5, 10, 8,
    # low nibble first: 0x5F, 0x8A. Block 2: scale 2.0, code -7 -> nibble 1, the
    # unused high nibble stays 0: 0x01.
    x = torch.tensor([7.0, -3.4, 1.6, 0.0, -14.0])
    enc = encode(x, "int4", block_size=4)
    assert enc.payload == struct.pack("<2f", 1.0, 2.0) + bytes([0x5F, 0x8A, 0x01])
    assert len(enc.payload) == encoded_size(5, "int4", 4)
    want = torch.tensor([7.0, -3.0, 2.0, 0.0, -14.0])
    torch.testing.assert_close(decode(enc), want, rtol=0, atol=0)


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_all_zero_block_has_zero_scale_and_decodes_to_zeros(codec: str) -> None:
    x = torch.cat([torch.zeros(8), _randn(8), torch.zeros(3)])
    enc = encode(x, codec, block_size=8)
    scales = _scales(enc)
    assert scales[0].item() == 0.0 and scales[2].item() == 0.0
    y = decode(enc)
    assert torch.equal(y[:8], torch.zeros(8)) and torch.equal(y[16:], torch.zeros(3))
    assert torch.equal(decode(encode(torch.zeros(5), codec)), torch.zeros(5))


# --- error bounds ------------------------------------------------------------


@pytest.mark.parametrize(("codec", "unit_roundoff"), [("fp16", 2.0**-11), ("bf16", 2.0**-8)])
def test_half_precision_relative_error_bound(codec: str, unit_roundoff: float) -> None:
    g = torch.Generator().manual_seed(1)
    # Magnitudes 1e-3 .. 1e4 stay in the normal range of both formats.
    mag = 10.0 ** (torch.rand(5000, generator=g) * 7 - 3)
    x = mag * torch.where(torch.rand(5000, generator=g) < 0.5, -1.0, 1.0)
    enc = encode(x, codec)
    assert len(enc.payload) == 2 * x.numel()
    rel = ((decode(enc) - x).abs() / x.abs()).max().item()
    assert 0 < rel <= unit_roundoff


def test_fp16_out_of_range_raises() -> None:
    with pytest.raises(ValueError, match="fp16 range"):
        encode(torch.tensor([1.0, 70000.0]), "fp16")


@pytest.mark.parametrize("codec", ["int8", "int4"])
@pytest.mark.parametrize("block_size", [1, 7, 64, 256])
@pytest.mark.parametrize("stochastic", [False, True])
def test_blockwise_error_bound(codec: str, block_size: int, stochastic: bool) -> None:
    x = _randn(2000, seed=2) * 3.0
    g = torch.Generator().manual_seed(3)
    enc = encode(x, codec, block_size=block_size, stochastic=stochastic, generator=g)
    scales = _scales(enc)
    # Scales are the float32 quotient absmax / qmax, exactly.
    pad = -x.numel() % block_size
    absmax = torch.nn.functional.pad(x, (0, pad)).view(-1, block_size).abs().amax(dim=1)
    torch.testing.assert_close(scales, absmax / QMAX[codec], rtol=0, atol=0)
    err = (decode(enc) - x).abs()
    step = _per_value(scales, x.numel(), block_size)
    bound = step if stochastic else step / 2
    # One ulp of slack for the float32 division and product.
    assert bool((err <= bound * (1 + 2**-20) + 1e-30).all())
    # A lossy codec that came back exact would mean the bound above checked nothing.
    assert err.max().item() > 0


def test_encode_accepts_any_float_dtype_and_shape() -> None:
    x64 = _randn(48, seed=4).double().view(6, 8)
    for x in (x64, x64.half(), x64.bfloat16(), x64.float().t()):
        y = decode(encode(x, "int8", block_size=16))
        assert y.dtype == torch.float32 and y.shape == (48,)
        torch.testing.assert_close(y, x.float().reshape(-1), atol=0.03, rtol=0)


def test_empty_tensor_round_trips() -> None:
    for codec in DENSE:
        enc = encode(torch.empty(0), codec)
        assert enc.payload == b""
        assert decode(enc, expected_numel=0).shape == (0,)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_input_matches_cpu() -> None:
    x = _randn(1000, seed=5)
    for codec in DENSE:
        assert encode(x.cuda(), codec).payload == encode(x, codec).payload


# --- stochastic rounding -----------------------------------------------------


def _mean_error(x: torch.Tensor, codec: str, samples: int, seed: int) -> torch.Tensor:
    # The block size divides x.numel(), so every tiled copy of x gets the same blocks
    # and scales: one encode yields `samples` independent roundings of x.
    assert x.numel() % 16 == 0
    g = torch.Generator().manual_seed(seed)
    enc = encode(x.repeat(samples), codec, block_size=16, stochastic=True, generator=g)
    assert torch.equal(_scales(enc), _scales(encode(x, codec, block_size=16)).repeat(samples))
    return decode(enc).double().view(samples, -1).mean(dim=0) - x.double()


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_stochastic_rounding_is_unbiased(codec: str) -> None:
    x = _randn(64, seed=6)
    rms_10 = _mean_error(x, codec, 10, seed=7).pow(2).mean().sqrt().item()
    rms_1000 = _mean_error(x, codec, 1000, seed=8).pow(2).mean().sqrt().item()
    # Independent rounding noise averages out like 1/sqrt(N): a factor ~10 here.
    assert rms_1000 < rms_10 / 4
    # Nearest rounding has a fixed bias that no amount of averaging removes.
    nearest = (decode(encode(x, codec, block_size=16)) - x).pow(2).mean().sqrt().item()
    assert rms_1000 < nearest / 4


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_same_seed_gives_identical_bytes(codec: str) -> None:
    x = _randn(3000, seed=9)

    def run(seed: int) -> bytes:
        g = torch.Generator().manual_seed(seed)
        return encode(x, codec, stochastic=True, generator=g).payload

    assert run(11) == run(11)
    assert run(11) != run(12)
    assert encode(x, codec).payload == encode(x, codec).payload


# --- bad input to encode -----------------------------------------------------


@pytest.mark.parametrize("codec", DENSE)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_input_raises(codec: str, bad: float) -> None:
    x = _randn(300, seed=16)
    x[257] = bad
    with pytest.raises(ValueError, match="non-finite"):
        encode(x, codec)


def test_encode_rejects_bad_arguments() -> None:
    x = torch.ones(4)
    with pytest.raises(ValueError, match="codec"):
        encode(x, "int2")
    for bs in (0, -1, 2**20 + 1, 1.5):
        with pytest.raises(ValueError, match="block_size"):
            encode(x, "int8", block_size=bs)
    with pytest.raises(ValueError, match="stochastic"):
        encode(x, "fp16", stochastic=True)
    with pytest.raises(ValueError, match="floating-point"):
        encode(torch.ones(4, dtype=torch.int32), "int8")
    with pytest.raises(TypeError):
        encode([1.0, 2.0], "int8")


# --- hostile payloads --------------------------------------------------------


@pytest.mark.parametrize("codec", DENSE)
def test_decode_rejects_truncated_and_oversized_payloads(codec: str) -> None:
    enc = encode(_randn(101, seed=17), codec, block_size=16)
    for payload in (enc.payload[:-1], enc.payload + b"\x00", b""):
        with pytest.raises(CodecError) as info:
            decode(_with_payload(enc, payload))
        assert info.value.reason == "size_mismatch"
    with pytest.raises(CodecError, match="size_mismatch"):
        decode(Encoded(codec, 103, 16, enc.payload))
    if codec == "int4":
        # 102 values fit the same 51 code bytes; the zero padding nibble then reads as code -8.
        with pytest.raises(CodecError, match="bad_code"):
            decode(Encoded(codec, 102, 16, enc.payload))
    with pytest.raises(CodecError, match="numel_mismatch"):
        decode(enc, expected_numel=100)
    assert decode(enc, expected_numel=101).shape == (101,)


def test_decode_rejects_bad_fields() -> None:
    cases = [
        (Encoded("int2", 4, 4, b""), "unknown_codec"),
        (Encoded(None, 4, 4, b""), "unknown_codec"),  # type: ignore[arg-type]
        (Encoded("none", -1, 4, b""), "bad_numel"),
        (Encoded("none", 1.0, 4, b"\x00" * 4), "bad_numel"),  # type: ignore[arg-type]
        (Encoded("none", 1, 0, b"\x00" * 4), "bad_block_size"),
        (Encoded("none", 1, True, b"\x00" * 4), "bad_block_size"),
        (Encoded("none", 1, 4, [0, 0, 0, 0]), "bad_payload"),  # type: ignore[arg-type]
        (Encoded("none", 2**62, 4, b""), "size_mismatch"),
    ]
    for enc, reason in cases:
        with pytest.raises(CodecError) as info:
            decode(enc)
        assert info.value.reason == reason
        assert isinstance(info.value, ProtocolError)


def test_decode_rejects_out_of_range_values() -> None:
    one = struct.pack("<f", 1.0)
    cases = [
        (Encoded("int8", 2, 4, one + bytes([0x80, 0x01])), "bad_code"),
        (Encoded("int4", 2, 4, one + bytes([0x08])), "bad_code"),  # low nibble 8, high 0
        (Encoded("int4", 1, 4, one + bytes([0x88])), "bad_code"),  # padding nibble not zero
        (Encoded("int8", 1, 4, struct.pack("<f", -1.0) + b"\x01"), "bad_scale"),
        (Encoded("int8", 1, 4, struct.pack("<f", -0.0) + b"\x01"), "bad_scale"),
        (Encoded("int8", 1, 4, struct.pack("<f", math.nan) + b"\x01"), "bad_scale"),
        (Encoded("int8", 1, 4, struct.pack("<f", 3e38) + b"\x01"), "bad_scale"),
        (Encoded("none", 2, 4, struct.pack("<2f", 1.0, math.inf)), "non_finite"),
        (Encoded("fp16", 1, 4, bytes.fromhex("007e")), "non_finite"),  # fp16 NaN
        (Encoded("bf16", 1, 4, bytes.fromhex("807f")), "non_finite"),  # bf16 +inf
    ]
    for enc, reason in cases:
        with pytest.raises(CodecError) as info:
            decode(enc)
        assert info.value.reason == reason, enc


def test_encoder_output_never_overflows_near_float32_max() -> None:
    x = torch.tensor([3.4028235e38, -1.0, 3.0e38])
    for codec in ("int8", "int4"):
        y = decode(encode(x, codec, block_size=2))
        assert bool(torch.isfinite(y).all())
        torch.testing.assert_close(y[0], x[0], rtol=0.02, atol=0)


# --- wire format -------------------------------------------------------------


@pytest.mark.parametrize("codec", DENSE)
def test_wire_round_trip_through_msgpack(codec: str) -> None:
    x = _randn(77, seed=18)
    enc = encode(x, codec, block_size=8)
    wire = msgpack.unpackb(msgpack.packb(enc.to_wire()))
    assert set(wire) == {"c", "n", "b", "p"}
    back = Encoded.from_wire(wire, max_numel=77)
    assert back == enc
    assert torch.equal(decode(back), decode(enc))


def test_from_wire_rejects_garbage() -> None:
    good = encode(torch.ones(10), "int8", block_size=4).to_wire()
    cases = [
        ([1, 2, 3], "malformed"),
        (None, "malformed"),
        ({k: v for k, v in good.items() if k != "p"}, "malformed"),
        ({**good, "x": 1}, "malformed"),
        ({**good, "c": "int3"}, "unknown_codec"),
        ({**good, "c": b"int8"}, "unknown_codec"),
        ({**good, "n": -1}, "bad_numel"),
        ({**good, "n": "10"}, "bad_numel"),
        ({**good, "n": False}, "bad_numel"),
        ({**good, "b": 0}, "bad_block_size"),
        ({**good, "b": 2**20 + 1}, "bad_block_size"),
        ({**good, "p": "text"}, "bad_payload"),
        ({**good, "p": good["p"][:-1]}, "size_mismatch"),
        ({**good, "n": 11}, "size_mismatch"),
    ]
    for wire, reason in cases:
        with pytest.raises(CodecError) as info:
            Encoded.from_wire(wire, max_numel=100)
        assert info.value.reason == reason, wire
    with pytest.raises(CodecError, match="bad_numel"):
        Encoded.from_wire(good, max_numel=9)
    with pytest.raises(CodecError, match="bad_numel"):
        Encoded.from_wire({**good, "n": 2**40}, max_numel=100)
    huge = {"c": "none", "n": 2**40, "b": 1, "p": b""}
    with pytest.raises(CodecError, match="size_mismatch"):
        Encoded.from_wire(huge, max_numel=2**50)


_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=0, max_value=40),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.sampled_from(DENSE),
    st.binary(max_size=64),
    st.lists(st.integers(), max_size=3),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(
        st.dictionaries(st.sampled_from(["c", "n", "b", "p", "x", 0]), _values, max_size=5),
        _values,
    )
)
def test_from_wire_fuzz_only_raises_codec_error(wire: object) -> None:
    try:
        enc = Encoded.from_wire(wire, max_numel=1000)
    except CodecError:
        return
    assert isinstance(enc, Encoded)
    try:
        y = decode(enc)
    except CodecError:
        return
    assert y.shape == (enc.numel,) and bool(torch.isfinite(y).all())


@st.composite
def _near_valid_wire(draw: st.DrawFn) -> dict:
    codec = draw(st.sampled_from(DENSE))
    numel = draw(st.integers(min_value=0, max_value=40))
    block_size = draw(st.integers(min_value=1, max_value=9))
    size = encoded_size(numel, codec, block_size)
    payload = draw(st.binary(min_size=size, max_size=size) | st.binary(max_size=size + 2))
    return {"c": codec, "n": numel, "b": block_size, "p": payload}


@settings(max_examples=300, deadline=None)
@given(_near_valid_wire())
def test_near_valid_payloads_decode_finite_or_raise_codec_error(wire: dict) -> None:
    try:
        y = decode(Encoded.from_wire(wire, max_numel=40))
    except CodecError:
        return
    assert y.shape == (wire["n"],) and bool(torch.isfinite(y).all())


def test_none_can_travel_without_copies_both_ways() -> None:
    x = torch.arange(6, dtype=torch.float32)
    enc = encode(x, "none", copy=False)
    assert isinstance(enc.payload, memoryview) and bytes(enc.payload) == x.numpy().tobytes()
    received = bytearray(enc.payload)
    meta = Encoded.from_meta(enc.meta(), memoryview(received), max_numel=6)
    view = decode(meta, expected_numel=6, copy=False)
    received[0:4] = struct.pack("<f", 9.0)  # a view of the received bytes, not a copy
    assert view[0] == 9.0
    assert decode(meta, copy=True).data_ptr() != view.data_ptr()
    with pytest.raises(CodecError, match="malformed"):
        Encoded.from_meta({"c": "none"}, received, max_numel=6)
    with pytest.raises(CodecError) as info:
        Encoded.from_meta(enc.meta(), received, max_numel=5)
    assert info.value.reason == "bad_numel"


@pytest.mark.parametrize("codec", ["none", "fp16", "bf16", "int8", "int4"])
def test_decode_with_norm_gives_decode_and_its_norm(codec):
    torch.manual_seed(0)
    enc = encode(torch.randn(10_000), codec)
    values, norm = decode_with_norm(enc, expected_numel=10_000)
    assert torch.equal(values, decode(enc))
    assert norm == pytest.approx(float(torch.linalg.vector_norm(values.double())), rel=1e-5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_decode_with_norm_refuses_what_decode_refuses(bad):
    x = torch.ones(1000)
    x[17] = bad
    enc = Encoded(codec="none", numel=1000, block_size=256, payload=x.numpy().tobytes())
    with pytest.raises(CodecError) as err:
        decode_with_norm(enc)
    assert err.value.reason == "non_finite"


def test_decode_with_norm_of_finite_values_whose_squares_overflow_float32():
    x = torch.full((4,), 3e38)
    enc = Encoded(codec="none", numel=4, block_size=256, payload=x.numpy().tobytes())
    _, norm = decode_with_norm(enc)
    assert norm == pytest.approx(6e38, rel=1e-6)
