"""Repair of a part whose owner failed, between real repair endpoints, without a network.

Every member is a real :class:`PartRepair` on a real all-reduce context (signing,
decoding, refusals); only the transport is replaced by in-memory calls that run the
callee's registered handler, and report its refusals as the real transport does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import torch

from protocol.averaging.context import AllReduceContext
from protocol.averaging.hooks import Hooks, Judge
from protocol.averaging.parts import AllReduceSettings, weighted_mean_reducer
from protocol.averaging.repair import REPAIR_RPC, PartRepair
from protocol.errors import ProtocolError
from protocol.wire import codec as codecs
from protocol.wire.messages import Header
from protocol.wire.partwire import seal_part
from verification.identity import Identity
from verification.means import weighted_mean

RUN = "repair-test"
ROUND, FRAGMENT, PART = 1, 0, 0
KEY = (ROUND, FRAGMENT, "update")
NUMEL = 1_000
OWNER, A, B, C = (Identity.from_seed(bytes([i]) * 32) for i in range(1, 5))
GROUP = [OWNER.peer_id, A.peer_id, B.peer_id, C.peer_id]
WEIGHTS = {A.peer_id: 1, B.peer_id: 2, C.peer_id: 3}


class _Network:
    """Which member answers calls, and who is down."""

    def __init__(self) -> None:
        self.transports: dict[str, _Transport] = {}
        self.down: set[str] = set()


class _Transport:
    """What repair uses of a Transport: handlers, and calls that run the callee's."""

    def __init__(self, network: _Network, peer_id: str) -> None:
        self.network = network
        self.peer_id = peer_id
        self.handlers: dict[str, object] = {}
        network.transports[peer_id] = self

    def add_handler(self, name: str, handler: object, **_: object) -> None:
        self.handlers[name] = handler

    def remove_handler(self, name: str) -> None:
        self.handlers.pop(name, None)

    async def call(
        self, peer: str, name: str, data: Sequence[bytes | memoryview], timeout: float
    ) -> bytes:
        callee = self.network.transports.get(peer)
        if peer in self.network.down or callee is None:
            raise ProtocolError("unreachable", "no route to the peer", peer)
        payload = b"".join(bytes(b) for b in data)
        try:
            reply = await asyncio.wait_for(callee.handlers[name](self.peer_id, payload), timeout)
        except ProtocolError as exc:  # as the real transport reports a remote refusal
            raise ProtocolError("remote_error", f"{exc.reason}: {exc.detail}", peer) from None
        return b"".join(bytes(b) for b in reply)


class _Blocking(Judge):
    def __init__(self, blocked: str) -> None:
        self.blocked = blocked
        self.refusals: list[tuple[str, str]] = []

    def blocks(self, peer: str, round_: int) -> str | None:
        return "banned" if peer == self.blocked else None

    def on_refusal(self, peer: str, round_: int | None, fragment: int | None, reason: str) -> None:
        self.refusals.append((peer, reason))


def _members(network: _Network, judge: Judge | None = None) -> dict[str, PartRepair]:
    repairs = {}
    for who in (A, B, C):
        settings = AllReduceSettings(run_id=RUN, codec="none", timeout=2.0)
        transport = _Transport(network, who.peer_id)
        context = AllReduceContext(
            transport,  # type: ignore[arg-type]
            who,
            settings,
            Hooks(weighted_mean_reducer, judge=judge or Judge()),
        )
        context.clock.start(ROUND)
        repairs[who.peer_id] = PartRepair(context)
        repairs[who.peer_id].register()
    return repairs


def _values() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {p: torch.randn(NUMEL, generator=g) for p in WEIGHTS}


def _repair_all(
    repairs: dict[str, PartRepair], values: dict[str, torch.Tensor], who: Sequence[str]
) -> list[tuple[torch.Tensor, list[str]] | None]:
    async def main() -> list[tuple[torch.Tensor, list[str]] | None]:
        deadline = time.monotonic() + 5
        return await asyncio.gather(
            *(
                repairs[p].run(KEY, PART, GROUP, OWNER.peer_id, values[p], WEIGHTS[p], deadline)
                for p in who
            )
        )

    return asyncio.run(main())


def _mean_of(values: dict[str, torch.Tensor], peers: Sequence[str]) -> torch.Tensor:
    ordered = sorted(peers)  # every member reduces in PeerID order
    return weighted_mean([values[p] for p in ordered], [float(WEIGHTS[p]) for p in ordered])


