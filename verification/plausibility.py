"""Plausibility against history, where statistics over the inputs cannot decide.

Two checks a node makes with what it saw before rather than with a robust centre:

* an owner with a single partner (gossip, or a butterfly group of two) screens the
  partner's part against its own and against the norms it accepted before
  (:meth:`Plausibility.pair_verdicts`): a median of two is their mean, so one partner
  would otherwise decide what "normal" is;
* a member checks an owner's reduced result against its own contribution (norm ratio
  and cosine, :func:`~verification.screening.check_reduced`) and against the results
  honest owners returned before (:meth:`Plausibility.check_result`); a mean of global
  copies also against being *shorter* than both (``owner_shrunk``).

Each history is kept per ``(fragment, content)``: an update's norms say nothing about a
global copy's; a copy's, per part as well (a part of layer norms and a part of a weight
matrix differ in their values' size far more than a round changes either).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence

import torch

from verification.policy import TrustPolicy
from verification.records import Contribution
from verification.screening import Verdict, check_reduced, finite_norm

__all__ = ["COPY_MIN_RATIO", "MIN_FOR_STATISTICS", "Plausibility"]

MIN_FOR_STATISTICS = 3
"""Fewer inputs (or remembered norms) than this: a median is no longer robust."""
_NORM_HISTORY = 32  # accepted norms remembered per fragment
COPY_MIN_RATIO = 0.8
"""A mean of global copies shorter than this share of both the member's own copy and the
means honest owners returned for the same part before is refused (``owner_shrunk``).
Copies in a mixing swarm sit 10 to 30 % of their norm apart and nearly parallel, so an
honest mean is about as long as each (two copies 30 % apart average to 0.99 of either's
length); an owner that mixes in a zeroed copy of its own returns (n - 1) / n of the
mean: half in a pair, 0.75 in a group of 4 (groups of 5 or more pass: 0.8 and over)."""
_COPY_HISTORY = 8
"""Accepted means of copies remembered per part: few, so that the copies' slow drift
over a run does not move the bound."""
_MAX_PAIR_SPREAD = 4.0  # a partner's token claim widens its norm bound at most this much

_Key = tuple[int, str]
"""``(fragment, content)``."""


class Plausibility:
    """One node's norm histories and the checks that use them.

    Args:
        policy: the operator's trust policy (``norm_kappa``, ``min_cosine``).
        me: this node's PeerID.
    """

    def __init__(self, policy: TrustPolicy, me: str) -> None:
        self.policy = policy
        self.me = me
        self._norms: dict[_Key, deque[float]] = {}  # norms of accepted parts
        self._results: dict[_Key, deque[float]] = {}  # RMS of accepted results
        self._copies: dict[tuple[int, int], deque[float]] = {}  # norms of accepted means

    def pair_verdicts(
        self, key: _Key, admitted: Sequence[Contribution], verdicts: list[Verdict]
    ) -> list[Verdict]:
        """Screen a pair (gossip, or a butterfly group of two) against this node's own part.

        With two inputs there is no robust centre: a median of two is their mean, so one
        partner decides what "normal" is. The owner compares the partner's part with its
        own (norm ratio and cosine, as a member checks an owner's result) and with the
        norms it accepted for this ``(fragment, content)`` before, so a partner whose
        update is far longer than anything seen, or points against this node's own, is
        refused.
        """
        own = next((c for c in admitted if c.peer == self.me), None)
        history = self._norms.setdefault(key, deque(maxlen=_NORM_HISTORY))
        own_norm = float(own.vector.norm()) if own is not None else 0.0
        out = list(verdicts)
        for i, c in enumerate(admitted):
            if c.peer == self.me or not out[i].ok:
                continue
            out[i] = self._partner_verdict(c, out[i], own, own_norm, history)
        for c, verdict in zip(admitted, out):
            if verdict.ok and (c.peer != self.me or own_norm > 0):
                history.append(float(c.vector.norm()))
        return out

    def _partner_verdict(
        self,
        c: Contribution,
        verdict: Verdict,
        own: Contribution | None,
        own_norm: float,
        history: deque,
    ) -> Verdict:
        """``verdict`` on the partner's part ``c``, unless its norm or direction is off."""
        norm = float(c.vector.norm())
        # Own norm now, or what was normal before when this node has little to compare.
        reference = max(own_norm, statistics.median(history) if history else 0.0)
        spread = 1.0
        if own is not None and own.tokens > 0:
            spread = min(_MAX_PAIR_SPREAD, max(1.0, c.tokens / own.tokens))
        bound = self.policy.norm_kappa * spread * reference
        if reference > 0 and norm > bound:
            return Verdict(c.peer, False, "norm", f"norm {norm:.3g} > {bound:.3g}")
        if own is not None and own_norm > 0 and norm > 0:
            cosine = float(torch.dot(c.vector, own.vector)) / (norm * own_norm)
            if cosine < self.policy.min_cosine:
                return Verdict(c.peer, False, "direction", f"cosine {cosine:.3f} with own part")
        return verdict

    def check_result(
        self,
        key: _Key,
        reduced: torch.Tensor,
        own: torch.Tensor,
        spread: float,
        included: bool,
        reduced_norm: float | None,
        part: int = 0,
    ) -> str | None:
        """Why an owner's reduced part is implausible next to this node's ``own``
        contribution and the results accepted before (None: plausible). See
        :meth:`~verification.verifier.Verifier.check_reduced` for the arguments."""
        own_norm, _ = finite_norm(own)
        if own_norm == 0.0:
            return None  # an idle member has nothing to compare the owner's result with
        # one pass per vector for the norms (the result's comes from its decoding), one
        # for the dot product
        reduced_norm, bad = finite_norm(reduced) if reduced_norm is None else (reduced_norm, 0)
        if bad:
            return "not_finite"
        copies = None
        if key[1] == "weights":
            copies = self._copies.setdefault((key[0], part), deque(maxlen=_COPY_HISTORY))
            if self._shrunk(reduced_norm, own_norm, copies):
                return "owner_shrunk"
        reason = self._check_update(key, reduced, own, spread, included, reduced_norm, own_norm)
        if reason is None and copies is not None:
            copies.append(reduced_norm)
        return reason

    @staticmethod
    def _shrunk(reduced_norm: float, own_norm: float, accepted: deque) -> bool:
        """Whether a mean of copies is shorter than :data:`COPY_MIN_RATIO` of both this
        node's own copy and the means it accepted for the part before (never with fewer
        than :data:`MIN_FOR_STATISTICS` of them: a newcomer that started from its own
        initialisation holds a copy of another length)."""
        if len(accepted) < MIN_FOR_STATISTICS:
            return False
        bound = COPY_MIN_RATIO * min(own_norm, statistics.median(accepted))
        return reduced_norm < bound

    def _check_update(
        self,
        key: _Key,
        reduced: torch.Tensor,
        own: torch.Tensor,
        spread: float,
        included: bool,
        reduced_norm: float,
        own_norm: float,
    ) -> str | None:
        """The length and direction checks of any result (see :meth:`check_result`)."""
        rms = reduced_norm / max(1.0, reduced.numel()) ** 0.5
        history = self._results.setdefault(key, deque(maxlen=_NORM_HISTORY))
        if not included:
            return self._check_without_own(own, own_norm, rms, history, spread)
        verdict = check_reduced(
            reduced,
            own,
            max_ratio=self.policy.norm_kappa * spread,
            min_cosine=self.policy.min_cosine,
            norms=(reduced_norm, own_norm),
        )
        # Longer than this node's own update, but no longer than the results honest
        # owners returned before: a peer that trained more, not an owner that lies.
        if (
            verdict.reason == "owner_norm"
            and len(history) >= MIN_FOR_STATISTICS
            and rms <= self.policy.norm_kappa * statistics.median(history)
        ):
            verdict = Verdict(verdict.peer, True, "ok", "")
        if verdict.ok:
            history.append(rms)
        return None if verdict.ok else verdict.reason

    def _check_without_own(
        self, own: torch.Tensor, own_norm: float, rms: float, history: deque, spread: float
    ) -> str | None:
        """Judge a result the owner left this node's part out of (with a reason).

        Its direction need not follow this node's part, but its length must stay within
        what honest owners returned before (or, with little history, within
        ``norm_kappa`` times this node's own update): an owner that refused this node
        must not be able to hand it anything at all."""
        if len(history) >= MIN_FOR_STATISTICS:
            bound = self.policy.norm_kappa * statistics.median(history)
        else:
            bound = self.policy.norm_kappa * spread * own_norm / max(1, own.numel()) ** 0.5
        if rms > bound:
            return "owner_norm"
        history.append(rms)
        return None
