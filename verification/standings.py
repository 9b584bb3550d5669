"""Peers' standing with one node: who is in, and what a violation costs.

A peer is refused by the operator's lists (deny, allow-only), or by its standing in
the node's :class:`~verification.reputation.ReputationStore`: quarantined, banned or
below the policy's minimum reputation. A violation lowers the peer's score and, past
the policy's thresholds, quarantines or bans it; checked proof of misbehaviour acts at
once; the operator bans and pardons by hand. A peer flagged during a round is refused
only from the next round on, when this node also votes to leave it out of the groups,
so honest members that saw the evidence at different moments still agree.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence
from typing import Protocol

from verification.policy import TrustPolicy
from verification.reputation import ReputationStore, Standing
from verification.rounds import RoundClock

__all__ = ["EventSink", "Standings", "repeated"]

logger = logging.getLogger(__name__)


def repeated(
    history: deque[int], round_: int, window: int, needed: int, distinct: bool = False
) -> bool:
    """Record ``round_`` in ``history`` (once per round with ``distinct``) and say whether
    it now holds ``needed`` entries within the last ``window`` rounds; when it does, the
    history starts again (the caller charges one violation for them)."""
    if not (distinct and round_ in history):
        history.append(round_)
    while history and history[0] <= round_ - window:
        history.popleft()
    if len(history) < needed:
        return False
    history.clear()
    return True


class EventSink(Protocol):
    """Where a verdict that costs a peer is reported (the node's ``events.jsonl``)."""

    def write(self, event: str, **fields: object) -> None: ...


class Standings:
    """Who this node deals with, and the cost of each violation.

    Args:
        policy: the operator's trust policy.
        me: this node's PeerID (never refused).
        reputation: the node's reputation store.
        lock: the lock every use of the node's stores takes.
        events: the node's event log, for one line per verdict that costs a peer.
    """

    def __init__(
        self,
        policy: TrustPolicy,
        me: str,
        reputation: ReputationStore,
        lock: threading.RLock,
        events: EventSink | None,
        clock: RoundClock,
    ) -> None:
        self.policy = policy
        self.me = me
        self.reputation = reputation
        self.events = events
        self.clock = clock
        """This node's rounds (a flag counts from the current one at the earliest)."""
        self._lock = lock
        self._flagged_at: dict[str, int] = {}
        self._outliers: dict[str, deque[int]] = {}  # rounds a peer failed a screen in

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

    def listed(self, peer: str) -> str | None:
        """Why the operator's lists refuse ``peer`` (None: they admit it), its standing
        aside: what a gather's members refuse (every honest member of a gather must
        reduce the same parts, so a peer this node alone quarantined or banned is left
        out through its votes, not by this node's reduction)."""
        if peer == self.me:
            return None
        ok, why = self.policy.admits(peer)
        return None if ok else why

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

    # ---- what it costs -----------------------------------------------------------------

    def violation(
        self, peer: str, round_: int, fragment: int | None, reason: str, detail: str
    ) -> None:
        """One violation by ``peer``: its score, and the policy's action once its
        violations reach a threshold; one log line and one event."""
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
                self._flagged_at.setdefault(peer, max(round_, self.clock.current))
        logger.warning(
            "peer %s round %d fragment %s: %s (%s); %s, score %.2f",
            *(peer, round_, fragment, reason, detail, standing.status, standing.score),
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

    def outlier(
        self, peer: str, round_: int, fragment: int | None, reason: str, detail: str
    ) -> bool:
        """A statistical screen refused ``peer``'s vector (its norm or direction against
        the others', or an owner's result against history): a violation only once the
        peer has failed one in ``policy.outlier_rounds`` different rounds within
        ``policy.outlier_window`` rounds. Before that the vector is left out and the
        outlier logged, and nothing else is held against the peer: one round's outlier is
        as often an honest peer's misfortune (a base an owner that lied shrank, a
        noisy round) as a fault, and a faulty peer fails round after round.

        Returns:
            Whether this one counted as a violation.
        """
        with self._lock:
            history = self._outliers.setdefault(peer, deque())
            policy = self.policy
            again = repeated(history, round_, policy.outlier_window, policy.outlier_rounds, True)
        if again:
            self.violation(peer, round_, fragment, reason, detail)
            return True
        logger.info(
            "peer %s round %d fragment %s: outlier left out (%s: %s), not yet a violation",
            *(peer, round_, fragment, reason, detail),
        )
        if self.events is not None:
            self.events.write("outlier", peer=peer, round=round_, fragment=fragment, reason=reason)
        return False

    def convict(self, peer: str, round_: int, fragment: int, reason: str) -> None:
        """Act on checked proof of misbehaviour (e.g. equivocation): the policy's
        ``on_proof`` action at once, whatever the peer's record so far."""
        self.violation(peer, round_, fragment, reason, "proven by signed evidence")
        with self._lock:
            standing = self.reputation.standing(peer, round_)
            if self.policy.on_proof == "ban" and standing.status != "banned":
                self.reputation.ban(peer, reason)
            elif standing.status == "ok":
                self.reputation.quarantine(peer, round_, self.policy.quarantine_rounds, reason)
            self._flagged_at.setdefault(peer, max(round_, self.clock.current))

    def ban(self, peer: str, reason: str) -> Standing:
        """The operator bans ``peer`` (from the next round: this round's groups are formed)."""
        with self._lock:
            standing = self.reputation.ban(peer, reason)
            self._flagged_at.setdefault(peer, self.clock.current)
        return standing

    def pardon(self, peer: str, reason: str) -> Standing:
        """The operator lifts ``peer``'s ban or quarantine at once (its score and
        violations stay)."""
        with self._lock:
            standing = self.reputation.pardon(peer, reason)
            self._flagged_at.pop(peer, None)
        return standing