def test_members_repair_a_failed_owners_part_to_the_same_values() -> None:
    values = _values()
    repairs = _members(_Network())
    results = _repair_all(repairs, values, [A.peer_id, B.peer_id, C.peer_id])
    expected = _mean_of(values, list(WEIGHTS))
    for fixed in results:
        assert fixed is not None
        vector, contributors = fixed
        assert contributors == sorted(WEIGHTS)
        assert torch.equal(vector, expected)  # bitwise, on every member
    assert all(r.context.rejected == {} for r in repairs.values())
    # each member sent its part to the two others and took theirs in
    part_bytes = NUMEL * 4
    for r in repairs.values():
        sent, received = r.context.traffic(KEY)
        assert sent >= 2 * part_bytes and received >= 2 * part_bytes


def test_an_unreachable_member_is_left_out_of_the_repair() -> None:
    values = _values()
    network = _Network()
    repairs = _members(network)
    network.down.add(C.peer_id)
    results = _repair_all(repairs, values, [A.peer_id, B.peer_id])
    expected = _mean_of(values, [A.peer_id, B.peer_id])
    for fixed in results:
        assert fixed is not None
        assert fixed[1] == sorted([A.peer_id, B.peer_id])
        assert torch.equal(fixed[0], expected)


def test_a_member_alone_keeps_its_own_values() -> None:
    values = _values()
    network = _Network()
    repairs = _members(network)
    network.down.update({B.peer_id, C.peer_id})
    assert _repair_all(repairs, values, [A.peer_id]) == [None]


def test_no_repair_when_a_member_took_the_owners_result() -> None:
    # B accepted the owner's result for the part: a repair without it would leave the
    # others' values unlike B's, so they keep their own and nobody is blamed.
    values = _values()
    repairs = _members(_Network())
    repairs[B.peer_id].accepted(KEY, PART)
    assert _repair_all(repairs, values, [A.peer_id, C.peer_id]) == [None, None]
    assert all(r.context.rejected == {} for r in repairs.values())


def _repair_message(who: Identity, values: torch.Tensor, group: list[str]) -> bytes:
    header = Header("repair", RUN, ROUND, FRAGMENT, PART, who.peer_id)
    enc = codecs.encode(values, "none")
    meta = {"content": "update", "group": group, "weight": 1, **enc.meta()}
    return seal_part(who, header, meta, enc.payload).to_bytes()


def test_a_second_different_repair_message_is_equivocation() -> None:
    values = _values()
    repairs = _members(_Network())
    _repair_all(repairs, values, [A.peer_id, B.peer_id, C.peer_id])
    handle = repairs[A.peer_id].context.transport.handlers[REPAIR_RPC]
    other = _repair_message(B, values[B.peer_id] + 1.0, GROUP)
    try:
        asyncio.run(handle(B.peer_id, other))  # type: ignore[operator]
    except ProtocolError as exc:
        assert exc.reason == "equivocation"
    else:
        raise AssertionError("a second repair message was taken")
    assert repairs[A.peer_id].context.rejected == {"equivocation": 1}


def test_repair_messages_from_outside_the_group_or_a_blocked_peer_are_refused() -> None:
    values = _values()
    stranger, banned = (Identity.from_seed(bytes([i]) * 32) for i in (8, 9))
    judge = _Blocking(blocked=banned.peer_id)
    repairs = _members(_Network(), judge)
    results = _repair_all(repairs, values, [A.peer_id, B.peer_id, C.peer_id])
    assert all(r is not None and r[1] == sorted(WEIGHTS) for r in results)
    handle = repairs[A.peer_id].context.transport.handlers[REPAIR_RPC]
    reasons = []
    for who in (stranger, banned):
        message = _repair_message(who, values[A.peer_id], [*GROUP, who.peer_id])
        try:
            asyncio.run(handle(who.peer_id, message))  # type: ignore[operator]
        except ProtocolError as exc:
            reasons.append(exc.reason)
    assert reasons == ["group_mismatch", "banned"]
    assert judge.refusals == [(stranger.peer_id, "group_mismatch"), (banned.peer_id, "banned")]
    assert repairs[A.peer_id].context.rejected == {"group_mismatch": 1, "banned": 1}
