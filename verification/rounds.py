"""The round this node is at: one clock that every layer reads.

The node's loop moves it: :meth:`RoundClock.start` when it starts work on a round (a
fragment's sync), :meth:`RoundClock.finish` when a round ends here or the node takes a
place among the rounds (a resume, a catch-up, the wall clock's round). The verifier
counts flags from :attr:`~RoundClock.current`, the all-reduce refuses parts far from it
and drops its old runners, and the commitments forget the rounds long before it. An
exchange run without a node's loop (tests, benchmarks) starts its round on the clock
itself. Nobody sets a round by hand, and :attr:`~RoundClock.current` never goes back.
"""

from __future__ import annotations

__all__ = ["RoundClock"]


class RoundClock:
    """Where this node's rounds stand.

    Attributes:
        ended: the last round this node finished (0: none yet).
        current: the newest round this node works on; never behind ``ended``.
    """

    __slots__ = ("current", "ended")

    def __init__(self) -> None:
        self.ended = 0
        self.current = 0

    def start(self, round_: int) -> None:
        """Work on ``round_`` starts here (a round already passed changes nothing)."""
        if round_ > self.current:
            self.current = round_

    def finish(self, round_: int) -> None:
        """This node's state is that of the end of ``round_`` (a round ended, or a state
        taken: it may be older than the last one ended, after a resume or a rebase)."""
        self.ended = round_
        self.start(round_)

    def __repr__(self) -> str:
        return f"RoundClock(ended={self.ended}, current={self.current})"
