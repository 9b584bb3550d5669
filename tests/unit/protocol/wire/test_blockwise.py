"""Blockwise absmax quantization: hand-computed codes, the bounds a peer's payload must
keep, and a range decoded alone equal to the same range of the whole."""

from __future__ import annotations

import pytest
import torch

from protocol.wire import _blockwise
from protocol.wire._tensorbytes import CodecError, from_bytes


def _payload(values: list[float], codec: str, block: int) -> torch.Tensor:
    flat = torch.tensor(values, dtype=torch.float32)
    return from_bytes(_blockwise.encode(flat, codec, block, False, None))


def test_int8_codes_and_scales_by_hand() -> None:
    raw = _payload([127.0, -63.5, 0.0, 1.0], "int8", 2)
    scales = raw[:8].clone().view(torch.float32)
    codes = raw[8:].view(torch.int8)
    # absmax / 127 per block of two, in float32
    assert torch.equal(scales, torch.tensor([127.0, 1.0]) / 127)
    assert codes.tolist() == [127, -64, 0, 127]  # -63.5 rounds half to even
    decoded = _blockwise.decode(raw, "int8", 4, 2)
    torch.testing.assert_close(decoded, torch.tensor([127.0, -64.0, 0.0, 1.0]))


def test_int4_packs_two_codes_a_byte_and_decodes_within_half_a_step() -> None:
    values = [7.0, -7.0, 3.0, 1.0, 0.5]  # odd count: a zero padding nibble
    raw = _payload(values, "int4", 8)
    assert raw.numel() == 4 + 3  # one scale, five codes in three bytes
    assert int(raw[4]) == (7 + 8) | ((-7 + 8) << 4)
    decoded = _blockwise.decode(raw, "int4", 5, 8)
    assert (decoded - torch.tensor(values)).abs().max() <= 0.5


def test_an_all_zero_block_decodes_to_positive_zeros() -> None:
    raw = _payload([0.0, -0.0, 0.0, 0.0], "int8", 4)
    decoded = _blockwise.decode(raw, "int8", 4, 4)
    assert torch.equal(decoded, torch.zeros(4)) and not bool(torch.signbit(decoded).any())


def test_codes_and_scales_out_of_range_are_refused() -> None:
    raw = _payload([1.0, 2.0], "int8", 2).clone()
    raw[4] = 0x80  # code -128
    with pytest.raises(CodecError, match="-128") as info:
        _blockwise.decode(raw, "int8", 2, 2)
    assert info.value.reason == "bad_code"
    raw = _payload([1.0, 2.0], "int8", 2).clone()
    raw[:4] = from_bytes(torch.tensor([-1.0]).numpy().tobytes())
    with pytest.raises(CodecError) as info:
        _blockwise.decode(raw, "int8", 2, 2)
    assert info.value.reason == "bad_scale"
    with pytest.raises(ValueError, match="non-finite"):
        _blockwise.encode(torch.tensor([float("nan")]), "int8", 2, False, None)


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_a_range_decoded_alone_equals_that_range_of_the_whole(codec: str) -> None:
    torch.manual_seed(0)
    values = torch.randn(101).tolist()
    raw = _payload(values, codec, 16)
    whole = _blockwise.decode(raw, codec, 101, 16)
    for lo, hi in [(0, 101), (3, 40), (16, 32), (99, 101), (7, 7)]:
        assert torch.equal(_blockwise.decode_range(raw, codec, 101, 16, lo, hi), whole[lo:hi])


def test_stochastic_rounding_is_unbiased_on_average() -> None:
    flat = torch.full((4096,), 0.25)
    flat[0] = 1.0  # scale 1/127: 0.25 is 31.75 steps
    generator = torch.Generator().manual_seed(1)
    raw = from_bytes(_blockwise.encode(flat, "int8", 4096, True, generator))
    decoded = _blockwise.decode(raw, "int8", 4096, 4096)
    assert set(decoded[1:].mul(127).round().tolist()) == {31.0, 32.0}
    assert abs(decoded[1:].mean().item() - 0.25) < 0.002
