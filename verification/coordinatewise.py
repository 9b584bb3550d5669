"""Coordinate-wise aggregators: each coordinate of the result from that coordinate alone.

The token-weighted mean, the coordinate-wise median and the trimmed mean. Every input
shapes the result, and a block of the inputs gives that block of the result, bitwise,
so an owner can reduce block by block as parts arrive
(:data:`verification.aggregators.COORDINATEWISE`). Each one cites the paper it comes
from.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from verification.means import Aggregate, as_rows, checked_weights, mean_rows, weighted_mean
from verification.sorting import middle, sorted_rows

__all__ = ["mean", "median", "trimmed_mean"]


def mean(vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> Aggregate:
    """Token-weighted mean, the plain (non-robust) DiLoCo average.

    McMahan et al., "Communication-Efficient Learning of Deep Networks from
    Decentralized Data", AISTATS 2017 (FedAvg); Douillard et al., "DiLoCo: Distributed
    Low-Communication Training of Language Models", 2023.

    Args:
        vectors: 1-D tensors of one length.
        weights: non-negative token weights; all zero means equal weights.

    Returns:
        The weighted mean; every input is listed as used.
    """
    rows = as_rows(vectors)
    checked_weights(weights, len(rows), rows[0])
    return Aggregate(weighted_mean(rows, weights), list(range(len(rows))))


def median(vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> Aggregate:
    """Coordinate-wise median (Yin, Chen, Ramchandran, Bartlett, "Byzantine-Robust
    Distributed Learning: Towards Optimal Statistical Rates", ICML 2018).

    Unweighted: a token claim cannot move a median, which is the point. For an even
    number of inputs each coordinate is the mean of its two middle values.

    Args:
        vectors: 1-D tensors of one length.
        weights: accepted for a uniform signature and checked, but not used.

    Returns:
        The coordinate-wise median; every input is listed as used.
    """
    rows = as_rows(vectors)
    checked_weights(weights, len(rows), rows[0])
    return Aggregate(middle(sorted_rows(rows)), list(range(len(rows))))


def trimmed_mean(
    vectors: Sequence[torch.Tensor], weights: Sequence[float], *, trim: float = 0.2
) -> Aggregate:
    """Coordinate-wise trimmed mean (Yin, Chen, Ramchandran, Bartlett, "Byzantine-Robust
    Distributed Learning: Towards Optimal Statistical Rates", ICML 2018).

    Per coordinate, drops the ``floor(trim * n)`` largest and smallest values and
    averages the rest, unweighted as in the paper. If nothing would remain, it falls
    back to the coordinate-wise median; if nothing is dropped (``trim * n < 1``, e.g.
    the default 0.2 with four inputs) it is the plain unweighted mean.

    Args:
        vectors: 1-D tensors of one length.
        weights: accepted for a uniform signature and checked, but not used.
        trim: fraction trimmed from each end, in ``[0, 0.5]``.

    Returns:
        The trimmed mean; every input is listed as used (any of them may be kept in
        some coordinate).
    """
    if not 0.0 <= trim <= 0.5:
        raise ValueError(f"trim must be in [0, 0.5], got {trim}")
    rows = as_rows(vectors)
    checked_weights(weights, len(rows), rows[0])
    n = len(rows)
    cut = math.floor(trim * n)
    used = list(range(n))
    if cut == 0:  # nothing to drop, so no need to sort
        return Aggregate(mean_rows(rows), used)
    ordered = sorted_rows(rows)
    if n - 2 * cut <= 0:
        return Aggregate(middle(ordered), used)
    return Aggregate(mean_rows(ordered[cut : n - cut]), used)
