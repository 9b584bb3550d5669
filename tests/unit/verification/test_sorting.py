"""Coordinate-wise order statistics: the sorting network gives torch.sort's values exactly."""

from __future__ import annotations

import pytest
import torch

from verification.sorting import _merge_exchange, coordinate_median, middle, sorted_rows


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 13, 32, 33])
def test_sorted_rows_equal_torch_sort_bitwise(n: int) -> None:
    torch.manual_seed(n)
    matrix = torch.randn(n, 257)
    matrix[0, :5] = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 1e-38])
    rows = sorted_rows(matrix)
    expected = matrix.sort(dim=0).values
    assert len(rows) == n
    assert torch.equal(torch.stack(rows), expected)
    assert torch.equal(torch.stack(sorted_rows(list(matrix))), expected)  # rows as a list


def test_a_nan_is_sorted_last_as_torch_sort_places_it() -> None:
    matrix = torch.tensor([[1.0, float("nan")], [float("nan"), 2.0], [0.0, 3.0]])
    rows = torch.stack(sorted_rows(matrix))
    assert torch.equal(rows.isnan(), matrix.sort(dim=0).values.isnan())
    assert rows[0].tolist() == [0.0, 2.0]


def test_the_network_has_batchers_comparator_counts() -> None:
    assert _merge_exchange(1) == ()
    assert len(_merge_exchange(4)) == 5 and len(_merge_exchange(8)) == 19
    assert all(i < j for i, j in _merge_exchange(13))


def test_the_median_of_an_even_count_is_the_mean_of_the_middle_two() -> None:
    matrix = torch.tensor([[1.0, 10.0], [4.0, 0.0], [2.0, 5.0], [100.0, -1.0]])
    torch.testing.assert_close(coordinate_median(matrix), torch.tensor([3.0, 2.5]))
    torch.testing.assert_close(coordinate_median(matrix[:3]), torch.tensor([2.0, 5.0]))
    assert middle([torch.tensor(7.0)]).item() == 7.0
    with pytest.raises(ValueError, match="zero rows"):
        coordinate_median(torch.empty(0, 3))
