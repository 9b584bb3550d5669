"""What an all-reduce exchanges, and the hooks the node plugs into it.

Shared by the butterfly all-reduce (:mod:`protocol.averaging.allreduce`: its owner and
member sides) and the repair of a part whose owner failed (:mod:`protocol.averaging.repair`):

* settings and plain records: :class:`AllReduceSettings`, :class:`AllReduceResult`,
  and the verification layer's :class:`~verification.records.Contribution` and
  :class:`~verification.records.Reduction` (re-exported);
* what an all-reduce averages (:data:`Content`: members' updates, or their global
  copies when groups mix weights) and how one is named (:data:`AllReduceKey`);
* how a fragment is cut: :func:`part_bounds` and :class:`PartPlan` (which members
  own which part; clients own none);
* the default reducer, a token-weighted mean (:func:`weighted_mean_reducer`, and its
  :data:`Planner` for reducing while parts arrive);
* the three hooks a node plugs in: :class:`Judge` (trust decisions),
  :class:`Commitments` (the commit phase) and :class:`FaultInjection` (tests only:
  it transforms what the honest code signs and commits, :func:`seal_with`).

What the sides of one node's all-reduce share at run time (transport, key, counters,
the one place a part is decoded or refused) is
:class:`~protocol.averaging.context.AllReduceContext`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch

from protocol.wire import codec as codecs
from protocol.wire.messages import Header
from protocol.wire.partwire import SealedPart, seal_part
from verification.aggregators import weighted_mean
from verification.identity import Identity
from verification.records import Contribution, Prefix, Reduction, StreamPlan

__all__ = [
    "CONTENTS",
    "AllReduceKey",
    "AllReduceResult",
    "AllReduceSettings",
    "Commitments",
    "Content",
    "Contribution",
    "FaultInjection",
    "Judge",
    "PartPlan",
    "Planner",
    "Prefix",
    "Reducer",
    "Reduction",
    "StreamPlan",
    "part_bounds",
    "seal_for",
    "seal_with",
    "weighted_mean_plan",
    "weighted_mean_reducer",
]

Content = Literal["update", "weights"]
"""What an exchange of a fragment averages: ``update``, the members' pseudo-gradients
(weighted by tokens); ``weights``, their global copies (weighted alike), which groups
that do not span the swarm also average. Both exchanges of a fragment run side by side
in a round; every part, result, repair and commitment names its content (signed), and
each has its own sessions, commitments and screening history."""
CONTENTS: tuple[str, ...] = get_args(Content)

RESULT_BITS = 8
"""Bits per value of an owner's ``sparse`` result of ``topk`` parts."""

AllReduceKey = tuple[int, int, str]
"""``(round, fragment, content)``: one all-reduce, as sessions, repairs and byte counts
are keyed (a fragment's exchange in a round that mixes runs two: ``update`` and
``weights``)."""


@dataclass(frozen=True)
class AllReduceSettings:
    """How parts are encoded, bounded and waited for."""

    run_id: str
    codec: str = "none"
    block_size: int = 256
    """Values per scale (per chunk for ``topk``); parts start on its multiples."""
    topk_k: int = 0
    """With codec ``topk``: values every chunk of a part keeps."""
    topk_bits: int = 0
    """With codec ``topk``: bits per kept value of a part."""
    timeout: float = 30.0
    max_tokens: int = 10**9
    max_message_bytes: int = 256 * 2**20
    round_window: int = 2
    fragments: int = 1024
    repair: bool = True
    weights_codec: str | None = None
    """The codec of ``weights`` exchanges (e.g. fp16 global copies beside int8
    pseudo-gradients); None: ``codec``."""
    stream_reduce: bool = False
    """An owner reduces block by block while the parts arrive, when its reducer has a
    :data:`Planner` (:mod:`protocol.averaging.streaming`), and sends a raw float32
    result back as it is reduced (:mod:`protocol.averaging.streamback`); False: once
    they are all in."""
    gather: bool = False
    """``update`` exchanges all-gather (``sync.exchange = "gather"``): every member
    sends its whole part to every other member and reduces the group's parts itself,
    so no owner answers with a result (:class:`PartPlan`); groups with a client, and
    ``weights`` exchanges, reduce by owner as ever."""

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.timeout <= 0 or self.fragments < 1:
            raise ValueError("block_size, timeout and fragments must be positive")

    def codec_for(self, content: str) -> str:
        """The codec this node encodes parts and results of ``content`` with (a ``topk``
        part's result: ``sparse``)."""
        if content == "weights" and self.weights_codec is not None:
            return self.weights_codec
        return self.codec

    def wire_codec(self, content: str, result: bool) -> dict[str, Any]:
        """``codec`` and its arguments for :func:`protocol.wire.codec.encode`: a part of
        ``content``, or (``result``) an owner's reduction of such parts. ``topk`` parts
        reduce to the union of their kept values, sent as ``sparse`` in 8 bits."""
        codec = self.codec_for(content)
        if codec != "topk":
            return {"codec": codec, "block_size": self.block_size}
        if result:
            return {"codec": "sparse", "block_size": self.block_size, "bits": RESULT_BITS}
        return {
            "codec": "topk",
            "block_size": self.block_size,
            "k": self.topk_k,
            "bits": self.topk_bits,
        }


