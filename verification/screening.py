"""Per-contribution screening: which peers' vectors may enter an aggregate.

:func:`screen` judges every contribution to one aggregation and returns one
:class:`Verdict` per candidate, in input order. Cheap checks run first and never
depend on other peers: the length (``"shape"``), finiteness (``"not_finite"``) and the
token claim (``"tokens"``). The statistical checks then compare each survivor with the
others: its norm against the median norm (``"norm"``) and its direction against a
leave-one-out coordinate-wise median (``"direction"``).

:func:`check_reduced` is the other side of a butterfly all-reduce: a member checks the
part an owner sent back against the member's own contribution to it.

Nothing here raises on bad peer data; a bad contribution is a verdict, and the caller
logs it, audits it and tells the trust policy.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from verification.aggregators import coordinate_median

__all__ = ["Candidate", "ScreeningConfig", "Verdict", "check_reduced", "screen"]

# Norms at or below this count as zero: such a vector has no direction to judge.
_TINY = 1e-12

DIRECTION_SAMPLE = 1 << 16
"""Coordinates the direction check samples from parts larger than this."""

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
    """

    peer: str
    vector: torch.Tensor
    tokens: int
    expected_numel: int


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


def _cheap_verdict(c: Candidate, cfg: ScreeningConfig) -> Verdict:
    v = c.vector
    if v.dim() != 1 or v.numel() != c.expected_numel or not v.is_floating_point():
        return Verdict(
            c.peer,
            False,
            "shape",
            f"expected 1-D floating tensor of {c.expected_numel}, got {v.dtype} {tuple(v.shape)}",
        )
    if not bool(torch.isfinite(v).all()):
        bad = int((~torch.isfinite(v)).sum())
        return Verdict(c.peer, False, "not_finite", f"{bad} of {v.numel()} values not finite")
    if cfg.enabled and not 0 <= c.tokens <= cfg.max_tokens:
        return Verdict(c.peer, False, "tokens", f"claimed {c.tokens}, allowed 0..{cfg.max_tokens}")
    return _ok(c.peer)


def _leave_one_out_medians(stacked: torch.Tensor) -> torch.Tensor:
    """Row i: the coordinate-wise median of every row except i, for all i at once.

    Sorting each column once gives every leave-one-out median: removing the value of
    rank ``r`` shifts the ranks above ``r`` down by one, so the remaining value at
    position ``j`` is ``sorted[j]`` when ``j < r`` and ``sorted[j + 1]`` otherwise.
    This costs one sort instead of ``n``.
    """
    n = stacked.shape[0]
    ordered, index = stacked.sort(dim=0)
    rank = torch.empty_like(index)
    positions = torch.arange(n, device=stacked.device).unsqueeze(1).expand_as(index)
    rank.scatter_(0, index, positions)
    rest = n - 1
    lo, hi = (rest - 1) // 2, rest // 2
    at_lo = torch.where(rank > lo, ordered[lo], ordered[lo + 1])
    at_hi = torch.where(rank > hi, ordered[hi], ordered[hi + 1])
    return (at_lo + at_hi) / 2


def _direction_sample(stacked: torch.Tensor) -> torch.Tensor:
    """The columns the direction check looks at: all of them, or a random subset.

    The leave-one-out median needs a sort per coordinate, which dominates screening
    on multi-million-value parts. A cosine over ``DIRECTION_SAMPLE`` coordinates drawn
    uniformly at random estimates the full cosine to about ``1/sqrt(sample)`` for
    high-dimensional vectors, and drawing them afresh from the OS's randomness on
    every call means a peer cannot know which coordinates will be looked at.
    """
    d = stacked.shape[1]
    if d <= DIRECTION_SAMPLE:
        return stacked
    generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))
    cols = torch.randint(0, d, (DIRECTION_SAMPLE,), generator=generator)
    return stacked[:, cols.to(stacked.device)]


def _statistical_verdicts(
    peers: list[str], stacked: torch.Tensor, cfg: ScreeningConfig
) -> list[Verdict]:
    """Norm and direction checks among candidates that passed the cheap checks."""
    verdicts = [_ok(p) for p in peers]
    norms = torch.linalg.vector_norm(stacked, dim=1, dtype=torch.float64)
    # Idle peers send zero vectors; they pass (nothing to judge) and stay out of the
    # reference statistics, or a swarm of mostly idle peers would make every working
    # peer look like a norm outlier against a zero median.
    active = [i for i in range(len(peers)) if norms[i] > _TINY]
    if len(active) < _MIN_FOR_STATISTICS:
        return verdicts
    active_norms = norms[active]
    limit = cfg.norm_kappa * float(coordinate_median(active_norms))
    sample = _direction_sample(stacked[active])
    centers = _leave_one_out_medians(sample)
    center_norms = torch.linalg.vector_norm(centers, dim=1, dtype=torch.float64)
    sample_norms = torch.linalg.vector_norm(sample, dim=1, dtype=torch.float64)
    dots = (sample * centers).sum(dim=1, dtype=torch.float64)
    for row, i in enumerate(active):
        norm = float(active_norms[row])
        if norm > limit:
            verdicts[i] = Verdict(
                peers[i], False, "norm", f"norm {norm:.4g} > {cfg.norm_kappa:g} x median"
            )
            continue
        # A zero leave-one-out median has no direction; the check cannot judge.
        if float(center_norms[row]) <= _TINY:
            continue
        if float(sample_norms[row]) <= _TINY:
            continue
        cosine = float(dots[row]) / (float(sample_norms[row]) * float(center_norms[row]))
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
    (``||x_i|| > norm_kappa * median_j ||x_j||``) and the direction check (cosine with
    the coordinate-wise median of the *other* candidates below ``min_cosine``). Leaving
    the candidate out of its own reference keeps an attacker from pulling the centre
    towards itself.

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
    verdicts = [_cheap_verdict(c, cfg) for c in candidates]
    if not cfg.enabled:
        return verdicts
    passed = [i for i, v in enumerate(verdicts) if v.ok]
    if len(passed) < _MIN_FOR_STATISTICS:
        return verdicts
    stacked = torch.stack([candidates[i].vector for i in passed])
    if not stacked.is_floating_point():  # pragma: no cover - the shape check refuses these
        stacked = stacked.to(torch.float32)
    for i, verdict in zip(
        passed, _statistical_verdicts([candidates[i].peer for i in passed], stacked, cfg)
    ):
        verdicts[i] = verdict
    return verdicts


def check_reduced(
    reduced: torch.Tensor,
    own: torch.Tensor,
    *,
    max_ratio: float = 3.0,
    min_cosine: float = -0.1,
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
    if not bool(torch.isfinite(reduced).all()):
        bad = int((~torch.isfinite(reduced)).sum())
        return Verdict("", False, "not_finite", f"{bad} of {reduced.numel()} values not finite")
    reduced_norm = float(torch.linalg.vector_norm(reduced, dtype=torch.float64))
    own_norm = float(torch.linalg.vector_norm(own, dtype=torch.float64))
    if reduced_norm > max_ratio * max(own_norm, _TINY):
        return Verdict(
            "",
            False,
            "owner_norm",
            f"reduced norm {reduced_norm:.4g} > {max_ratio:g} x own norm {own_norm:.4g}",
        )
    if reduced_norm > _TINY and own_norm > _TINY:
        dot = float((reduced.to(own.dtype) * own).sum(dtype=torch.float64))
        cosine = dot / (reduced_norm * own_norm)
        if cosine < min_cosine:
            return Verdict(
                "", False, "owner_direction", f"cosine {cosine:.3f} < {min_cosine:g} with own part"
            )
    return _ok("")
