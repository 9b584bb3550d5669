"""What the owner side, the member side and repair of one node's all-reduce share.

One :class:`AllReduceContext` per node holds the transport, the key, the settings, the
hooks the node plugs in (reducer, judge, fault injection, commitments), the byte and refusal counters, the worker thread that hashes,
decodes and reduces off the event loop, and the pool large bodies are received into.
It is also the one place a part (or an owner's result) is read, decoded or refused:
every refusal is counted and reported to the judge here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

import torch

from protocol.averaging.contributions import SentParts
from protocol.averaging.hooks import Hooks
from protocol.averaging.parts import (
    CONTENTS,
    AllReduceKey,
    AllReduceSettings,
    Contribution,
)
from protocol.errors import ProtocolError
from protocol.p2p.transport import BufferPool, Lease, Read, Transport
from protocol.wire import codec as codecs
from protocol.wire.messages import Header
from protocol.wire.partwire import Part, open_part, read_part
from verification.identity import Identity
from verification.rounds import RoundClock

__all__ = ["AllReduceContext", "Follow", "Follower", "part_weight"]

logger = logging.getLogger(__name__)


class Follower(Protocol):
    """What follows a part's body as it arrives (the owner's streamed reduction)."""

    def arrived(self, peer: str, nbytes: int) -> None:
        """The first ``nbytes`` of ``peer``'s body are in and checked."""

    def detach(self, peer: str) -> None:
        """``peer``'s body will not be read any further (refused, or its stream broke)."""


Follow = Callable[[Header, dict, str, memoryview], Follower | None]
"""``(header, meta, sender, body buffer) -> Follower | None``: who follows a part whose
head is checked and whose body is about to be read into ``body buffer``."""


def part_weight(meta: dict) -> int | None:
    """The token weight a part's meta claims, or None when it is not a non-negative int."""
    weight = meta.get("weight")
    if not isinstance(weight, int) or isinstance(weight, bool) or weight < 0:
        return None
    return weight


