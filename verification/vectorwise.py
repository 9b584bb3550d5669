"""Aggregators over whole vectors: clipping around a centre, and Krum's selection.

They weigh, clip or pick whole vectors (distances, norms, a centre), so they keep their
meaning on sparse inputs whose supports barely overlap
(:data:`verification.aggregators.SPARSE_SAFE`), but need every input whole before
they start. Each one cites the paper it comes from.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from verification.means import Aggregate, checked_weights, stack_rows, weighted_mean
from verification.sorting import coordinate_median

__all__ = ["centered_clip", "clipped_mean", "krum", "multi_krum"]


def _krum_scores(stacked: torch.Tensor, f: int) -> torch.Tensor:
    """Krum score of each input: summed squared distances to its nearest neighbours."""
    n = stacked.shape[0]
    if n == 1:
        return torch.zeros(1, dtype=stacked.dtype, device=stacked.device)
    # The exact (non-matmul) path: the matmul trick loses precision through
    # cancellation exactly when honest vectors are close, which is when it matters.
    dist = torch.cdist(stacked, stacked, compute_mode="donot_use_mm_for_euclid_dist") ** 2
    dist.fill_diagonal_(math.inf)
    # Blanchard et al. use n - f - 2 neighbours, which needs n > f + 2; below that
    # bound Krum gives no guarantee anyway, so score against every other input.
    k = n - f - 2 if n - f - 2 >= 1 else n - 1
    return dist.sort(dim=1).values[:, :k].sum(dim=1)


def _check_f(f: int) -> None:
    if isinstance(f, bool) or not isinstance(f, int) or f < 0:
        raise ValueError(f"f must be a non-negative integer, got {f!r}")


def centered_clip(
    vectors: Sequence[torch.Tensor],
    weights: Sequence[float],
    *,
    tau: float = 1.0,
    iters: int = 3,
    center: torch.Tensor | None = None,
) -> Aggregate:
    """Centered clipping (Karimireddy, He, Jaggi, "Learning from History for Byzantine
    Robust Optimization", ICML 2021).

    Starting from ``center`` (the coordinate-wise median when not given), repeats
    ``v <- v + sum_i w_i * clip(x_i - v)`` where ``clip(d) = d * min(1, r / ||d||)``.
    The radius is relative, ``r = tau * median_i ||x_i - v0||`` around the starting
    point ``v0``, so one setting works at any gradient scale; the paper's absolute
    radius is recovered by passing the matching ``tau``. The radius is fixed after the
    start so an iteration cannot widen it. Weights are normalised to sum to one.

    Args:
        vectors: 1-D tensors of one length.
        weights: non-negative token weights; all zero means equal weights.
        tau: clipping radius as a multiple of the median distance to the start, > 0.
        iters: number of clipping iterations, >= 1.
        center: starting point, e.g. the previous round's aggregate (the paper's
            momentum); defaults to the coordinate-wise median.

    Returns:
        The clipped centre; every input is listed as used.
    """
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters must be an integer >= 1, got {iters!r}")
    stacked = stack_rows(vectors)
    w = checked_weights(weights, len(vectors), stacked)
    if center is None:
        v = coordinate_median(stacked)
    else:
        if center.shape != stacked[0].shape:
            raise ValueError(
                f"center has shape {tuple(center.shape)}, vectors have {tuple(stacked[0].shape)}"
            )
        v = center.to(dtype=stacked.dtype, device=stacked.device).clone()
    radius = tau * coordinate_median(torch.linalg.vector_norm(stacked - v, dim=1))
    for _ in range(iters):
        diff = stacked - v
        norms = torch.linalg.vector_norm(diff, dim=1)
        # A zero difference needs no clipping (and would divide by zero).
        scale = torch.where(norms > radius, radius / norms.clamp_min(1e-30), torch.ones_like(norms))
        v = v + (w * scale) @ diff
    return Aggregate(v, list(range(len(vectors))))


def clipped_mean(
    vectors: Sequence[torch.Tensor], weights: Sequence[float], *, tau: float = 1.0
) -> Aggregate:
    """Norm-clipped weighted mean: each input scaled down to at most ``tau`` times the
    median of the inputs' norms, then :func:`weighted_mean` (the per-client clipping of
    DP-FedAvg, McMahan, Ramage, Talwar, Zhang, "Learning Differentially Private Recurrent
    Language Models", ICLR 2018; as a robust rule, e.g. Karimireddy et al., ICML 2021).

    It never looks at single coordinates, so it keeps its meaning on sparse inputs
    whose supports barely overlap (where a coordinate-wise median or trimmed mean sees
    one value per coordinate and drops it). An input's share of the result is bounded
    by its weight times the radius.

    Args:
        vectors: 1-D tensors of one length.
        weights: non-negative token weights; all zero means equal weights.
        tau: clipping radius as a multiple of the median norm, > 0.

    Returns:
        The mean of the clipped inputs; every input is listed as used.
    """
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    stacked = stack_rows(vectors)
    checked_weights(weights, len(vectors), stacked)
    norms = torch.linalg.vector_norm(stacked, dim=1)
    radius = tau * coordinate_median(norms)
    scale = torch.where(norms > radius, radius / norms.clamp_min(1e-30), torch.ones_like(norms))
    rows = [stacked[i] * scale[i] for i in range(len(vectors))]
    return Aggregate(weighted_mean(rows, weights), list(range(len(vectors))))


def krum(vectors: Sequence[torch.Tensor], weights: Sequence[float], *, f: int) -> Aggregate:
    """Krum (Blanchard, El Mhamdi, Guerraoui, Stainer, "Machine Learning with
    Adversaries: Byzantine Tolerant Gradient Descent", NeurIPS 2017).

    Scores each input by the summed squared distances to its ``n - f - 2`` nearest
    other inputs and returns the input with the lowest score (the first one on ties).
    With ``n <= f + 2`` the paper's neighbour count is not positive; every other input
    (``n - 1``) is used instead, and the guarantee of the paper does not hold.

    Args:
        vectors: 1-D tensors of one length.
        weights: accepted for a uniform signature and checked, but not used.
        f: number of Byzantine inputs to tolerate, >= 0.

    Returns:
        The selected input (a copy) and its index.
    """
    _check_f(f)
    stacked = stack_rows(vectors)
    checked_weights(weights, len(vectors), stacked)
    best = int(torch.argmin(_krum_scores(stacked, f)))
    return Aggregate(stacked[best].clone(), [best])


def multi_krum(
    vectors: Sequence[torch.Tensor],
    weights: Sequence[float],
    *,
    f: int,
    m: int | None = None,
) -> Aggregate:
    """Multi-Krum (Blanchard, El Mhamdi, Guerraoui, Stainer, "Machine Learning with
    Adversaries: Byzantine Tolerant Gradient Descent", NeurIPS 2017; El Mhamdi,
    Guerraoui, Rouault, "The Hidden Vulnerability of Distributed Learning in
    Byzantium", ICML 2018).

    Selects the ``m`` inputs with the lowest Krum scores (ties go to the lower index)
    and returns their token-weighted mean. ``m`` defaults to ``n - f`` and is clipped
    to ``[1, n]``.

    Args:
        vectors: 1-D tensors of one length.
        weights: non-negative token weights; if all selected weights are zero the
            selected inputs count equally.
        f: number of Byzantine inputs to tolerate, >= 0.
        m: number of inputs to average, >= 1; default ``n - f``.

    Returns:
        The weighted mean of the selected inputs and their indices.
    """
    _check_f(f)
    if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
        raise ValueError(f"m must be an integer >= 1, got {m!r}")
    stacked = stack_rows(vectors)
    n = stacked.shape[0]
    checked_weights(weights, n, stacked)
    count = min(n, max(1, n - f if m is None else m))
    order = torch.argsort(_krum_scores(stacked, f), stable=True)
    chosen = sorted(int(i) for i in order[:count])
    kept = [weights[i] for i in chosen]
    return Aggregate(weighted_mean([stacked[i] for i in chosen], kept), chosen)
