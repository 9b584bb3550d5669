"""Tests for verification.screening: each attack caught for the right reason, honest peers never."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verification.directions import DIRECTION_SAMPLE, direction_columns, leave_one_out_medians
from verification.screening import (
    Candidate,
    ScreeningConfig,
    Verdict,
    check_reduced,
    finite_norm,
    screen,
)

D = 64
CFG = ScreeningConfig()


def _honest(seed: int, n: int = 4, d: int = D) -> list[torch.Tensor]:
    """Honest peers: one common direction plus noise (base + 0.3 * randn)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(d, generator=g)
    return [base + 0.3 * torch.randn(d, generator=g) for _ in range(n)]


def _candidates(vectors: list[torch.Tensor], tokens: list[int] | None = None) -> list[Candidate]:
    tokens = tokens or [1000] * len(vectors)
    return [Candidate(f"peer{i}", v, t, D) for i, (v, t) in enumerate(zip(vectors, tokens))]


def _reasons(verdicts: list[Verdict]) -> list[str]:
    return [v.reason for v in verdicts]


# --- one attacker among four honest peers --------------------------------------


def _bad(kind: str, honest: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
    victim = honest[0]
    if kind == "sign_flip":
        return -victim, 1000
    if kind == "scaled":
        return 100 * victim, 1000
    if kind == "nan":
        v = victim.clone()
        v[3] = float("nan")
        return v, 1000
    if kind == "inf":
        v = victim.clone()
        v[0] = float("inf")
        return v, 1000
    if kind == "length":
        return victim[:-1].clone(), 1000
    if kind == "tokens":
        return victim.clone(), 10**10
    if kind == "negative_tokens":
        return victim.clone(), -1
    raise AssertionError(kind)


EXPECTED = {
    "sign_flip": "direction",
    "scaled": "norm",
    "nan": "not_finite",
    "inf": "not_finite",
    "length": "shape",
    "tokens": "tokens",
    "negative_tokens": "tokens",
}


@pytest.mark.parametrize("kind", list(EXPECTED))
@pytest.mark.parametrize("seed", range(3))
def test_one_attacker_is_rejected_for_the_right_reason(kind: str, seed: int) -> None:
    honest = _honest(seed)
    bad, tokens = _bad(kind, honest)
    position = seed % 5
    vectors = honest[:position] + [bad] + honest[position:]
    token_list = [1000] * 5
    token_list[position] = tokens
    verdicts = screen(_candidates(vectors, token_list), CFG)
    want = ["ok"] * 5
    want[position] = EXPECTED[kind]
    assert _reasons(verdicts) == want
    assert [v.peer for v in verdicts] == [f"peer{i}" for i in range(5)]
    assert not verdicts[position].ok and verdicts[position].detail
    assert all(v.ok and v.detail == "" for i, v in enumerate(verdicts) if i != position)


def test_every_attack_at_once_among_four_honest() -> None:
    honest = _honest(7)
    kinds = ["sign_flip", "scaled", "nan", "length", "tokens"]
    bad = [_bad(k, honest) for k in kinds]
    vectors = [b[0] for b in bad] + honest
    tokens = [b[1] for b in bad] + [1000] * 4
    verdicts = screen(_candidates(vectors, tokens), CFG)
    assert _reasons(verdicts) == [EXPECTED[k] for k in kinds] + ["ok"] * 4


@pytest.mark.parametrize("n", [3, 4, 5, 8])
@pytest.mark.parametrize("seed", range(5))
def test_honest_peers_are_never_rejected(n: int, seed: int) -> None:
    verdicts = screen(_candidates(_honest(100 + seed, n)), CFG)
    assert _reasons(verdicts) == ["ok"] * n


def test_fewer_than_three_skips_norm_and_direction() -> None:
    honest = _honest(1, 1)
    # A sign-flipped and a 100x vector would be caught among more peers; two inputs
    # give no robust reference, so both pass.
    verdicts = screen(_candidates([-honest[0], 100 * honest[0]]), CFG)
    assert _reasons(verdicts) == ["ok", "ok"]


def test_a_part_refused_for_its_norm_does_not_steer_the_direction_check() -> None:
    # A group of three: two honest members whose updates are nearly orthogonal, and a
    # hundredfold part pointing away from the first. Left in the first member's
    # leave-one-out centre, it made that centre the mean of the partner and itself:
    # the honest member was charged with "direction" in a gossip swarm under load.
    g = torch.Generator().manual_seed(5)
    a = torch.randn(D, generator=g)
    b = torch.randn(D, generator=g)
    b = b - (b @ a) / (a @ a) * a + 0.05 * a  # cosine with a just above zero
    attacker = 100 * (b - 2 * a)
    verdicts = screen(_candidates([a, b, attacker]), CFG)
    assert _reasons(verdicts) == ["ok", "ok", "norm"]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("position", range(3))
def test_in_a_group_of_three_a_sign_flip_is_still_refused(seed: int, position: int) -> None:
    honest = _honest(seed, 2)
    vectors = list(honest)
    vectors.insert(position, -honest[0])
    want = ["ok", "ok"]
    want.insert(position, "direction")
    assert _reasons(screen(_candidates(vectors), CFG)) == want


def test_statistics_count_only_candidates_that_passed_the_cheap_checks() -> None:
    honest = _honest(2, 2)
    nan = honest[0].clone()
    nan[0] = float("nan")
    # Two survivors (one of them scaled 100x): too few for a robust median.
    vectors = [honest[0], 100 * honest[1], nan, honest[1][:-1]]
    verdicts = screen(_candidates(vectors), CFG)
    assert _reasons(verdicts) == ["ok", "ok", "not_finite", "shape"]


def test_disabled_screening_keeps_only_shape_and_finiteness() -> None:
    honest = _honest(3)
    nan = honest[0].clone()
    nan[1] = float("nan")
    vectors = [*honest, -honest[0], 100 * honest[0], nan, honest[0][:5]]
    tokens = [10**12] * len(vectors)
    verdicts = screen(_candidates(vectors, tokens), ScreeningConfig(enabled=False))
    assert _reasons(verdicts) == ["ok"] * 6 + ["not_finite", "shape"]


def test_shape_check_refuses_2d_and_integer_tensors() -> None:
    honest = _honest(4)
    vectors = [*honest, honest[0].reshape(8, 8), torch.ones(D, dtype=torch.int64)]
    assert _reasons(screen(_candidates(vectors), CFG)) == ["ok"] * 4 + ["shape", "shape"]


def test_zero_vectors_pass_and_do_not_skew_the_reference() -> None:
    honest = _honest(5, 3)
    # Four idle peers (zero vectors, some claiming tokens) and three working ones.
    # Counting the zeros, the median norm would be 0 and every working peer a norm
    # outlier; without them the working peers are judged among themselves.
    vectors = [torch.zeros(D)] * 4 + honest
    tokens = [0, 500, 0, 500, 1000, 1000, 1000]
    assert _reasons(screen(_candidates(vectors, tokens), CFG)) == ["ok"] * 7
    # The working peers are still judged: a sign-flipped one among them is caught.
    vectors = [torch.zeros(D)] * 4 + honest + [-honest[0]]
    assert _reasons(screen(_candidates(vectors), CFG)) == ["ok"] * 7 + ["direction"]


def test_thresholds_come_from_the_config() -> None:
    honest = _honest(6)
    vectors = [*honest, 2 * honest[0]]
    assert _reasons(screen(_candidates(vectors), CFG))[-1] == "ok"
    strict = ScreeningConfig(norm_kappa=1.5)
    assert _reasons(screen(_candidates(vectors), strict))[-1] == "norm"
    tokens = [1000] * 4 + [101]
    assert _reasons(screen(_candidates(vectors, tokens), ScreeningConfig(max_tokens=100)))[-1] == (
        "tokens"
    )


def test_empty_input_gives_no_verdicts() -> None:
    assert screen([], CFG) == []


def _sort_leave_one_out_medians(stacked: torch.Tensor) -> torch.Tensor:
    """Reference: one torch.sort, ranks by scatter, as before the sorting network."""
    n = stacked.shape[0]
    ordered, index = stacked.sort(dim=0)
    rank = torch.empty_like(index)
    positions = torch.arange(n).unsqueeze(1).expand_as(index)
    rank.scatter_(0, index, positions)
    lo, hi = (n - 2) // 2, (n - 1) // 2
    at_lo = torch.where(rank > lo, ordered[lo], ordered[lo + 1])
    at_hi = torch.where(rank > hi, ordered[hi], ordered[hi + 1])
    return (at_lo + at_hi) / 2


def _brute_force(x: torch.Tensor) -> torch.Tensor:
    """Reference: the sort-based median of the other rows, one row at a time."""
    rows = []
    for i in range(x.shape[0]):
        others = torch.cat([x[:i], x[i + 1 :]]).sort(dim=0).values
        m = others.shape[0]
        rows.append(others[m // 2] if m % 2 else (others[m // 2 - 1] + others[m // 2]) / 2)
    return torch.stack(rows)


@settings(max_examples=100, deadline=None)
@given(
    n=st.integers(2, 12),
    d=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    scale=st.sampled_from([1.0, 1e30]),
)
def test_leave_one_out_median_matches_brute_force(n: int, d: int, seed: int, scale: float) -> None:
    # Small integers force ties, the case where rank bookkeeping could go wrong.
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (n, d), generator=g).float() * scale
    got = leave_one_out_medians(x)
    assert torch.equal(got, _brute_force(x))
    assert torch.equal(got, _sort_leave_one_out_medians(x))


def test_leave_one_out_median_on_a_wide_sample_matches_the_sort_reference() -> None:
    for n in (3, 4, 5, 8):
        x = torch.randn(n, 20_000, generator=torch.Generator().manual_seed(n))
        assert torch.equal(leave_one_out_medians(x), _sort_leave_one_out_medians(x)), n


# --- finiteness and norms in one pass -------------------------------------------


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", [[0], [D - 1], [5, 9, 40]])
def test_every_non_finite_value_is_counted(bad: float, where: list[int]) -> None:
    honest = _honest(12)
    v = honest[0].clone()
    v[where] = bad
    verdicts = screen(_candidates([*honest, v]), CFG)
    assert _reasons(verdicts) == ["ok"] * 4 + ["not_finite"]
    assert verdicts[-1].detail == f"{len(where)} of {D} values not finite"
    assert check_reduced(v, honest[0]).detail == f"{len(where)} of {D} values not finite"


def test_huge_finite_values_are_judged_by_norm_not_finiteness() -> None:
    # Squares of 1e30 overflow float32 and 1e200 overflows float64: the vectors are
    # finite all the same, so they fail the norm check, not the finiteness check.
    honest = _honest(13)
    huge32 = honest[0] / honest[0].abs().max() * 1e30
    verdicts = screen(_candidates([*honest, huge32]), CFG)
    assert _reasons(verdicts) == ["ok"] * 4 + ["norm"]
    want = float(torch.linalg.vector_norm(huge32, dtype=torch.float64))
    assert verdicts[-1].detail.startswith(f"norm {want:.4g} >")  # finite, from float64
    assert check_reduced(huge32, honest[0]).reason == "owner_norm"
    honest64 = [v.double() for v in honest]
    huge64 = honest64[0] / honest64[0].abs().max() * 1e200
    verdicts = screen(_candidates([*honest64, huge64]), CFG)
    assert _reasons(verdicts) == ["ok"] * 4 + ["norm"]


def test_norms_agree_with_float64() -> None:
    g = torch.Generator().manual_seed(14)
    for v in (torch.randn(250_000, generator=g), torch.randn(7, generator=g) * 1e25):
        want = float(torch.linalg.vector_norm(v, dtype=torch.float64))
        assert finite_norm(v) == (pytest.approx(want, rel=1e-5), 0)


# --- check_reduced -------------------------------------------------------------


def test_check_reduced_accepts_an_honest_average() -> None:
    honest = _honest(8)
    reduced = torch.stack(honest).mean(0)
    for own in honest:
        assert check_reduced(reduced, own) == Verdict("", True, "ok")


def test_check_reduced_rejects_an_inflated_part() -> None:
    own = _honest(9, 1)[0]
    # ||10 own|| = 10 ||own|| > 3 ||own||
    verdict = check_reduced(10 * own, own)
    assert (verdict.ok, verdict.reason, verdict.peer) == (False, "owner_norm", "")
    # 2.9x is within the default ratio, 4x within a looser one.
    assert check_reduced(2.9 * own, own).ok
    assert check_reduced(4 * own, own, max_ratio=5.0).ok


def test_check_reduced_rejects_a_reversed_part() -> None:
    own = _honest(10, 1)[0]
    verdict = check_reduced(-own, own)
    assert (verdict.ok, verdict.reason) == (False, "owner_direction")
    # Orthogonal (cosine 0) passes the default -0.1, fails a stricter 0.5.
    own2 = torch.tensor([1.0, 0.0])
    assert check_reduced(torch.tensor([0.0, 1.0]), own2).ok
    assert check_reduced(torch.tensor([0.0, 1.0]), own2, min_cosine=0.5).reason == (
        "owner_direction"
    )


def test_check_reduced_rejects_non_finite_and_wrong_shape() -> None:
    own = torch.ones(4)
    assert check_reduced(torch.tensor([1.0, float("nan"), 1.0, 1.0]), own).reason == "not_finite"
    assert check_reduced(torch.ones(3), own).reason == "shape"


def test_check_reduced_zero_vectors() -> None:
    own = torch.ones(4)
    # A zero reduced part has no direction; its norm is within any bound.
    assert check_reduced(torch.zeros(4), own).ok
    assert check_reduced(torch.zeros(4), torch.zeros(4)).ok
    # A zero own part vouches for nothing non-zero (documented).
    assert check_reduced(own, torch.zeros(4)).reason == "owner_norm"


def test_direction_check_samples_large_parts_and_still_catches_a_flip() -> None:
    d = DIRECTION_SAMPLE * 5
    g = torch.Generator().manual_seed(11)
    base = torch.randn(d, generator=g)
    honest = [base + 0.5 * torch.randn(d, generator=g) for _ in range(4)]
    for trial in range(3):
        cands = [Candidate(f"h{i}", v, 100, d) for i, v in enumerate(honest)]
        cands.append(Candidate("bad", -honest[trial], 100, d))
        verdicts = screen(cands, ScreeningConfig())
        assert [v.ok for v in verdicts] == [True, True, True, True, False]
        assert verdicts[-1].reason == "direction"


@pytest.mark.parametrize("d", [DIRECTION_SAMPLE + 1, 250_000, 2_500_000, 10**9])
def test_direction_columns_take_one_fresh_column_per_stratum(d: int) -> None:
    cols = direction_columns(d)
    k = torch.arange(DIRECTION_SAMPLE, dtype=torch.int64)
    # stratum k holds the columns c with k * d <= c * DIRECTION_SAMPLE < (k + 1) * d
    assert cols.shape == (DIRECTION_SAMPLE,)
    assert bool((cols * DIRECTION_SAMPLE > k * d - DIRECTION_SAMPLE).all())
    assert bool((cols * DIRECTION_SAMPLE < (k + 1) * d).all())
    assert bool((cols[1:] >= cols[:-1]).all()) and int(cols[0]) >= 0 and int(cols[-1]) < d
    assert not torch.equal(cols, direction_columns(d))  # drawn afresh on every call


def test_every_column_is_sampled_about_equally_often() -> None:
    d, draws = 3 * DIRECTION_SAMPLE + 12_345, 400
    counts = torch.zeros(d, dtype=torch.int64)
    for _ in range(draws):
        counts += torch.bincount(direction_columns(d), minlength=d)
    rate = counts / draws
    p = DIRECTION_SAMPLE / d
    assert abs(float(rate.mean()) - p) < 1e-6
    # binomial spread: 400 draws at p ~ 0.31 give a standard deviation of about 0.023
    assert float(rate.min()) > p - 0.15 and float(rate.max()) < p + 0.15
    # no stretch of the vector is favoured: the first and last tenths match the rest
    tenth = d // 10
    for part in (rate[:tenth], rate[-tenth:]):
        assert abs(float(part.mean()) - p) < 0.01


def test_direction_check_survives_float32_overflow_in_the_sample() -> None:
    # Squares of 1e25 overflow float32: the cosines are computed again in float64
    # instead of coming out as NaN, which would let the flip through.
    d = DIRECTION_SAMPLE * 2
    g = torch.Generator().manual_seed(15)
    base = torch.randn(d, generator=g)
    honest = [(base + 0.5 * torch.randn(d, generator=g)) * 1e25 for _ in range(4)]
    cands = [Candidate(f"h{i}", v, 100, d) for i, v in enumerate(honest)]
    cands.append(Candidate("bad", -honest[0], 100, d))
    assert _reasons(screen(cands, ScreeningConfig())) == ["ok"] * 4 + ["direction"]


@pytest.mark.parametrize("scale", [1.0, -1.0, 5.0, 0.0])
def test_check_reduced_with_the_callers_norms_gives_the_same_verdict(scale):
    torch.manual_seed(3)
    own = torch.randn(1000)
    reduced = scale * own + 0.1 * torch.randn(1000)
    norms = (finite_norm(reduced)[0], finite_norm(own)[0])
    plain = check_reduced(reduced, own, max_ratio=3.0, min_cosine=-0.1)
    given = check_reduced(reduced, own, max_ratio=3.0, min_cosine=-0.1, norms=norms)
    assert (given.ok, given.reason) == (plain.ok, plain.reason)
    assert plain.reason == {1.0: "ok", -1.0: "owner_direction", 5.0: "owner_norm", 0.0: "ok"}[scale]


def test_screen_takes_the_norm_computed_while_decoding():
    torch.manual_seed(4)
    vectors = [torch.randn(500) for _ in range(4)]
    norms = [finite_norm(v)[0] for v in vectors]
    given = [Candidate(str(i), v, 1, 500, n) for i, (v, n) in enumerate(zip(vectors, norms))]
    assert [v.reason for v in screen(given, ScreeningConfig())] == ["ok"] * 4
    # the norm given is the one the checks use: no second pass over the values
    given[2] = Candidate("2", vectors[2], 1, 500, 100 * norms[2])
    assert [v.reason for v in screen(given, ScreeningConfig())] == ["ok", "ok", "norm", "ok"]


def test_a_shrunken_or_zero_global_copy_is_left_out_of_the_mix() -> None:
    """Global copies are copies of one model: their norms sit together, and one far
    below the others' (or, in a pair, this node's own) is refused; one drifted in
    direction but not in size is not."""
    from verification.screening import screen_copies

    g = torch.Generator().manual_seed(5)
    model = torch.randn(500, generator=g)
    copies = [model + 0.05 * torch.randn(500, generator=g) for _ in range(3)]
    drifted = model + 0.6 * torch.randn(500, generator=g)  # an early round's drift
    group = [Candidate(f"p{i}", v, 1, 500) for i, v in enumerate([*copies, drifted])]
    zero = Candidate("zero", torch.zeros(500), 1, 500)
    shrunk = Candidate("shrunk", model / 4, 1, 500)
    verdicts = screen_copies([*group, zero, shrunk], own=None, kappa=3.0)
    assert [v.ok for v in verdicts] == [True] * 4 + [False, False]
    assert {v.reason for v in verdicts[4:]} == {"copy_norm"}
    # a pair: the partner's copy against this node's own
    pair = screen_copies([group[0], zero], own=0, kappa=3.0)
    assert [v.ok for v in pair] == [True, False]
    assert all(v.ok for v in screen_copies([group[0], zero], own=None, kappa=3.0))
