"""The sent check: a contribution must be the work its trace records.

A replay check proves that a member trained the windows of its trace
(:mod:`verification.replay`); it says nothing of what the member then sent. A member can
train honestly and send zeros, a copy of the swarm's last step, or a shifted vector
(ALIE), all with a true trace. The sent check closes that gap.

With ``sync.alpha = 0`` a fragment's pseudo-gradient is ``global - local``, and after
each sync the local copy is the new global copy plus the inner steps taken while the
sync ran (:meth:`node.train.outer.OuterOptimizer.merge_local`). So the pseudo-gradient a sync
sends is exactly minus the sum of the fragment's changes over the inner steps since the
last sync that was applied, and those are the windows of its claim. Each window of a
fragment's trace records the sketch of that fragment's change (``moved``); the sketch is
linear, so the sketch of what was sent must be minus their sum.

What was sent went through the codec: ``Q(pg + residual)`` with error feedback, where the
residual is the last encode's rounding error. Both rounding errors are bounded by the
codec's step, which the checker reads off the sent values themselves (:func:`slack`): a
block's step is its largest value over 127 (int8) or 7 (int4); half-precision codecs
round to a relative 2^-11 (fp16) or 2^-8 (bf16). Sparse codecs (``topk``) keep most of a
pseudo-gradient back for later syncs: no check (:func:`slack` is None).

The check passes when the distance between the two sketches is within
``trust.replay_tolerance`` of the trace's size plus the codec's slack. With int8 that
slack is about a tenth of an honest pseudo-gradient; with int4 close to its whole size,
so there the check catches only gross changes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from verification.traces import TraceWindow

__all__ = ["binds", "passes", "sent_apart", "slack", "trace_sum"]

_QMAX = {"int8": 127, "int4": 7}
_HALF_ULP = {"fp16": 2.0**-11, "bf16": 2.0**-8}


def trace_sum(windows: Sequence[TraceWindow]) -> torch.Tensor | None:
    """The sketch of a fragment's change over a trace's windows (None where a window
    carries no fragment sketch)."""
    if not windows or any(not w.moved for w in windows):
        return None
    return torch.tensor([list(w.moved) for w in windows], dtype=torch.float64).sum(0)


def binds(codec: str) -> bool:
    """Whether the sent check binds what a member sends under ``codec`` to its trace
    closely enough that, with replay checks, a flag can wait for their evidence: every
    codec :func:`slack` applies to but int4, whose slack is close to a whole
    pseudo-gradient (:mod:`node.checks.work` lets check records only weigh then)."""
    return codec == "none" or codec in _HALF_ULP or codec == "int8"


def slack(
    vector: torch.Tensor, codec: str, block_size: int, stochastic: bool, feedback: bool
) -> float | None:
    """How far, in norm, a sent vector may be from the pseudo-gradient it encodes: the
    rounding error of this encode and, with error feedback, the residual of the last one
    (taken as large: the last encode's step is not known), each at most half a step (a
    whole step with stochastic rounding). None for codecs the check does not apply to."""
    v = vector.detach().reshape(-1).float()
    if codec == "none":
        return 0.0
    if codec in _HALF_ULP:
        return (2.0 if feedback else 1.0) * 2.0 * _HALF_ULP[codec] * float(v.norm())
    if codec not in _QMAX:
        return None
    # the norm of every value's step: each block's largest value over qmax, block_size times
    n = v.numel() // block_size * block_size
    squares = v[:n].view(-1, block_size).abs().amax(1).pow(2).sum() * block_size if n else 0.0
    if n < v.numel():
        squares = squares + v[n:].abs().amax().pow(2) * (v.numel() - n)
    step = math.sqrt(float(squares)) / _QMAX[codec]
    per_encode = 1.0 if stochastic else 0.5
    # the last encode's residual: allow twice this one's step (the scale moves a little
    # from one sync to the next)
    encodes = 3.0 if feedback else 1.0
    return encodes * per_encode * step


def sent_apart(moved: torch.Tensor, sent: torch.Tensor) -> float:
    """The distance between the sketch of the sent vector and minus the windows' sum,
    over the sum's size (inf where the windows did not move and something was sent)."""
    apart = float((sent + moved).norm())
    size = float(moved.norm())
    return apart / size if size > 0 else (0.0 if apart == 0 else math.inf)


def passes(moved: torch.Tensor, sent: torch.Tensor, tolerance: float, allowed: float) -> bool:
    """Whether ``sent`` is within ``tolerance`` of the windows' size plus ``allowed``
    (the codec's :func:`slack`) of minus their sum."""
    return float((sent + moved).norm()) <= tolerance * float(moved.norm()) + allowed