class AllReduceContext:
    """What the owner side, the member side and repair share for one node.

    Args:
        transport: the node's transport.
        identity: the node's key (signs every message).
        settings: encoding, limits and deadlines.
        hooks: the node's reducer, judge, commit phase and fault injection (each neutral
            by default, :class:`~protocol.averaging.hooks.Hooks`).
        clock: the node's round clock (parts far from its current round are refused);
            default: one of its own, which each exchange starts.

    Attributes:
        sent: where the member side keeps the parts it sent, for useful-work checks
            (:class:`~protocol.averaging.contributions.SentParts`); None keeps none.
    """

    def __init__(
        self,
        transport: Transport,
        identity: Identity,
        settings: AllReduceSettings,
        hooks: Hooks | None = None,
        clock: RoundClock | None = None,
    ) -> None:
        hooks = hooks if hooks is not None else Hooks()
        self.transport = transport
        self.identity = identity
        self.settings = settings
        self.reducer = hooks.reducer
        self.judge = hooks.judge
        self.faults = hooks.faults
        """How this node acts (tests swap in a faulty one)."""
        self.commitments = hooks.commitments
        self.sent: SentParts | None = None
        self.clock = clock if clock is not None else RoundClock()
        self.bytes_sent = 0
        self.bytes_received = 0
        self.rejected: dict[str, int] = {}
        """Refusals of peers' messages so far, by reason."""
        self.results_streamed = 0
        """Owners' results this node took as they were reduced (checked by their trailer)."""
        self.results_redone = 0
        """Of those, results whose owner gave its streamed blocks up (fetched again)."""
        self.pool = BufferPool()
        """Buffers large parts and results are received into, reused round after round."""
        # Bytes per all-reduce: two in flight at once (a fragment and its weight mix)
        # must not count each other's traffic.
        self._ledger: dict[AllReduceKey, list[int]] = {}
        self.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="atoll-parts")
        """Where hashing, decoding and reducing run, off the event loop (awaited as
        ``asyncio.wrap_future(worker.submit(fn, *args))``): the loop keeps reading streams
        meanwhile, and a single thread keeps the allocator's per-thread arenas (each
        holds on to a freed part) to one."""

    # ---- counters ---------------------------------------------------------------------

    def tally(
        self, at: AllReduceKey | None, sent: int = 0, received: int = 0, totals: bool = True
    ) -> None:
        """Count bytes: in this node's totals, and (``at`` given) against the all-reduce
        ``(round, fragment, content)``; ``totals=False`` charges the all-reduce only."""
        if totals:
            self.bytes_sent += sent
            self.bytes_received += received
        if at is None:
            return
        entry = self._ledger.setdefault(at, [0, 0])
        entry[0] += sent
        entry[1] += received

    def traffic(self, at: AllReduceKey) -> tuple[int, int]:
        """Bytes sent and received for the all-reduce ``(round, fragment, content)`` so far."""
        sent, received = self._ledger.get(at, (0, 0))
        return sent, received

    def forget_before(self, round_: int) -> None:
        """Drop the byte counts of rounds before ``round_``."""
        for old in [k for k in self._ledger if k[0] < round_]:
            del self._ledger[old]

    def reject(
        self,
        reason: str,
        detail: str,
        peer: str,
        round_: int | None = None,
        fragment: int | None = None,
    ) -> ProtocolError:
        """Count and report a refusal of ``peer``'s message; returns the error to raise."""
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        try:
            self.judge.on_refusal(peer, round_, fragment, reason)
        except Exception:  # bookkeeping must never change what the protocol answers
            logger.exception("judge failed on a refusal from %s", peer)
        return ProtocolError(reason, detail, peer)

    # ---- parts ------------------------------------------------------------------------

    def decode(self, part: Part, numel: int, peer: str) -> Contribution:
        """A member's signed part (or repair message) as a :class:`Contribution`; its
        vector is a view of the received bytes when the codec allows (no copy).

        Raises:
            ProtocolError: bad data (refused and reported) or a bad weight.
        """
        at = (part.header.round, part.header.fragment)
        try:
            enc = codecs.Encoded.from_meta(part.meta, part.body, max_numel=numel)
            self.check_codec(enc, str(part.meta.get("content")), result=False)
            # the norm is the finiteness check of raw values: screening gets it for free
            vector, norm = codecs.decode_with_norm(enc, expected_numel=numel, copy=False)
        except ProtocolError as exc:
            raise self.reject(exc.reason, exc.detail, peer, *at) from None
        weight = part_weight(part.meta)
        if weight is None:
            raise self.reject("malformed", "weight must be a non-negative integer", peer, *at)
        return Contribution(
            peer=peer,
            vector=vector,
            weight=float(min(weight, self.settings.max_tokens)),
            digest=part.digest,
            tokens=weight,
            norm=norm,
        )

    def encode(self, values: torch.Tensor, content: str, result: bool = False) -> codecs.Encoded:
        """``values`` in the codec of ``content`` (as a part, or as an owner's ``result``);
        a ``none`` payload is a view of ``values`` (keep them unchanged until the message
        is sent)."""
        return codecs.encode(values, **self.settings.wire_codec(content, result), copy=False)

    def check_codec(self, enc: codecs.Encoded, content: str, result: bool) -> None:
        """Refuse a sparse payload in other than the run's sparse codec, or a dense one
        where the run is sparse: a ``topk`` part keeping more than the run's ``k`` (or in
        more bits) would buy more than its share of the bytes and of the support.

        Raises:
            ProtocolError: ``wrong_codec``.
        """
        want = self.settings.wire_codec(content, result)
        sparse = want["codec"] in codecs.SPARSE or enc.codec in codecs.SPARSE
        if not sparse:
            return
        have = {"codec": enc.codec, "block_size": enc.block_size}
        if enc.codec == "topk":
            have.update(k=enc.k, bits=enc.bits)
        elif enc.codec == "sparse":
            have.update(bits=enc.bits)
        if have != want:
            raise ProtocolError(
                "wrong_codec",
                f"{enc.codec} (chunk {enc.block_size}, k {enc.k}, {enc.bits} bits) where "
                f"the run sends {want['codec']} (chunk {want['block_size']}, "
                f"k {want.get('k', 0)}, {want.get('bits', 0)} bits)",
            )

    def content_of(self, part: Part, peer: str) -> str:
        """What ``part`` says it averages (signed with it).

        Raises:
            ProtocolError: ``malformed`` (refused and reported) when it names none of
                :data:`~protocol.averaging.parts.CONTENTS`.
        """
        content = part.meta.get("content")
        if content not in CONTENTS:
            h = part.header
            raise self.reject("malformed", f"content {content!r}", peer, h.round, h.fragment)
        return str(content)

    async def open(self, data: bytes, peer: str, **checks: object) -> Part:
        """Open a part message from ``peer`` off the event loop (hashing a body takes
        milliseconds per megabyte; the loop keeps reading other streams meanwhile).

        Raises:
            ProtocolError: as :func:`~protocol.wire.partwire.open_part`.
        """
        opening = functools.partial(
            open_part,
            data,
            max_bytes=self.settings.max_message_bytes,
            expected_sender=peer,
            run_id=self.settings.run_id,
            **checks,  # type: ignore[arg-type]
        )
        return await asyncio.wrap_future(self.worker.submit(opening))

    async def read_message(
        self,
        read: Read,
        length: int,
        sender: str,
        kind: str,
        round_window: tuple[int, int],
        dest: torch.Tensor | None = None,
        trailer: Callable[[], Awaitable[bytes]] | None = None,
        follow: Follow | None = None,
    ) -> Lease:
        """A part or result as it arrives: refused on its head (signature, run, kind,
        round window) before any body byte is read, each chunk checked against its hash
        as it comes (for a result streamed back, against its trailer, read by
        ``trailer``). Raw float32 of ``dest``'s size goes straight into ``dest``; any other
        body into a pooled buffer, which goes back to the pool with the returned lease
        (whose data is the :class:`~protocol.wire.partwire.Part`). ``follow`` names who
        follows a pooled body as its checked chunks come in."""
        held: Lease | None = None
        followed: Follower | None = None

        def into(header: Header, meta: dict, size: int) -> memoryview:
            nonlocal held, followed
            if dest is not None and meta.get("c") == "none" and size == dest.numel() * 4:
                return memoryview(dest.numpy()).cast("B")
            held = self.pool.lease(size)
            if follow is not None:
                followed = follow(header, meta, sender, held.data)
            return held.data  # type: ignore[no-any-return]

        def progress(nbytes: int) -> None:
            if followed is not None:
                followed.arrived(sender, nbytes)

        try:
            part = await read_part(
                read,
                length,
                into,
                max_bytes=self.settings.max_message_bytes,
                expected_sender=sender,
                run_id=self.settings.run_id,
                kinds=(kind,),
                round_window=round_window,
                progress=progress,
                trailer=trailer,
            )
        except BaseException:
            if followed is not None:
                followed.detach(sender)  # before its buffer can be handed to anyone else
            if held is not None:
                held.release()
            raise
        # a pooled body goes back to the pool with the part
        return held.handed_to(part) if held is not None else Lease(part)
