"""Whether this node's global copy is the swarm's, and which state is the swarm's.

Two views, one rule.

* **After a round that went wrong** (a sync failed or averaged alone while peers were
  live, a part kept local values, the node joined mid-round), a node signs its state's
  digest for the round as *unsettled* and waits for its peers' signed digests
  (:func:`protocol.catchup.attested`). :func:`swarm_state` picks the round's state from
  them the same way on every node: the digest the most *settled* peers signed, then the
  one the most peers signed, then the smallest digest. Two nodes that both lost a sync
  thus agree on one of their two states instead of each waiting for the other's.
  A joining node's digest is never taken, so a newcomer's first weights never win.
* **Every round** (:class:`AgreementWatch`), a node compares its digest of the round
  before with the ones its peers' heartbeats carry, by the same rule with its own
  digest counted once. Losing two rounds in a row means it is off on its own (it
  averaged alone, or took results others did not): it takes the swarm's state.

Groups that mix weights (gossip, or the butterfly before it has reached everyone)
hold different copies by design and are judged by neither.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping

__all__ = ["AgreementWatch", "swarm_state"]

_DIGEST = re.compile(r"[0-9a-f]{64}")
_ROUNDS_KEPT = 4


def swarm_state(attestations: Mapping[str, Mapping[str, str]]) -> str | None:
    """The round's state the swarm converges on.

    Args:
        attestations: each signed digest of the round, with ``{signer: standing}``
            (:data:`protocol.catchup.STANDINGS`).

    Returns:
        The digest with the most ``settled`` signers, then the most signers, then the
        smallest; a digest only ``joining`` nodes signed is never taken. None when
        there is none to take.
    """
    counts = {
        d: (
            sum(1 for s in who.values() if s == "settled"),
            sum(1 for s in who.values() if s != "joining"),
        )
        for d, who in attestations.items()
    }
    candidates = [d for d, (_, signed) in counts.items() if signed > 0]
    if not candidates:
        return None
    return min(candidates, key=lambda d: (-counts[d][0], -counts[d][1], d))


class AgreementWatch:
    """Digests by round: this node's and what its peers' heartbeats said.

    Args:
        rounds: consecutive rounds of disagreement after which :meth:`check` says so.
    """

    def __init__(self, rounds: int = 2) -> None:
        self.rounds = rounds
        self._own: dict[int, str] = {}
        self._peers: dict[int, dict[str, str]] = {}
        self._apart = 0
        self._checked = 0

    def own(self, round_: int, digest: str) -> None:
        self._own[round_] = digest
        self._trim()

    def heard(self, peer: str, said: object) -> None:
        """A heartbeat's ``digest`` field, ``[round, hex digest]`` (anything else is
        ignored: it comes from a peer)."""
        if not isinstance(said, (list, tuple)) or len(said) != 2:
            return
        round_, digest = said
        if (
            type(round_) is int
            and round_ > 0
            and isinstance(digest, str)
            and _DIGEST.fullmatch(digest)
        ):
            self._peers.setdefault(round_, {})[peer] = digest
            self._trim()

    def check(self, round_: int) -> str | None:
        """After round ``round_``: why this node should take the swarm's state (its copy
        of round ``round_ - 1``, settled by now, lost to another by :func:`swarm_state`'s
        rule, its own digest counted once, for :attr:`rounds` rounds in a row), or None."""
        r = round_ - 1
        if r <= self._checked:
            return None
        self._checked = r
        ours, theirs = self._own.get(r), self._peers.get(r, {})
        if ours is None or not theirs:
            return None
        votes = Counter(theirs.values())
        votes[ours] += 1
        best = min(votes, key=lambda d: (-votes[d], d))
        if best == ours:
            self._apart = 0
            return None
        self._apart += 1
        if self._apart < self.rounds:
            return None
        self._apart = 0
        return (
            f"this node's global copy differs from the one {votes[best]} of {len(theirs)} "
            f"peers hold, for {self.rounds} rounds in a row (round {r}: {ours[:12]} against "
            f"{best[:12]})"
        )

    def _trim(self) -> None:
        newest = max([*self._own, *self._peers, 0])
        for table in (self._own, self._peers):
            for r in [r for r in table if r <= newest - _ROUNDS_KEPT]:
                del table[r]
