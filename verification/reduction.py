"""The owner's reduction of one part: admit, screen, cap the weights, aggregate, audit.

With useful-work checks on, a member's claimed weight in an ``update`` is first scaled
by the share of it its checked work bears out
(:meth:`verification.workscores.Scores.factor`), so partial work buys partial influence
before any flag. Screening verdicts that cost a peer go to its
:class:`~verification.standings.Standings`; every contribution gets one audit row
through the node's :class:`~verification.ledger.Ledger`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from verification.aggregators import COORDINATEWISE, aggregate
from verification.ledger import Ledger
from verification.means import Aggregate
from verification.plausibility import MIN_FOR_STATISTICS, Plausibility
from verification.policy import TrustPolicy
from verification.reasons import HEURISTIC_REASONS, OUTLIER_REASONS, VICTIM_REASONS
from verification.records import Contribution, Prefix, Reduction, StreamPlan
from verification.screening import Candidate, ScreeningConfig, Verdict, screen, screen_copies
from verification.shares import max_share_weights
from verification.standings import Standings
from verification.workscores import Scores

__all__ = ["Reducer"]

logger = logging.getLogger(__name__)


class Reducer:
    """Reduces the parts a node owns under its trust policy.

    Args:
        policy: the operator's trust policy.
        standings: who is in, and what a violation costs.
        plausibility: pairs screened against what was accepted before.
        work: each peer's checked work (None without useful-work checks).
        ledger: the node's audit log and reputations (and this node's PeerID).
    """

    def __init__(
        self,
        policy: TrustPolicy,
        standings: Standings,
        plausibility: Plausibility,
        work: Scores | None,
        ledger: Ledger,
    ) -> None:
        self.policy = policy
        self.me = ledger.me
        self.standings = standings
        self.plausibility = plausibility
        self.work = work
        self.ledger = ledger
        self.screening = ScreeningConfig(
            enabled=policy.screening,
            norm_kappa=policy.norm_kappa,
            min_cosine=policy.min_cosine,
            max_tokens=policy.max_tokens,
        )

    def stream_plan(
        self, round_: int, members: Sequence[tuple[str, float]], content: str = "update"
    ) -> StreamPlan | None:
        """How an owner may reduce block by block while ``members``' parts (``(peer,
        weight)`` in the order the reduction will take them) arrive: the admitted
        members with their capped weights, when the aggregator is coordinate-wise
        (None otherwise). Screening still runs on the whole parts once they are in; if
        it leaves anyone out, :meth:`reduce` starts over (see
        :class:`~verification.records.Prefix`)."""
        name = self.policy.aggregator
        if name not in COORDINATEWISE:
            return None
        admitted = [(p, w) for p, w in members if not self.standings.refusal(p, round_)]
        if not admitted:
            return None
        claimed = self._evidenced([w for _, w in admitted], [p for p, _ in admitted], content)
        weights = tuple(max_share_weights(claimed, self.policy.max_share))
        params = dict(self.policy.aggregator_params)

        def combine(rows: Sequence[torch.Tensor]) -> torch.Tensor:
            return aggregate(name, rows, weights, params).vector

        return StreamPlan(tuple(p for p, _ in admitted), weights, combine)

    def reduce(
        self,
        round_: int,
        fragment: int,
        part: int,
        contributions: Sequence[Contribution],
        shared: bool = False,
        content: str = "update",
        prefix: Prefix | None = None,
        gathered: bool = False,
    ) -> Reduction:
        """Screen, cap weights, aggregate robustly; audit every contribution.

        With ``shared`` (a repair, reduced by every member on its own) only what the
        inputs themselves show decides: no standing, no history, so every honest member
        computes the same values. ``content`` says what the contributions are
        (``update`` or ``weights``); each keeps its own history of norms. ``prefix``:
        what was reduced while the parts arrived (:meth:`stream_plan`); it is completed
        when screening kept exactly its members, and ignored otherwise. ``gathered`` (a
        gather, shared too): only the operator's lists refuse a member, not its
        standing (:meth:`~verification.standings.Standings.listed`).
        """
        why = {c.peer: self._refusal(c.peer, round_, shared, gathered) for c in contributions}
        rejected: dict[str, str] = {p: reason for p, reason in why.items() if reason}
        admitted = [c for c in contributions if not why[c.peer]]
        numel = contributions[0].vector.numel()
        good = self._screened(admitted, numel, round_, fragment, content, shared, rejected)
        result = self._aggregated(good, prefix, "shared" if shared else content)
        used = [good[i].peer for i in result.used]
        for c in good:
            if c.peer not in used:
                rejected[c.peer] = "not_selected"
        self.ledger.reduction(round_, fragment, part, contributions, used, rejected)
        return Reduction(result.vector, used, rejected)

    def _refusal(self, peer: str, round_: int, shared: bool, gathered: bool) -> str | None:
        """Why this reduction takes nothing from ``peer``: a gather asks only the
        operator's lists, a shared reduction only whether ``peer`` is blocked, this
        node's own its whole standing."""
        if gathered:
            return self.standings.listed(peer)
        if shared:
            return self.standings.blocks(peer, round_)
        return self.standings.refusal(peer, round_)

    def _screened(
        self,
        admitted: Sequence[Contribution],
        numel: int,
        round_: int,
        fragment: int,
        content: str,
        shared: bool,
        rejected: dict[str, str],
    ) -> list[Contribution]:
        """The admitted contributions that pass screening (this node's own always does);
        each refused one goes into ``rejected`` and, unless it is only an implausible
        pair or a shrunken copy, counts as a violation. A copy falls short of its group's
        norm most often because an owner that lied shrank the mean its holder took
        (a zero owner in a pair halves it): it is left out of the mix, and its holder,
        the victim, is not accused."""
        candidates = [Candidate(c.peer, c.vector, c.tokens, numel, c.norm) for c in admitted]
        verdicts = screen(candidates, self.screening)
        if content == "weights" and self.policy.screening:
            verdicts = self._copies(candidates, verdicts, shared)
        paired = self.policy.screening and len(admitted) < MIN_FOR_STATISTICS
        if paired and not shared:
            verdicts = self.plausibility.pair_verdicts((fragment, content), admitted, verdicts)
        good = []
        for c, verdict in zip(admitted, verdicts):
            if verdict.ok or c.peer == self.me:
                good.append(c)
                continue
            rejected[c.peer] = verdict.reason
            if verdict.reason in VICTIM_REASONS or (paired and verdict.reason in HEURISTIC_REASONS):
                # Two inputs have no robust centre: an implausible pair is left out of
                # this round without accusing anyone; so is a shrunken copy.
                logger.info(
                    "round %d fragment %d: %s left out (%s)",
                    round_,
                    fragment,
                    c.peer,
                    verdict.detail,
                )
                continue
            if verdict.reason in OUTLIER_REASONS:
                self.standings.outlier(c.peer, round_, fragment, verdict.reason, verdict.detail)
            else:
                self.standings.violation(c.peer, round_, fragment, verdict.reason, verdict.detail)
        return good

    def _copies(
        self, candidates: list[Candidate], verdicts: list[Verdict], shared: bool
    ) -> list[Verdict]:
        """Global copies whose norm falls far below the group's are left out too
        (:func:`verification.screening.screen_copies`; a shared repair judges by the
        inputs alone, so a pair there has no reference)."""
        ok = [i for i, v in enumerate(verdicts) if v.ok]
        peers = [candidates[i].peer for i in ok]
        own = None if shared or self.me not in peers else peers.index(self.me)
        judged = screen_copies([candidates[i] for i in ok], own, self.policy.norm_kappa)
        out = list(verdicts)
        for i, verdict in zip(ok, judged, strict=True):
            out[i] = verdict
        return out

    def _aggregated(
        self, good: Sequence[Contribution], prefix: Prefix | None, content: str
    ) -> Aggregate:
        """The policy's aggregator over ``good`` with capped weights (the streamed
        ``prefix`` completed when it was reduced over exactly these)."""
        claimed = self._evidenced([c.weight for c in good], [c.peer for c in good], content)
        weights = max_share_weights(claimed, self.policy.max_share)
        result = _complete(prefix, good, weights) if prefix is not None else None
        if result is None:
            result = aggregate(
                self.policy.aggregator,
                [c.vector for c in good],
                weights,
                self.policy.aggregator_params,
            )
        return result

    def _evidenced(
        self, weights: Sequence[float], peers: Sequence[str], content: str
    ) -> list[float]:
        """Weights scaled by the share of its claim each peer's checked work bears out:
        its pseudo-gradient's, and, where the group mixes copies, its copy's (a member
        whose work does not show holds a copy that did not move with the swarm's, and
        would drag every member's back). As they are without checks, for this node's
        own, and in the shared repairs every member reduces alike."""
        if self.work is None or content == "shared":
            return list(weights)
        scaled = []
        for w, p in zip(weights, peers, strict=True):
            scaled.append(w if p == self.me else w * self.work.factor(p))
        return scaled


def _complete(
    prefix: Prefix, good: Sequence[Contribution], weights: Sequence[float]
) -> Aggregate | None:
    """The prefix's reduction completed over ``good``, or None when ``good`` and its
    weights are not the ones the prefix was reduced with."""
    out = prefix.complete([c.peer for c in good], weights, [c.vector for c in good])
    return None if out is None else Aggregate(out, list(range(len(good))))
