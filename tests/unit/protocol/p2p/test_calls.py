"""The RPCs a node makes: over the direct plane where the callee runs it, else through
p2pd, with a failed direct route remembered; each call bounded and sized."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from protocol.errors import ProtocolError
from protocol.p2p import _framing, direct
from protocol.p2p._buffers import Lease
from protocol.p2p.calls import PLANES, Caller

PEER = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


class _P2P:
    """What a caller asks of p2pd besides streams: the peers it is connected to."""

    async def list_peers(self):
        addr = f"/ip4/10.1.2.3/tcp/4001/p2p/{PEER}"
        return [SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: PEER), addrs=[addr])]


class _Direct:
    """A direct client whose connections fail (the callee's port is blocked)."""

    def __init__(self) -> None:
        self.tried: list[direct.Route] = []

    async def call(self, peer, route, name, data, limit, receive):
        self.tried.append(route)
        raise direct.DirectUnavailable("connection refused")


@pytest.fixture
def through_p2pd(monkeypatch):
    """p2pd's exchanges: the data port answer for ``atoll.direct``, an echo otherwise."""
    sent: list[str] = []

    async def exchange(p2p, peer, protocol, data, limit, receive=None):
        sent.append(protocol)
        if protocol.endswith(f"/{direct.RPC_NAME}/1"):
            return Lease(direct.encode_port(5555, tls=True))
        if protocol.endswith("/atoll.slow/1"):
            await asyncio.sleep(60)
        return Lease(b"echo:" + bytes(data))

    monkeypatch.setattr(_framing, "exchange", exchange)
    return sent


def test_without_a_direct_plane_every_call_goes_through_p2pd(through_p2pd) -> None:
    caller = Caller(_P2P(), None, max_message_bytes=1024)  # type: ignore[arg-type]
    lease = asyncio.run(caller.call_into(PEER, "atoll.part", b"hi", timeout=5))
    assert lease.data == b"echo:hi"
    assert caller.calls_by_plane == {"p2pd": 1, "tcp": 0, "tls": 0} and set(PLANES) == {
        "p2pd",
        "tcp",
        "tls",
    }
    assert through_p2pd == ["/atoll/rpc/atoll.part/1"]


def test_a_failed_direct_route_falls_back_to_p2pd_and_is_not_tried_again(through_p2pd) -> None:
    client = _Direct()
    caller = Caller(_P2P(), client, max_message_bytes=1024)  # type: ignore[arg-type]

    async def twice() -> list[bytes]:
        first = await caller.call_into(PEER, "atoll.part", b"a", timeout=5)
        second = await caller.call_into(PEER, "atoll.part", b"b", timeout=5)
        return [first.data, second.data]

    assert asyncio.run(twice()) == [b"echo:a", b"echo:b"]
    assert client.tried == [direct.Route("10.1.2.3", 5555, True)]  # once, then remembered
    assert caller.routes[PEER][0] is None
    assert caller.calls_by_plane["p2pd"] == 2 and through_p2pd.count("/atoll/rpc/atoll.part/1") == 2


def test_an_oversized_request_is_refused_before_anything_is_sent(through_p2pd) -> None:
    caller = Caller(_P2P(), None, max_message_bytes=4)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError) as info:
        asyncio.run(caller.call_into(PEER, "atoll.part", b"12345", timeout=5))
    assert info.value.reason == "oversized" and through_p2pd == []


def test_a_call_past_its_deadline_is_a_timeout(through_p2pd) -> None:
    caller = Caller(_P2P(), None, max_message_bytes=1024)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="took over 0.1s") as info:
        asyncio.run(caller.call_into(PEER, "atoll.slow", b"x", timeout=0.1))
    assert info.value.reason == "timeout" and info.value.peer == PEER
