"""The direction check's numerics: which coordinates it samples, and the centres.

Screening (:func:`verification.screening.screen`) judges a part's direction by its
cosine with a centre made of the other parts: the coordinate-wise median of the other
rows, computed for every row at once from one sort per column
(:func:`leave_one_out_medians`). On multi-million-value parts that sort dominates, so
the check looks at a stratified sample of :data:`DIRECTION_SAMPLE` columns drawn afresh
on every call (:func:`direction_sample`), which a peer cannot know in advance.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch

from verification.sorting import sorted_rows

__all__ = [
    "DIRECTION_SAMPLE",
    "direction_centres",
    "direction_columns",
    "direction_sample",
    "leave_one_out_medians",
    "row_stats",
]

_SAMPLE_BITS = 14
DIRECTION_SAMPLE = 1 << _SAMPLE_BITS
"""Coordinates the direction check samples from parts larger than this. Sized by
measurement (four 2.5M-value pseudo-gradients with honest cosines near 0.27, 30 draws
each): the sampled cosine's standard error is 0.015 at 4,096 coordinates, 0.008 at
16,384 and 0.004 at 65,536, at 0.4, 1.0 and 4.0 ms per screening. At 16,384 the error is
a twelfth of the 0.1 between the default ``min_cosine`` and orthogonal; the check costs
a quarter of what 65,536 did."""


def leave_one_out_medians(stacked: torch.Tensor) -> torch.Tensor:
    """Row i: the coordinate-wise median of every row except i, for all i at once.

    Sorting each column once gives every leave-one-out median. Removing value ``x``
    from a sorted column shifts the values above it down by one, so the remaining
    value at position ``j`` is ``sorted[j]`` when more than ``j`` values lie below
    ``x``, that is when ``x > sorted[j]``, and ``sorted[j + 1]`` otherwise. Ties need
    no care: removing any one of equal values leaves the same column. This costs one
    sort instead of ``n``.
    """
    n = stacked.shape[0]
    ordered = sorted_rows(stacked)

    def remaining(j: int) -> torch.Tensor:
        # torch.where(stacked > ordered[j], ordered[j], ordered[j + 1]); a gather picks
        # the same values at half of torch.where's cost on CPU
        choices = torch.stack([ordered[j + 1], ordered[j]])
        return torch.gather(choices, 0, (stacked > ordered[j]).long())

    rest = n - 1
    lo, hi = (rest - 1) // 2, rest // 2
    if lo == hi:  # an odd number of others has one middle value
        return remaining(lo)
    return (remaining(lo) + remaining(hi)) / 2


def direction_columns(d: int) -> torch.Tensor:
    """``DIRECTION_SAMPLE`` column indices below ``d``, ascending: one per stratum.

    Column ``k`` is ``(k * d + r) // DIRECTION_SAMPLE`` with ``r`` uniform in
    ``[0, d)``, drawn with a fresh seed from the OS's randomness on every call: one
    uniform draw from the ``k``-th of ``DIRECTION_SAMPLE`` equal strata. Every
    coordinate is still sampled with probability ``DIRECTION_SAMPLE / d``, as with
    independent uniform draws, and every stretch of the vector is covered in
    proportion to its length (stratified sampling: its estimate of a sum is never
    worse than that of independent draws). In ascending order the gather streams
    through memory, about twice as fast as in random order.
    """
    generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))
    within = torch.randint(0, d, (DIRECTION_SAMPLE,), generator=generator)
    return (torch.arange(0, DIRECTION_SAMPLE * d, d) + within) >> _SAMPLE_BITS


def direction_sample(vectors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The columns the direction check looks at, one row per vector: all, or a subset.

    The leave-one-out median needs a sort per coordinate, which dominates screening
    on multi-million-value parts. A cosine over ``DIRECTION_SAMPLE`` coordinates drawn
    at random estimates the full cosine to about ``1/sqrt(sample)`` for
    high-dimensional vectors, and drawing them afresh on every call means a peer
    cannot know which coordinates will be looked at. One draw serves every vector, and
    only the sampled columns are copied.
    """
    d = vectors[0].shape[0]
    if d <= DIRECTION_SAMPLE:
        return torch.stack(list(vectors))
    cols = direction_columns(d).to(vectors[0].device)
    return torch.stack([v.index_select(0, cols) for v in vectors])


def row_stats(
    sample: torch.Tensor, centers: torch.Tensor
) -> tuple[list[float], list[float], list[float]]:
    """Per row: the sample's norm, the centre's norm and their dot product.

    In the sample's precision; values whose squares or products overflow it (the
    vectors themselves are finite) get all three again in float64.
    """
    stats = _stats_in(sample, centers)
    if not all(math.isfinite(value) for row in stats for value in row):
        stats = _stats_in(sample.double(), centers.double())
    return stats[0], stats[1], stats[2]


def _stats_in(x: torch.Tensor, c: torch.Tensor) -> list[list[float]]:
    norms = [torch.linalg.vector_norm(m, dim=1).tolist() for m in (x, c)]
    return [*norms, (x * c).sum(dim=1).tolist()]


def direction_centres(sample: torch.Tensor) -> torch.Tensor:
    """Row i: the centre row i's direction is judged against.

    The coordinate-wise median of the other rows, so that an input cannot pull its own
    centre towards itself; with three rows that would be the mean of two (one of them
    decides it), so three are judged against the median of all three, which a single
    input cannot move past the other two.
    """
    if sample.shape[0] == 3:  # the fewest rows the statistical checks judge
        return sample.median(dim=0).values.expand_as(sample)
    return leave_one_out_medians(sample)
