"""The node's trust decisions: screening, robust aggregation, policy, reputation, audit.

:class:`Verifier` plugs into the all-reduce as its judge (it has the shape of
:class:`protocol.averaging.hooks.Judge`), and its ``reducer``
(:class:`~verification.reduction.Reducer`) as the owner's reducer: the all-reduce calls
it directly on plain records, :class:`~verification.records.Contribution`, and gets a
:class:`~verification.records.Reduction` back. Every contribution a node sees as a part owner gets
one audit row (accepted, rejected with a reason, or its own), every violation goes
through the operator's :class:`~verification.policy.TrustPolicy` (drop, quarantine,
ban); peers that are quarantined, banned, denied or below the policy's minimum
reputation are refused, and this node votes to leave quarantined and banned ones out
of the round's groups.

The owner's reduction (admit, screen, cap the weights and aggregate, audit) is
:class:`~verification.reduction.Reducer`. Who is in and what a violation costs is
:class:`~verification.standings.Standings`, the checks against history (a pair's
parts, an owner's result) are :class:`~verification.plausibility.Plausibility`, and
what is written down (audit rows, reputations) goes through the node's
:class:`~verification.ledger.Ledger`. Which refusals cost a peer is
:mod:`verification.reasons`.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import torch

from verification.ledger import Ledger
from verification.plausibility import Plausibility
from verification.policy import TrustPolicy
from verification.reasons import (
    BENIGN_REASONS,
    OUTLIER_REASONS,
    POLICY_REASONS,
    VICTIM_REASONS,
)
from verification.reduction import Reducer
from verification.rounds import RoundClock
from verification.standings import EventSink, Standings, repeated
from verification.workscores import Scores

__all__ = ["EventSink", "Verifier"]

logger = logging.getLogger(__name__)


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
        self.ledger = Ledger(db_path, me)
        """Audit rows and reputations, written off the critical path by one thread;
        standings are read from memory."""
        self.audit = self.ledger.audit
        self.reputation = self.ledger.reputation
        self.plausibility = Plausibility(policy, me)
        """Pairs screened and owners' results judged against what was accepted before."""
        self.standings = Standings(
            policy, me, self.reputation, self.ledger.lock, events, self.clock
        )
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
        self.reducer = Reducer(policy, self.standings, self.plausibility, self.work, self.ledger)
        """The owner's reduction of the parts this node owns."""
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

    # ---- refusals ----------------------------------------------------------------------

    def on_refusal(self, peer: str, round_: int | None, fragment: int | None, reason: str) -> None:
        r = self.clock.current if round_ is None else round_
        # part 0: refused before its part was known
        self.ledger.row(r, fragment if fragment is not None else 0, 0, peer, "rejected", reason)
        if reason not in BENIGN_REASONS and reason not in POLICY_REASONS:
            # Counted when it happens: a replayed message names an old round, and a
            # quarantine counted from that round would already be over.
            self.standings.violation(
                peer, max(r, self.clock.current), fragment, reason, "message refused"
            )
        elif reason in POLICY_REASONS:
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
        with self.ledger.lock:
            reason = "no_delivery" if committed else "absent"
            self.ledger.row(round_, fragment, part, peer, "missing", reason)
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
        self.ledger.row(round_, fragment, part, owner, "owner_rejected", reason)
        unaccused = BENIGN_REASONS | POLICY_REASONS | VICTIM_REASONS
        if reason in OUTLIER_REASONS:
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
        with self.ledger.lock:
            if op == "ban":
                standing = self.standings.ban(peer, reason)
            else:
                standing = self.standings.pardon(peer, reason)
            self.ledger.row(self.clock.current, 0, 0, peer, f"operator_{op}", reason)
        if self.events is not None:
            self.events.write(f"operator_{op}", peer=peer, reason=reason, round=self.clock.current)
        # an operator's command is on disk when it is answered (`atoll peers` reads the file)
        if not self.ledger.flush():
            logger.warning("operator %s of %s: not written to the audit log within 30 s", op, peer)
        return {
            "peer": peer,
            "score": round(standing.score, 3),
            "status": standing.status,
            "violations": standing.violations,
            "reason": standing.reason,
        }

    def flush(self, timeout: float = 30.0) -> bool:
        """Commit every queued audit row and reputation change (before a checkpoint)."""
        return self.ledger.flush(timeout)

    def close(self) -> None:
        """Flush and close the node's SQLite file (nothing queued is lost)."""
        self.ledger.close()
