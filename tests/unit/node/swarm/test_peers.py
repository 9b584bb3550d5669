"""The registry view: live and refused peers, one key in two processes, re-dialling."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
from pathlib import Path

import pytest

from node.swarm import peers as peers_module
from node.swarm.peers import LIVE_SECONDS, DuplicateIdentityError, PeerView, PeerViewSettings
from protocol import registry
from protocol.errors import ProtocolError
from protocol.p2p.reachability import Reachability
from tests.unit._fakes import FakeDHT, FakeTransport
from verification.identity import Identity

RUN = "run"
SPEC = "s" * 64


def _view(dht: FakeDHT, identity: Identity, spec: str = SPEC, **kw) -> PeerView:
    transport = kw.pop("transport", None) or FakeTransport(dht, identity.peer_id)
    settings = PeerViewSettings(
        RUN,
        spec,
        Path("/data/identity.key"),
        tuple(kw.pop("initial_peers", ())),
        request_timeout=1.0,
        registry_seconds=kw.pop("registry_seconds", 0.01),
        registry_shards=kw.pop("shards", 1),
    )
    return PeerView(transport, identity, settings)


async def _store(dht: FakeDHT, identity: Identity, **fields) -> registry.PeerRecord:
    record = registry.PeerRecord(
        peer=identity.peer_id,
        round=fields.pop("round", 1),
        step=fields.pop("step", 10),
        maddrs=(f"/ip4/10.0.0.9/tcp/1/p2p/{identity.peer_id}",),
        updated=fields.pop("updated", time.time()),
        **{"spec": SPEC, **{k: v for k, v in fields.items() if k != "shards"}},
    )
    transport = FakeTransport(dht, identity.peer_id)
    await registry.publish_record(
        transport, identity, RUN, record, expiration=10, timeout=1, shards=fields.get("shards", 1)
    )
    return record


def _publish(dht: FakeDHT, identity: Identity, **fields) -> registry.PeerRecord:
    return asyncio.run(_store(dht, identity, **fields))


def test_record_says_where_whether_reachable_and_which_spec() -> None:
    dht, me = FakeDHT(), Identity.generate()
    transport = FakeTransport(dht, me.peer_id, reachability=Reachability("private"))
    view = _view(dht, me, transport=transport)
    rec = view.record(3, 42, ["/ip4/10.0.0.1/tcp/2/p2p/x"])
    assert (rec.round, rec.step, rec.control) == (3, 42, ("/ip4/10.0.0.1/tcp/2/p2p/x",))
    assert rec.reachable is False and rec.spec == SPEC and rec.instance == view.instance
    asyncio.run(view.refresh(rec))
    assert view.records[me.peer_id] == dataclasses.replace(rec)  # round trip through the DHT


def test_live_refused_sources_and_behind() -> None:
    dht, me = FakeDHT(), Identity.generate()
    same, client, other, stale = (Identity.generate() for _ in range(4))
    _publish(dht, same, round=4)
    _publish(dht, client, round=5, reachable=False)
    _publish(dht, other, round=5, spec="o" * 64)
    _publish(dht, stale, round=9, updated=time.time() - LIVE_SECONDS - 1)
    view = _view(dht, me)
    asyncio.run(view.refresh(view.record(4, 0)))
    assert view.live() == {same.peer_id, client.peer_id}
    assert list(view.refused()) == [other.peer_id]
    assert view.refused()[other.peer_id].startswith("spec_mismatch: runs spec oooooooooooo")
    assert [r.peer for r in view.sources(4)] == [same.peer_id]  # a client serves no state
    assert view.sources(5) == []
    assert view.behind(5) == [same.peer_id]
    assert not view.reachable(client.peer_id) and view.reachable(same.peer_id)
    assert view.reachable("12D3KooWunknown")


def test_a_second_process_with_this_key_that_started_earlier_stops_this_one() -> None:
    dht, me = FakeDHT(), Identity.generate()
    view = _view(dht, me)
    # the other process started before this one and keeps writing its record
    _publish(dht, me, instance="other", started=view.started - 5)
    asyncio.run(view.read())
    assert view.conflict is not None
    assert "another node is running with the identity key /data/identity.key" in view.conflict


def test_a_second_process_that_started_later_is_the_one_to_stop() -> None:
    dht, me = FakeDHT(), Identity.generate()
    view = _view(dht, me)
    _publish(dht, me, instance="other", started=view.started + 5)
    asyncio.run(view.read())
    assert view.conflict is None


def test_start_refuses_a_key_whose_other_process_keeps_refreshing() -> None:
    dht, me = FakeDHT(), Identity.generate()
    view = _view(dht, me, registry_seconds=0.05)
    _publish(dht, me, instance="other", started=view.started - 60)

    async def both() -> None:
        async def keep_writing() -> None:
            for _ in range(20):
                await asyncio.sleep(0.02)
                await _store(dht, me, instance="other", started=view.started - 60)

        writer = asyncio.ensure_future(keep_writing())
        try:
            await view.ensure_identity_free()
        finally:
            writer.cancel()

    with pytest.raises(DuplicateIdentityError, match="identity key /data/identity.key"):
        asyncio.run(both())


def test_start_accepts_a_record_left_by_its_own_previous_run() -> None:
    dht, me = FakeDHT(), Identity.generate()
    _publish(dht, me, instance="crashed", started=time.time() - 100)  # fresh, but not refreshed
    view = _view(dht, me, registry_seconds=0.05)
    asyncio.run(view.ensure_identity_free())  # waits a moment, then starts
    stale = FakeDHT()
    _publish(stale, me, instance="old", updated=time.time() - LIVE_SECONDS - 1)
    started = time.monotonic()
    asyncio.run(_view(stale, me, registry_seconds=5.0).ensure_identity_free())
    assert time.monotonic() - started < 1.0  # a stale record is not even waited on


def test_isolated_node_redials_initial_peers_with_backoff() -> None:
    dht, me = FakeDHT(), Identity.generate()
    transport = FakeTransport(dht, me.peer_id)
    view = _view(dht, me, transport=transport, initial_peers=["/ip4/10.0.0.2/tcp/1/p2p/boot"])

    async def refreshes(n: int) -> None:
        for _ in range(n):
            await view.refresh(view.record(1, 0))

    asyncio.run(refreshes(3))
    assert transport.rejoins == [["/ip4/10.0.0.2/tcp/1/p2p/boot"]]  # once, then it waits
    view._redial.next_at = 0.0  # the backoff has passed
    transport.rejoin_answers = 0
    asyncio.run(refreshes(1))
    assert len(transport.rejoins) == 2 and view._redial.attempts == 2


def test_a_node_whose_registry_shows_fewer_peers_than_its_control_channel_hears_rejoins() -> None:
    dht, me = FakeDHT(), Identity.generate()
    seen, lost, other = Identity.generate(), Identity.generate(), Identity.generate()
    transport = FakeTransport(dht, me.peer_id)
    heard: set[str] = set()
    view = _view(dht, me, transport=transport)
    view.heard = lambda: heard
    _publish(dht, seen)
    asyncio.run(view.refresh(view.record(1, 0)))
    assert transport.rejoins == [] and view.cut_off() is None
    heard.update({seen.peer_id, lost.peer_id, other.peer_id})  # 1 of 3 in the registry
    view._redial.next_at = 0.0
    asyncio.run(view.refresh(view.record(1, 0)))
    assert "the registry shows 1 live peers, the control channel hears 3" in view.cut_off()
    # it dials the peers it has seen (their registry addresses), having no initial peers
    assert transport.rejoins == [[f"/ip4/10.0.0.9/tcp/1/p2p/{seen.peer_id}"]]
    _publish(dht, lost)
    _publish(dht, other)
    view._redial.next_at = 0.0
    asyncio.run(view.refresh(view.record(1, 0)))
    assert view.cut_off() is None and len(transport.rejoins) == 1 and view._redial.attempts == 0


def test_a_node_with_live_peers_or_no_initial_peers_never_redials() -> None:
    dht, me, peer = FakeDHT(), Identity.generate(), Identity.generate()
    lonely = FakeTransport(dht, me.peer_id)
    asyncio.run(_view(dht, me, transport=lonely).refresh(_view(dht, me).record(1, 0)))
    assert lonely.rejoins == []  # nobody to re-dial
    _publish(dht, peer)
    busy = FakeTransport(dht, me.peer_id)
    view = _view(dht, me, transport=busy, initial_peers=["/ip4/10.0.0.2/tcp/1/p2p/boot"])
    asyncio.run(view.refresh(view.record(1, 0)))
    assert busy.rejoins == []


def test_a_large_swarm_refreshes_less_often_and_counts_peers_gone_later() -> None:
    dht, me = FakeDHT(), Identity.generate()
    view = _view(dht, me, registry_seconds=2.0)
    small = [Identity.generate() for _ in range(3)]
    for peer in small:
        _publish(dht, peer)
    asyncio.run(view.read())
    # up to network.base_rate_peers (8) nodes: the base pace, exactly as before
    assert (view.stretch, view.interval, view.live_seconds) == (1.0, 2.0, LIVE_SECONDS)
    late = Identity.generate()
    _publish(dht, late, updated=time.time() - 1.5 * LIVE_SECONDS)  # silent for 15 s
    for _ in range(11):
        _publish(dht, Identity.generate())
    asyncio.run(view.read())
    # 16 records (this node's own included): twice as slow, twice as patient
    assert len(view.records.keys() | {me.peer_id}) == 16
    assert (view.stretch, view.interval, view.live_seconds) == (2.0, 4.0, 2 * LIVE_SECONDS)
    assert late.peer_id in view.live()  # in a swarm of 4 it would count as gone


def test_a_refresh_is_due_one_interval_after_the_last() -> None:
    dht, me = FakeDHT(), Identity.generate()
    view = _view(dht, me, registry_seconds=0.2)
    assert view.due()
    asyncio.run(view.refresh(view.record(0, 0)))
    assert not view.due()
    time.sleep(0.25)
    assert view.due()


def _fixed_identities(count: int, shards: int) -> list[Identity]:
    """``count`` identities from fixed seeds, every one of ``shards`` shards holding at
    least two (the same ones on every run: no test depends on luck)."""
    found: list[Identity] = []
    for i in range(10_000):
        identity = Identity.from_seed(hashlib.sha256(f"peer {i}".encode()).digest())
        found.append(identity)
        per = [0] * shards
        for x in found:
            per[registry.registry_shard(x.peer_id, shards)] += 1
        if len(found) >= count and min(per) >= 2:
            return found
    raise AssertionError("no fixed identities cover every shard")


def test_registry_shard_is_stable_in_range_and_spreads_peers() -> None:
    peers = [x.peer_id for x in _fixed_identities(400, 8)]
    shards = [registry.registry_shard(p, 8) for p in peers]
    assert shards == [registry.registry_shard(p, 8) for p in peers]  # the same every time
    counts = [shards.count(i) for i in range(8)]
    assert min(counts) >= 25 and max(counts) <= 80, counts  # about 50 each
    assert {registry.registry_shard(p, 1) for p in peers} == {0}
    with pytest.raises(ValueError, match="shards must be >= 1"):
        registry.registry_shard(peers[0], 0)
    transport = FakeTransport(FakeDHT(), peers[0])
    with pytest.raises(ValueError, match="shards must be >= 1"):
        asyncio.run(registry.read_registry(transport, RUN, timeout=1, shards=0))


def test_a_sharded_registry_spreads_records_over_its_keys_and_reads_them_all() -> None:
    dht, me = FakeDHT(), Identity.generate()
    others = _fixed_identities(20, 4)
    for peer in others:
        _publish(dht, peer, shards=4)
    view = _view(dht, me, shards=4)
    asyncio.run(view.refresh(view.record(1, 0)))
    assert view.live() == {p.peer_id for p in others}
    keys = {f"{RUN}:nodes:4:{i}" for i in range(4)}
    assert set(dht.data) == keys  # nothing under the unsharded key
    for i in range(4):
        held = set(dht.data[f"{RUN}:nodes:4:{i}"])
        assert held and all(registry.registry_shard(p, 4) == i for p in held)
    # a node on another shard count reads other keys: it sees no one (a shared setting)
    single = _view(dht, Identity.generate())
    asyncio.run(single.read())
    assert single.live() == set()


def test_a_record_under_another_shard_than_its_own_is_refused() -> None:
    dht, me, intruder = FakeDHT(), Identity.generate(), Identity.generate()
    record = _publish(dht, intruder, shards=4)
    own = registry.registry_shard(intruder.peer_id, 4)
    wrong = (own + 1) % 4
    dht.data[f"{RUN}:nodes:4:{wrong}"] = dht.data.pop(f"{RUN}:nodes:4:{own}")
    view = _view(dht, me, shards=4)
    asyncio.run(view.read())
    assert intruder.peer_id not in view.records
    dht.data[f"{RUN}:nodes:4:{own}"] = dht.data.pop(f"{RUN}:nodes:4:{wrong}")
    asyncio.run(view.read())
    assert view.records[intruder.peer_id] == record


class _FailingShards(FakeTransport):
    """A DHT whose reads of some keys time out."""

    def __init__(self, dht: FakeDHT, peer_id: str) -> None:
        super().__init__(dht, peer_id)
        self.failing: set[str] = set()

    async def dht_get(self, key: str, **kw):
        if key in self.failing:
            raise ProtocolError("timeout", f"get {key!r}")
        return await super().dht_get(key, **kw)


def test_a_shard_that_cannot_be_read_keeps_its_last_records() -> None:
    dht, me = FakeDHT(), Identity.generate()
    others = _fixed_identities(12, 3)
    for peer in others:
        _publish(dht, peer, shards=3)
    transport = _FailingShards(dht, me.peer_id)
    view = _view(dht, me, transport=transport, shards=3)
    asyncio.run(view.read())
    everyone = {p.peer_id for p in others}
    assert view.live() == everyone
    # shard 0's read times out and a peer of shard 1 leaves: shard 0's peers stay known,
    # the one gone from shard 1 is gone
    transport.failing = {f"{RUN}:nodes:3:0"}
    gone = next(p for p in others if registry.registry_shard(p.peer_id, 3) == 1)
    dht.data[f"{RUN}:nodes:3:1"].pop(gone.peer_id)
    asyncio.run(view.read())
    assert view.live() == everyone - {gone.peer_id}
    # no shard readable: the read fails as a whole and the view is kept
    transport.failing = {f"{RUN}:nodes:3:{i}" for i in range(3)}
    with pytest.raises(ProtocolError):
        asyncio.run(registry.read_registry(transport, RUN, timeout=1, shards=3))
    asyncio.run(view.read())
    assert view.live() == everyone - {gone.peer_id}


def test_too_few_shards_for_the_swarm_is_said_once(monkeypatch, caplog) -> None:
    monkeypatch.setattr(peers_module, "SHARD_RECORDS_WARN", 4)
    dht, me = FakeDHT(), Identity.generate()
    for _ in range(8):
        _publish(dht, Identity.generate(), shards=2)
    view = _view(dht, me, shards=2)
    with caplog.at_level(logging.WARNING, logger="node.swarm.peers"):
        asyncio.run(view.read())
        assert not caplog.records  # 8 records in 2 shards: 4 each, not above
        _publish(dht, Identity.generate(), shards=2)
        asyncio.run(view.read())
        asyncio.run(view.read())
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1, warnings
    assert "9 records in 2 DHT key(s)" in warnings[0]
    assert "network.registry_shards" in warnings[0]


def test_a_node_whose_registry_shows_only_peers_of_another_spec_is_not_cut_off() -> None:
    # It reads the registry fine: the peers there run another spec. Re-joining the DHT
    # would find the same ones, and it once did so every 2 s for a whole run.
    dht, me, stranger = FakeDHT(), Identity.generate(), Identity.generate()
    transport = FakeTransport(dht, me.peer_id)
    view = _view(dht, me, transport=transport, initial_peers=["/ip4/10.0.0.2/tcp/1/p2p/boot"])
    _publish(dht, stranger, spec="another-spec")
    for _ in range(3):
        asyncio.run(view.refresh(view.record(1, 0)))
    assert view.live() == set() and set(view.refused()) == {stranger.peer_id}
    assert view.cut_off() is None and transport.rejoins == []


def test_after_a_rejoin_that_did_not_help_the_next_waits_as_long_as_it_said() -> None:
    dht, me = FakeDHT(), Identity.generate()
    transport = FakeTransport(dht, me.peer_id)  # its re-joins connect, to no avail
    view = _view(dht, me, transport=transport, initial_peers=["/ip4/10.0.0.2/tcp/1/p2p/boot"])
    asyncio.run(view.refresh(view.record(1, 0)))
    view._redial.next_at = 0.0
    before = time.monotonic()
    asyncio.run(view.refresh(view.record(1, 0)))
    assert view._redial.attempts == 2
    assert view._redial.next_at - before >= 4.0 - 0.5  # 2 s, then 4 s: not back to 2 s
