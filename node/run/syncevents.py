"""A sync in flight (:class:`Pending`), and what its events say: which sync, its group, who is in which part of the
result, the tokens it carried, how long it took, and the fingerprint of the fragment's
global copy after it (:mod:`node.run.syncer` writes them)."""

from __future__ import annotations

import concurrent.futures
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from protocol.averaging.exchange import ExchangeOutcome

__all__ = ["Pending", "applied_record", "digest", "outcome_record"]


@dataclass
class Pending:
    """A sync in flight."""

    round: int
    fragment: int
    tokens: int
    step: int
    started: float
    future: concurrent.futures.Future
    weights: torch.Tensor
    """The fragment's global copy as sent if the group mixes weights (mix codec applied)."""
    deadline: float = 0.0
    """``time.monotonic()`` by which the exchange is over, whatever its peers do."""
    sent_from: torch.Tensor | None = None
    """The fragment's local copy the pseudo-gradient was taken from (see
    :meth:`~node.train.outer.OuterOptimizer.merge_local`)."""
    ended: list[float] = field(default_factory=list)
    """``time.monotonic()`` when the exchange ended, once it did (written on the
    transport's loop)."""


def outcome_record(pending: Pending, done: ExchangeOutcome) -> dict[str, Any]:
    """What any ended exchange's event says: which sync, its group and who is in which
    part of the result, the tokens it carried and how long it took."""
    result = done.result
    return {
        "round": pending.round,
        "fragment": pending.fragment,
        "group": done.group,
        "contributors": result.contributors,
        "complete": result.complete,
        "tokens": pending.tokens,
        "step": pending.step,
        "seconds": time.monotonic() - pending.started,
    }


def applied_record(
    pending: Pending, done: ExchangeOutcome, digest: str, step: int
) -> dict[str, Any]:
    """The ``sync`` event of an applied exchange."""
    result, mixed = done.result, done.mixed
    return {
        **outcome_record(pending, done),
        "owners": result.owners,
        "fallback_parts": result.fallback_parts,
        "repaired_parts": result.repaired_parts,
        "bytes_sent": result.bytes_sent + (mixed.bytes_sent if mixed else 0),
        "mixed": mixed is not None,
        # how far this node's copy sat from its group's mean (relative): copies of a
        # swarm that mixes differ by design, and this is by how much
        "copy_apart": _apart(pending.weights, mixed.vector) if mixed is not None else None,
        "cell": done.cell,
        "global_digest": digest,
        "overlap_steps": step - pending.step,
    }


def _apart(own: torch.Tensor, mean: torch.Tensor) -> float:
    """``||own - mean|| / ||mean||`` (0 for a zero mean)."""
    scale = float(mean.norm())
    return round(float((own.to(mean) - mean).norm()) / scale, 6) if scale > 0 else 0.0


def digest(value: torch.Tensor) -> str:
    """A short fingerprint of a fragment's global copy (float32 bytes)."""
    data = value.detach().float().contiguous().cpu().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]
