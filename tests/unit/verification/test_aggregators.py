"""Tests for verification.aggregators: hand-computed cases and robustness."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from verification.aggregators import AGGREGATORS, aggregate
from verification.coordinatewise import mean, median, trimmed_mean
from verification.means import Aggregate
from verification.sorting import coordinate_median, sorted_rows
from verification.vectorwise import centered_clip, krum, multi_krum


def _t(*rows: list[float]) -> list[torch.Tensor]:
    return [torch.tensor(r, dtype=torch.float32) for r in rows]


# Five 2-D points with one outlier, used by the Krum cases below:
#   b = [1, 0], e = [10, 10], c = [0, 2], a = [0, 0], d = [2, 2]
# Squared distances:
#   a-b 1   a-c 4   a-d 8   a-e 200
#   b-c 5   b-d 5   b-e 181
#   c-d 4   c-e 164
#   d-e 128
# With f = 1, Krum sums the n - f - 2 = 2 smallest distances to the others:
#   a: 1 + 4 = 5     b: 1 + 5 = 6     c: 4 + 4 = 8     d: 4 + 5 = 9
#   e: 128 + 164 = 292
KRUM_POINTS = _t([1, 0], [10, 10], [0, 2], [0, 0], [2, 2])  # b, e, c, a, d
B, E, C, A, D = range(5)


# --- mean --------------------------------------------------------------------


def test_mean_is_token_weighted() -> None:
    # (1*[1, 2] + 1*[3, 4] + 2*[5, 6]) / 4 = [14, 18] / 4 = [3.5, 4.5]
    out = mean(_t([1, 2], [3, 4], [5, 6]), [1, 1, 2])
    assert_close(out.vector, torch.tensor([3.5, 4.5]))
    assert out.used == [0, 1, 2]


def test_mean_with_all_zero_weights_is_the_plain_mean() -> None:
    # ([1, 2] + [3, 4] + [5, 6]) / 3 = [3, 4]
    out = mean(_t([1, 2], [3, 4], [5, 6]), [0, 0, 0])
    assert_close(out.vector, torch.tensor([3.0, 4.0]))


def test_single_input_comes_back_from_every_aggregator() -> None:
    x = _t([1.5, -2.0, 3.0])
    for name in AGGREGATORS:
        params = {"f": 0} if "krum" in name else {}
        out = aggregate(name, x, [7], params)
        assert_close(out.vector, x[0]), name
        assert out.used == [0]


# --- median ------------------------------------------------------------------


def test_median_odd_count_ignores_outlier() -> None:
    # coordinate 0: 1, 2, 3, 4, 100 -> 3; coordinate 1: -100, 10, 20, 30, 40 -> 20
    vectors = _t([1, 10], [2, 20], [3, 30], [4, 40], [100, -100])
    out = median(vectors, [1, 1, 1, 1, 1000])
    assert_close(out.vector, torch.tensor([3.0, 20.0]))
    assert out.used == [0, 1, 2, 3, 4]


def test_median_even_count_averages_the_two_middle_values() -> None:
    # coordinate 0: 1, 2, 3, 100 -> (2 + 3) / 2 = 2.5  (torch.median would say 2)
    # coordinate 1: -4, 0, 8, 9 -> (0 + 8) / 2 = 4
    out = median(_t([1, 0], [3, 9], [2, -4], [100, 8]), [1, 1, 1, 1])
    assert_close(out.vector, torch.tensor([2.5, 4.0]))


def test_coordinate_median_of_norms_vector() -> None:
    assert float(coordinate_median(torch.tensor([5.0, 1.0, 2.0, 4.0]))) == 3.0


# --- trimmed mean ------------------------------------------------------------


def test_trimmed_mean_drops_one_each_side_per_coordinate() -> None:
    # n = 5, trim 0.2 -> floor(1.0) = 1 dropped from each end.
    # coordinate 0: 1, 2, 3, 4, 100      -> drop 1 and 100   -> (2 + 3 + 4) / 3 = 3
    # coordinate 1: -100, 10, 20, 35, 40 -> drop -100 and 40 -> (10 + 20 + 35) / 3 = 65 / 3
    vectors = _t([1, 10], [2, 20], [3, 35], [4, 40], [100, -100])
    out = trimmed_mean(vectors, [1] * 5, trim=0.2)
    assert_close(out.vector, torch.tensor([3.0, 65 / 3]))
    assert out.used == [0, 1, 2, 3, 4]


def test_trimmed_mean_small_trim_is_the_plain_mean() -> None:
    # n = 4, trim 0.2 -> floor(0.8) = 0 dropped: ([1] + [2] + [3] + [10]) / 4 = 4
    out = trimmed_mean(_t([1], [2], [3], [10]), [1, 1, 1, 1], trim=0.2)
    assert_close(out.vector, torch.tensor([4.0]))


def test_trimmed_mean_falls_back_to_median_when_nothing_remains() -> None:
    # n = 4, trim 0.5 -> 2 dropped from each end, nothing left -> median (2 + 3) / 2
    out = trimmed_mean(_t([1], [2], [3], [10]), [1, 1, 1, 1], trim=0.5)
    assert_close(out.vector, torch.tensor([2.5]))
    # n = 5, trim 0.4 -> 2 dropped from each end, the middle value remains
    out = trimmed_mean(_t([1], [2], [3], [10], [-50]), [1] * 5, trim=0.4)
    assert_close(out.vector, torch.tensor([2.0]))


@pytest.mark.parametrize("trim", [-0.1, 0.6, math.nan])
def test_trimmed_mean_rejects_bad_trim(trim: float) -> None:
    with pytest.raises(ValueError, match="trim"):
        trimmed_mean(_t([1], [2]), [1, 1], trim=trim)


# --- sorting network against torch.sort ----------------------------------------------


def _sort_median(x: torch.Tensor) -> torch.Tensor:
    """Reference: coordinate-wise median by torch.sort, as before the sorting network."""
    n = x.shape[0]
    ordered = x.sort(dim=0).values
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def _sort_trimmed_mean(x: torch.Tensor, trim: float) -> torch.Tensor:
    """Reference: trimmed mean by torch.sort, as before the sorting network."""
    n = x.shape[0]
    cut = math.floor(trim * n)
    if n - 2 * cut <= 0:
        return _sort_median(x)
    return x.sort(dim=0).values[cut : n - cut].mean(dim=0)


def _matrix(n: int, d: int, seed: int, kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "ties":  # few distinct values: most columns hold ties
        return torch.randint(-2, 3, (n, d), generator=g).float()
    if kind == "signed_zeros":  # ties between 0.0 and -0.0
        return torch.randint(-1, 2, (n, d), generator=g).float() * 0.0
    x = torch.randn(n, d, generator=g)
    if kind == "large":  # finite, but their squares and sums overflow float32
        return x * 3e38 / 4
    if kind == "inf":
        x[torch.rand(n, d, generator=g) < 0.2] = math.inf
        x[torch.rand(n, d, generator=g) < 0.2] = -math.inf
    if kind == "nan":
        x[torch.rand(n, d, generator=g) < 0.2] = math.nan
    return x


KINDS = ["randn", "ties", "signed_zeros", "large", "inf", "nan"]


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 40),  # past 32 rows the network gives way to torch.sort
    d=st.integers(0, 9),
    seed=st.integers(0, 2**16),
    kind=st.sampled_from(KINDS),
)
def test_sorted_rows_are_exactly_torch_sort(n: int, d: int, seed: int, kind: str) -> None:
    x = _matrix(n, d, seed, kind)
    want = x.sort(dim=0).values
    got = sorted_rows(x)
    assert len(got) == n
    assert_close(torch.stack(got), want, rtol=0, atol=0, equal_nan=True)
    assert_close(torch.stack(sorted_rows(list(x))), want, rtol=0, atol=0, equal_nan=True)
    # fresh tensors: writing to the result leaves the input alone
    before = x.clone()
    for row in got:
        row.zero_()
    assert_close(x, before, rtol=0, atol=0, equal_nan=True)


def test_sorted_rows_on_wide_matrices_match_torch_sort() -> None:
    for n in (3, 4, 5, 8, 13, 32):
        x = torch.randn(n, 10_000, generator=torch.Generator().manual_seed(n))
        assert torch.equal(torch.stack(sorted_rows(x)), x.sort(dim=0).values), n


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 12),
    d=st.integers(1, 9),
    seed=st.integers(0, 2**16),
    kind=st.sampled_from(["randn", "ties", "signed_zeros"]),
    trim=st.sampled_from([0.0, 0.1, 0.2, 0.25, 0.3, 0.4, 0.5]),
)
def test_median_and_trimmed_mean_match_the_sort_reference(
    n: int, d: int, seed: int, kind: str, trim: float
) -> None:
    x = _matrix(n, d, seed, kind)
    assert_close(coordinate_median(x), _sort_median(x), rtol=0, atol=0)
    assert_close(median(list(x), [1] * n).vector, _sort_median(x), rtol=0, atol=0)
    # Summed in a different order than the reference's mean: equal up to rounding.
    assert_close(trimmed_mean(list(x), [1] * n, trim=trim).vector, _sort_trimmed_mean(x, trim))


@pytest.mark.parametrize("n", [5, 7, 10])
def test_trimmed_mean_drops_huge_values_like_the_reference(n: int) -> None:
    # One or two attackers per coordinate send values near float32's largest; the trim
    # must drop exactly them, or a sum of the rest would overflow or cancel.
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, 1000, generator=g)
    cut = math.floor(0.2 * n)
    for column in range(x.shape[1]):
        rows = torch.randperm(n, generator=g)[:cut]
        x[rows, column] = 3e38 * torch.sign(torch.randn(cut, generator=g))
    want = _sort_trimmed_mean(x, 0.2)
    got = trimmed_mean(list(x), [1] * n, trim=0.2).vector
    assert bool(torch.isfinite(got).all())
    assert_close(got, want)


def test_aggregators_keep_the_dtype_that_stacking_gives() -> None:
    ints = [torch.tensor([1, 2]), torch.tensor([3, 5]), torch.tensor([2, 9])]
    assert trimmed_mean(ints, [1] * 3).vector.dtype == torch.float32
    assert median(ints, [1] * 3).vector.dtype == torch.float32
    mixed = [torch.tensor([1.0, 2.0], dtype=torch.float64), torch.tensor([3.0, 5.0])]
    assert trimmed_mean(mixed, [1, 1]).vector.dtype == torch.float64
    assert_close(median(mixed, [1, 1]).vector, torch.tensor([2.0, 3.5], dtype=torch.float64))


# --- centered clipping -------------------------------------------------------


def test_centered_clip_one_iteration_by_hand() -> None:
    # center v0 = [0, 0]; x1 = [3, 4] (norm 5), x2 = [1, 0] (norm 1), x3 = [0, 2] (norm 2)
    # radius = tau * median(5, 1, 2) = 1 * 2 = 2
    # clip(x1 - v0) = [3, 4] * 2/5 = [1.2, 1.6]; x2 and x3 are within the radius.
    # Equal weights: v1 = ([1.2, 1.6] + [1, 0] + [0, 2]) / 3 = [2.2 / 3, 3.6 / 3]
    vectors = _t([3, 4], [1, 0], [0, 2])
    out = centered_clip(vectors, [1, 1, 1], tau=1.0, iters=1, center=torch.zeros(2))
    assert_close(out.vector, torch.tensor([2.2 / 3, 1.2]))
    assert out.used == [0, 1, 2]


def test_centered_clip_weighted_one_iteration_by_hand() -> None:
    # Same clipped differences, weights [2, 1, 1] -> [0.5, 0.25, 0.25]:
    # v1 = 0.5 * [1.2, 1.6] + 0.25 * [1, 0] + 0.25 * [0, 2] = [0.85, 1.3]
    vectors = _t([3, 4], [1, 0], [0, 2])
    out = centered_clip(vectors, [2, 1, 1], tau=1.0, iters=1, center=torch.zeros(2))
    assert_close(out.vector, torch.tensor([0.85, 1.3]))


def test_centered_clip_two_iterations_match_the_formula() -> None:
    # Second step recomputed from the paper's update with the radius fixed at 2.
    vectors = _t([3, 4], [1, 0], [0, 2])
    v = torch.tensor([2.2 / 3, 1.2])
    step = torch.zeros(2)
    for x in vectors:
        d = x - v
        step += d * min(1.0, 2.0 / float(d.norm())) / 3
    out = centered_clip(vectors, [1, 1, 1], tau=1.0, iters=2, center=torch.zeros(2))
    assert_close(out.vector, v + step)


def test_centered_clip_default_center_is_the_median() -> None:
    # x = [0, 0], [1, 0], [0, 1], [10, 10]; median per coordinate of (0, 0, 1, 10) = 0.5
    # differences from [0.5, 0.5]: three of norm sqrt(0.5), the outlier 9.5 * sqrt(2)
    # radius = median(sqrt(.5), sqrt(.5), sqrt(.5), 9.5 sqrt(2)) = sqrt(0.5)
    # the outlier's difference is clipped to [0.5, 0.5]; the honest ones sum to
    # [-0.5, -0.5] + [0.5, -0.5] + [-0.5, 0.5] = [-0.5, -0.5], so the step is 0
    # and [0.5, 0.5] is a fixed point. The plain mean would be [2.75, 2.75].
    vectors = _t([0, 0], [1, 0], [0, 1], [10, 10])
    out = centered_clip(vectors, [1, 1, 1, 1], tau=1.0, iters=3)
    assert_close(out.vector, torch.tensor([0.5, 0.5]))


def test_centered_clip_rejects_bad_settings() -> None:
    vectors = _t([1, 2], [3, 4])
    with pytest.raises(ValueError, match="tau"):
        centered_clip(vectors, [1, 1], tau=0.0)
    with pytest.raises(ValueError, match="iters"):
        centered_clip(vectors, [1, 1], iters=0)
    with pytest.raises(ValueError, match="center"):
        centered_clip(vectors, [1, 1], center=torch.zeros(3))


# --- Krum and multi-Krum -----------------------------------------------------


def test_krum_picks_lowest_score_by_hand() -> None:
    # Scores (see KRUM_POINTS): a = 5 is the lowest.
    out = krum(KRUM_POINTS, [1] * 5, f=1)
    assert out.used == [A]
    assert_close(out.vector, torch.tensor([0.0, 0.0]))


def test_krum_with_few_inputs_uses_every_neighbour() -> None:
    # n = 3, f = 1: n - f - 2 = 0 neighbours would score everyone 0 (and pick index 0).
    # With n - 1 = 2 neighbours: points 0, 1, 5; squared distances 0-1: 1, 0-5: 25, 1-5: 16
    #   score(0) = 1 + 25 = 26, score(1) = 1 + 16 = 17, score(5) = 25 + 16 = 41 -> index 1
    out = krum(_t([0], [1], [5]), [1, 1, 1], f=1)
    assert out.used == [1]
    assert_close(out.vector, torch.tensor([1.0]))


def test_krum_returns_a_copy() -> None:
    vectors = _t([0.0], [1.0], [2.0])
    out = krum(vectors, [1, 1, 1], f=0)
    out.vector.add_(100)
    assert float(vectors[out.used[0]]) < 100


def test_multi_krum_averages_the_n_minus_f_best() -> None:
    # m = n - f = 4: a (5), b (6), c (8), d (9); e (292) is left out.
    # ([0, 0] + [1, 0] + [0, 2] + [2, 2]) / 4 = [0.75, 1.0]
    out = multi_krum(KRUM_POINTS, [1] * 5, f=1)
    assert out.used == sorted([A, B, C, D])
    assert_close(out.vector, torch.tensor([0.75, 1.0]))


def test_multi_krum_weights_the_selected_inputs() -> None:
    # weights b=1, e=50, c=1, a=1, d=4; e is not selected, so its claim does nothing:
    # (1*[1, 0] + 1*[0, 2] + 1*[0, 0] + 4*[2, 2]) / 7 = [9/7, 10/7]
    out = multi_krum(KRUM_POINTS, [1, 50, 1, 1, 4], f=1)
    assert_close(out.vector, torch.tensor([9 / 7, 10 / 7]))


def test_multi_krum_explicit_m() -> None:
    # m = 2: a (5) and b (6) -> ([0, 0] + [1, 0]) / 2 = [0.5, 0]
    out = multi_krum(KRUM_POINTS, [1] * 5, f=1, m=2)
    assert out.used == [B, A]
    assert_close(out.vector, torch.tensor([0.5, 0.0]))
    # m = 1 is Krum.
    assert multi_krum(KRUM_POINTS, [1] * 5, f=1, m=1).used == krum(KRUM_POINTS, [1] * 5, f=1).used
    # m above n is clipped to n.
    assert multi_krum(KRUM_POINTS, [1] * 5, f=1, m=99).used == [0, 1, 2, 3, 4]


def test_krum_rejects_bad_f_and_m() -> None:
    with pytest.raises(ValueError, match="f"):
        krum(KRUM_POINTS, [1] * 5, f=-1)
    with pytest.raises(ValueError, match="m"):
        multi_krum(KRUM_POINTS, [1] * 5, f=1, m=0)


# --- robustness --------------------------------------------------------------

ROBUST = {
    "median": {},
    "trimmed_mean": {"trim": 0.2},
    "centered_clip": {"tau": 1.0, "iters": 3},
    "krum": {"f": 1},
    "multi_krum": {"f": 1},
}


def _honest(seed: int, n: int = 4, d: int = 50) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(d, generator=g)
    return [base + 0.3 * torch.randn(d, generator=g) for _ in range(n)]


def _attack(kind: str, honest: list[torch.Tensor], seed: int) -> torch.Tensor:
    honest_mean = torch.stack(honest).mean(0)
    if kind == "huge":
        return 1e4 * torch.randn(honest_mean.numel(), generator=torch.Generator().manual_seed(seed))
    return -20.0 * honest_mean  # sign-flipped and amplified


@pytest.mark.parametrize("kind", ["huge", "sign_flip"])
@pytest.mark.parametrize("seed", range(4))
def test_robust_aggregators_stay_near_the_honest_mean(kind: str, seed: int) -> None:
    honest = _honest(seed)
    honest_mean = torch.stack(honest).mean(0)
    bad = _attack(kind, honest, seed)
    position = seed % 5
    vectors = honest[:position] + [bad] + honest[position:]
    weights = [1.0] * 5
    # The honest mean is ~7 long and the honest spread ~2: half the honest mean's
    # length is far outside what an uncaught attacker produces.
    bound = 0.5 * float(honest_mean.norm())

    plain = mean(vectors, weights).vector
    assert float((plain - honest_mean).norm()) > 3 * bound

    for name, params in ROBUST.items():
        out = aggregate(name, vectors, weights, params)
        assert float((out.vector - honest_mean).norm()) < bound, name
        if name in ("krum", "multi_krum"):
            assert position not in out.used, name


# --- aggregate() and input validation -----------------------------------------


def test_aggregate_dispatches_with_params() -> None:
    vectors = _t([1, 10], [2, 20], [3, 35], [4, 40], [100, -100])
    direct = trimmed_mean(vectors, [1] * 5, trim=0.4)
    via = aggregate("trimmed_mean", vectors, [1] * 5, {"trim": 0.4})
    assert isinstance(via, Aggregate)
    assert_close(via.vector, direct.vector)
    # Integral floats (as a TOML float might give) are fine for integer parameters.
    assert aggregate("krum", KRUM_POINTS, [1] * 5, {"f": 1.0}).used == [A]


def test_aggregate_names_the_allowed_aggregators() -> None:
    with pytest.raises(ValueError) as err:
        aggregate("avg", _t([1]), [1])
    for name in ("mean", "median", "trimmed_mean", "centered_clip", "krum", "multi_krum"):
        assert name in str(err.value)
    assert set(AGGREGATORS) == {
        "mean",
        "median",
        "trimmed_mean",
        "centered_clip",
        "clipped_mean",
        "krum",
        "multi_krum",
    }


@pytest.mark.parametrize(
    ("name", "params", "match"),
    [
        ("mean", {"trim": 0.1}, "'trim'"),
        ("trimmed_mean", {"tau": 1.0}, "'tau'"),
        ("krum", {}, "needs parameter f"),
        ("krum", {"f": True}, "number"),
        ("krum", {"f": 1.5}, "integer"),
        ("centered_clip", {"tau": "1"}, "number"),
    ],
)
def test_aggregate_rejects_bad_params(name: str, params: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        aggregate(name, KRUM_POINTS, [1] * 5, params)


def test_inputs_are_validated() -> None:
    with pytest.raises(ValueError, match="at least one"):
        mean([], [])
    with pytest.raises(ValueError, match="elements"):
        mean(_t([1, 2], [1]), [1, 1])
    with pytest.raises(ValueError, match="1-D"):
        mean([torch.zeros(2, 2)], [1])
    with pytest.raises(ValueError, match="weights"):
        mean(_t([1], [2]), [1])
    with pytest.raises(ValueError, match="non-negative"):
        median(_t([1], [2]), [1, -1])


# --- sparse inputs (codec topk) ------------------------------------------------------------

_SPARSE = [
    torch.tensor([3.0, 0, 0, 0]),
    torch.tensor([0, 4.0, 0, 0]),
    torch.tensor([0, 0, 0, 12.0]),
]


def test_clipped_mean_by_hand() -> None:
    # norms 3, 4, 12: the median 4 is the radius, so the third is scaled by 4 / 12
    out = aggregate("clipped_mean", _SPARSE, [1, 1, 1], {"tau": 1.0})
    torch.testing.assert_close(out.vector, torch.tensor([1.0, 4 / 3, 0, 4 / 3]))
    assert out.used == [0, 1, 2]
    weighted = aggregate("clipped_mean", _SPARSE, [2, 1, 1], {"tau": 2.0})  # radius 8
    torch.testing.assert_close(weighted.vector, torch.tensor([1.5, 1.0, 0, 2.0]))
    with pytest.raises(ValueError, match="tau"):
        aggregate("clipped_mean", _SPARSE, [1, 1, 1], {"tau": 0.0})


def test_sparse_safe_aggregators_on_disjoint_supports_by_hand() -> None:
    from verification.aggregators import SPARSE_SAFE

    want = {
        "mean": ({}, [1.0, 4 / 3, 0, 4.0]),
        # the coordinate-wise median of disjoint supports is zero: the centre is 0 and one
        # iteration clips as the norm-clipped mean does (radius: the median norm, 4)
        "centered_clip": ({"tau": 1.0, "iters": 1}, [1.0, 4 / 3, 0, 4 / 3]),
        "clipped_mean": ({"tau": 1.0}, [1.0, 4 / 3, 0, 4 / 3]),
        # squared distances 25 (a-b), 153 (a-c), 160 (b-c): a and b score 25, a first
        "krum": ({"f": 0}, [3.0, 0, 0, 0]),
        "multi_krum": ({"f": 1, "m": 2}, [1.5, 2.0, 0, 0]),
    }
    assert set(want) == SPARSE_SAFE
    for name, (params, values) in want.items():
        out = aggregate(name, _SPARSE, [1, 1, 1], params)
        torch.testing.assert_close(out.vector, torch.tensor(values), msg=name)


def test_coordinatewise_aggregators_drop_sparse_values_which_is_why_they_are_refused() -> None:
    from verification.aggregators import SPARSE_SAFE

    for name, params in (("median", {}), ("trimmed_mean", {"trim": 0.34})):
        assert name not in SPARSE_SAFE
        out = aggregate(name, _SPARSE, [1, 1, 1], params)
        assert not bool(out.vector.any()), name
