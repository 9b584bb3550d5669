"""The plain records the verification layer judges: one contribution, one reduction,
and how an owner may reduce block by block while the contributions still arrive.

The all-reduce (:mod:`protocol.averaging`) builds these from the parts it receives
and hands them to the owner's reducer (:meth:`verification.reduction.Reducer.reduce`);
nothing here knows about the wire.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["Contribution", "Prefix", "Reduction", "StreamPlan"]


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


@dataclass(frozen=True)
class StreamPlan:
    """How an owner may reduce its part block by block while the parts arrive.

    A reducer offers one when its result is coordinate-wise (values ``lo:hi`` of the
    result depend only on values ``lo:hi`` of the inputs, bitwise alike whether computed
    for a block or for the whole vector), under the assumption that every one of
    ``peers`` ends up in the result with these ``weights``.

    Attributes:
        peers: the contributors, in the order the reduction takes them.
        weights: their weights as the reduction would use them.
        combine: the same rows' values ``lo:hi`` (one tensor per peer, in order) ->
            the result's values ``lo:hi``.
    """

    peers: tuple[str, ...]
    weights: tuple[float, ...]
    combine: Callable[[Sequence[torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class Prefix:
    """What an owner reduced while the parts arrived: ``out[:upto]`` is ``plan.combine``
    over ``plan.peers``. A reducer whose final contributors and weights are the plan's
    completes ``out[upto:]`` and returns ``out``; otherwise it reduces from scratch."""

    plan: StreamPlan
    out: torch.Tensor
    upto: int

    def complete(
        self, peers: Sequence[str], weights: Sequence[float], vectors: Sequence[torch.Tensor]
    ) -> torch.Tensor | None:
        """The reduction completed over ``vectors`` (one per peer, in order), or None
        when ``peers`` and ``weights`` are not the plan's (the caller then reduces from
        scratch)."""
        plan = self.plan
        if tuple(peers) != plan.peers or tuple(float(w) for w in weights) != plan.weights:
            return None
        if self.upto < self.out.numel():
            self.out[self.upto :] = plan.combine([v[self.upto :] for v in vectors])
        return self.out
