"""Per-contribution screening: which peers' vectors may enter an aggregate.

:func:`screen` judges every contribution to one aggregation and returns one
:class:`Verdict` per candidate, in input order. Cheap checks run first and never
depend on other peers: the length (``"shape"``), finiteness (``"not_finite"``) and the
token claim (``"tokens"``). The statistical checks then compare each survivor with the
others: its norm against the median norm (``"norm"``), then, among those the norm check
kept, its direction against a leave-one-out coordinate-wise median (``"direction"``;
its column sample and centres are :mod:`verification.directions`).

:func:`check_reduced` is the other side of a butterfly all-reduce: a member checks the
part an owner sent back against the member's own contribution to it.

Nothing here raises on bad peer data; a bad contribution is a verdict, and the caller
logs it, audits it and tells the trust policy.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from verification.directions import direction_centres, direction_sample, row_stats

__all__ = [
    "Candidate",
    "ScreeningConfig",
    "Verdict",
    "check_reduced",
    "finite_norm",
    "screen",
    "screen_copies",
]

# Norms at or below this count as zero: such a vector has no direction to judge.
_TINY = 1e-12

# Fewer inputs than this and a median is no longer robust: one outlier of two moves it.
_MIN_FOR_STATISTICS = 3


@dataclass(frozen=True)
class ScreeningConfig:
    """Settings for :func:`screen`.

    Attributes:
        enabled: when False only the checks that are never optional run (shape and
            finiteness).
        norm_kappa: reject when ``||x_i|| > norm_kappa * median_j ||x_j||``.
        min_cosine: reject when the cosine between ``x_i`` and the coordinate-wise
            median of the other inputs is below this.
        max_tokens: reject a token claim above this (or below zero). Accepted claims
            are capped separately by the node's policy.
    """

    enabled: bool = True
    norm_kappa: float = 3.0
    min_cosine: float = -0.1
    max_tokens: int = 10**9


@dataclass(frozen=True)
class Candidate:
    """One peer's contribution to an aggregation.

    Attributes:
        peer: the contributing PeerID.
        vector: the decoded contribution, expected 1-D.
        tokens: the peer's claimed token count for this contribution.
        expected_numel: the length the receiver expects (from the fragment plan, never
            from the peer).
        norm: the vector's norm when the receiver computed it while decoding (which
            also found every value finite); None: screening computes it.
    """

    peer: str
    vector: torch.Tensor
    tokens: int
    expected_numel: int
    norm: float | None = None


@dataclass(frozen=True)
class Verdict:
    """The outcome of screening one contribution.

    Attributes:
        peer: the PeerID judged ("" from :func:`check_reduced`; the caller fills it in).
        ok: whether the contribution may be used.
        reason: ``"ok"`` or a short machine-friendly reason.
        detail: human-readable numbers behind the reason, for the log line.
    """

    peer: str
    ok: bool
    reason: str
    detail: str = ""


def _ok(peer: str) -> Verdict:
    return Verdict(peer, True, "ok")


def finite_norm(v: torch.Tensor) -> tuple[float, int]:
    """The norm of ``v`` and how many of its values are not finite.

    One pass when every value is finite, the common case: a NaN or an infinity makes
    the norm NaN or infinite, so the values are counted only when the norm is not
    finite. Finite values whose squares overflow float32 get their norm again in
    float64, where no float32 vector of finite values overflows.
    """
    norm = float(torch.linalg.vector_norm(v, dtype=torch.promote_types(v.dtype, torch.float32)))
    if math.isfinite(norm):
        return norm, 0
    bad = int((~torch.isfinite(v)).sum())
    if bad:
        return norm, bad
    return float(torch.linalg.vector_norm(v, dtype=torch.float64)), 0


def _cheap_verdict(c: Candidate, cfg: ScreeningConfig) -> tuple[Verdict, float]:
    """The checks on one candidate alone, and its norm for the statistical checks."""
    v = c.vector
    if v.dim() != 1 or v.numel() != c.expected_numel or not v.is_floating_point():
        detail = (
            f"expected 1-D floating tensor of {c.expected_numel}, got {v.dtype} {tuple(v.shape)}"
        )
        return Verdict(c.peer, False, "shape", detail), math.nan
    norm, bad = finite_norm(v) if c.norm is None else (c.norm, 0)
    if bad:
        detail = f"{bad} of {v.numel()} values not finite"
        return Verdict(c.peer, False, "not_finite", detail), norm
    if cfg.enabled and not 0 <= c.tokens <= cfg.max_tokens:
        detail = f"claimed {c.tokens}, allowed 0..{cfg.max_tokens}"
        return Verdict(c.peer, False, "tokens", detail), norm
    return _ok(c.peer), norm


def _statistical_verdicts(
    peers: list[str], vectors: list[torch.Tensor], norms: list[float], cfg: ScreeningConfig
) -> list[Verdict]:
    """Norm and direction checks among candidates that passed the cheap checks."""
    verdicts = [_ok(p) for p in peers]
    # Idle peers send zero vectors; they pass (nothing to judge) and stay out of the
    # reference statistics, or a swarm of mostly idle peers would make every working
    # peer look like a norm outlier against a zero median.
    active = [i for i in range(len(peers)) if norms[i] > _TINY]
    if len(active) < _MIN_FOR_STATISTICS:
        return verdicts
    active_norms = [norms[i] for i in active]
    limit = cfg.norm_kappa * statistics.median(active_norms)
    for row, i in enumerate(active):
        if active_norms[row] > limit:
            verdicts[i] = Verdict(
                peers[i],
                False,
                "norm",
                f"norm {active_norms[row]:.4g} > {cfg.norm_kappa:g} x median",
            )
    # The direction check's centres come from the inputs the norm check kept: a refused
    # input would otherwise steer them (in a group of three, an honest member's
    # leave-one-out centre is the mean of its partner and a hundredfold part).
    kept = [i for i in active if verdicts[i].ok]
    if len(kept) < _MIN_FOR_STATISTICS:
        return verdicts
    sample = direction_sample([vectors[i] for i in kept])
    sample_norms, center_norms, dots = row_stats(sample, direction_centres(sample))
    for row, i in enumerate(kept):
        # A zero centre has no direction; the check cannot judge.
        if center_norms[row] <= _TINY or sample_norms[row] <= _TINY:
            continue
        cosine = dots[row] / (sample_norms[row] * center_norms[row])
        if cosine < cfg.min_cosine:
            verdicts[i] = Verdict(
                peers[i],
                False,
                "direction",
                f"cosine {cosine:.3f} < {cfg.min_cosine:g} against the others' median",
            )
    return verdicts


def screen(candidates: Sequence[Candidate], cfg: ScreeningConfig) -> list[Verdict]:
    """Judges every contribution to one aggregation.

    Cheap checks first, each candidate on its own: shape (1-D, floating point,
    ``expected_numel`` long), finiteness, and, when enabled, the token claim. Then,
    when enabled, among the candidates that passed: the norm check
    (``||x_i|| > norm_kappa * median_j ||x_j||``) and, among those it kept, the direction
    check (cosine with the coordinate-wise median of the *other* kept candidates below
    ``min_cosine``; of all three when three were kept). Leaving the candidate out of its
    own reference keeps an attacker from pulling the centre towards itself; leaving the
    norm check's refusals out keeps a long part from steering everyone's centre.

    The statistical checks need at least three non-zero candidates: with fewer, a median
    is no more robust than a mean (one of two inputs moves it anywhere), so they are
    skipped rather than letting a single bad peer decide what "normal" is. Zero vectors
    (an honest idle peer, even one claiming tokens) pass both statistical checks, since
    a zero vector has no direction and cannot be too large, and are left out of the
    reference statistics.

    With ``cfg.enabled`` False only shape and finiteness are checked: an aggregate
    cannot be computed from a vector of the wrong length or with a NaN in it.

    Args:
        candidates: the contributions, one per peer.
        cfg: screening settings.

    Returns:
        One verdict per candidate, in input order.
    """
    cheap = [_cheap_verdict(c, cfg) for c in candidates]
    verdicts = [verdict for verdict, _ in cheap]
    if not cfg.enabled:
        return verdicts
    passed = [i for i, v in enumerate(verdicts) if v.ok]
    if len(passed) < _MIN_FOR_STATISTICS:
        return verdicts
    statistical = _statistical_verdicts(
        [candidates[i].peer for i in passed],
        [candidates[i].vector for i in passed],
        [cheap[i][1] for i in passed],
        cfg,
    )
    for i, verdict in zip(passed, statistical):
        verdicts[i] = verdict
    return verdicts


def screen_copies(candidates: Sequence[Candidate], own: int | None, kappa: float) -> list[Verdict]:
    """Judges the global copies a group mixes (its ``weights`` exchange) by their norms.

    Every member's copy is a copy of one model: their norms sit within a few percent of
    each other, whatever their direction has drifted. :func:`screen` lets a zero vector
    pass (an idle member's pseudo-gradient is zero); a zero or shrunken *copy* would
    drag every member's base towards zero, so a copy whose norm is below the others'
    median norm (a pair: the judge's ``own`` copy's) over ``kappa`` is left out
    (``"copy_norm"``). Norms above ``kappa`` times are :func:`screen`'s business.

    Args:
        candidates: the copies, one per member (they passed :func:`screen`).
        own: which candidate is this node's own (None: a pair has no reference).
        kappa: the norm screen's factor (``trust.norm_kappa``).

    Returns:
        One verdict per candidate, in input order.
    """
    norms = [c.norm if c.norm is not None else finite_norm(c.vector)[0] for c in candidates]
    verdicts = []
    for i, c in enumerate(candidates):
        others = [n for j, n in enumerate(norms) if j != i]
        if len(candidates) >= _MIN_FOR_STATISTICS:
            reference = statistics.median(others)
        elif own is not None and own != i:
            reference = norms[own]
        else:
            reference = 0.0
        if norms[i] * kappa < reference:
            detail = f"norm {norms[i]:.4g} < the others' {reference:.4g} / {kappa:g}"
            verdicts.append(Verdict(c.peer, False, "copy_norm", detail))
        else:
            verdicts.append(_ok(c.peer))
    return verdicts


def _cosine(a: torch.Tensor, b: torch.Tensor, a_norm: float, b_norm: float) -> float:
    """The cosine between two finite, non-zero vectors of the same shape, given their norms."""
    dtype = torch.promote_types(b.dtype, torch.float32)
    dot = float(torch.dot(a.reshape(-1).to(dtype), b.reshape(-1).to(dtype)))
    if not math.isfinite(dot):  # finite values whose products overflow float32
        dot = float(torch.dot(a.reshape(-1).double(), b.reshape(-1).double()))
    return dot / (a_norm * b_norm)


def check_reduced(
    reduced: torch.Tensor,
    own: torch.Tensor,
    *,
    max_ratio: float = 3.0,
    min_cosine: float = -0.1,
    norms: tuple[float, float] | None = None,
) -> Verdict:
    """A member's check of the reduced part an owner returned, against its own part.

    An honest average is no longer than the longest input and points, roughly, where
    the honest inputs point; a member only knows its own input, so it checks that the
    reduced part is at most ``max_ratio`` times as long as its own contribution
    (``"owner_norm"``) and not pointing away from it (``"owner_direction"``).

    A member whose own part is zero (or near it) cannot vouch for any non-zero reduced
    part: the norm bound becomes ``max_ratio * 1e-12`` and fails. Callers with an idle
    contribution should not base an accusation on this check. The direction check is
    skipped when either vector is near zero, since a cosine is then undefined.

    Args:
        reduced: the part the owner sent back.
        own: this member's contribution to that part.
        max_ratio: largest allowed ``||reduced|| / ||own||``.
        min_cosine: smallest allowed cosine between ``reduced`` and ``own``.
        norms: ``(||reduced||, ||own||)`` from :func:`finite_norm`, when the caller
            already has them and both vectors are finite (saves two passes).

    Returns:
        A verdict with ``peer=""``; reason ``"ok"``, ``"shape"``, ``"not_finite"``,
        ``"owner_norm"`` or ``"owner_direction"``.
    """
    if reduced.shape != own.shape or not reduced.is_floating_point():
        return Verdict(
            "",
            False,
            "shape",
            f"expected {tuple(own.shape)}, got {reduced.dtype} {tuple(reduced.shape)}",
        )
    if norms is not None:
        reduced_norm, own_norm = norms
    else:
        reduced_norm, bad = finite_norm(reduced)
        if bad:
            return Verdict("", False, "not_finite", f"{bad} of {reduced.numel()} values not finite")
        own_norm = finite_norm(own)[0]
    if reduced_norm > max_ratio * max(own_norm, _TINY):
        return Verdict(
            "",
            False,
            "owner_norm",
            f"reduced norm {reduced_norm:.4g} > {max_ratio:g} x own norm {own_norm:.4g}",
        )
    if reduced_norm > _TINY and own_norm > _TINY:
        cosine = _cosine(reduced, own, reduced_norm, own_norm)
        if cosine < min_cosine:
            return Verdict(
                "", False, "owner_direction", f"cosine {cosine:.3f} < {min_cosine:g} with own part"
            )
    return _ok("")
