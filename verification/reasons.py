"""Which refusals cost a peer: the classes of reasons a node's verdicts fall into.

A refusal is benign (an honest peer can cause it), a policy's (the operator's lists or a
peer's standing), a victim's (a copy short through another's fault), a statistical
outlier's (a violation only when repeated) or, for every other reason, a violation.
"""

from __future__ import annotations

__all__ = [
    "BENIGN_REASONS",
    "HEURISTIC_REASONS",
    "OUTLIER_REASONS",
    "POLICY_REASONS",
    "VICTIM_REASONS",
]

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

POLICY_REASONS = frozenset({"denied", "not_allowed", "quarantined", "banned", "low_reputation"})
"""Refusals by the operator's lists or a peer's standing: already counted, not again."""
HEURISTIC_REASONS = frozenset({"norm", "direction"})
"""Screens that need a robust centre: in a pair (no centre) they accuse no one."""
OUTLIER_REASONS = HEURISTIC_REASONS | {"owner_norm", "owner_direction"}
"""Statistical verdicts: a violation only when repeated
(:meth:`verification.standings.Standings.outlier`)."""
VICTIM_REASONS = frozenset({"copy_norm", "owner_shrunk"})
"""Refusals of copies (a member's, or an owner's mean of them) whose failure is most often
the holder's misfortune, never held against it: a copy a zero owner shrank before is
short, and so is any mean its honest holder returns."""
