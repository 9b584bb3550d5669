"""Plausibility against history: a pair's partner against this node's own part, and an
owner's result against this node's contribution and the results accepted before."""

from __future__ import annotations

import torch

from verification.plausibility import COPY_MIN_RATIO, MIN_FOR_STATISTICS, Plausibility
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


def test_a_mean_of_copies_shorter_than_own_and_the_means_before_is_refused() -> None:
    """An owner that mixes a zeroed copy of its own into a pair's mean returns half of
    it, into a group of four's three quarters: refused once the part has a history."""
    checks = Plausibility(TrustPolicy(norm_kappa=3.0), ME)
    copy = torch.linspace(0.5, 1.5, 16)
    weights = (0, "weights")
    # a newcomer's first means are taken whatever their length: its own copy may come
    # from an initialisation of its own
    assert checks.check_result(weights, copy * 0.5, copy, 1.0, True, None, part=0) is None
    for scale in (1.0, 0.99, 1.01):  # honest means, about as long as this node's copy
        assert checks.check_result(weights, copy * scale, copy, 1.0, True, None, part=0) is None
    assert COPY_MIN_RATIO == 0.8
    for shrunk in (0.5, 0.75):
        assert (
            checks.check_result(weights, copy * shrunk, copy, 1.0, True, None, part=0)
            == "owner_shrunk"
        )
    # what honest mixing gives: 0.99 of the copy's length
    assert checks.check_result(weights, copy * 0.9, copy, 1.0, True, None, part=0) is None
    # another part has its own history (its values another size): nothing to go by yet
    small = copy / 100
    assert checks.check_result(weights, small * 0.5, small, 1.0, True, None, part=1) is None
    # a short update is not a shrunk copy: updates differ in length round to round
    for _ in range(MIN_FOR_STATISTICS):
        assert checks.check_result(KEY, copy, copy, 1.0, True, None, part=0) is None
    assert checks.check_result(KEY, copy * 0.3, copy, 1.0, True, None, part=0) is None


def test_a_mean_shorter_than_own_but_like_the_means_before_is_taken() -> None:
    """A member whose own copy is longer than the group's (it started apart) takes means
    as long as those honest owners returned before."""
    checks = Plausibility(TrustPolicy(norm_kappa=3.0), ME)
    copy = torch.ones(16)
    weights = (0, "weights")
    for _ in range(MIN_FOR_STATISTICS):
        assert checks.check_result(weights, copy, copy * 1.5, 1.0, True, None, part=0) is None
    assert checks.check_result(weights, copy, copy * 2, 1.0, True, None, part=0) is None
