"""Tests for protocol.wire.feedback: error feedback bounds the accumulated error, keeps
its residual when an encode fails, and refuses settings its codec does not have."""

from __future__ import annotations

import math

import pytest
import torch

from protocol.wire.codec import decode, encode
from protocol.wire.feedback import FeedbackSettings

QMAX = {"int8": 127, "int4": 7}


def _randn(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_error_feedback_bounds_accumulated_error_on_a_repeated_vector(codec: str) -> None:
    x = _randn(256, seed=10)
    plain_dec = decode(encode(x, codec, block_size=64)).double()
    ef = FeedbackSettings(codec, block_size=64).build()
    acc_ef = torch.zeros(256, dtype=torch.float64)
    acc_plain = torch.zeros(256, dtype=torch.float64)
    worst_ef = 0.0
    plain_at_100 = 0.0
    for t in range(1, 201):
        acc_ef += decode(ef.encode(x)).double() - x.double()
        acc_plain += plain_dec - x.double()
        worst_ef = max(worst_ef, acc_ef.abs().max().item())
        if t == 100:
            plain_at_100 = acc_plain.abs().max().item()
    # The accumulated EF error telescopes to minus the residual, which is at most
    # half a quantization step of x + residual.
    step = x.abs().max().item() / QMAX[codec]
    assert worst_ef <= step
    torch.testing.assert_close(acc_ef, -ef.residual.double(), rtol=0, atol=1e-4)
    plain_at_200 = acc_plain.abs().max().item()
    assert plain_at_200 == pytest.approx(2 * plain_at_100, rel=1e-6)
    assert plain_at_200 > 20 * worst_ef


@pytest.mark.parametrize("stochastic", [False, True])
def test_error_feedback_bounds_accumulated_error_on_random_vectors(stochastic: bool) -> None:
    g = torch.Generator().manual_seed(13)
    ef = FeedbackSettings("int4", block_size=32, stochastic=stochastic).build(g)
    acc_ef = torch.zeros(512, dtype=torch.float64)
    acc_plain = torch.zeros(512, dtype=torch.float64)
    for t in range(200):
        # A small persistent mean is what plain quantization keeps rounding away.
        x = _randn(512, seed=100 + t) + 0.05
        acc_ef += decode(ef.encode(x)).double() - x.double()
        plain = encode(x, "int4", block_size=32, stochastic=stochastic, generator=g)
        acc_plain += decode(plain).double() - x.double()
    assert acc_ef.abs().max().item() <= 2.0
    assert acc_ef.pow(2).mean().sqrt().item() < acc_plain.pow(2).mean().sqrt().item() / 5


def test_error_feedback_residual_and_reset() -> None:
    x = _randn(100, seed=14)
    ef = FeedbackSettings("int8", block_size=16).build()
    assert ef.residual is None
    enc = ef.encode(x)
    assert enc.payload == encode(x, "int8", block_size=16).payload
    torch.testing.assert_close(ef.residual, x - decode(enc), rtol=0, atol=0)
    second = ef.encode(x)
    assert second.payload == encode(x + (x - decode(enc)), "int8", block_size=16).payload
    with pytest.raises(ValueError, match="reset"):
        ef.encode(torch.zeros(99))
    ef.reset()
    assert ef.residual is None
    ef.encode(torch.zeros(99))
    assert torch.equal(ef.residual, torch.zeros(99))


def test_error_feedback_keeps_residual_when_encode_fails() -> None:
    ef = FeedbackSettings("int8").build()
    ef.encode(_randn(10, seed=15))
    before = ef.residual.clone()
    with pytest.raises(ValueError, match="non-finite"):
        ef.encode(torch.full((10,), math.nan))
    assert torch.equal(ef.residual, before)


def test_error_feedback_refuses_settings_its_codec_does_not_have() -> None:
    with pytest.raises(ValueError, match="stochastic"):
        FeedbackSettings("bf16", stochastic=True).build()
    with pytest.raises(ValueError, match="codec"):
        FeedbackSettings("sparse").build()
    with pytest.raises(ValueError, match="topk k"):
        FeedbackSettings("topk", block_size=64, k=0, bits=2).build()
    with pytest.raises(ValueError, match="decay"):
        FeedbackSettings("int8", decay=1.5).build()
