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
* and the three hooks a node plugs in are in :mod:`protocol.averaging.hooks`.

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

from verification.means import weighted_mean
from verification.records import Contribution, Prefix, Reduction, StreamPlan

__all__ = [
    "CONTENTS",
    "AllReduceKey",
    "AllReduceResult",
    "AllReduceSettings",
    "Content",
    "Contribution",
    "PartPlan",
    "Planner",
    "Prefix",
    "Reducer",
    "Reduction",
    "StreamPlan",
    "part_bounds",
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
"""``(round, fragment, content)``: one all-reduce, as runners, repairs and byte counts
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
    :func:`verification.means.weighted_mean` of the contributions, in order."""
    peers = [c.peer for c in contributions]
    weights = [c.weight for c in contributions]
    vectors = [c.vector for c in contributions]
    done = None if prefix is None else prefix.complete(peers, weights, vectors)
    if done is not None:
        return Reduction(done, peers)
    return Reduction(weighted_mean(vectors, weights), peers)


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
