"""The member side of an all-reduce between in-memory services: an owner that cannot be
reached or whose result is refused costs only its part, and an owner that sees another
group ends the wait for parts that will not come."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from protocol.averaging.hooks import FaultInjection, Judge
from protocol.averaging.parts import AllReduceSettings, PartPlan
from protocol.errors import ProtocolError
from protocol.wire.partwire import SealedPart
from tests.unit.protocol.averaging._network import Network, mean_of
from verification.identity import Identity

RUN = "member-test"
A, B = Identity.from_seed(b"a" * 32), Identity.from_seed(b"b" * 32)
NUMEL = 1_000


class _Records(Judge):
    def __init__(self) -> None:
        self.owners_refused: list[tuple[str, str]] = []

    def on_owner_refused(self, owner: str, round_: int, fragment: int, part: int, reason: str):
        self.owners_refused.append((owner, reason))


class _CorruptReply(FaultInjection):
    """An owner whose signed result has one body byte changed on the way out."""

    def reply(self, sealed: SealedPart) -> SealedPart:
        body = bytearray(sealed.body)
        body[0] ^= 0x01
        return SealedPart(sealed.head, sealed.signature, memoryview(body), sealed.digest)


def _pair(network: Network, groups: dict[str, list[str]], vectors: dict[str, torch.Tensor]):
    async def main():
        runs = [network.services[p].run(1, 0, groups[p], vectors[p], 1) for p in groups]
        return await asyncio.wait_for(asyncio.gather(*runs), 10)

    return dict(zip(groups, asyncio.run(main())))


def test_two_members_end_with_the_same_mean() -> None:
    network = Network()
    for identity in (A, B):
        network.service(identity, AllReduceSettings(run_id=RUN, codec="int8", timeout=5))
    group = [A.peer_id, B.peer_id]
    vectors = {A.peer_id: torch.ones(NUMEL), B.peer_id: torch.full((NUMEL,), 3.0)}
    results = _pair(network, {p: group for p in group}, vectors)
    for result in results.values():
        assert result.complete and result.bytes_sent > 0 and result.bytes_received > 0
        torch.testing.assert_close(result.vector, mean_of(list(vectors.values()), [1, 1]))
    assert torch.equal(results[A.peer_id].vector, results[B.peer_id].vector)


def test_an_owner_that_cannot_be_reached_costs_only_its_part() -> None:
    network = Network()
    member = network.service(A, AllReduceSettings(run_id=RUN, timeout=0.6))
    network.down.add(B.peer_id)
    vector = torch.arange(NUMEL, dtype=torch.float32)
    result = asyncio.run(member.run(1, 0, [A.peer_id, B.peer_id], vector, 1))
    assert result.fallback_parts == [1] and not result.complete
    assert result.contributors == [[A.peer_id], [A.peer_id]]
    assert torch.equal(result.vector, vector)  # its own values where the owner failed


def test_a_result_refused_as_it_arrives_is_reported_and_costs_only_its_part() -> None:
    network = Network()
    judge = _Records()
    network.service(A, AllReduceSettings(run_id=RUN, timeout=5), judge=judge)
    network.service(B, AllReduceSettings(run_id=RUN, timeout=5), faults=_CorruptReply())
    group = [A.peer_id, B.peer_id]
    vectors = {A.peer_id: torch.ones(NUMEL), B.peer_id: torch.full((NUMEL,), 3.0)}
    results = _pair(network, {p: group for p in group}, vectors)
    a = results[A.peer_id]
    assert a.fallback_parts == [1] and judge.owners_refused == [(B.peer_id, "bad_chunk")]
    (_, cut), (_, end) = PartPlan.of(A.peer_id, group, None, NUMEL, 256).bounds
    assert torch.equal(a.vector[cut:end], vectors[A.peer_id][cut:])  # B's part: its own values
    assert torch.equal(a.vector[:cut], torch.full((cut,), 2.0))  # its own part: the mean


def test_owners_that_see_another_group_end_the_wait_at_once() -> None:
    network = Network()
    for identity in (A, B):
        network.service(identity, AllReduceSettings(run_id=RUN, timeout=4))
    groups = {A.peer_id: [A.peer_id, B.peer_id], B.peer_id: [B.peer_id, A.peer_id]}
    vectors = {p: torch.ones(NUMEL) for p in groups}
    results = _pair(network, groups, vectors)
    for result in results.values():
        assert result.fallback_parts == [1]
        assert result.seconds < 1.5  # not the 2 s an owner waits for a part
    assert network.services[A.peer_id].context.rejected == {"group_mismatch": 1}


def test_an_unknown_content_is_refused_before_anything_is_sent() -> None:
    network = Network()
    member = network.service(A, AllReduceSettings(run_id=RUN, timeout=1))
    with pytest.raises(ValueError):
        asyncio.run(
            member.run(1, 0, [A.peer_id, B.peer_id], torch.ones(10), 1, content="gradients")
        )
    assert network.calls == []


class _Cutting:
    """An owner's side of the wire that says ``redo`` to the part, then cuts the stream
    of the first ``cuts`` fetches of the signed result."""

    def __init__(self, cuts: int) -> None:
        self.cuts = cuts
        self.calls: list[str] = []

    @property
    def caller(self) -> _Cutting:
        return self

    async def call_into(self, peer, name, data, *, timeout, receive=None):
        self.calls.append(name)
        if name == "atoll.part":
            raise ProtocolError("redo", "the streamed blocks were given up", peer)
        if self.cuts:
            self.cuts -= 1
            raise ProtocolError("connection_lost", "IncompleteReadError", peer)
        return "the signed result"


def _call_owner(cuts: int) -> tuple[object, _Cutting, int]:
    from protocol.averaging.context import AllReduceContext
    from protocol.averaging.member import MemberRun
    from protocol.averaging.runner import ExchangeRunner

    wire = _Cutting(cuts)
    context = AllReduceContext(wire, A, AllReduceSettings(run_id=RUN, timeout=5))  # type: ignore[arg-type]
    runner = ExchangeRunner((1, 0, "update"), context)
    runner.join(PartPlan.of(A.peer_id, [A.peer_id, B.peer_id], None, 8, 1), time.monotonic() + 5)
    vector = torch.zeros(8)
    member = MemberRun(runner, None, vector, 1, torch.empty(8), {})  # type: ignore[arg-type]
    part = SealedPart(b"h", b"s" * 64, memoryview(b"body"), b"d" * 32)

    async def main() -> object:
        try:
            return await member._call_owner(B.peer_id, part, runner.key, 1, runner.done_by, vector)
        except ProtocolError as exc:
            return exc.reason

    return asyncio.run(main()), wire, context.results_redone


def test_a_cut_fetch_of_the_signed_result_after_a_redo_is_tried_again_once() -> None:
    """Under load the stream of the fetch that follows a ``redo`` was cut now and then,
    and with no second try the member lost the part (it kept its own values)."""
    taken, wire, redone = _call_owner(cuts=1)
    assert taken == "the signed result" and redone == 1
    assert wire.calls == ["atoll.part", "atoll.result", "atoll.result"]
    lost, wire, _ = _call_owner(cuts=2)
    assert lost == "connection_lost"
    assert wire.calls == ["atoll.part", "atoll.result", "atoll.result"]