Reducer = Callable[..., Reduction]
"""``(round, fragment, part, contributions, *, shared=False, content="update",
prefix=None) -> Reduction`` on the part's owner. ``shared=True`` (repair, where every
member reduces the same inputs itself) asks for a reduction that depends on the inputs
alone, so members agree bitwise; ``content`` says what the contributions are
(:data:`Content`); ``prefix`` is what the owner reduced while the parts arrived, by the
reducer's :data:`Planner` (:class:`~verification.records.Prefix`); ``gathered=True`` (with
``shared``: a gather, where every member reduces the group's parts) refuses a member only
for the operator's lists (:meth:`Judge.listed`)."""

Planner = Callable[[int, Sequence[tuple[str, float]], str], StreamPlan | None]
"""``(round, [(peer, weight), ...], content) -> StreamPlan | None``: how the owner may
reduce block by block while the parts arrive, for the reducer it goes with."""


def weighted_mean_plan(
    round_: int, members: Sequence[tuple[str, float]], content: str = "update"
) -> StreamPlan | None:
    """:data:`Planner` of :func:`weighted_mean_reducer` (every member, its weight)."""
    if not members:
        return None
    weights = tuple(float(w) for _, w in members)
    return StreamPlan(
        tuple(p for p, _ in members),
        weights,
        functools.partial(weighted_mean, weights=weights),
    )


def weighted_mean_reducer(
    round_: int,
    fragment: int,
    part: int,
    contributions: Sequence[Contribution],
    shared: bool = False,
    content: str = "update",
    prefix: Prefix | None = None,
    gathered: bool = False,
) -> Reduction:
    """Token-weighted mean (plain mean when every weight is zero):
    :func:`verification.aggregators.weighted_mean` of the contributions, in order."""
    peers = [c.peer for c in contributions]
    weights = [c.weight for c in contributions]
    vectors = [c.vector for c in contributions]
    done = None if prefix is None else prefix.complete(peers, weights, vectors)
    if done is not None:
        return Reduction(done, peers)
    return Reduction(weighted_mean(vectors, weights), peers)


class Judge:
    """The trust decisions an all-reduce asks for; the default accepts everything.

    The node's :class:`~verification.verifier.Verifier` has its shape (the all-reduce
    calls it directly, as it calls the reducer on plain records): who is refused, what a
    refusal costs the peer, and whether an owner's result is plausible.
    """

    def refusal(self, peer: str, round_: int) -> str | None:
        """Why this node, as an owner, leaves ``peer``'s part out of its result at
        ``round_``; None admits it. The part is still taken and the result still
        returned to the peer, so every member of a part gets the one result."""
        return None

    def listed(self, peer: str, round_: int) -> str | None:
        """Why the operator's lists refuse ``peer``: all a gather refuses a member for
        (its members must reduce the same parts; standing acts through votes)."""
        return None

    def blocks(self, peer: str, round_: int) -> str | None:
        """Why this node does not deal with ``peer`` at all (refuses its messages and
        its results): the operator's own lists, or proof of misbehaviour; None talks."""
        return None

    def on_refusal(self, peer: str, round_: int | None, fragment: int | None, reason: str) -> None:
        """A message from the authenticated ``peer`` was refused before aggregation."""

    def on_missing(self, peer: str, round_: int, fragment: int, part: int, committed: bool) -> None:
        """``peer``'s part never reached this owner by its deadline (``committed``: after
        the peer signed a commitment to send it)."""

    def on_owner_refused(
        self, owner: str, round_: int, fragment: int, part: int, reason: str
    ) -> None:
        """This node refused ``owner``'s reduced part (it keeps its own values there)."""

    def check_reduced(
        self,
        owner: str,
        round_: int,
        fragment: int,
        part: int,
        reduced: torch.Tensor,
        own: torch.Tensor,
        spread: float = 1.0,
        included: bool = True,
        reduced_norm: float | None = None,
        content: str = "update",
    ) -> str | None:
        """Judge a reduced part against this node's own contribution; a reason refuses it.
        ``included`` is False when the owner left this node's part out (with a reason);
        ``reduced_norm`` is the result's norm when decoding computed it; ``content`` says
        what was averaged.

        ``spread`` is the largest contributor weight over this node's own (at least 1):
        a node that trained less than its peers sees a larger average than its own.
        """
        return None


