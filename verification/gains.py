"""What a check record says of a contribution: its gain and its lift.

A record (:class:`verification.usefulness.CheckRecord`) holds per-window losses;
:func:`judge` turns them into measurements of two contributions to the same exchange,
the checked one and the checker's own:

- its **gain**: its mean loss drop on the control windows, divided by its claimed
  batches raised to :data:`WORK_EXPONENT`. A round's gain grows more slowly than its
  steps (on the demo model 10, 50 and 100 steps from one state gave gains in the ratio
  0.18 : 0.50 : 1, an exponent between 0.64 and 1.04; 0.75 sits inside), so an honest
  node that trained fewer steps and claims them compares evenly, while a member that
  trained a tenth of the steps it claims shows about 0.2 to 0.5 of an honest gain (gains
  are concave in steps: the first steps gain most);
- its **lift**: its mean gain on windows of its own claimed batches beyond its mean
  gain on control text. A member that trained on the batches it claims keeps some of
  what it learned there; one that trained elsewhere, or sends someone else's change,
  lifts nothing.

How a peer's records are pooled into flags and weights is
:class:`verification.workscores.Scores`.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from verification.usefulness import CheckRecord

__all__ = ["WORK_EXPONENT", "Estimate", "Verdict", "judge"]

WORK_EXPONENT = 0.75
"""Gains are compared per claimed batch raised to this power (see the module docstring)."""


@dataclass(frozen=True)
class Estimate:
    """A mean over windows and its standard error, in nats per token."""

    mean: float
    se: float

    @classmethod
    def of(cls, values: list[float], scale: float = 1.0) -> Estimate:
        n = len(values)
        spread = statistics.stdev(values) if n > 1 else 0.0
        return cls(scale * math.fsum(values) / max(1, n), scale * spread / math.sqrt(max(1, n)))

    def minus(self, other: Estimate) -> Estimate:
        return Estimate(self.mean - other.mean, math.hypot(self.se, other.se))


@dataclass(frozen=True)
class Verdict:
    """What one record measured, each per claimed batch to :data:`WORK_EXPONENT` for
    gains (so contributions of different claims compare) and in nats for lifts.

    Attributes:
        gain: the contribution's mean gain on the control windows.
        ref_gain: the checker's own contribution's gain on the same windows (None when
            the checker claimed nothing).
        lift: the contribution's gain on its claimed windows beyond its gain on control
            text (None without claimed windows).
        ref_lift: the checker's own, on its own claimed windows (None likewise).
    """

    gain: Estimate
    ref_gain: Estimate | None = None
    lift: Estimate | None = None
    ref_lift: Estimate | None = None


def judge(record: CheckRecord) -> Verdict:
    """What ``record`` measured (see the module docstring)."""
    gains = [before - after for before, after, _, _ in record.control]
    ref_gains = [before - after for _, _, before, after in record.control]
    ref_gain = ref_lift = None
    if record.reference_claimed > 0:
        ref_gain = Estimate.of(ref_gains, record.reference_claimed**-WORK_EXPONENT)
        if record.reference_assigned:
            own = Estimate.of([b - a for b, a in record.reference_assigned])
            ref_lift = own.minus(Estimate.of(ref_gains))
    if record.claimed <= 0:
        # a claim no one can draw from counts as no work at all
        nothing = Estimate(0.0, 0.0)
        return Verdict(nothing, ref_gain, nothing if ref_lift is not None else None, ref_lift)
    gain = Estimate.of(gains, record.claimed**-WORK_EXPONENT)
    lift = None
    if record.assigned:
        lift = Estimate.of([b - a for b, a in record.assigned]).minus(Estimate.of(gains))
    return Verdict(gain, ref_gain, lift, ref_lift)
