"""An owner's reduction started early, block by block while the parts arrive: which parts
it follows, and a result bitwise the one reduced once all are in."""

from __future__ import annotations

import asyncio
import time

import torch

from protocol.averaging.owner import open_part
from protocol.averaging.parts import AllReduceSettings, PartPlan, weighted_mean_plan
from protocol.wire import codec as codecs
from protocol.wire.messages import Header
from tests.unit.protocol.averaging._network import Network
from verification.identity import Identity

RUN = "early-test"
A, B = Identity.from_seed(b"A" * 32), Identity.from_seed(b"B" * 32)
GROUP = [A.peer_id, B.peer_id]
NUMEL = 4_096


def _vectors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {p: torch.randn(NUMEL, generator=g) for p in GROUP}


def _results(stream_reduce: bool) -> dict[str, torch.Tensor]:
    network = Network()
    for identity in (A, B):
        settings = AllReduceSettings(run_id=RUN, timeout=5, stream_reduce=stream_reduce)
        network.service(identity, settings)
    vectors = _vectors()

    async def main():
        runs = [
            network.services[p].run(1, 0, GROUP, vectors[p], i + 1) for i, p in enumerate(GROUP)
        ]
        return await asyncio.wait_for(asyncio.gather(*runs), 10)

    return {p: r.vector for p, r in zip(GROUP, asyncio.run(main()))}


def test_a_result_reduced_while_parts_arrive_is_bitwise_the_one_reduced_at_the_end() -> None:
    streamed, whole = _results(stream_reduce=True), _results(stream_reduce=False)
    for p in GROUP:
        assert torch.equal(streamed[p], whole[p])


def test_only_an_expected_members_part_for_this_owners_part_is_followed() -> None:
    network = Network()
    service = network.service(A, AllReduceSettings(run_id=RUN, timeout=5, stream_reduce=True))
    plan = PartPlan.of(A.peer_id, GROUP, None, NUMEL, 256)
    lo, hi = plan.bounds[0]
    enc = codecs.encode(torch.ones(hi - lo), "none")
    meta = {"content": "update", "weight": 2, **enc.meta()}

    def body() -> memoryview:
        return memoryview(bytearray(enc.payload))

    async def main() -> list[object]:
        runner = service.runners.open((1, 0, "update"))
        runner.join(plan, time.monotonic() + 5)
        owned = runner.owned = open_part(runner, torch.zeros(NUMEL), 1, weighted_mean_plan, None)
        early = owned.early
        assert early is not None
        mine = Header("part", RUN, 1, 0, 0, B.peer_id)
        seen = [
            early.follow(Header("part", RUN, 2, 0, 0, B.peer_id), meta, B.peer_id, body()),
            early.follow(Header("part", RUN, 1, 0, 1, B.peer_id), meta, B.peer_id, body()),
            early.follow(mine, meta, "12D3KooWstranger", body()),
            early.follow(mine, {**meta, "weight": -1}, B.peer_id, body()),
            early.follow(mine, meta, B.peer_id, body()) is early,
            early.weights,
        ]
        await asyncio.wait_for(early.stop(), 5)  # the reduction proper starts: streaming ends
        return seen

    assert asyncio.run(main()) == [None, None, None, None, True, {B.peer_id: 2.0}]
