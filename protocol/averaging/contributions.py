"""A member's whole contribution to an exchange, kept for a few rounds and served to
the group members that check it.

A member sends each owner one signed part of its pseudo-gradient; no one else sees the
whole. A useful-work check (:mod:`verification.usefulness`) needs the whole, so the
member keeps the signed parts it sent (and the one it reduced itself, signed the same
way) for :data:`ROUNDS_KEPT` rounds, and serves them on :data:`CONTRIBUTION_RPC`. A
checker authenticates every part (the contributor's signature, run, round, fragment,
part index), compares each sent part's digest with the commitment the contributor
signed to the group before the exchange, and decodes them into one vector: what the
owners reduced, bit for bit. The part a member owned itself was never sent and so never
committed; it is covered by the member's signature only.

Every part of an ``update`` carries the member's signed :class:`WorkClaim` in its head
(``work``): which batches of its assignment the pseudo-gradient was trained on. It is
committed with the part, before anyone can know which of those batches a checker will
draw, so a member that trained fewer than it claims cannot choose its claim afterwards.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from protocol.averaging.parts import AllReduceKey, AllReduceSettings, PartPlan
from protocol.errors import ProtocolError
from protocol.wire import codec as codecs
from protocol.wire.partwire import SealedPart, open_part

__all__ = [
    "CONTRIBUTION_RPC",
    "ROUNDS_KEPT",
    "Fetched",
    "SentParts",
    "WorkClaim",
    "open_contribution",
]

CONTRIBUTION_RPC = "atoll.contribution"
"""The RPC a member serves its kept contributions on: ``msgpack([round, fragment])`` for
its pseudo-gradient, ``msgpack([round, fragment, "weights"])`` for the global copy it
sent where its group mixed copies."""
ROUNDS_KEPT = 3
"""Rounds a member keeps its sent parts for (checks run within the round after)."""
_MAX_REQUEST_BYTES = 64

CommittedDigests = Callable[[str, int, int, str], dict[int, bytes] | None]
"""``(peer, round, fragment, content)`` to the part digests ``peer`` committed to, or None."""


class SentParts:
    """The signed parts this node sent (and owned) per exchange, for the last rounds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: dict[tuple[int, int, str], list[bytes]] = {}

    def keep(self, key: AllReduceKey, parts: dict[int, SealedPart]) -> None:
        """Keep the parts of an exchange (copies: bodies may be views)."""
        round_, fragment, content = key
        wires = [parts[j].to_bytes() for j in sorted(parts)]
        with self._lock:
            self._kept[(round_, fragment, content)] = wires
            for old in [k for k in self._kept if k[0] <= round_ - ROUNDS_KEPT]:
                del self._kept[old]

    def get(self, round_: int, fragment: int, content: str = "update") -> list[bytes] | None:
        with self._lock:
            return self._kept.get((round_, fragment, content))

    async def serve(self, peer: str, request: bytes) -> bytes:
        """The :data:`CONTRIBUTION_RPC` handler: the kept parts, or an empty list."""
        try:
            fields = msgpack.unpackb(request, raw=False)
            if not isinstance(fields, list) or len(fields) not in (2, 3):
                raise ValueError("expected [round, fragment] or [round, fragment, content]")
            content = fields[2] if len(fields) == 3 else "update"
            if content not in ("update", "weights"):
                raise ValueError(f"unknown content {content!r}")
            wires = self.get(int(fields[0]), int(fields[1]), content)
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError) as exc:
            raise ProtocolError("malformed", f"contribution request: {exc}", peer) from None
        return msgpack.packb(wires or [], use_bin_type=True)


_MAX_SPANS = 64
_MAX_COUNT = 2**40
_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class WorkClaim:
    """The batches a pseudo-gradient was trained on, as its member claims them.

    A member trains, in each round, the batches of an *assigned* stream keyed by the run,
    its PeerID, the round and its rank (:func:`node.data.corpus.assigned_stream`), drawn from
    slice ``slice[0]`` of ``slice[1]`` of the run's train tokens (one rank per slice:
    a site's rank ``k`` trains slice ``slice[0] * ranks + k`` of ``slice[1] * ranks``).

    Attributes:
        spans: ``(round, start, count)``: draws ``start`` to ``start + count`` of that
            round's stream, on every rank.
        ranks: processes that trained in step (a site's ranks; 1 for a single process).
        slice: ``(index, count)`` of the data slice (``data.site``, ``data.sites``).
        batch: windows per batch (``data.batch_size``).
        trace: the digest of the member's signed trace of this training, where the run
            replays windows of it (``trust.replay_steps``; :mod:`verification.replay`).
    """

    spans: tuple[tuple[int, int, int], ...]
    ranks: int = 1
    slice: tuple[int, int] = (0, 1)
    batch: int = 1
    trace: str | None = None

    @property
    def batches(self) -> int:
        """Every claimed batch, over every rank."""
        return self.ranks * sum(count for _, _, count in self.spans)

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "spans": [list(s) for s in self.spans],
            "ranks": self.ranks,
            "slice": list(self.slice),
            "batch": self.batch,
        }
        if self.trace is not None:
            wire["trace"] = self.trace
        return wire

    @classmethod
    def from_wire(cls, value: Any, peer: str) -> WorkClaim:
        """Parse a claim from a part's head.

        Raises:
            ProtocolError: ``malformed``.
        """
        keys = {"spans", "ranks", "slice", "batch"}
        if not isinstance(value, dict) or set(value) not in (keys, keys | {"trace"}):
            raise ProtocolError("malformed", "a work claim holds spans, ranks, slice, batch", peer)
        trace = value.get("trace")
        if trace is not None and not (
            isinstance(trace, str) and len(trace) == 64 and all(c in _HEX for c in trace)
        ):
            raise ProtocolError("malformed", "a claim's trace is a hex SHA-256 digest", peer)
        spans, ranks, slice_, batch = (value[k] for k in ("spans", "ranks", "slice", "batch"))
        if not isinstance(spans, list) or len(spans) > _MAX_SPANS:
            raise ProtocolError("malformed", f"a work claim has at most {_MAX_SPANS} spans", peer)
        if not all(
            _ints(s, 3) and s[0] >= 0 and s[1] >= 0 and 0 < s[2] < _MAX_COUNT for s in spans
        ):
            raise ProtocolError("malformed", "claimed spans are (round, start, count > 0)", peer)
        if not _ints([ranks, batch], 2) or not 1 <= ranks <= 4096 or not 1 <= batch <= 2**20:
            raise ProtocolError("malformed", "a claim's ranks and batch are out of range", peer)
        if not _ints(slice_, 2) or not 0 <= slice_[0] < slice_[1] <= 2**20:
            raise ProtocolError("malformed", "a claim's data slice is out of range", peer)
        spans_ = tuple((s[0], s[1], s[2]) for s in spans)
        return cls(spans_, ranks, (slice_[0], slice_[1]), batch, trace)


