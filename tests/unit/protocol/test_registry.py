"""The peer registry over an in-memory DHT: a record round trip, its shard, and records
that are not what they claim (node/swarm/peers.py's view of the registry: test_peers.py)."""

from __future__ import annotations

import asyncio

import pytest

from protocol import registry
from protocol.wire.messages import Header, seal
from tests.unit._fakes import FakeDHT, FakeTransport
from verification.identity import Identity

RUN = "registry-test"


def _record(identity: Identity, round_: int = 3) -> registry.PeerRecord:
    return registry.PeerRecord(
        peer=identity.peer_id,
        round=round_,
        step=120,
        maddrs=("/ip4/10.0.0.1/tcp/1",),
        updated=1000.0,
        control=("/ip4/10.0.0.1/tcp/2",),
        reachable=False,
        spec="s" * 64,
        instance="abc",
        started=990.0,
    )


@pytest.mark.parametrize("shards", [1, 3])
def test_a_record_comes_back_as_published_from_its_shard(shards: int) -> None:
    dht, nodes = FakeDHT(), [Identity.generate() for _ in range(4)]
    for node in nodes:
        transport = FakeTransport(dht, node.peer_id)
        stored = registry.publish_record(
            transport, node, RUN, _record(node), expiration=60, timeout=1, shards=shards
        )
        assert asyncio.run(stored)  # type: ignore[arg-type]
    reader = FakeTransport(dht, "reader")
    read = asyncio.run(registry.read_registry(reader, RUN, timeout=1, shards=shards))  # type: ignore[arg-type]
    assert read == {n.peer_id: _record(n) for n in nodes}
    if shards > 1:
        keys = {k for k in dht.data if k.startswith(f"{RUN}:nodes:{shards}:")}
        held = {n.peer_id: registry.registry_shard(n.peer_id, shards) for n in nodes}
        assert keys == {f"{RUN}:nodes:{shards}:{i}" for i in set(held.values())}


def test_a_node_publishes_only_its_own_record() -> None:
    me, other = Identity.generate(), Identity.generate()
    with pytest.raises(ValueError, match="only its own"):
        asyncio.run(
            registry.publish_record(
                FakeTransport(FakeDHT(), me.peer_id),  # type: ignore[arg-type]
                me,
                RUN,
                _record(other),
                expiration=60,
                timeout=1,
            )
        )


def test_forged_and_malformed_records_are_dropped_and_the_rest_kept() -> None:
    dht, good, forger = FakeDHT(), Identity.generate(), Identity.generate()
    asyncio.run(
        registry.publish_record(
            FakeTransport(dht, good.peer_id),  # type: ignore[arg-type]
            good,
            RUN,
            _record(good),
            expiration=60,
            timeout=1,
        )
    )
    victim = Identity.generate().peer_id
    header = Header("record", RUN, 9, 0, 0, forger.peer_id)
    forged = seal(forger, header, {"step": 1, "maddrs": [], "time": 1.0})
    bad = seal(forger, Header("record", RUN, 9, 0, 0, forger.peer_id), {"step": "x"})
    dht.data[f"{RUN}:nodes"][victim] = forged  # under another node's subkey
    dht.data[f"{RUN}:nodes"][forger.peer_id] = bad  # its own, but malformed
    read = asyncio.run(registry.read_registry(FakeTransport(dht, "r"), RUN, timeout=1))  # type: ignore[arg-type]
    assert set(read) == {good.peer_id}
