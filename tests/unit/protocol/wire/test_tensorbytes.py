"""Tensors as wire bytes: flat float32 input, byte views and copies, finiteness checks."""

from __future__ import annotations

import pytest
import torch

from protocol.errors import ProtocolError
from protocol.wire._tensorbytes import (
    CodecError,
    all_finite,
    as_flat_f32,
    from_bytes,
    require_finite,
    to_bytes,
    view_bytes,
)


def test_any_float_tensor_becomes_flat_float32_and_anything_else_is_refused() -> None:
    x = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    flat = as_flat_f32(x)
    assert flat.dtype == torch.float32 and flat.shape == (6,)
    assert flat.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    with pytest.raises(ValueError, match="floating-point"):
        as_flat_f32(torch.arange(3))
    with pytest.raises(TypeError, match="torch.Tensor"):
        as_flat_f32([1.0, 2.0])  # type: ignore[arg-type]


def test_bytes_round_trip_little_endian() -> None:
    t = torch.tensor([1.0, -2.5], dtype=torch.float32)
    raw = to_bytes(t)
    assert raw == b"\x00\x00\x80\x3f\x00\x00\x20\xc0"
    assert bytes(view_bytes(t)) == raw
    assert torch.equal(from_bytes(raw).view(torch.float32), t)
    assert from_bytes(b"").numel() == 0


def test_finiteness_is_checked_in_one_pass_and_named_when_it_fails() -> None:
    assert all_finite(torch.empty(0)) and all_finite(torch.tensor([1.0, -3.0]))
    assert not all_finite(torch.tensor([1.0, float("inf")]))
    assert not all_finite(torch.tensor([float("nan"), 0.0]))
    require_finite(torch.ones(3))
    with pytest.raises(ValueError, match="2 non-finite"):
        require_finite(torch.tensor([float("nan"), 1.0, -float("inf")]))


def test_a_codec_error_is_a_protocol_error() -> None:
    error = CodecError("bad_scale", "negative")
    assert isinstance(error, ProtocolError) and error.reason == "bad_scale"
