"""The plain records the verification layer judges: one contribution, one reduction.

The all-reduce (:mod:`protocol.averaging`) builds these from the parts it receives
and hands them to the owner's reducer (:meth:`verification.verifier.Verifier.reduce`);
nothing here knows about the wire.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["Contribution", "Reduction"]


@dataclass(frozen=True)
class Contribution:
    """One member's decoded part, as the owner received it.

    ``tokens`` is what the peer claimed; ``weight`` is that claim capped by the run's
    ``max_tokens``. ``vector`` may be a view of the received bytes: read it, never
    write to it. ``digest`` names the signed part it came in (what audit rows and
    commitments name). ``norm`` is ``vector``'s Euclidean norm when the receiver
    computed it while decoding (None: not known yet).
    """

    peer: str
    vector: torch.Tensor
    weight: float
    digest: bytes
    tokens: int = 0
    norm: float | None = None


@dataclass(frozen=True)
class Reduction:
    """An owner's reduced part: the vector, who is in it, and who was refused and why."""

    vector: torch.Tensor
    used: list[str]
    rejected: dict[str, str] = field(default_factory=dict)
