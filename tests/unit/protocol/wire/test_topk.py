"""The ``topk`` and ``sparse`` codecs: hand-computed payloads, bounds, error feedback and
every malformed payload refused with its reason."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.wire import codec as codecs
from protocol.wire.codec import CodecError, Encoded, decode, encode, encoded_size
from protocol.wire.feedback import FeedbackSettings

X = torch.tensor([0.1, -3.0, 0.5, 2.0, 0.0, 1.0, -0.2, 0.3])


def _small() -> Encoded:
    return encode(X, "topk", block_size=4, k=2, bits=2)


def test_hand_computed_small_vector() -> None:
    enc = _small()
    # chunk 0 keeps -3 and 2 (scale 3 / 1.5 = 2): codes 0 and round(2.5) = 2 -> -3, 1
    # chunk 1 keeps 1 and 0.3 (scale 1 / 1.5): codes 3 and round(1.95) = 2 -> 1, 1/3
    want = torch.tensor([0.0, -3.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0 / 3.0])
    torch.testing.assert_close(decode(enc), want)
    raw = bytes(enc.payload)
    assert struct.unpack("<2f", raw[:8]) == pytest.approx((2.0, 1.0 / 1.5))
    assert struct.unpack("<2H", raw[8:12]) == (2, 2)
    assert list(raw[12:16]) == [1, 3, 1, 3]
    # codes 0, 2, 3, 2, two bits each, the first in the lowest bits
    assert raw[16] == 0 | 2 << 2 | 3 << 4 | 2 << 6
    assert len(raw) == encoded_size(8, "topk", 4, k=2, bits=2) == 17
    assert enc.meta() == {"c": "topk", "n": 8, "b": 4, "k": 2, "q": 2}


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize(("numel", "chunk", "k"), [(10_000, 4096, 41), (1000, 256, 3), (7, 4, 4)])
def test_every_chunk_keeps_exactly_k_and_values_within_half_a_step(
    bits: int, numel: int, chunk: int, k: int
) -> None:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(bits))
    enc = encode(x, "topk", block_size=chunk, k=k, bits=bits)
    out = decode(enc)
    assert len(enc.payload) == encoded_size(numel, "topk", chunk, k=k, bits=bits)
    for start in range(0, numel, chunk):
        piece, original = out[start : start + chunk], x[start : start + chunk]
        kept = piece != 0
        assert int(kept.sum()) == min(k, piece.numel())
        # the kept ones are the largest magnitudes of the chunk
        threshold = original.abs().topk(min(k, piece.numel())).values.min()
        assert bool((original[kept].abs() >= threshold).all())
        step = float(original.abs().max()) / ((2**bits - 1) / 2)
        assert float((piece[kept] - original[kept]).abs().max()) <= step / 2 + 1e-6


def test_offsets_take_one_byte_up_to_256_values_12_bits_up_to_4096_and_two_bytes_above() -> None:
    x = torch.randn(8192)
    assert len(encode(x[:512], "topk", block_size=256, k=4, bits=8).payload) == 2 * 6 + 8 * 2
    # 8 offsets in 12 bytes, 7 in 11 (the last one's high nibble unused)
    assert len(encode(x[:512], "topk", block_size=512, k=8, bits=8).payload) == 6 + 12 + 8
    assert len(encode(x[:512], "topk", block_size=512, k=7, bits=8).payload) == 6 + 11 + 7
    assert len(encode(x, "topk", block_size=8192, k=8, bits=8).payload) == 6 + 16 + 8


def test_twelve_bit_offsets_hand_computed() -> None:
    x = torch.zeros(4096)
    x[[5, 0x123, 0xABC]] = torch.tensor([1.0, -1.0, 1.0])
    raw = bytes(encode(x, "topk", block_size=4096, k=3, bits=8).payload)
    # offsets 0x005, 0x123, 0xABC: the first in the low 12 bits of three bytes
    assert raw[6:11] == bytes([0x05, 0x30, 0x12, 0xBC, 0x0A])
    torch.testing.assert_close(decode(Encoded("topk", 4096, 4096, raw, k=3, bits=8)), x)


def test_twelve_bit_offsets_refused_when_unused_bits_are_set_or_offsets_go_back() -> None:
    x = torch.zeros(4096)
    x[[5, 0x123, 0xABC]] = 1.0
    raw = bytearray(encode(x, "topk", block_size=4096, k=3, bits=8).payload)
    # a high nibble after the last offset; offsets 0x005 then 0x004 (going back)
    for at, value in ((10, bytes([0x1A])), (6, bytes([0x05, 0x40, 0x00]))):
        bad = bytearray(raw)
        bad[at : at + len(value)] = value
        with pytest.raises(CodecError) as err:
            decode(Encoded("topk", 4096, 4096, bytes(bad), k=3, bits=8))
        assert err.value.reason == "bad_index"


def test_stochastic_rounding_is_unbiased_on_kept_values() -> None:
    x = torch.tensor([1.0, 0.37, -0.61, 0.05])
    gen = torch.Generator().manual_seed(0)
    runs = torch.stack(
        [
            decode(encode(x, "topk", block_size=4, k=4, bits=2, stochastic=True, generator=gen))
            for _ in range(4000)
        ]
    )
    torch.testing.assert_close(runs.mean(0), x, atol=0.03, rtol=0)


@pytest.mark.parametrize("decay", [1.0, 0.9])
def test_error_feedback_carries_what_was_not_sent(decay: float) -> None:
    ef = FeedbackSettings("topk", block_size=64, k=2, bits=2, decay=decay).build()
    previous = torch.zeros(300)
    gen = torch.Generator().manual_seed(1)
    sent_total = torch.zeros(300)
    inputs_total = torch.zeros(300)
    for _ in range(5):
        x = torch.randn(300, generator=gen)
        sent = decode(ef.encode(x))
        assert ef.residual is not None
        # what was sent plus what is carried is the input plus the carried share
        torch.testing.assert_close(sent + ef.residual, x + decay * previous)
        previous = ef.residual.clone()
        sent_total += sent
        inputs_total += x
    if decay == 1.0:
        # plain error feedback: the sums differ by exactly the last residual
        torch.testing.assert_close(sent_total + previous, inputs_total, atol=1e-5, rtol=0)


def test_sparse_keeps_every_non_zero_value_of_a_union() -> None:
    a = decode(encode(torch.randn(512), "topk", block_size=128, k=3, bits=2))
    b = decode(encode(torch.randn(512), "topk", block_size=128, k=3, bits=2))
    union = (a + b) / 2
    enc = encode(union, "sparse", block_size=128, bits=8)
    out = decode(enc)
    assert torch.equal(out != 0, union != 0)
    step = float(union.abs().max()) / 127.5
    assert float((out - union).abs().max()) <= step / 2 + 1e-6
    assert enc.meta() == {"c": "sparse", "n": 512, "b": 128, "k": 0, "q": 8}
    bound = codecs.sparse_result_bound(512, 128, 3, members=2)
    assert len(enc.payload) <= bound


def test_wire_round_trip_and_keys() -> None:
    enc = _small()
    back = Encoded.from_wire(enc.to_wire(), max_numel=8)
    assert torch.equal(decode(back), decode(enc))
    wire = enc.to_wire()
    del wire["k"]
    with pytest.raises(CodecError) as err:
        Encoded.from_wire(wire, max_numel=8)
    assert err.value.reason == "malformed"
    with pytest.raises(CodecError, match="k, q missing"):
        Encoded.from_meta({"c": "topk", "n": 8, "b": 4}, enc.payload, max_numel=8)


def _patched(enc: Encoded, at: int, value: bytes) -> Encoded:
    raw = bytearray(enc.payload)
    raw[at : at + len(value)] = value
    return Encoded("topk", enc.numel, enc.block_size, bytes(raw), k=enc.k, bits=enc.bits)


@pytest.mark.parametrize(
    ("at", "value", "reason"),
    [
        (12, bytes([4]), "bad_index"),  # offset 4 in a chunk of 4
        (12, bytes([3]), "bad_index"),  # 3 then 3: not strictly increasing
        (13, bytes([0]), "bad_index"),  # 1 then 0: decreasing
        (8, struct.pack("<H", 1), "bad_count"),  # keeps 1, declared 2
        (0, struct.pack("<f", float("nan")), "bad_scale"),
        (0, struct.pack("<f", float("inf")), "bad_scale"),
        (0, struct.pack("<f", -1.0), "bad_scale"),
        (0, struct.pack("<f", -0.0), "bad_scale"),
    ],
)
def test_malformed_topk_refused_with_its_reason(at: int, value: bytes, reason: str) -> None:
    with pytest.raises(CodecError) as err:
        decode(_patched(_small(), at, value))
    assert err.value.reason == reason


def test_padding_bits_must_be_zero() -> None:
    enc = encode(torch.tensor([1.0, -2.0, 3.0]), "topk", block_size=4, k=3, bits=2)
    raw = bytearray(enc.payload)
    raw[-1] |= 0b1100_0000  # the fourth, unused code
    with pytest.raises(CodecError) as err:
        decode(Encoded("topk", 3, 4, bytes(raw), k=3, bits=2))
    assert err.value.reason == "bad_code"


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"k": 0}, "bad_count"),
        ({"k": 5}, "bad_count"),
        ({"bits": 3}, "malformed"),
        ({"block_size": 70_000}, "bad_block_size"),
        ({"payload": b"\0" * 16}, "size_mismatch"),
    ],
)
def test_bad_topk_fields_refused(fields: dict, reason: str) -> None:
    enc = _small()
    args = {"codec": "topk", "numel": 8, "block_size": 4, "payload": enc.payload, "k": 2, "bits": 2}
    args.update(fields)
    with pytest.raises(CodecError) as err:
        decode(Encoded(**args))
    assert err.value.reason == reason


def test_sparse_counts_beyond_a_chunk_or_wrong_length_refused() -> None:
    enc = encode(torch.tensor([0.0, 1.0, 0.0, 2.0]), "sparse", block_size=4, bits=8)
    raw = bytearray(enc.payload)
    raw[4:6] = struct.pack("<H", 5)
    with pytest.raises(CodecError) as err:
        decode(Encoded("sparse", 4, 4, bytes(raw), bits=8))
    assert err.value.reason == "bad_count"
    with pytest.raises(CodecError) as err:
        decode(Encoded("sparse", 4, 4, bytes(enc.payload) + b"\0", bits=8))
    assert err.value.reason == "size_mismatch"
    with pytest.raises(CodecError) as err:
        decode(Encoded("sparse", 4, 4, bytes(enc.payload), k=2, bits=8))
    assert err.value.reason == "malformed"


def test_encode_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="topk k"):
        encode(X, "topk", block_size=4, k=5, bits=2)
    with pytest.raises(ValueError, match="topk k = 0"):
        encode(X, "topk", block_size=4, k=0, bits=2)
    with pytest.raises(ValueError, match="topk bits"):
        encode(X, "topk", block_size=4, k=2, bits=3)
    with pytest.raises(ValueError, match="non-finite"):
        encode(torch.tensor([1.0, float("nan")]), "topk", block_size=4, k=1, bits=2)
    with pytest.raises(ValueError, match="decay"):
        FeedbackSettings("topk", block_size=4, k=1, bits=2, decay=0.0).build()


@settings(max_examples=300, deadline=None)
@given(
    codec=st.sampled_from(["topk", "sparse"]),
    numel=st.integers(0, 40),
    chunk=st.sampled_from([1, 3, 8, 300, 5000]),
    bits=st.sampled_from([2, 4, 8]),
    body=st.binary(max_size=200),
)
def test_fuzzed_sparse_payloads_never_crash(
    codec: str, numel: int, chunk: int, bits: int, body: bytes
) -> None:
    k = 0 if codec == "sparse" else min(chunk, 2)
    try:
        out = decode(Encoded(codec, numel, chunk, body, k=k, bits=bits))
    except CodecError:
        return
    assert out.shape == (numel,)
    assert bool(torch.isfinite(out).all())
