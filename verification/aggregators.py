"""Robust aggregators by name: how the contributions that passed screening become one update.

Every aggregator takes the same inputs, a sequence of 1-D float tensors of one length
and their non-negative token weights, and returns an
:class:`~verification.means.Aggregate`: the combined vector and the indices of the
inputs that shaped it, so the audit log can say exactly whose work went into a round.
The coordinate-wise ones are in :mod:`verification.coordinatewise`, those over whole
vectors (clipping, Krum) in :mod:`verification.vectorwise`, each citing the paper it
comes from; this module is their one registry, with the parameters a config may set.

Inputs are assumed screened (finite, right length, see ``verification.screening``).
All work is vectorised over coordinates; the only Python loops run over inputs or
iterations, never over the entries of a vector. The one weighted mean is
:func:`verification.means.weighted_mean`.

The share cap that weighted aggregators need, because token counts are claims and not
facts, is :func:`verification.shares.max_share_weights`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from verification.coordinatewise import mean, median, trimmed_mean
from verification.means import Aggregate
from verification.vectorwise import centered_clip, clipped_mean, krum, multi_krum

__all__ = ["AGGREGATORS", "COORDINATEWISE", "SPARSE_SAFE", "aggregate"]

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
