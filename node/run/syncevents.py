"""What a sync's events say: which sync, its group, who is in which part of the
result, the tokens it carried, how long it took, and the fingerprint of the fragment's
global copy after it (:mod:`node.run.syncer` writes them)."""

from __future__ import annotations

import hashlib
import time
from typing import TYPE_CHECKING, Any

import torch

from protocol.averaging.exchange import ExchangeOutcome

if TYPE_CHECKING:
    from node.run.syncer import Pending

__all__ = ["applied_record", "digest", "outcome_record"]


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
