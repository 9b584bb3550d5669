"""The node's trust decisions: screening, robust aggregation, policy, reputation, audit.

:class:`Verifier` plugs into the all-reduce as both the owner's reducer and its judge
(it has the shape of :class:`protocol.averaging.hooks.Judge`; the all-reduce calls it
directly on plain records, :class:`~verification.records.Contribution`, and gets a
:class:`~verification.records.Reduction` back). Every contribution a node sees as a part owner gets
one audit row (accepted, rejected with a reason, or its own), every violation goes
through the operator's :class:`~verification.policy.TrustPolicy` (drop, quarantine,
ban); peers that are quarantined, banned, denied or below the policy's minimum
reputation are refused, and this node votes to leave quarantined and banned ones out
of the round's groups.

The owner's reduction runs here in steps (admit, screen, cap the weights and
aggregate, audit). With useful-work checks on, a member's claimed weight in an
``update`` is first scaled by the share of it its checked work bears out
(:meth:`verification.workscores.Scores.factor`), so partial work buys partial influence
before any flag. Who is in and what a violation costs is
:class:`~verification.standings.Standings`, and the checks against history (a pair's
parts, an owner's result) are :class:`~verification.plausibility.Plausibility`.

The SQLite stores are used from the transport's loop thread (reducer, judge) and
from the training thread (group exclusion, status), so every call takes one lock.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import torch

from verification.aggregators import COORDINATEWISE, Aggregate, aggregate
from verification.audit import AuditLog
from verification.plausibility import MIN_FOR_STATISTICS, Plausibility
from verification.policy import TrustPolicy
from verification.records import Contribution, Prefix, Reduction, StreamPlan
from verification.reputation import ReputationStore
from verification.rounds import RoundClock
from verification.screening import Candidate, ScreeningConfig, Verdict, screen, screen_copies
from verification.shares import max_share_weights
from verification.standings import EventSink, Standings, repeated
from verification.workscores import Scores
from verification.writer import Writer

__all__ = ["BENIGN_REASONS", "EventSink", "Verifier"]

logger = logging.getLogger(__name__)

BENIGN_REASONS = frozenset(
    {
        "group_mismatch",
        "not_in_round",
        "late",
        "stale_round",
        "busy",
        "timeout",
        "too_slow",
        "uncommitted",
        "late_commit",
    }
)
"""Refusals an honest peer can cause (different views, slowness, a node that was frozen
or cut off and sends what belongs to a round that is over); never held against it.

