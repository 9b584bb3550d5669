"""The owner side of an all-reduce between in-memory services: every member's part
reduced into one signed result each member gets, and parts refused before their values
are looked at."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import torch

from protocol.averaging.hooks import Judge
from protocol.averaging.parts import AllReduceSettings
from protocol.errors import ProtocolError
from protocol.wire.messages import Header
from protocol.wire.partwire import open_part, seal_part
from tests.unit.protocol.averaging._network import Network, mean_of
from verification.identity import Identity

RUN = "owner-test"
A, B, C = (Identity.from_seed(bytes([i]) * 32) for i in (1, 2, 3))
GROUP = [A.peer_id, B.peer_id, C.peer_id]
WEIGHTS = {A.peer_id: 1, B.peer_id: 2, C.peer_id: 3}
NUMEL = 1_000


class _Refuses(Judge):
    """Leaves ``peer``'s parts out of this owner's result (its policy refuses it)."""

    def __init__(self, peer: str) -> None:
        self.peer = peer

    def refusal(self, peer: str, round_: int) -> str | None:
        return "low_reputation" if peer == self.peer else None


def _vectors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {p: torch.randn(NUMEL, generator=g) for p in GROUP}


def _run_all(network: Network, vectors: dict[str, torch.Tensor]):
    async def main():
        runs = [network.services[p].run(1, 0, GROUP, vectors[p], WEIGHTS[p]) for p in GROUP]
        return await asyncio.wait_for(asyncio.gather(*runs), 10)

    return dict(zip(GROUP, asyncio.run(main())))


def test_each_owner_reduces_its_part_from_every_member() -> None:
    network = Network()
    for identity in (A, B, C):
        network.service(identity, AllReduceSettings(run_id=RUN, timeout=5))
    vectors = _vectors()
    results = _run_all(network, vectors)
    expected = mean_of([vectors[p] for p in GROUP], [WEIGHTS[p] for p in GROUP])
    for result in results.values():
        assert result.complete and result.owners == GROUP
        torch.testing.assert_close(result.vector, expected, rtol=0, atol=1e-6)
        assert torch.equal(result.vector, results[A.peer_id].vector)  # one result per part


def test_an_owner_does_not_wait_for_a_member_its_policy_refuses() -> None:
    network = Network()
    settings = AllReduceSettings(run_id=RUN, timeout=4)
    owner = network.service(A, settings, judge=_Refuses(C.peer_id))
    network.down.add(C.peer_id)  # C never sends its part

    async def main():
        return await owner.run(1, 0, [A.peer_id, C.peer_id], torch.ones(NUMEL), 1)

    result = asyncio.run(main())
    assert result.contributors[0] == [A.peer_id] and result.fallback_parts == [1]
    assert result.seconds < 1.0  # not the 2 s an owner waits for an expected part


def _part_from(sender: Identity, fragment: int = 0, round_: int = 1) -> object:
    header = Header("part", RUN, round_, fragment, 0, sender.peer_id)
    meta = {"content": "update", "group": GROUP, "owners": GROUP, "weight": 1, "c": "none"}
    sealed = seal_part(sender, header, meta, bytes(4 * 10))
    return open_part(sealed.to_bytes(), max_bytes=1 << 20)


class _Blocks(Judge):
    def blocks(self, peer: str, round_: int) -> str | None:
        return "denied" if peer == C.peer_id else None


def test_parts_are_refused_on_their_header_before_any_wait() -> None:
    network = Network()
    settings = AllReduceSettings(run_id=RUN, timeout=5, fragments=1)
    owner = network.service(A, settings, judge=_Blocks())

    def reason(part, peer: str) -> str:
        with pytest.raises(ProtocolError) as info:
            asyncio.run(asyncio.wait_for(owner.handle_part(peer, part), 1))
        return info.value.reason

    assert reason(_part_from(C), C.peer_id) == "denied"
    assert reason(_part_from(B, fragment=3), B.peer_id) == "wrong_part"
    assert owner.context.rejected == {"denied": 1, "wrong_part": 1}


def test_a_part_for_a_round_this_node_never_joins_is_refused_at_its_timeout() -> None:
    owner = Network().service(A, AllReduceSettings(run_id=RUN, timeout=0.2))
    with pytest.raises(ProtocolError) as info:
        asyncio.run(owner.handle_part(B.peer_id, _part_from(B)))
    assert info.value.reason == "not_in_round" and owner.context.rejected == {"not_in_round": 1}


def test_a_result_is_fetched_only_by_a_member_of_a_known_exchange() -> None:
    owner = Network().service(A, AllReduceSettings(run_id=RUN, timeout=5))

    def reason(data: bytes) -> str:
        with pytest.raises(ProtocolError) as info:
            asyncio.run(owner.handle_result(B.peer_id, data))
        return info.value.reason

    assert reason(b"\xc1") == "malformed"
    assert reason(msgpack.packb([1, 0, "update"])) == "not_in_round"


def test_a_gather_acknowledgement_says_whether_the_part_was_taken() -> None:
    from protocol.averaging.gather import gather_ack, read_gather_ack

    assert read_gather_ack(gather_ack(), "p") == ""
    assert read_gather_ack(gather_ack("late"), "p") == "late"
    for bad in (b"", b"\xc1", msgpack.packb([1]), msgpack.packb({"taken": 1}), bytes(300)):
        with pytest.raises(ProtocolError) as err:
            read_gather_ack(bad, "p")
        assert err.value.reason == "malformed"
