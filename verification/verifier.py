"""The node's trust decisions: screening, robust aggregation, policy, reputation, audit.

:class:`Verifier` plugs into the all-reduce as both the owner's reducer and its judge
(it has the shape of :class:`protocol.averaging.parts.Judge`; the all-reduce calls it
directly on plain records, :class:`~verification.records.Contribution`, and gets a
:class:`~verification.records.Reduction` back). Every contribution a node sees as a part owner gets
one audit row (accepted, rejected with a reason, or its own), every violation goes
through the operator's :class:`~verification.policy.TrustPolicy` (drop, quarantine,
ban); peers that are quarantined, banned, denied or below the policy's minimum
reputation are refused, and this node votes to leave quarantined and banned ones out
of the round's groups.

The SQLite stores are used from the transport's loop thread (reducer, judge) and
from the training thread (group exclusion, status), so every call takes one lock.
"""

from __future__ import annotations

import logging
import statistics
import threading
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch

from verification.aggregators import COORDINATEWISE, Aggregate, aggregate, max_share_weights
from verification.audit import AuditLog
from verification.policy import TrustPolicy
from verification.records import Contribution, Prefix, Reduction, StreamPlan
from verification.reputation import ReputationStore, Standing
from verification.screening import (
    Candidate,
    ScreeningConfig,
    Verdict,
    check_reduced,
    finite_norm,
    screen,
)
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

_MIN_FOR_STATISTICS = 3  # fewer inputs than this: screen pairwise (see _pair_verdicts)
_NORM_HISTORY = 32  # accepted norms remembered per fragment
_MAX_PAIR_SPREAD = 4.0  # a partner's token claim widens its norm bound at most this much

_POLICY_REASONS = frozenset({"denied", "not_allowed", "quarantined", "banned", "low_reputation"})
_HEURISTIC_REASONS = frozenset({"norm", "direction"})


class EventSink(Protocol):
    """Where a verdict that costs a peer is reported (the node's ``events.jsonl``)."""

    def write(self, event: str, **fields: object) -> None: ...


