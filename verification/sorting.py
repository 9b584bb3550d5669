"""Coordinate-wise order statistics of a few rows: sorted rows and the median.

The order-based aggregators (:mod:`verification.aggregators`) and screening
(:mod:`verification.screening`) sort every coordinate of a handful of equal-length rows.
For up to :data:`_NETWORK_MAX_ROWS` rows a sorting network of elementwise minimum and
maximum does that far faster than ``torch.sort`` along dim 0, and gives exactly the
same values.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

__all__ = ["coordinate_median", "middle", "sorted_rows"]

# torch.sort along dim 0 sorts every column on its own and costs 7-30x what a sorting
# network of elementwise minimum/maximum costs for up to 32 rows (measured with one
# thread, 16k-2.5M columns); past that the comparator count grows as n log^2 n.
_NETWORK_MAX_ROWS = 32


@functools.cache
def _merge_exchange(n: int) -> tuple[tuple[int, int], ...]:
    """Comparators ``(i, j)``, ``i < j``, of a sorting network for ``n`` inputs.

    Batcher's merge exchange (Knuth, The Art of Computer Programming vol. 3, 5.2.2,
    Algorithm M), which works for any ``n``: 5 comparators for 4 inputs, 19 for 8.
    """
    pairs: list[tuple[int, int]] = []
    if n < 2:
        return ()
    t = (n - 1).bit_length()
    p = 1 << (t - 1)
    while p > 0:
        q, r, d = 1 << (t - 1), 0, p
        while True:
            pairs += [(i, i + d) for i in range(n - d) if i & p == r]
            if q == p:
                break
            d, q, r = q - p, q >> 1, p
        p >>= 1
    return tuple(pairs)


def sorted_rows(matrix: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The rows of ``matrix.sort(dim=0).values``, fresh tensors, by a sorting network.

    Minimum and maximum select values without arithmetic, so the rows are exactly
    the sorted values, infinities included. NaN is the exception: sort places it last
    and min/max spread it, so a matrix holding one goes through ``torch.sort``. A sum
    catches a NaN in one pass (it is NaN or infinite then); only a matrix whose sum is
    not finite is scanned for one.

    Args:
        matrix: an ``(n, ...)`` tensor with ``n >= 1``, or its rows (one shape and
            dtype), which saves stacking them.

    Returns:
        ``n`` tensors shaped like a row, in ascending order per coordinate.
    """
    rows = list(matrix)  # a tensor iterates over its rows
    n = len(rows)
    if n == 1:
        return [rows[0].clone()]
    if n > _NETWORK_MAX_ROWS or (rows[0].is_floating_point() and _has_nan(matrix)):
        return list(torch.stack(rows).sort(dim=0).values)
    for i, j in _merge_exchange(n):
        rows[i], rows[j] = torch.minimum(rows[i], rows[j]), torch.maximum(rows[i], rows[j])
    return rows


def _has_nan(matrix: torch.Tensor | Sequence[torch.Tensor]) -> bool:
    # one pass in the common case: the sum of finite values is finite
    if isinstance(matrix, torch.Tensor):
        total = float(matrix.sum())
    else:
        total = sum(float(row.sum()) for row in matrix)
    if math.isfinite(total):
        return False
    return any(bool(row.isnan().any()) for row in matrix)


def middle(ordered: Sequence[torch.Tensor]) -> torch.Tensor:
    """The median of sorted rows: the middle one, or the mean of the two middle ones."""
    n = len(ordered)
    if n % 2 == 1:
        return ordered[n // 2]
    return (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def coordinate_median(matrix: torch.Tensor) -> torch.Tensor:
    """Median over dim 0; for an even row count, the mean of the two middle values.

    ``torch.median`` returns the lower of the two middle values, which biases every
    coordinate downwards for even counts; averaging the pair is the textbook median.

    Args:
        matrix: an ``(n, ...)`` tensor with ``n >= 1``.

    Returns:
        A tensor shaped like ``matrix[0]``.
    """
    if matrix.shape[0] == 0:
        raise ValueError("median of zero rows")
    return middle(sorted_rows(matrix))
