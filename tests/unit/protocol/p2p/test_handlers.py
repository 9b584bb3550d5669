"""The RPCs a node serves: names checked, each registered on p2pd and, but for p2pd's own,
in the direct plane's table."""

from __future__ import annotations

import asyncio

import pytest

from protocol.p2p import _framing, direct, reachability
from protocol.p2p.handlers import P2PD_ONLY, Handlers, protocol_id


class _P2P:
    def __init__(self) -> None:
        self.handlers: dict[str, object] = {}

    async def add_binary_stream_handler(self, protocol: str, handler) -> None:
        self.handlers[protocol] = handler

    async def remove_binary_stream_handler(self, protocol: str) -> None:
        del self.handlers[protocol]


def _handlers(p2p: _P2P) -> Handlers:
    gate = _framing.StreamGate(8, 2)
    return Handlers(p2p, gate, _framing.Pace(1.0, 0, 1.0), max_message_bytes=1 << 20)  # type: ignore[arg-type]


async def _echo(peer: str, data: bytes) -> bytes:
    return data


def test_an_rpc_name_becomes_its_p2pd_protocol() -> None:
    assert protocol_id("atoll.part") == "/atoll/rpc/atoll.part/1"
    for bad in ("", "a/b", "x" * 65, "space name"):
        with pytest.raises(ValueError, match="expected 1-64"):
            protocol_id(bad)


def test_a_handler_is_served_on_p2pd_and_on_the_direct_plane() -> None:
    p2p = _P2P()
    handlers = _handlers(p2p)
    asyncio.run(handlers.add("atoll.part", _echo, 1024, 5.0))
    assert set(p2p.handlers) == {"/atoll/rpc/atoll.part/1"}
    served = handlers.served("atoll.part")
    assert served is not None and served.max_request_bytes == 1024
    assert handlers.forget("atoll.part") == "/atoll/rpc/atoll.part/1"
    assert handlers.served("atoll.part") is None


def test_p2pds_own_rpcs_are_not_served_directly() -> None:
    assert {reachability.RPC_NAME, direct.RPC_NAME} == P2PD_ONLY
    handlers = _handlers(_P2P())
    asyncio.run(handlers.add(direct.RPC_NAME, _echo, 64, 5.0))
    assert handlers.served(direct.RPC_NAME) is None


def test_registrations_are_checked_before_they_are_made() -> None:
    handlers = _handlers(_P2P())
    with pytest.raises(ValueError, match="max_request_bytes = 0"):
        handlers.check("atoll.part", 0)
    with pytest.raises(ValueError, match="max_request_bytes"):
        handlers.check("atoll.part", (1 << 20) + 1)
    asyncio.run(handlers.add("atoll.part", _echo, 1024, 5.0))
    with pytest.raises(ValueError, match="already registered"):
        handlers.check("atoll.part", 1024)


def test_close_removes_every_handler_from_p2pd() -> None:
    p2p = _P2P()
    handlers = _handlers(p2p)

    async def main() -> None:
        await handlers.add("atoll.a", _echo, 64, 5.0)
        await handlers.add("atoll.b", _echo, 64, 5.0)
        await handlers.close()

    asyncio.run(main())
    assert p2p.handlers == {}
