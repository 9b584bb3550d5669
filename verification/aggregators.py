"""Robust aggregators: how the contributions that passed screening become one update.

Every aggregator takes the same inputs, a sequence of 1-D float tensors of one length
and their non-negative token weights, and returns an :class:`Aggregate`: the combined
vector and the indices of the inputs that shaped it, so the audit log can say exactly
whose work went into a round. Each one cites the paper it comes from.

Inputs are assumed screened (finite, right length, see ``verification.screening``).
All work is vectorised over coordinates; the only Python loops run over inputs or
iterations, never over the entries of a vector.

:func:`weighted_mean` is the one weighted mean of the code base: the ``mean``
aggregator, Multi-Krum, the all-reduce's default reducer
(:func:`protocol.averaging.parts.weighted_mean_reducer`) and the single-process
reference (:mod:`node.ops.simulate`) all combine rows through it, so they agree bitwise.

The share cap that weighted aggregators need, because token counts are claims and not
facts, is :func:`verification.shares.max_share_weights`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from verification.sorting import coordinate_median, middle, sorted_rows

__all__ = [
    "AGGREGATORS",
    "COORDINATEWISE",
    "Aggregate",
    "aggregate",
    "SPARSE_SAFE",
    "centered_clip",
    "clipped_mean",
    "coordinate_median",
    "krum",
    "mean",
    "median",
    "multi_krum",
    "trimmed_mean",
    "weighted_mean",
]


@dataclass(frozen=True)
class Aggregate:
    """The result of an aggregation.

    Attributes:
        vector: the aggregated 1-D tensor.
        used: sorted indices of the inputs that influence ``vector``.
    """

    vector: torch.Tensor
    used: list[int]


# --- shared helpers ----------------------------------------------------------


def _rows(vectors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
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


def _stack(vectors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Stacks the inputs into an ``(n, d)`` matrix after checking they line up."""
    return torch.stack(_rows(vectors))


def _mean_rows(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """The plain mean of equal-length rows, summed in place instead of stacked first."""
    total = rows[0].clone()
    for row in rows[1:]:
        total.add_(row)
    return total.div_(len(rows))


def _weights(weights: Sequence[float], n: int, like: torch.Tensor) -> torch.Tensor:
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


# --- aggregators -------------------------------------------------------------


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
    rows = _rows(vectors)
    _weights(weights, len(rows), rows[0])
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
    rows = _rows(vectors)
    _weights(weights, len(rows), rows[0])
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
    rows = _rows(vectors)
    _weights(weights, len(rows), rows[0])
    n = len(rows)
    cut = math.floor(trim * n)
    used = list(range(n))
    if cut == 0:  # nothing to drop, so no need to sort
        return Aggregate(_mean_rows(rows), used)
    ordered = sorted_rows(rows)
    if n - 2 * cut <= 0:
        return Aggregate(middle(ordered), used)
    return Aggregate(_mean_rows(ordered[cut : n - cut]), used)


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
    stacked = _stack(vectors)
    w = _weights(weights, len(vectors), stacked)
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
    stacked = _stack(vectors)
    _weights(weights, len(vectors), stacked)
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
    stacked = _stack(vectors)
    _weights(weights, len(vectors), stacked)
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
    stacked = _stack(vectors)
    n = stacked.shape[0]
    _weights(weights, n, stacked)
    count = min(n, max(1, n - f if m is None else m))
    order = torch.argsort(_krum_scores(stacked, f), stable=True)
    chosen = sorted(int(i) for i in order[:count])
    kept = [weights[i] for i in chosen]
    return Aggregate(weighted_mean([stacked[i] for i in chosen], kept), chosen)


# --- registry ----------------------------------------------------------------

AGGREGATORS: dict[str, Callable[..., Aggregate]] = {
    "mean": mean,
    "median": median,
    "trimmed_mean": trimmed_mean,
    "centered_clip": centered_clip,
    "clipped_mean": clipped_mean,
    "krum": krum,
    "multi_krum": multi_krum,
}

SPARSE_SAFE = frozenset({"mean", "centered_clip", "clipped_mean", "krum", "multi_krum"})
"""Aggregators that keep their meaning on sparse inputs (``sync.codec = "topk"``): they
weigh, clip or pick whole vectors. A coordinate-wise median or trimmed mean of parts that
keep 1 % of each chunk sees, on most coordinates of the union, one non-zero value among
zeros and drops it: the result is almost all zero, so those two are refused."""

COORDINATEWISE = frozenset({"mean", "median", "trimmed_mean"})
"""Aggregators whose values ``lo:hi`` depend only on the inputs' values ``lo:hi`` and
that use every input: run on a block of the inputs they give that block of the
result, bitwise (``tests/unit/verification/test_aggregators.py`` checks it), so an
owner can reduce block by block as parts arrive. The others need whole vectors (distances, a centre)."""

# Parameters a config may set, with their kind; ``center`` is a tensor, so only
# direct callers of centered_clip pass it.
_PARAMS: dict[str, dict[str, type]] = {
    "mean": {},
    "median": {},
    "trimmed_mean": {"trim": float},
    "centered_clip": {"tau": float, "iters": int},
    "clipped_mean": {"tau": float},
    "krum": {"f": int},
    "multi_krum": {"f": int, "m": int},
}
_REQUIRED: dict[str, tuple[str, ...]] = {"krum": ("f",), "multi_krum": ("f",)}


def _check_param(name: str, key: str, value: object, kind: type) -> float | int:
    # bool is an int subclass; `f = true` in a config is a mistake, not f = 1.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}.{key} must be a number, got {value!r}")
    if kind is int:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"{name}.{key} must be an integer, got {value!r}")
        return int(value)
    return float(value)


def aggregate(
    name: str,
    vectors: Sequence[torch.Tensor],
    weights: Sequence[float],
    params: Mapping[str, float | int] | None = None,
) -> Aggregate:
    """Runs the aggregator called ``name`` with parameters taken from a config.

    Args:
        name: one of ``AGGREGATORS``.
        vectors: 1-D tensors of one length.
        weights: non-negative token weights.
        params: the aggregator's numeric parameters (e.g. ``{"trim": 0.1}``).

    Returns:
        The aggregator's result.

    Raises:
        ValueError: unknown name, unknown or missing parameter, or a bad value.
    """
    if name not in AGGREGATORS:
        raise ValueError(f"unknown aggregator {name!r}: expected one of {', '.join(AGGREGATORS)}")
    allowed = _PARAMS[name]
    kwargs: dict[str, float | int] = {}
    for key, value in (params or {}).items():
        if key not in allowed:
            accepts = ", ".join(allowed) if allowed else "no parameters"
            raise ValueError(
                f"unknown parameter {key!r} for aggregator {name!r} (accepts {accepts})"
            )
        kwargs[key] = _check_param(name, key, value, allowed[key])
    missing = [key for key in _REQUIRED.get(name, ()) if key not in kwargs]
    if missing:
        raise ValueError(f"aggregator {name!r} needs parameter {', '.join(missing)}")
    return AGGREGATORS[name](vectors, weights, **kwargs)
