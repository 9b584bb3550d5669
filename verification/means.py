"""The record every aggregator returns, the checks of its inputs, and the one weighted mean.

:func:`weighted_mean` is the one weighted mean of the code base: the ``mean``
aggregator, Multi-Krum, the norm-clipped mean, the all-reduce's default reducer
(:func:`protocol.averaging.parts.weighted_mean_reducer`) and the single-process
reference (:mod:`node.ops.simulate`) all combine rows through it, so they agree bitwise.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["Aggregate", "as_rows", "checked_weights", "mean_rows", "stack_rows", "weighted_mean"]


@dataclass(frozen=True)
class Aggregate:
    """The result of an aggregation.

    Attributes:
        vector: the aggregated 1-D tensor.
        used: sorted indices of the inputs that influence ``vector``.
    """

    vector: torch.Tensor
    used: list[int]


def as_rows(vectors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The inputs in one floating dtype, after checking they line up.

    The dtype is the one :func:`torch.stack` would give them (float32 for integers),
    so aggregators that work row by row agree with those that stack.
    """
    if len(vectors) == 0:
        raise ValueError("aggregation needs at least one vector")
    numel = vectors[0].numel()
    for i, v in enumerate(vectors):
        if v.dim() != 1:
            raise ValueError(f"vector {i} must be 1-D, got shape {tuple(v.shape)}")
        if v.numel() != numel:
            raise ValueError(f"vector {i} has {v.numel()} elements, vector 0 has {numel}")
    dtype = functools.reduce(torch.promote_types, [v.dtype for v in vectors])
    if not dtype.is_floating_point:
        dtype = torch.float32
    return [v.to(dtype) for v in vectors]


def stack_rows(vectors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Stacks the inputs into an ``(n, d)`` matrix after checking they line up."""
    return torch.stack(as_rows(vectors))


def mean_rows(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """The plain mean of equal-length rows, summed in place instead of stacked first."""
    total = rows[0].clone()
    for row in rows[1:]:
        total.add_(row)
    return total.div_(len(rows))


def checked_weights(weights: Sequence[float], n: int, like: torch.Tensor) -> torch.Tensor:
    """Returns weights normalised to sum to one; all-zero weights count as equal."""
    if len(weights) != n:
        raise ValueError(f"got {len(weights)} weights for {n} vectors")
    w = torch.tensor([float(x) for x in weights], dtype=torch.float64)
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ValueError(f"weights must be finite and non-negative, got {list(weights)}")
    total = w.sum()
    # An all-idle round (every weight zero) still has vectors to combine; equal weights
    # are the only choice that favours nobody.
    w = torch.full_like(w, 1.0 / n) if total == 0 else w / total
    return w.to(dtype=like.dtype, device=like.device)


def weighted_mean(rows: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """``sum_i (w_i / sum_j w_j) * rows[i]``, summed in place in input order.

    Each coordinate is computed on its own from the same coordinate of every row, so
    the mean of a block of the rows is bitwise that block of the whole mean (an owner
    reduces block by block as parts arrive, :mod:`protocol.averaging.streaming`).

    Args:
        rows: tensors of one shape and dtype (not checked here; the ``mean``
            aggregator checks its inputs first).
        weights: one per row; a negative weight counts as zero, and when every
            weight is zero the rows count equally.

    Returns:
        A new tensor shaped like ``rows[0]``.
    """
    clipped = [max(0.0, w) for w in weights]
    total, n = sum(clipped), len(clipped)
    shares = [w / total for w in clipped] if total > 0 else [1.0 / n] * n
    out = torch.zeros_like(rows[0])
    for row, share in zip(rows, shares):
        out.add_(row, alpha=share)
    return out