class Commitments:
    """The commit phase of an exchange; a service without one skips it.

    Before sending any part, a member publishes the digests of its signed parts for
    ``(round, fragment, content)`` and waits (bounded) for its group's commitments. An
    owner takes a part only if its sender committed to exactly that digest before the
    owner's own commit phase closed, so no member can shape its part after seeing
    the others'.
    """

    async def commit(
        self,
        round_: int,
        fragment: int,
        group: Sequence[str],
        digests: dict[int, bytes],
        content: str = "update",
    ) -> None:
        """Publish this node's commitment and wait for the group's (bounded)."""

    async def check(
        self,
        peer: str,
        round_: int,
        fragment: int,
        part: int,
        digest: bytes,
        closed_at: float,
        content: str = "update",
    ) -> str | None:
        """Why ``peer``'s part is refused: ``uncommitted``, ``late_commit`` or
        ``commit_mismatch`` (None: committed in time). ``closed_at`` is this owner's
        ``time.monotonic()`` when its commit phase closed."""
        return None

    def committed(self, peer: str, round_: int, fragment: int, content: str = "update") -> bool:
        """Whether ``peer`` signed a commitment for ``(round, fragment, content)``: a
        member that committed and then delivered nothing broke a promise it signed."""
        return False

    def evidence(self, peer: str, round_: int, fragment: int, content: str = "update") -> bytes:
        """``peer``'s signed commitment for ``(round, fragment, content)`` as this node
        holds it (empty when none). An owner puts its contributors' commitments into its
        signed result: what it relied on, so a contributor that signed another
        commitment cannot pass it off as proof that the owner misstated its input."""
        return b""

    def check_result(
        self,
        owner: str,
        round_: int,
        fragment: int,
        part: int,
        reply: bytes,
        contributors: Sequence[str],
        digests: Sequence[bytes],
        content: str = "update",
    ) -> str | None:
        """Why an owner's signed result is refused: ``bad_owner`` when it names, for a
        contributor, a digest other than the one that contributor committed to."""
        return None


class FaultInjection:
    """How this node acts in an all-reduce: honestly, unless a fault is injected.

    ``atoll run --byzantine MODE`` (tests and benchmarks) overrides these hooks. Each one
    only transforms what the honest code hands it and returns it unchanged by default:
    the member signs its parts (:func:`seal_with`) and commits to their digests itself,
    and the owner signs its result itself.
    """

    def contribution(self, round_: int, fragment: int, vector: torch.Tensor) -> torch.Tensor:
        return vector

    def part(self, meta: dict, encoded: codecs.Encoded) -> tuple[dict, codecs.Encoded]:
        """A part's fields and values before they are signed."""
        return meta, encoded

    def sealed(self, header: Header, meta: dict, sealed: SealedPart) -> SealedPart:
        """A signed part as it goes on the wire."""
        return sealed

    def sent_to(self, j: int, header: Header, meta: dict) -> dict:
        """In a gather, the fields of the one part as signed for member ``j`` (the same
        ``meta`` object: the one part everyone gets)."""
        return meta

    commit_delay: float = 0.0
    """Seconds to wait before committing."""

    def commits(
        self, group: Sequence[str], digests: dict[int, bytes]
    ) -> list[tuple[Sequence[str], dict[int, bytes]]]:
        """The commitments made, in order, as ``(group waited for, digests)``."""
        return [(group, digests)]

    def reduced_meta(self, meta: dict) -> dict:
        return meta

    def reduced(self, vector: torch.Tensor) -> torch.Tensor:
        return vector

    def reply(self, sealed: SealedPart) -> SealedPart:
        """The signed result as it goes on the wire."""
        return sealed

    def trailer(self, frame: bytes) -> bytes:
        """The trailer of a result streamed back, as it goes on the wire."""
        return frame

    silent: bool = False
    """Announce and commit, then send no part and answer no one (a silent member)."""

    def silent_in(self, round_: int, fragment: int) -> bool:
        """Whether to go quiet in the exchange of ``round_`` and ``fragment``."""
        return self.silent

    stream_results: bool = True
    """As an owner, stream its result back while reducing (when settings allow it)."""


