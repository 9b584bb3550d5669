"""The share cap: no single peer may carry more than a given share of an aggregate.

Weighted aggregators need it because token counts are claims, not facts; the verifier
caps the weights of what passed screening before any aggregator sees them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["max_share_weights"]


def max_share_weights(weights: Sequence[float], max_share: float) -> list[float]:
    """Caps weights so that no single input carries more than ``max_share`` of the total.

    Water-filling from the top: the largest weights are lowered to a common level ``c``
    chosen so that ``c == max_share * sum_i min(w_i, c)``; smaller weights keep their
    value, so nobody gains weight and honest token counts stay as claimed. Example:
    ``[1, 1, 8]`` with ``0.5`` gives ``[1, 1, 2]``.

    When the cap cannot be met, the result is equal weights (``total / n`` each), the
    weighting with the smallest largest share: this happens when ``max_share * n < 1``,
    and also when fewer than ``1 / max_share`` inputs have a positive weight (no
    reweighting of the working inputs alone can then meet the cap). All-zero weights
    come back unchanged, since aggregators already treat them as equal.

    Args:
        weights: non-negative weights, e.g. token counts.
        max_share: largest allowed share of the total, in ``(0, 1]``.

    Returns:
        The capped weights, in input order.
    """
    if not 0.0 < max_share <= 1.0:
        raise ValueError(f"max_share must be in (0, 1], got {max_share}")
    w = [float(x) for x in weights]
    if any(not math.isfinite(x) or x < 0 for x in w):
        raise ValueError(f"weights must be finite and non-negative, got {list(weights)}")
    n = len(w)
    total = math.fsum(w)
    if n == 0 or total == 0 or max_share == 1.0:
        return w
    positive = sum(1 for x in w if x > 0)
    if positive * max_share < 1.0:
        return [total / n] * n
    order = sorted(range(n), key=lambda i: -w[i])
    ranked = [w[i] for i in order]
    suffix = [math.fsum(ranked[k:]) for k in range(n)]
    capped, level = 0, ranked[0]
    for k in range(n):
        # With the k largest lowered to `level`, the k-th largest must not exceed it.
        denom = 1.0 - k * max_share
        if denom <= 0:
            # k * max_share >= 1: any common level keeps the capped shares <= 1/k.
            capped, level = k, ranked[k]
            break
        level = max_share * suffix[k] / denom
        # A relative tolerance keeps float rounding from capping one input too many.
        if ranked[k] <= level * (1 + 1e-12):
            capped = k
            break
    else:  # pragma: no cover - unreachable when positive * max_share >= 1
        return [total / n] * n
    out = list(w)
    for i in order[:capped]:
        out[i] = level
    return out
