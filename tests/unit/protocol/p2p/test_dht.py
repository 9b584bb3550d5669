"""The transport's handle on its DHT process: records stored and looked up under a
deadline, counted by kind, and what another peer got wrong dropped."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from protocol.errors import ProtocolError
from protocol.p2p.dht import Dht, DhtUsage


def _done(value) -> asyncio.Future:
    future = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


class _Process:
    """hivemind's DHT as :class:`Dht` uses it: futures for store and get."""

    def __init__(self, found=None, hang: bool = False) -> None:
        self.found = found
        self.hang = hang
        self.stored: list[tuple] = []

    def store(self, key, value, expiration, subkey=None, return_future=False):
        self.stored.append((key, subkey, value))
        return _done(True)

    def get(self, key, latest=True, return_future=False, beam_size=None):
        if self.hang:
            return asyncio.get_running_loop().create_future()  # never answers
        return _done(self.found)


def test_usage_counts_operations_and_bytes() -> None:
    usage = DhtUsage()
    usage.count(sent=10)
    usage.count(received=5, op=False)
    assert (usage.ops, usage.bytes_sent, usage.bytes_received) == (1, 10, 5)


def test_a_store_is_counted_under_its_kind() -> None:
    process = _Process()
    dht = Dht(process, request_timeout=5)  # type: ignore[arg-type]
    assert asyncio.run(dht.store("key", "sub", b"value", 60, kind="registry"))
    assert process.stored == [("key", "sub", b"value")]
    assert dht.usage["registry"].ops == 1 and dht.usage["registry"].bytes_sent == 3 + 3 + 5


def test_a_lookup_returns_bytes_subkeys_or_nothing() -> None:
    item = lambda v: SimpleNamespace(value=v)  # noqa: E731
    plain = Dht(_Process(item(b"abc")), 5)  # type: ignore[arg-type]
    assert asyncio.run(plain.get("k", kind="clock")) == b"abc"
    assert plain.usage["clock"].bytes_received == 3
    nested = {"a": item(b"1"), "b": item("not bytes"), 3: item(b"x")}
    subkeys = Dht(_Process(item(nested)), 5)  # type: ignore[arg-type]
    assert asyncio.run(subkeys.get("k")) == {"a": b"1"}  # what a peer got wrong is dropped
    assert asyncio.run(Dht(_Process(None), 5).get("k")) is None  # type: ignore[arg-type]
    assert asyncio.run(Dht(_Process(item(42)), 5).get("k")) is None  # type: ignore[arg-type]


def test_a_lookup_past_its_deadline_is_a_timeout() -> None:
    dht = Dht(_Process(hang=True), request_timeout=5)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="took over 0.1s") as info:
        asyncio.run(dht.get("k", timeout=0.1))
    assert info.value.reason == "timeout"