def _ints(value: Any, n: int) -> bool:
    return (
        isinstance(value, list)
        and len(value) == n
        and all(isinstance(x, int) and not isinstance(x, bool) for x in value)
    )


@dataclass(frozen=True)
class Fetched:
    """A peer's checked contribution: its values, its parts' digests, its token weight
    and the work it claims (None: its parts carry no claim)."""

    vector: torch.Tensor
    digests: list[bytes]
    tokens: int
    claim: WorkClaim | None = None


def open_contribution(
    data: bytes,
    peer: str,
    key: tuple[int, int],
    numel: int,
    settings: AllReduceSettings,
    committed: CommittedDigests,
    content: str = "update",
) -> Fetched:
    """Check and decode a contribution served by ``peer`` for exchange ``key``: its
    pseudo-gradient, or with ``content="weights"`` the global copy it sent to mix.

    Raises:
        ProtocolError: ``malformed``, ``uncommitted``, ``commit_mismatch``,
            ``not_in_round`` or any refusal of :func:`~protocol.wire.partwire.open_part`.
    """
    round_, fragment = key
    try:
        wires = msgpack.unpackb(data, raw=False)
    except Exception as exc:
        raise ProtocolError("malformed", f"contribution: {type(exc).__name__}", peer) from None
    if not isinstance(wires, list) or not wires or not all(isinstance(w, bytes) for w in wires):
        raise ProtocolError("malformed", "a contribution is a non-empty list of parts", peer)
    digests = committed(peer, round_, fragment, content)
    if digests is None:
        raise ProtocolError("uncommitted", f"no commitment for round {round_}", peer)
    parts = [
        open_part(
            w,
            max_bytes=settings.max_message_bytes,
            expected_sender=peer,
            run_id=settings.run_id,
            kinds=("part",),
        )
        for w in wires
    ]
    first = parts[0].meta
    group, owners = first.get("group"), first.get("owners")
    if not isinstance(group, list) or not isinstance(owners, list):
        raise ProtocolError("malformed", "parts name no group", peer)
    try:
        gather = settings.gather and content == "update"
        plan = PartPlan.of(peer, group, owners, numel, settings.block_size, gather)
    except ValueError as exc:
        raise ProtocolError("malformed", str(exc), peer) from None
    return _assemble(parts, plan, (round_, fragment, content), digests, peer, numel)


def _assemble(
    parts: Sequence, plan: PartPlan, key: AllReduceKey, digests: dict, peer: str, numel: int
) -> Fetched:
    # a gather's member sent everyone one part under its own index, and committed to it
    indices = [plan.index] if plan.gather else list(range(len(plan.owners)))
    if [p.header.part for p in parts] != indices:
        raise ProtocolError("malformed", "not one part per owner, in order", peer)
    vector = torch.empty(numel, dtype=torch.float32)
    tokens = -1
    work = parts[0].meta.get("work")
    for j, part in zip(indices, parts, strict=True):
        h, meta = part.header, part.meta
        if (h.round, h.fragment, meta.get("content")) != key:
            raise ProtocolError("not_in_round", f"part {j} is of another exchange", peer)
        if (meta.get("group"), meta.get("owners")) != (plan.group, plan.owners):
            raise ProtocolError("malformed", f"part {j} names another group", peer)
        if (j != plan.index or plan.gather) and digests.get(j) != part.digest:
            raise ProtocolError("commit_mismatch", f"part {j} is not the one committed", peer)
        weight = meta.get("weight")
        if not isinstance(weight, int) or weight < 0 or tokens not in (-1, weight):
            raise ProtocolError("malformed", f"part {j} claims another weight", peer)
        if meta.get("work") != work:
            raise ProtocolError("malformed", f"part {j} claims other work", peer)
        tokens = weight
        lo, hi = plan.bounds[j]
        try:
            enc = codecs.Encoded.from_meta(meta, part.body, max_numel=hi - lo)
            vector[lo:hi] = codecs.decode(enc, expected_numel=hi - lo)
        except ProtocolError as exc:
            raise ProtocolError(exc.reason, f"part {j}: {exc.detail}", peer) from None
    if not torch.isfinite(vector).all():
        raise ProtocolError("not_finite", "the contribution holds non-finite values", peer)
    claim = None if work is None else WorkClaim.from_wire(work, peer)
    return Fetched(vector, [p.digest for p in parts], tokens, claim)
