"""The dial-back check: the callee dials the caller's observed address, nothing else."""

from __future__ import annotations

import asyncio
import socket

import msgpack
import pytest

from protocol.errors import ProtocolError
from protocol.p2p.reachability import DialbackServer, Reachability, probe


def _free_listener() -> tuple[socket.socket, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    return sock, sock.getsockname()[1]


def _closed_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    return port


def test_server_dials_the_observed_address_and_reports_open_ports() -> None:
    listener, open_port = _free_listener()
    closed = _closed_port()
    try:
        server = DialbackServer(lambda: "/ip4/127.0.0.1/tcp/55555")
        raw = asyncio.run(server.handle("peerA", msgpack.packb({"ports": [open_port, closed]})))
        assert msgpack.unpackb(raw) == {"observed": "127.0.0.1", "open": [open_port]}
    finally:
        listener.close()


def test_server_without_an_observed_ip_dials_nothing() -> None:
    server = DialbackServer(lambda: "/p2p/X/p2p-circuit")
    raw = asyncio.run(server.handle("peerA", msgpack.packb({"ports": [80]})))
    assert msgpack.unpackb(raw) == {"observed": None, "open": []}


@pytest.mark.parametrize(
    "body",
    [
        {"ports": []},
        {"ports": [0]},
        {"ports": [70000]},
        {"ports": [1, 2, 3, 4, 5]},
        {"ports": ["80"]},
        [1],
    ],
)
def test_server_refuses_malformed_requests(body: object) -> None:
    server = DialbackServer(lambda: "/ip4/127.0.0.1/tcp/1")
    with pytest.raises(ProtocolError) as info:
        asyncio.run(server.handle("peerA", msgpack.packb(body)))
    assert info.value.reason == "malformed"


def test_server_refuses_garbage_and_rate_limits_each_peer() -> None:
    server = DialbackServer(lambda: None)
    with pytest.raises(ProtocolError):
        asyncio.run(server.handle("peerA", b"\xc1\xc1"))

    async def twice() -> None:
        await server.handle("peerB", msgpack.packb({"ports": [1]}))
        await server.handle("peerB", msgpack.packb({"ports": [1]}))

    with pytest.raises(ProtocolError) as info:
        asyncio.run(twice())
    assert info.value.reason == "busy"


def _answers(table: dict[str, object]):
    async def call(peer: str, request: bytes, timeout: float) -> bytes:
        answer = table[peer]
        if isinstance(answer, Exception):
            raise answer
        return msgpack.packb(answer)

    return call


def test_probe_any_peer_that_reached_a_port_makes_it_public() -> None:
    call = _answers(
        {
            "a": {"observed": "203.0.113.7", "open": []},
            "b": {"observed": "203.0.113.7", "open": [4001]},
            "c": ProtocolError("timeout"),
        }
    )
    found = asyncio.run(probe(call, ["a", "b", "c"], [4001, 4002], timeout=1.0))
    assert found.status == "public" and found.reachable
    assert found.observed == "203.0.113.7"
    assert found.ports == {4001: True, 4002: False}
    assert found.checked_by == ("a", "b")


def test_probe_nobody_reached_means_private_with_advice() -> None:
    call = _answers({"a": {"observed": "198.51.100.2", "open": []}})
    found = asyncio.run(probe(call, ["a"], [4001], timeout=1.0))
    assert found.status == "private" and not found.reachable
    text = found.summary()
    assert "NOT reachable" in text and "198.51.100.2" in text and "4001" in text
    assert found.to_dict()["reachable"] is False


def test_probe_with_no_answers_or_no_peers_is_unknown_and_counts_as_reachable() -> None:
    call = _answers({"a": ProtocolError("unreachable"), "b": {"open": "nonsense"}})
    assert asyncio.run(probe(call, ["a", "b"], [1], timeout=1.0)).status == "unknown"
    assert asyncio.run(probe(call, [], [1], timeout=1.0)).status == "unknown"
    assert Reachability("unknown").reachable


def test_forced_reachability_says_so() -> None:
    private = Reachability.forced_to("private")
    assert not private.reachable and "network.reachability" in private.summary()
    assert Reachability.forced_to("public").reachable
