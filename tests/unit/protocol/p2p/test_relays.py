"""Owning parts through a relay: circuit addresses, when a node claims them, and how a
caller connects through them (p2pd stood in for by its two calls used here)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from protocol.p2p import relays
from protocol.p2p.config import TransportConfig
from protocol.p2p.reachability import Reachability
from verification.identity import Identity

ME, PEER, ID_A, ID_B = (Identity.generate().peer_id for _ in range(4))
RELAY_A = f"/ip4/203.0.113.7/tcp/31337/p2p/{ID_A}"
RELAY_B = f"/ip4/203.0.113.8/tcp/31337/p2p/{ID_B}"


class FakeP2P:
    """``list_peers`` and ``_client.connect`` of a hivemind P2P."""

    def __init__(self, connected: set[str], answers: set[str] = frozenset()) -> None:
        self.connected = connected
        self.answers = answers  # relayed addresses whose connect succeeds
        self.dialled: list[tuple[str, str]] = []
        self._client = SimpleNamespace(connect=self._connect)

    async def list_peers(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(peer_id=p) for p in sorted(self.connected)]

    async def _connect(self, peer, maddrs) -> None:
        where = str(maddrs[0])
        self.dialled.append((str(peer), where))
        if where not in self.answers:
            raise ConnectionError("no reservation")
        self.connected.add(str(peer))


def test_circuits_name_this_node_through_each_relay_but_itself() -> None:
    mine = relays.circuits([RELAY_A, RELAY_B, f"/ip4/10.0.0.1/tcp/1/p2p/{ME}"], ME)
    assert mine == (f"{RELAY_A}/p2p-circuit/p2p/{ME}", f"{RELAY_B}/p2p-circuit/p2p/{ME}")
    assert [relays.relay_of(c) for c in mine] == [ID_A, ID_B]


def test_a_node_claims_the_circuits_it_holds_only_after_the_relay_had_time_to_reserve(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = TransportConfig(initial_peers=(RELAY_A,), trusted_relays=(RELAY_B,), relay_parts=True)
    p2p = FakeP2P({ID_A, ID_B})
    clock = [1000.0]
    monkeypatch.setattr(relays.time, "monotonic", lambda: clock[0])
    started = 1000.0 - relays.RESERVE_SECONDS + 1
    assert asyncio.run(relays.claim(p2p, cfg, ME, started)) == ()  # too soon
    clock[0] += 1
    # the trusted relays, not the initial peers, and only a relay it is connected to
    assert asyncio.run(relays.claim(p2p, cfg, ME, started)) == (f"{RELAY_B}/p2p-circuit/p2p/{ME}",)
    p2p.connected.clear()
    assert asyncio.run(relays.claim(p2p, cfg, ME, started)) == ()
    off = TransportConfig(trusted_relays=(RELAY_B,))
    assert asyncio.run(relays.claim(FakeP2P({ID_B}), off, ME, 0.0)) == ()


def test_a_caller_connects_through_the_first_circuit_that_answers() -> None:
    a, b = (f"{r}/p2p-circuit/p2p/{PEER}" for r in (RELAY_A, RELAY_B))
    direct = f"/ip4/192.168.1.2/tcp/31337/p2p/{PEER}"
    p2p = FakeP2P(set(), answers={f"{RELAY_B}/p2p-circuit"})
    assert asyncio.run(relays.connect(p2p, PEER, [direct, a, b], timeout=1.0))
    assert p2p.dialled == [(PEER, f"{RELAY_A}/p2p-circuit"), (PEER, f"{RELAY_B}/p2p-circuit")]
    # connected already: nothing dialled; no circuit of that peer: nothing to do
    assert asyncio.run(relays.connect(p2p, PEER, [a], timeout=1.0)) and len(p2p.dialled) == 2
    other = f"{RELAY_A}/p2p-circuit/p2p/{ME}"
    assert not asyncio.run(relays.connect(FakeP2P(set()), PEER, [direct, other], 1.0))
    assert not asyncio.run(relays.connect(FakeP2P(set()), PEER, [a], timeout=1.0))
    # peers listed once by the caller for several: p2pd is not asked again
    listed = FakeP2P(set())
    listed.list_peers = None  # type: ignore[assignment]
    assert asyncio.run(relays.connect(listed, PEER, [a], 1.0, peers={PEER}))
    assert listed.dialled == []


def test_a_relayed_node_is_reachable_and_says_through_what() -> None:
    circuit = f"{RELAY_A}/p2p-circuit/p2p/{ME}"
    relayed = Reachability("private", observed="198.51.100.2").through((circuit,))
    assert relayed.status == "relayed" and relayed.reachable
    assert RELAY_A in relayed.summary() and "owns parts" in relayed.summary()
    assert relayed.to_dict()["circuits"] == [circuit]
    waiting = Reachability("private")  # relay_parts, before the slot: nothing checked yet
    assert not waiting.reachable and "until p2pd holds a slot" in waiting.summary()