class Verifier:
    """Judges contributions and peers for one node.

    Args:
        policy: the operator's trust policy.
        db_path: the node's SQLite file (audit log and reputations).
        me: this node's PeerID.
        events: the node's event log, for one line per verdict that costs a peer.
    """

    def __init__(
        self, policy: TrustPolicy, db_path: Path, me: str, events: EventSink | None = None
    ) -> None:
        self.policy = policy
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
        self.round = 0
        self._lock = threading.RLock()
        self._flagged_at: dict[str, int] = {}
        # per (fragment, content): an update's norms say nothing about a global copy's
        self._norms: dict[tuple[int, str], deque[float]] = {}
        self._results: dict[tuple[int, str], deque[float]] = {}  # RMS of accepted results
        self._missed: dict[str, deque[int]] = {}  # rounds with a committed, undelivered part

    # ---- who is in -------------------------------------------------------------------

    def refusal(self, peer: str, round_: int) -> str | None:
        """Why this node takes nothing from ``peer`` at ``round_`` (None: it does)."""
        if peer == self.me:
            return None
        listed, standing, flagged_now = self._admission(peer, round_)
        if listed:
            return listed
        # Flagged during this very round: other honest members may not have seen the
        # evidence yet and still take its parts and its reduced results, so this node
        # does too (each part is still screened on its own) and refuses it from the next
        # round on, exactly when it also leaves it out of its groups.
        if flagged_now:
            return None
        if standing.status in ("quarantined", "banned"):
            return standing.status
        if standing.score < self.policy.min_reputation:
            return "low_reputation"
        return None

    def blocks(self, peer: str, round_: int) -> str | None:
        """Why this node does not deal with ``peer`` at all: the operator's lists, or a
        ban (proof of misbehaviour, or violations past ``violations_to_ban``).

        A quarantined peer is not blocked: as an owner this node leaves its parts out
        (:meth:`refusal`) but still answers it, and as a member it still takes its
        results, because the other honest members of the part do too until a majority
        votes it out of the groups (:meth:`excluded`); refusing them alone would make
        this node's values differ from theirs.
        """
        if peer == self.me:
            return None
        listed, standing, flagged_now = self._admission(peer, round_)
        if listed:
            return listed
        if standing.status == "banned" and not flagged_now:
            return "banned"
        return None

    def _admission(self, peer: str, round_: int) -> tuple[str | None, Standing, bool]:
        """What :meth:`refusal` and :meth:`blocks` decide from: the operator's lists'
        refusal (None: admitted), the peer's standing, and whether it was flagged during
        ``round_`` itself."""
        ok, why = self.policy.admits(peer)
        with self._lock:
            standing = self.reputation.standing(peer, round_)
            flagged_now = self._flagged_at.get(peer, -1) >= round_
        return (None if ok else why), standing, flagged_now

    def excluded(self, peers: Sequence[str], round_: int) -> set[str]:
        """The subset of ``peers`` this node votes to leave out of ``round_``: quarantined
        or banned. A peer is left out of a round's groups once more than half of the
        round's announcers vote so (:func:`protocol.averaging.matchmaking.voted_out`), so honest
        nodes that saw the evidence at different moments still form the same groups.

        Peers refused only by this node's own lists (deny, allow-only, minimum
        reputation) get no vote: they stay in the groups everyone computes; their parts
        and their reduced results are refused instead, and the part they own is
        repaired among the others.
        """
        with self._lock:
            return {
                p
                for p in peers
                if p != self.me
                and self.reputation.standing(p, round_).status in ("quarantined", "banned")
                # Flagged during this very round: the round's groups are already formed;
                # the vote counts from the next round, when refusals start too.
                and self._flagged_at.get(p, -1) < round_
            }

    def flagged(self, round_: int) -> dict[str, str]:
        """Peers quarantined or banned as of ``round_``: ``{peer: status}``."""
        with self._lock:
            standings = [self.reputation.standing(s.peer, round_) for s in self.reputation.all()]
        return {s.peer: s.status for s in standings if s.status != "ok"}

    def reputations(self) -> dict[str, dict[str, object]]:
        """Every known peer's stored score, status and violation count."""
        with self._lock:
            rows = self.reputation.all()
        return {
            s.peer: {"score": round(s.score, 3), "status": s.status, "violations": s.violations}
            for s in rows
        }

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
        weights = tuple(max_share_weights([w for _, w in admitted], self.policy.max_share))
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
    ) -> Reduction:
        """Screen, cap weights, aggregate robustly; audit every contribution.

        With ``shared`` (a repair, reduced by every member on its own) only what the
        inputs themselves show decides: no standing, no history, so every honest member
        computes the same values. ``content`` says what the contributions are
        (``update`` or ``weights``); each keeps its own history of norms. ``prefix``:
        what was reduced while the parts arrived (:meth:`stream_plan`); it is completed
        when screening kept exactly its members, and ignored otherwise.
        """
        rejected: dict[str, str] = {}
        admitted = []
        for c in contributions:
            why = self.blocks(c.peer, round_) if shared else self.refusal(c.peer, round_)
            if why:
                rejected[c.peer] = why
            else:
                admitted.append(c)
        numel = contributions[0].vector.numel()
        verdicts = screen(
            [Candidate(c.peer, c.vector, c.tokens, numel, c.norm) for c in admitted],
            self.screening,
        )
        paired = self.policy.screening and len(admitted) < _MIN_FOR_STATISTICS
        if paired and not shared:
            verdicts = self._pair_verdicts((fragment, content), admitted, verdicts)
        good = []
        for c, verdict in zip(admitted, verdicts):
            if verdict.ok or c.peer == self.me:
                good.append(c)
                continue
            rejected[c.peer] = verdict.reason
            if paired and verdict.reason in _HEURISTIC_REASONS:
                # Two inputs have no robust centre: an implausible pair is left out of
                # this round without accusing anyone.
                logger.info(
                    "round %d fragment %d: %s left out (%s)",
                    round_,
                    fragment,
                    c.peer,
                    verdict.detail,
                )
                continue
            self._violation(c.peer, round_, fragment, verdict.reason, verdict.detail)
        weights = max_share_weights([c.weight for c in good], self.policy.max_share)
        result = _complete(prefix, good, weights) if prefix is not None else None
        if result is None:
            result = aggregate(
                self.policy.aggregator,
                [c.vector for c in good],
                weights,
                self.policy.aggregator_params,
            )
        used = [good[i].peer for i in result.used]
        for c in good:
            if c.peer not in used:
                rejected[c.peer] = "not_selected"
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
        return Reduction(result.vector, used, rejected)

    def _pair_verdicts(
        self, exchange: tuple[int, str], admitted: Sequence[Contribution], verdicts: list[Verdict]
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
        history = self._norms.setdefault(exchange, deque(maxlen=_NORM_HISTORY))
        own_norm = float(own.vector.norm()) if own is not None else 0.0
        out = list(verdicts)
        for i, c in enumerate(admitted):
            if c.peer == self.me or not out[i].ok:
                continue
            norm = float(c.vector.norm())
            # Own norm now, or what was normal before when this node has little to compare.
            reference = max(own_norm, statistics.median(history) if history else 0.0)
            spread = 1.0
            if own is not None and own.tokens > 0:
                spread = min(_MAX_PAIR_SPREAD, max(1.0, c.tokens / own.tokens))
            bound = self.policy.norm_kappa * spread * reference
            if reference > 0 and norm > bound:
                out[i] = Verdict(c.peer, False, "norm", f"norm {norm:.3g} > {bound:.3g}")
            elif own_norm > 0 and norm > 0:
                cosine = float(torch.dot(c.vector, own.vector)) / (norm * own_norm)
                if cosine < self.policy.min_cosine:
                    out[i] = Verdict(
                        c.peer, False, "direction", f"cosine {cosine:.3f} with own part"
                    )
        for c, verdict in zip(admitted, out):
            if verdict.ok and (c.peer != self.me or own_norm > 0):
                history.append(float(c.vector.norm()))
        return out

    # ---- refusals ----------------------------------------------------------------------

    def on_refusal(self, peer: str, round_: int | None, fragment: int | None, reason: str) -> None:
        r = self.round if round_ is None else round_
        with self._lock:
            self._audit_row(
                round=r,
                fragment=fragment if fragment is not None else 0,
                part=0,  # refused before its part was known
                sender=peer,
                digest="",
                tokens=0,
                verdict="rejected",
                reason=reason,
            )
        if reason not in BENIGN_REASONS and reason not in _POLICY_REASONS:
            # Counted when it happens: a replayed message names an old round, and a
            # quarantine counted from that round would already be over.
            self._violation(peer, max(r, self.round), fragment, reason, "message refused")
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
        own_norm, _ = finite_norm(own)
        if own_norm == 0.0:
            return None  # an idle member has nothing to compare the owner's result with
        # one pass per vector for the norms (the result's comes from its decoding), one
        # for the dot product
        reduced_norm, bad = finite_norm(reduced) if reduced_norm is None else (reduced_norm, 0)
        if bad:
            return "not_finite"
        rms = reduced_norm / max(1.0, reduced.numel()) ** 0.5
        history = self._results.setdefault((fragment, content), deque(maxlen=_NORM_HISTORY))
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
            and len(history) >= _MIN_FOR_STATISTICS
            and rms <= self.policy.norm_kappa * statistics.median(history)
        ):
            verdict = Verdict(owner, True, "ok", "")
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
        if len(history) >= _MIN_FOR_STATISTICS:
            bound = self.policy.norm_kappa * statistics.median(history)
        else:
            bound = self.policy.norm_kappa * spread * own_norm / max(1, own.numel()) ** 0.5
        if rms > bound:
            return "owner_norm"
        history.append(rms)
        return None

    def on_missing(self, peer: str, round_: int, fragment: int, part: int, committed: bool) -> None:
        """Record a part that never came; a peer that keeps committing and not
        delivering (``policy.max_missed`` in ``policy.missed_window`` rounds) has
        broken promises it signed: one violation."""
        with self._lock:
            self._audit_row(
                round=round_,
                fragment=fragment,
                part=part,
                sender=peer,
                digest="",
                tokens=0,
                verdict="missing",
                reason="no_delivery" if committed else "absent",
            )
            if not committed:
                return
            misses = self._missed.setdefault(peer, deque())
            misses.append(round_)
            while misses and misses[0] <= round_ - self.policy.missed_window:
                misses.popleft()
            repeated = len(misses) >= self.policy.max_missed
            if repeated:
                misses.clear()
        if repeated:
            self._violation(peer, round_, fragment, "no_delivery", "committed, delivered nothing")

    def on_owner_refused(
        self, owner: str, round_: int, fragment: int, part: int, reason: str
    ) -> None:
        with self._lock:
            self._audit_row(
                round=round_,
                fragment=fragment,
                part=part,
                sender=owner,
                digest="",
                tokens=0,
                verdict="owner_rejected",
                reason=reason,
            )
        if reason not in BENIGN_REASONS and reason not in _POLICY_REASONS:
            self._violation(owner, round_, fragment, reason, "reduced part refused")

    def convict(self, peer: str, round_: int, fragment: int, reason: str) -> None:
        """Act on checked proof of misbehaviour (e.g. equivocation): the policy's
        ``on_proof`` action at once, whatever the peer's record so far."""
        self._violation(peer, round_, fragment, reason, "proven by signed evidence")
        with self._lock:
            standing = self.reputation.standing(peer, round_)
            if self.policy.on_proof == "ban" and standing.status != "banned":
                self.reputation.ban(peer, reason)
            elif standing.status == "ok":
                self.reputation.quarantine(peer, round_, self.policy.quarantine_rounds, reason)
            self._flagged_at.setdefault(peer, max(round_, self.round))

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
                standing = self.reputation.ban(peer, reason)
                self._flagged_at.setdefault(peer, self.round)
            else:
                standing = self.reputation.pardon(peer, reason)
                self._flagged_at.pop(peer, None)
            self._audit_row(
                round=self.round,
                fragment=0,
                part=0,
                sender=peer,
                digest="",
                tokens=0,
                verdict=f"operator_{op}",
                reason=reason,
            )
        if self.events is not None:
            self.events.write(f"operator_{op}", peer=peer, reason=reason, round=self.round)
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

    def _violation(
        self, peer: str, round_: int, fragment: int | None, reason: str, detail: str
    ) -> None:
        with self._lock:
            standing = self.reputation.record(peer, round_, ok=False, reason=reason)
            action = self.policy.action_for(standing.violations)
            if action == "quarantine" and standing.status == "ok":
                standing = self.reputation.quarantine(
                    peer, round_, self.policy.quarantine_rounds, reason
                )
            elif action == "ban" and standing.status != "banned":
                standing = self.reputation.ban(peer, reason)
            if standing.status != "ok":
                self._flagged_at.setdefault(peer, max(round_, self.round))
        logger.warning(
            "peer %s round %d fragment %s: %s (%s); %s, score %.2f",
            peer,
            round_,
            fragment,
            reason,
            detail,
            standing.status,
            standing.score,
        )
        if self.events is not None:
            self.events.write(
                "violation",
                peer=peer,
                round=round_,
                fragment=fragment,
                reason=reason,
                status=standing.status,
                score=standing.score,
            )

    def _audit_row(self, **row: object) -> None:
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
    plan = prefix.plan
    if tuple(c.peer for c in good) != plan.peers or tuple(weights) != plan.weights:
        return None
    if prefix.upto < prefix.out.numel():
        prefix.out[prefix.upto :] = plan.combine([c.vector[prefix.upto :] for c in good])
    return Aggregate(prefix.out, list(range(len(good))))
