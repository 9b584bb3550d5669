"""An owner's part reduced block by block while the members' parts still arrive.

Without it an owner reduces only once every part is fully in, so the reduction (for a
weighted mean of four 12.5M-value parts, 43 ms on one thread here) sits between the
exchange's two transfers. Here each member's body is followed as its chunks are
checked (:func:`~protocol.wire.partwire.read_part` reports them), and as soon as every
member the owner waits for has values ``lo:hi`` in, those values are decoded
(:func:`~protocol.wire.codec.decode_range`: a view for raw float32) and combined by the
reducer's :class:`~verification.records.StreamPlan`. When the last part is in, the
reducer screens the whole parts as before and, when it keeps exactly the plan's members
with the plan's weights, only completes what is left (:class:`~verification.records.Prefix`);
otherwise (a member refused, late or silent, a screening verdict, an aggregator that
needs whole vectors) it reduces from scratch. The plan's blocks are the reducer's own
coordinate-wise computation, so the result is bitwise the one a whole-vector reduction
gives.

Nothing here touches the network: the all-reduce feeds it (:meth:`attach`,
:meth:`arrived`, :meth:`detach`) on the event loop and runs :meth:`reduce_to` in a
worker thread, one call at a time.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from protocol.errors import ProtocolError
from protocol.wire import codec as codecs
from verification.records import Prefix, StreamPlan

__all__ = ["BLOCK_VALUES", "StreamingReduction"]

logger = logging.getLogger(__name__)

BLOCK_VALUES = 1 << 18
"""Values combined at once: 1 MiB of float32, the size of a checked chunk of a raw part."""


@dataclass
class _Source:
    encoded: codecs.Encoded
    ready_bytes: int = 0


class StreamingReduction:
    """One owner's part, reduced block by block as parts arrive.

    Args:
        numel: values in the part.
        own: this owner's peer and its own values for the part (complete from the start).
        block: values combined at once.
    """

    def __init__(self, numel: int, own: tuple[str, torch.Tensor], block: int = BLOCK_VALUES):
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        self.numel = numel
        self.block = block
        self.me, self._own = own
        self.plan: StreamPlan | None = None
        self.out: torch.Tensor | None = None
        self.upto = 0
        """Values ``out[:upto]`` are reduced."""
        self.broken = False
        """A block could not be reduced (a member's values were refused on the way): the
        owner reduces from scratch at the end."""
        self._sources: dict[str, _Source] = {}
        self._lock = threading.Lock()

    # ---- fed on the event loop -----------------------------------------------------------

    def attach(self, peer: str, encoded: codecs.Encoded) -> bool:
        """Follow ``peer``'s part, whose (validated) payload is being received into
        ``encoded.payload``; False when it is already followed or not of this part's size."""
        if encoded.numel != self.numel or peer == self.me:
            return False
        with self._lock:
            if peer in self._sources:
                return False
            self._sources[peer] = _Source(encoded)
        return True

    def attached(self) -> set[str]:
        with self._lock:
            return set(self._sources)

    def arrived(self, peer: str, nbytes: int) -> None:
        """The first ``nbytes`` of ``peer``'s payload are in and checked."""
        with self._lock:
            source = self._sources.get(peer)
            if source is not None:
                source.ready_bytes = max(source.ready_bytes, nbytes)

    def detach(self, peer: str) -> None:
        """Stop following ``peer`` (its part was refused or its stream broke): its buffer
        may be reused from now on, so nothing is read from it any more."""
        with self._lock:
            self._sources.pop(peer, None)
            if self.plan is not None and peer in self.plan.peers:
                self.broken = True

    def start(self, plan: StreamPlan) -> None:
        """Reduce by ``plan`` from now on (its peers must all be attached, or be this owner)."""
        with self._lock:
            if self.plan is not None:
                raise RuntimeError("the plan is set once")
            missing = [p for p in plan.peers if p != self.me and p not in self._sources]
            if missing:
                raise ValueError(f"plan names peers not attached: {missing}")
            self.plan = plan
            self.out = torch.empty(self.numel, dtype=torch.float32)

    def ready(self) -> int:
        """Values every member of the plan has in, rounded down to whole blocks (all of
        them once every part is complete); 0 before :meth:`start`."""
        with self._lock:
            if self.plan is None or self.broken:
                return 0
            values = self.numel
            for peer in self.plan.peers:
                if peer == self.me:
                    continue
                source = self._sources[peer]
                enc = source.encoded
                values = min(
                    values,
                    codecs.ready_values(enc.numel, enc.codec, enc.block_size, source.ready_bytes),
                )
        return values if values == self.numel else values - values % self.block

    # ---- run in a worker thread ------------------------------------------------------------

    def reduce_to(self, hi: int) -> None:
        """Reduce values ``upto:hi`` (call it with :meth:`ready`'s answer, one call at a
        time). A member's values that decoding refuses mark the reduction broken."""
        plan, out = self.plan, self.out
        if plan is None or out is None or self.broken:
            return
        with self._lock:
            sources = {p: self._sources.get(p) for p in plan.peers if p != self.me}
        if any(s is None for s in sources.values()):
            self.broken = True
            return
        lo = self.upto
        try:
            while lo < hi:
                end = min(hi, lo + self.block)
                rows = self._rows(plan.peers, sources, lo, end)  # type: ignore[arg-type]
                out[lo:end] = plan.combine(rows)
                lo = end
        except (ProtocolError, ValueError, RuntimeError) as exc:
            # the member's part is refused in full once it is in (context.decode); here the
            # speculative blocks are simply given up
            logger.info("streamed reduction given up at value %d: %s", lo, exc)
            self.broken = True
            return
        self.upto = hi

    def _rows(
        self, peers: Sequence[str], sources: dict[str, _Source], lo: int, hi: int
    ) -> list[torch.Tensor]:
        return [
            self._own[lo:hi] if p == self.me else codecs.decode_range(sources[p].encoded, lo, hi)
            for p in peers
        ]

    # ---- the end ---------------------------------------------------------------------------

    def close(self) -> None:
        """Drop every view of the members' buffers and of this owner's values (the
        receive buffers go back to their pool); the reduced values stay in ``out``."""
        with self._lock:
            self._sources.clear()
            self.broken = True
        self._own = torch.empty(0)

    def prefix(self) -> Prefix | None:
        """What was reduced, for the reducer (None when nothing usable was)."""
        if self.plan is None or self.out is None or self.broken:
            return None
        return Prefix(self.plan, self.out, self.upto)
