"""Plausibility against history: a pair's partner against this node's own part, and an
owner's result against this node's contribution and the results accepted before."""

from __future__ import annotations

import torch

from verification.plausibility import MIN_FOR_STATISTICS, Plausibility
from verification.policy import TrustPolicy
from verification.records import Contribution
from verification.screening import Verdict

ME, PARTNER = "me", "partner"
KEY = (0, "update")


def _pair(own: torch.Tensor, partner: torch.Tensor, tokens: tuple[int, int] = (0, 0)):
    return [
        Contribution(ME, own, 1.0, b"m" * 32, tokens=tokens[0]),
        Contribution(PARTNER, partner, 1.0, b"p" * 32, tokens=tokens[1]),
    ]


def _ok() -> list[Verdict]:
    return [Verdict(ME, True, "ok", ""), Verdict(PARTNER, True, "ok", "")]


def test_a_partner_like_this_nodes_own_part_is_taken() -> None:
    checks = Plausibility(TrustPolicy(norm_kappa=3.0), ME)
    own = torch.ones(8)
    out = checks.pair_verdicts(KEY, _pair(own, 2 * own), _ok())
    assert [v.ok for v in out] == [True, True]


def test_a_partner_far_longer_or_pointing_away_is_refused() -> None:
    checks = Plausibility(TrustPolicy(norm_kappa=3.0, min_cosine=-0.1), ME)
    own = torch.ones(8)
    long = checks.pair_verdicts(KEY, _pair(own, 4 * own), _ok())
    assert (long[1].ok, long[1].reason) == (False, "norm")
    away = checks.pair_verdicts(KEY, _pair(own, -own), _ok())
    assert (away[1].ok, away[1].reason) == (False, "direction")
    assert long[0].ok and away[0].ok  # this node's own part is never judged here


def test_a_partner_that_trained_on_more_tokens_may_be_longer() -> None:
    checks = Plausibility(TrustPolicy(norm_kappa=3.0), ME)
    own = torch.ones(8)
    out = checks.pair_verdicts(KEY, _pair(own, 4 * own, tokens=(100, 200)), _ok())
    assert out[1].ok  # the bound widens with the partner's larger token claim


def test_a_result_is_checked_against_this_nodes_own_contribution() -> None:
    checks = Plausibility(TrustPolicy(norm_kappa=3.0, min_cosine=-0.1), ME)
    own = torch.ones(16)
    assert checks.check_result(KEY, own * 1.5, own, 1.0, True, None) is None
    assert checks.check_result(KEY, own * 10, own, 1.0, True, None) == "owner_norm"
    assert checks.check_result(KEY, -own, own, 1.0, True, None) == "owner_direction"
    bad = own.clone()
    bad[0] = float("nan")
    assert checks.check_result(KEY, bad, own, 1.0, True, None) == "not_finite"
    assert checks.check_result(KEY, own * 10, torch.zeros(16), 1.0, True, None) is None  # idle


def test_a_long_result_like_the_honest_ones_before_is_taken() -> None:
    checks = Plausibility(TrustPolicy(norm_kappa=3.0), ME)
    own = torch.ones(16)
    for _ in range(MIN_FOR_STATISTICS):  # owners returned results this long before
        assert checks.check_result(KEY, own * 2.5, own * 2.5, 1.0, True, None) is None
    assert checks.check_result(KEY, own * 5, own, 1.0, True, None) is None
    assert checks.check_result((1, "update"), own * 5, own, 1.0, True, None) == "owner_norm"


def test_a_result_that_left_this_node_out_must_stay_short() -> None:
    checks = Plausibility(TrustPolicy(norm_kappa=3.0), ME)
    own = torch.ones(16)
    assert checks.check_result(KEY, -own * 2, own, 1.0, False, None) is None  # any direction
    assert checks.check_result(KEY, own * 4, own, 1.0, False, None) == "owner_norm"
