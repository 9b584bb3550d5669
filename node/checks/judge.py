"""Whether this node believes another checker's record, before it counts.

A node that holds the same round base as the record (the record's ``base`` and the
exchange's ``result`` are this node's own: it was in the group) can verify everything:
the seed, that the checker and the fragment were drawn, and, by recomputing it, every
loss. It recomputes the records about its own contribution that accuse it, and a
share ``trust.check_audit`` of the others (chosen by hash, so each auditor picks its
own); a record that fails any of this is false and costs its signer.

A node outside the group holds another base and can verify none of it. It counts the
record as its checker signed it; :class:`verification.workscores.Scores` flags a peer
only on failing results from two checkers or more, so one lying checker cannot get an
honest peer flagged by the nodes that cannot audit it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

from node.checks.inputs import CheckSettings, RoundInputs
from verification.gains import judge
from verification.usefulness import CheckRecord
from verification.workscores import Scores

__all__ = ["Belief", "believe"]


@dataclass(frozen=True)
class Belief:
    """What to do with a record: ``count`` it, ``recompute`` it first, or it is
    ``false`` (``why`` says how)."""

    action: Literal["count", "recompute", "false"]
    why: str = ""
    outsider: bool = False


def believe(
    record: CheckRecord,
    inputs: RoundInputs | None,
    settings: CheckSettings,
    me: str,
    fragments: int,
    scores: Scores,
) -> Belief:
    """How far this node believes ``record`` (see the module docstring).

    Args:
        inputs: this node's inputs of the record's round (None: it holds none: the round
            went wrong here, or it was not in that round).
    """
    f = record.fragment
    if f >= fragments:
        return Belief("false", f"names fragment {f} of a model with {fragments}")
    if inputs is None or record.base != inputs.base or record.result != inputs.exchanges[f].result:
        return Belief("count", outsider=True)
    seed = inputs.seed(settings.run_id, f)
    contributors = inputs.exchanges[f].contributors
    if record.seed != seed.hex():
        return Belief("false", "names another seed than the exchange's")
    if record.peer not in contributors or record.checker not in contributors:
        return Belief("false", "names a peer that did not contribute to the exchange")
    if record.checker not in inputs.checkers(settings, f, record.peer):
        return Belief("false", "its checker or fragment was not drawn by the seed")
    verdict = judge(record)
    accuses = scores.short(verdict, record.round)
    if (record.peer == me and accuses) or _audited(me, record, settings.audit):
        return Belief("recompute")
    return Belief("count")


def _audited(me: str, record: CheckRecord, share: float) -> bool:
    """Whether this node recomputes ``record`` (a fixed share, by hash)."""
    h = hashlib.sha256(f"{me}/{record.key}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < share
