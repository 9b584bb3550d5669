"""What the owner side, the member side and repair share: byte counts per exchange, one
place a part is decoded or refused, and every refusal counted and reported."""

from __future__ import annotations

import asyncio

import pytest
import torch

from protocol.averaging.context import AllReduceContext, part_weight
from protocol.averaging.hooks import Hooks, Judge
from protocol.averaging.parts import AllReduceSettings
from protocol.errors import ProtocolError
from protocol.wire.messages import Header
from protocol.wire.partwire import open_part, seal_part
from verification.identity import Identity

ME, PEER = Identity.from_seed(b"m" * 32), Identity.from_seed(b"p" * 32)


class _Judge(Judge):
    def __init__(self, fails: bool = False) -> None:
        self.refusals: list[tuple] = []
        self.fails = fails

    def on_refusal(self, peer, round_, fragment, reason) -> None:
        self.refusals.append((peer, round_, fragment, reason))
        if self.fails:
            raise RuntimeError("bookkeeping broke")


def _context(judge: Judge | None = None, **settings) -> AllReduceContext:
    s = AllReduceSettings(run_id="r", **settings)
    return AllReduceContext(None, ME, s, Hooks(judge=judge or _Judge()))  # type: ignore[arg-type]


def _part(values: torch.Tensor, meta: dict, codec: str = "none"):
    context = _context(codec=codec)
    enc = context.encode(values, "update")
    header = Header("part", "r", 1, 0, 0, PEER.peer_id)
    sealed = seal_part(PEER, header, {**meta, **enc.meta()}, enc.payload)
    return open_part(sealed.to_bytes(), max_bytes=1 << 20)


def test_a_weight_is_a_non_negative_integer_or_nothing() -> None:
    assert part_weight({"weight": 5}) == 5 and part_weight({"weight": 0}) == 0
    for bad in ({}, {"weight": -1}, {"weight": 1.5}, {"weight": True}, {"weight": "5"}):
        assert part_weight(bad) is None


def test_bytes_are_counted_per_exchange_and_in_total() -> None:
    context = _context()
    context.tally((1, 0, "update"), sent=10, received=4)
    context.tally((1, 0, "weights"), sent=1)
    context.tally((2, 0, "update"), received=7, totals=False)
    context.tally(None, sent=100)
    assert (context.bytes_sent, context.bytes_received) == (111, 4)
    assert context.traffic((1, 0, "update")) == (10, 4)
    assert context.traffic((2, 0, "update")) == (0, 7)
    context.forget_before(2)
    assert context.traffic((1, 0, "update")) == (0, 0)
    assert context.traffic((2, 0, "update")) == (0, 7)


def test_a_refusal_is_counted_and_reported_even_when_the_judge_fails() -> None:
    judge = _Judge(fails=True)
    context = _context(judge)
    error = context.reject("late", "after the deadline", PEER.peer_id, 3, 1)
    assert isinstance(error, ProtocolError) and error.reason == "late"
    assert context.rejected == {"late": 1}
    assert judge.refusals == [(PEER.peer_id, 3, 1, "late")]


def test_a_part_is_decoded_with_its_weight_capped_and_its_norm() -> None:
    values = torch.tensor([3.0, 4.0, 0.0, 0.0])
    context = _context(max_tokens=100)
    part = _part(values, {"content": "update", "weight": 1000})
    contribution = context.decode(part, 4, PEER.peer_id)
    assert torch.equal(contribution.vector, values) and contribution.norm == pytest.approx(5.0)
    assert contribution.weight == 100.0 and contribution.tokens == 1000
    assert contribution.digest == part.digest and context.content_of(part, PEER.peer_id) == "update"


def test_bad_parts_are_refused_and_reported() -> None:
    judge = _Judge()
    context = _context(judge)
    with pytest.raises(ProtocolError, match="weight"):
        context.decode(_part(torch.ones(4), {"weight": -3}), 4, PEER.peer_id)
    with pytest.raises(ProtocolError):
        context.decode(_part(torch.ones(4), {"weight": 1}), 8, PEER.peer_id)  # wrong size
    with pytest.raises(ProtocolError, match="content"):
        context.content_of(_part(torch.ones(4), {"content": "gradients"}), PEER.peer_id)
    assert sum(context.rejected.values()) == 3 and len(judge.refusals) == 3


def test_raw_float32_is_read_straight_into_the_destination() -> None:
    values = torch.arange(8, dtype=torch.float32)
    header = Header("reduced", "r", 1, 0, 0, PEER.peer_id)
    wire = seal_part(PEER, header, {"c": "none"}, values.numpy().tobytes()).to_bytes()
    dest = torch.zeros(8)

    async def main():
        context = _context()
        reader = asyncio.StreamReader()
        reader.feed_data(wire)
        reader.feed_eof()
        lease = await context.read_message(
            reader.read, len(wire), PEER.peer_id, "reduced", (1, 1), dest
        )
        return lease, context.pool.allocated

    lease, allocated = asyncio.run(main())
    assert torch.equal(dest, values) and allocated == 0  # no pooled buffer was taken
    assert lease.data.header == header
