"""Tests for verification.shares: the share cap by hand, its refusals and its properties."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verification.shares import max_share_weights


@pytest.mark.parametrize(
    ("weights", "share", "want"),
    [
        # c = 0.5 * (1 + 1 + c) -> c = 2; 2 / (1 + 1 + 2) = 0.5
        ([1, 1, 8], 0.5, [1, 1, 2]),
        # one capped: c = 0.3 * 6 / 0.7 = 2.571 < 3, so 3 is capped as well;
        # two capped: c = 0.3 * (2 + 1) / (1 - 0.6) = 2.25 >= 2; total 7.5, 2.25 / 7.5 = 0.3
        ([4, 3, 2, 1], 0.3, [2.25, 2.25, 2, 1]),
        # already within the cap: 4 / 10 = 0.4 <= 0.5
        ([4, 3, 2, 1], 0.5, [4, 3, 2, 1]),
        # max_share * n = 1 exactly: only equal weights qualify, at the smallest value
        ([5, 5, 5, 1], 0.25, [1, 1, 1, 1]),
        # max_share * n < 1: impossible, equal weights with the same total (12 / 3)
        ([1, 1, 10], 0.2, [4, 4, 4]),
        # only one positive weight and share 0.5: no weighting of the working peer
        # alone meets the cap -> equal weights (8 / 3 each)
        ([0, 0, 8], 0.5, [8 / 3, 8 / 3, 8 / 3]),
        ([0, 0, 0], 0.5, [0, 0, 0]),
        ([3, 9], 1.0, [3, 9]),
        ([], 0.5, []),
    ],
)
def test_max_share_weights_by_hand(weights: list[float], share: float, want: list[float]) -> None:
    got = max_share_weights(weights, share)
    assert got == pytest.approx(want)


def test_max_share_weights_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="max_share"):
        max_share_weights([1, 2], 0.0)
    with pytest.raises(ValueError, match="non-negative"):
        max_share_weights([1, -2], 0.5)


@settings(max_examples=200, deadline=None)
@given(
    # token weights: zero or at least one token's worth (subnormal floats are not weights)
    weights=st.lists(
        st.one_of(st.just(0.0), st.floats(1e-3, 1e6, allow_nan=False)), min_size=1, max_size=12
    ),
    share=st.floats(0.05, 1.0),
)
def test_max_share_weights_properties(weights: list[float], share: float) -> None:
    got = max_share_weights(weights, share)
    n, total = len(weights), math.fsum(got)
    assert len(got) == n
    positive = sum(1 for w in weights if w > 0)
    if total == 0:
        assert got == weights
    elif positive * share < 1:
        assert got == pytest.approx([math.fsum(weights) / n] * n)
    else:
        # Nobody gains weight, nobody exceeds the cap, and the order is kept.
        assert all(g <= w * (1 + 1e-9) + 1e-12 for g, w in zip(got, weights))
        assert max(got) <= share * total * (1 + 1e-9)
        for i in range(n):
            for j in range(n):
                if weights[i] <= weights[j]:
                    assert got[i] <= got[j] * (1 + 1e-9) + 1e-12
