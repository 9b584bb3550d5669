"""Failed replay checks per peer, and when they flag it.

A checker that replayed a window of a peer's trace and saw it fail says so in a signed
record (:mod:`verification.replay`). A failure this node replayed itself is proven and
flags its peer at once; failures on others' word need two checkers within the rounds a
peer is judged on, so one lying checker cannot get an honest peer flagged. A checker
proven to cheat has its own records left out of every peer's score
(:class:`verification.workscores.Scores`, which holds this record under its lock).
"""

from __future__ import annotations

__all__ = ["FailedReplays"]

_SPAN = 24
"""Rounds a failure on another's word counts for where no judging span is set."""


class FailedReplays:
    """Per peer, the newest failed replay check each checker reported.

    Not locked: its holder takes its own lock around every call.

    Args:
        rounds: the rounds a peer is judged on (None: :data:`_SPAN`).
    """

    def __init__(self, rounds: int | None) -> None:
        self.rounds = rounds
        # peer -> checker -> (round, proven) of its failed replay checks
        self._failed: dict[str, dict[str, tuple[int, bool]]] = {}

    def add(self, peer: str, checker: str, round_: int, proven: bool) -> None:
        """Count a failed replay check of ``peer``: ``proven`` where this node replayed
        the window itself, else on ``checker``'s word."""
        mine = self._failed.setdefault(peer, {})
        held = mine.get(checker)
        if held is None or held[0] < round_ or (proven and not held[1]):
            mine[checker] = (round_, proven or (held is not None and held[1]))

    def proven(self, peer: str) -> bool:
        """Whether a replay of ``peer``'s trace failed on this node."""
        return any(p for _, p in self._failed.get(peer, {}).values())

    def flags(self, peer: str) -> bool:
        """A failed replay proven here flags its peer; failures on others' word need two
        checkers (one lying checker cannot get an honest peer flagged), within the
        rounds a peer is judged on."""
        failed = self._failed.get(peer)
        if not failed:
            return False
        if any(proven for _, proven in failed.values()):
            return True
        newest = max(r for r, _ in failed.values())
        span = self.rounds if self.rounds is not None else _SPAN
        return len([c for c, (r, _) in failed.items() if r > newest - span]) >= 2

    def count(self, peer: str) -> int:
        """How many checkers reported a failed replay of ``peer``."""
        return len(self._failed.get(peer, {}))

    def peers(self) -> set[str]:
        """Every peer with a failed replay check."""
        return set(self._failed)

    def cheats(self) -> set[str]:
        """Peers proven here to have cheated (their word as checkers counts for nothing)."""
        return {p for p in self._failed if self.proven(p)}