def seal_with(
    faults: FaultInjection,
    identity: Identity,
    header: Header,
    meta: dict,
    encoded: codecs.Encoded,
) -> SealedPart:
    """The signed part this node sends: ``faults`` may change its fields and values
    before signing and the signed message after."""
    meta, encoded = faults.part(meta, encoded)
    sealed = seal_part(identity, header, {**meta, **encoded.meta()}, encoded.payload)
    return faults.sealed(header, meta, sealed)


def seal_for(
    faults: FaultInjection,
    identity: Identity,
    j: int,
    part: SealedPart,
    header: Header,
    meta: dict,
    encoded: codecs.Encoded,
) -> SealedPart:
    """In a gather, the one signed ``part`` (made by :func:`seal_with` from ``header``,
    ``meta`` and ``encoded``) as member ``j`` gets it: itself, unless ``faults`` signs
    member ``j`` other fields."""
    fields = faults.sent_to(j, header, meta)
    if fields is meta:
        return part
    return seal_part(identity, header, {**fields, **encoded.meta()}, encoded.payload)


def part_bounds(numel: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` ranges, near-equal and aligned to ``align`` elements.

    Aligning part edges to the codec's block size means a part is encoded with the
    same blocks as the whole vector would be.
    """
    if parts < 1:
        raise ValueError("parts must be >= 1")
    blocks = -(-numel // align)
    base, extra = divmod(blocks, parts)
    out, start = [], 0
    for p in range(parts):
        size = (base + (1 if p < extra else 0)) * align
        end = min(numel, start + size)
        out.append((start, end))
        start = end
    return out


@dataclass
class AllReduceResult:
    """What one all-reduce produced, and exactly whose values are in it."""

    vector: torch.Tensor
    group: list[str]
    contributors: list[list[str]]
    fallback_parts: list[int]
    repaired_parts: list[int] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    owners: list[str] = field(default_factory=list)
    """Members that owned a part (the group, less its clients)."""
    reduce_seconds: float = 0.0
    """As an owner: from its part's last contribution in (or the deadline) to its signed
    result: reducing, encoding, hashing and signing, the time between the exchange's two
    transfers on this node."""
    streamed_share: float = 0.0
    """As an owner: the share of its part reduced while the parts were still arriving
    and kept in the result (0 when the reduction started over or did not stream)."""

    @property
    def complete(self) -> bool:
        """True when every part holds every group member's contribution."""
        return (
            not self.fallback_parts
            and not self.repaired_parts
            and all(sorted(c) == sorted(self.group) for c in self.contributors)
        )

    @property
    def peers_in(self) -> set[str]:
        return {p for part in self.contributors for p in part}


@dataclass(frozen=True)
class PartPlan:
    """Who owns which part of one exchange, as every member computes it.

    Attributes:
        group: every member, in group order.
        owners: the members that own a part, in group order (clients own none).
        index: this node's part, or -1 when it is a client.
        bounds: ``[start, end)`` of each owner's part.
        gather: every member sends its whole vector to every other member and reduces
            all of them itself (``bounds`` is then the whole vector for each member).
    """

    group: list[str]
    owners: list[str]
    index: int
    bounds: list[tuple[int, int]]
    gather: bool = False

    @classmethod
    def of(
        cls,
        me: str,
        group: Sequence[str],
        owners: Sequence[str] | None,
        numel: int,
        align: int,
        gather: bool = False,
    ) -> PartPlan:
        """The plan for ``me`` in ``group``; ``owners`` defaults to the whole group.
        ``gather`` all-gathers where every member is an owner (a client cannot be
        called, so a group with one reduces by owner).

        Raises:
            ValueError: ``me`` is not in ``group``, an owner is not, or no one owns a part.
        """
        group = list(group)
        owners = list(group if owners is None else owners)
        if me not in group:
            raise ValueError("this node is not in the group")
        if not owners or not set(owners) <= set(group):
            raise ValueError("owners must be a non-empty subset of the group")
        index = owners.index(me) if me in owners else -1
        if gather and len(group) > 1 and owners == group:
            return cls(group, owners, index, [(0, numel)] * len(owners), gather=True)
        return cls(group, owners, index, part_bounds(numel, len(owners), align))

    @property
    def is_owner(self) -> bool:
        return self.index >= 0