``wrong_part`` is not among them: the group is checked first, so a part addressed to
the wrong owner of the very same group is a replayed or misdirected message."""

_POLICY_REASONS = frozenset({"denied", "not_allowed", "quarantined", "banned", "low_reputation"})
_HEURISTIC_REASONS = frozenset({"norm", "direction"})
"""Screens that need a robust centre: in a pair (no centre) they accuse no one."""
_OUTLIER_REASONS = _HEURISTIC_REASONS | {"owner_norm", "owner_direction"}
"""Statistical verdicts: a violation only when repeated
(:meth:`verification.standings.Standings.outlier`)."""
_VICTIM_REASONS = frozenset({"copy_norm", "owner_shrunk"})
"""Refusals of copies (a member's, or an owner's mean of them) whose failure is most often
the holder's misfortune, never held against it: a copy a zero owner shrank before is
short, and so is any mean its honest holder returns."""


class Verifier:
    """Judges contributions and peers for one node.

    Args:
        policy: the operator's trust policy.
        db_path: the node's SQLite file (audit log and reputations).
        me: this node's PeerID.
        events: the node's event log, for one line per verdict that costs a peer.
        clock: the node's round clock (default: a clock of its own, at round 0).
    """

    def __init__(
        self,
        policy: TrustPolicy,
        db_path: Path,
        me: str,
        events: EventSink | None = None,
        clock: RoundClock | None = None,
    ) -> None:
        self.policy = policy
        self.clock = clock if clock is not None else RoundClock()
        """This node's rounds: the node moves it, the verifier and the standings read it."""
        self.me = me
        self.events = events
        # audit rows and reputations are written off the critical path by one thread;
        # standings are read from memory
        self.writer = Writer(db_path)
        self.audit = AuditLog(db_path, writer=self.writer)
        self.reputation = ReputationStore(db_path, writer=self.writer)
        self.screening = ScreeningConfig(
            enabled=policy.screening,
            norm_kappa=policy.norm_kappa,
            min_cosine=policy.min_cosine,
            max_tokens=policy.max_tokens,
        )
        self.plausibility = Plausibility(policy, me)
        """Pairs screened and owners' results judged against what was accepted before."""
        self._lock = threading.RLock()
        self.standings = Standings(policy, me, self.reputation, self._lock, events, self.clock)
        """Who is in, and what a violation costs."""
        self.work = (
            Scores(
                policy.check_min_records,
                policy.check_min_work,
                policy.check_min_specific,
                rounds=policy.check_rounds or None,
            )
            if policy.checkers
            else None
        )
        """Each peer's checked work (None without useful-work checks); fed by the node's
        checks, read here for weights."""
        self._missed: dict[str, deque[int]] = {}  # rounds with a committed, undelivered part

    # ---- who is in (see verification.standings) ----------------------------------------

    def refusal(self, peer: str, round_: int) -> str | None:
        """Why this node takes nothing from ``peer`` at ``round_`` (None: it does)."""
        return self.standings.refusal(peer, round_)

    def blocks(self, peer: str, round_: int) -> str | None:
        """Why this node does not deal with ``peer`` at all (None: it does)."""
        return self.standings.blocks(peer, round_)

    def listed(self, peer: str, round_: int) -> str | None:
        """Why the operator's lists refuse ``peer`` (a gather's only refusal)."""
        return self.standings.listed(peer)

    def excluded(self, peers: Sequence[str], round_: int) -> set[str]:
        """The subset of ``peers`` this node votes to leave out of ``round_``."""
        return self.standings.excluded(peers, round_)

    def flagged(self, round_: int) -> dict[str, str]:
        """Peers quarantined or banned as of ``round_``: ``{peer: status}``."""
        return self.standings.flagged(round_)

    def reputations(self) -> dict[str, dict[str, object]]:
        """Every known peer's stored score, status and violation count."""
        return self.standings.reputations()

    # ---- the owner's reduction ---------------------------------------------------------

    def stream_plan(
        self, round_: int, members: Sequence[tuple[str, float]], content: str = "update"
    ) -> StreamPlan | None:
        """How an owner may reduce block by block while ``members``' parts (``(peer,
        weight)`` in the order the reduction will take them) arrive: the admitted
        members with their capped weights, when the aggregator is coordinate-wise
        (None otherwise). Screening still runs on the whole parts once they are in; if
        it leaves anyone out, :meth:`reduce` starts over (see :class:`Prefix`)."""
        name = self.policy.aggregator
        if name not in COORDINATEWISE:
            return None
        admitted = [(p, w) for p, w in members if not self.refusal(p, round_)]
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
        # the senders this node takes anything from: a shared reduction asks only whether
        # a sender is blocked, a gather's whether the operator's lists refuse it
        refuse = self.listed if gathered else self.blocks if shared else self.refusal
        why = {c.peer: refuse(c.peer, round_) for c in contributions}
        rejected: dict[str, str] = {p: reason for p, reason in why.items() if reason}
        admitted = [c for c in contributions if not why[c.peer]]
        numel = contributions[0].vector.numel()
        good = self._screened(admitted, numel, round_, fragment, content, shared, rejected)
        result = self._aggregated(good, prefix, "shared" if shared else content)
        used = [good[i].peer for i in result.used]
        for c in good:
            if c.peer not in used:
                rejected[c.peer] = "not_selected"
        self._audit_reduction(round_, fragment, part, contributions, used, rejected)
        return Reduction(result.vector, used, rejected)

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
            if verdict.reason in _VICTIM_REASONS or (
                paired and verdict.reason in _HEURISTIC_REASONS
            ):
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
            if verdict.reason in _OUTLIER_REASONS:
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

    def _audit_reduction(
        self,
        round_: int,
        fragment: int,
        part: int,
        contributions: Sequence[Contribution],
        used: Sequence[str],
        rejected: dict[str, str],
    ) -> None:
        """One audit row per contribution; a good mark for each peer in the result."""
        rows = []
        for c in contributions:
            if c.peer == self.me:
                verdict, reason = "own", "" if c.peer in used else rejected.get(c.peer, "")
            elif c.peer in used:
                verdict, reason = "accepted", ""
            else:
                verdict, reason = "rejected", rejected[c.peer]
            rows.append(
                dict(
                    round=round_,
                    fragment=fragment,
                    part=part,
                    sender=c.peer,
                    digest=c.digest,
                    tokens=int(c.tokens),
                    verdict=verdict,
                    reason=reason,
                )
            )
        with self._lock:
            self.audit.append_later(rows)
            for peer in used:
                if peer != self.me:
                    self.reputation.record(peer, round_, ok=True)

    # ---- refusals ----------------------------------------------------------------------

    def on_refusal(self, peer: str, round_: int | None, fragment: int | None, reason: str) -> None:
        r = self.clock.current if round_ is None else round_
        with self._lock:
            # part 0: refused before its part was known
            self._audit_row(r, fragment if fragment is not None else 0, 0, peer, "rejected", reason)
        if reason not in BENIGN_REASONS and reason not in _POLICY_REASONS:
            # Counted when it happens: a replayed message names an old round, and a
            # quarantine counted from that round would already be over.
            self.standings.violation(
                peer, max(r, self.clock.current), fragment, reason, "message refused"
            )
        elif reason in _POLICY_REASONS:
            logger.info("refused parts from %s at round %d: %s", peer, r, reason)

    def check_reduced(
        self,
        owner: str,
        round_: int,
        fragment: int,
        part: int,
        reduced: torch.Tensor,
        own: torch.Tensor,
        spread: float = 1.0,
        included: bool = True,
        reduced_norm: float | None = None,
        content: str = "update",
    ) -> str | None:
        blocked = self.blocks(owner, round_)
        if blocked:
            return blocked
        if not self.policy.screening:
            return None
        return self.plausibility.check_result(
            (fragment, content), reduced, own, spread, included, reduced_norm, part
        )

    def on_missing(self, peer: str, round_: int, fragment: int, part: int, committed: bool) -> None:
        """Record a part that never came; a peer that keeps committing and not
        delivering (``policy.max_missed`` in ``policy.missed_window`` rounds) has
        broken promises it signed: one violation."""
        with self._lock:
            reason = "no_delivery" if committed else "absent"
            self._audit_row(round_, fragment, part, peer, "missing", reason)
            if not committed:
                return
            misses = self._missed.setdefault(peer, deque())
            broken = repeated(misses, round_, self.policy.missed_window, self.policy.max_missed)
        if broken:
            self.standings.violation(
                peer, round_, fragment, "no_delivery", "committed, delivered nothing"
            )

    def on_owner_refused(
        self, owner: str, round_: int, fragment: int, part: int, reason: str
    ) -> None:
        with self._lock:
            self._audit_row(round_, fragment, part, owner, "owner_rejected", reason)
        unaccused = BENIGN_REASONS | _POLICY_REASONS | _VICTIM_REASONS
        if reason in _OUTLIER_REASONS:
            self.standings.outlier(owner, round_, fragment, reason, "reduced part refused")
        elif reason not in unaccused:
            self.standings.violation(owner, round_, fragment, reason, "reduced part refused")

    def convict(self, peer: str, round_: int, fragment: int, reason: str) -> None:
        """Act on checked proof of misbehaviour (e.g. equivocation): the policy's
        ``on_proof`` action at once, whatever the peer's record so far."""
        self.standings.convict(peer, round_, fragment, reason)

    def operator(self, op: str, peer: str, reason: str) -> dict[str, object]:
        """Apply an operator's ``ban`` or ``pardon`` of ``peer``: its standing, one audit
        row (``operator_ban`` / ``operator_pardon``) and one event.

        A ban counts from the next round (this round's groups are formed); a pardon lifts
        a ban or quarantine at once and keeps the peer's score and violations. Both are
        written to the SQLite file before this returns.

        Returns:
            The peer's new standing.
        """
        if op not in ("ban", "pardon"):
            raise ValueError(f"unknown operator command {op!r}")
        with self._lock:
            if op == "ban":
                standing = self.standings.ban(peer, reason)
            else:
                standing = self.standings.pardon(peer, reason)
            self._audit_row(self.clock.current, 0, 0, peer, f"operator_{op}", reason)
        if self.events is not None:
            self.events.write(f"operator_{op}", peer=peer, reason=reason, round=self.clock.current)
        # an operator's command is on disk when it is answered (`atoll peers` reads the file)
        if not self.writer.flush():
            logger.warning("operator %s of %s: not written to the audit log within 30 s", op, peer)
        return {
            "peer": peer,
            "score": round(standing.score, 3),
            "status": standing.status,
            "violations": standing.violations,
            "reason": standing.reason,
        }

    def _audit_row(
        self, round_: int, fragment: int, part: int, sender: str, verdict: str, reason: str
    ) -> None:
        """One audit row about a message or a peer rather than a contribution."""
        row = dict(
            round=round_,
            fragment=fragment,
            part=part,
            sender=sender,
            digest="",
            tokens=0,
            verdict=verdict,
            reason=reason,
        )
        self.audit.append_later([row])

    def flush(self, timeout: float = 30.0) -> bool:
        """Commit every queued audit row and reputation change (before a checkpoint)."""
        return self.writer.flush(timeout)

    def close(self) -> None:
        """Flush and close the node's SQLite file (nothing queued is lost)."""
        self.writer.close()
        with self._lock:
            self.audit.close()
            self.reputation.close()


def _complete(
    prefix: Prefix, good: Sequence[Contribution], weights: Sequence[float]
) -> Aggregate | None:
    """The prefix's reduction completed over ``good``, or None when ``good`` and its
    weights are not the ones the prefix was reduced with."""
    out = prefix.complete([c.peer for c in good], weights, [c.vector for c in good])
    return None if out is None else Aggregate(out, list(range(len(good))))
