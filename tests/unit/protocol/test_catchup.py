"""Catching up between in-memory nodes: a snapshot served in signed chunks, taken only
when its digest checks and enough peers signed it."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from protocol import catchup
from protocol.catchup import (
    CatchUpSettings,
    StateSnapshot,
    download,
    fetch_state,
    state_digest,
)
from protocol.errors import ProtocolError
from protocol.stateserver import StateServer
from verification.identity import Identity

RUN = "catchup-test"
A, B, JOINER = (Identity.from_seed(bytes([i]) * 32) for i in (11, 12, 13))
PLAN = "plan-digest"


class _Network:
    def __init__(self) -> None:
        self.handlers: dict[str, dict[str, object]] = {}
        self.dht: dict[str, dict[str, bytes]] = {}


class _Transport:
    """What catch-up uses of a Transport: one handler, calls, and the DHT."""

    def __init__(self, network: _Network, me: str) -> None:
        self.network, self.me = network, me
        network.handlers[me] = {}

    def add_handler(self, name: str, handler, **_: object) -> None:
        self.network.handlers[self.me][name] = handler

    def run(self, coro, timeout: float):
        return asyncio.run(coro)

    async def call(self, peer: str, name: str, data: bytes, **_: object) -> bytes:
        return await self.network.handlers[peer][name](self.me, data)  # type: ignore[operator]

    async def dht_store(self, key, subkey, value, expiration, **_: object) -> bool:
        self.network.dht.setdefault(key, {})[subkey] = value
        return True

    async def dht_get(self, key, **_: object):
        return dict(self.network.dht.get(key, {}))


def _snapshot(round_: int = 4) -> StateSnapshot:
    globals_ = (torch.arange(10, dtype=torch.float32), torch.ones(3))
    return StateSnapshot(round_, PLAN, globals_, (torch.full((10,), 0.5), None), steps=40)


def _serving(network: _Network, identity: Identity, folder: Path, snapshot: StateSnapshot):
    server = StateServer(_Transport(network, identity.peer_id), identity, RUN, folder)  # type: ignore[arg-type]
    server.register()
    digest = server.publish(snapshot)
    asyncio.run(server.attest(snapshot.round, digest, timeout=5))
    return server, digest


def _fetch(network: _Network, peers: list[str], **kwargs) -> StateSnapshot:
    transport = _Transport(network, JOINER.peer_id)
    options = {"plan_digest": PLAN, "sizes": [10, 3], "min_round": 0, "signers": 1, **kwargs}
    return asyncio.run(
        fetch_state(transport, JOINER, CatchUpSettings(RUN, timeout=5), peers, **options)  # type: ignore[arg-type]
    )


def test_a_served_snapshot_is_taken_whole_with_its_momentum(tmp_path: Path) -> None:
    network = _Network()
    snapshot = _snapshot()
    server, digest = _serving(network, A, tmp_path / "a", snapshot)
    try:
        taken = _fetch(network, [A.peer_id])
    finally:
        server.close()
    assert taken.round == 4 and taken.steps == 40 and state_digest(taken.globals) == digest
    assert all(torch.equal(x, y) for x, y in zip(taken.globals, snapshot.globals))
    assert torch.equal(taken.momentum[0], snapshot.momentum[0]) and taken.momentum[1] is None
    assert list((tmp_path / "a").iterdir()) == []  # served from an unlinked file


def test_a_state_too_few_peers_signed_is_refused(tmp_path: Path) -> None:
    network = _Network()
    server, _ = _serving(network, A, tmp_path / "a", _snapshot())
    try:
        with pytest.raises(ProtocolError) as info:
            _fetch(network, [A.peer_id], signers=2)
    finally:
        server.close()
    assert info.value.reason == "unattested"


def test_fragments_spread_over_peers_must_be_one_state(tmp_path: Path) -> None:
    network = _Network()
    first, _ = _serving(network, A, tmp_path / "a", _snapshot(round_=4))
    second, _ = _serving(network, B, tmp_path / "b", _snapshot(round_=5))
    try:
        with pytest.raises(ProtocolError) as info:
            _fetch(network, [A.peer_id, B.peer_id])  # fragment 0 from A, fragment 1 from B
    finally:
        first.close()
        second.close()
    assert info.value.reason == "mixed_state"


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"plan_digest": "another model"}, "wrong_model"),
        ({"digest": "f" * 64}, "other_state"),
        ({"min_round": 9}, "stale_round"),
        ({"sizes": [10, 4]}, "malformed"),
    ],
)
def test_a_state_that_is_not_the_one_asked_for_is_refused(tmp_path, kwargs, reason) -> None:
    network = _Network()
    server, _ = _serving(network, A, tmp_path / "a", _snapshot())
    try:
        with pytest.raises(ProtocolError) as info:
            _fetch(network, [A.peer_id], **kwargs)
    finally:
        server.close()
    assert info.value.reason == reason


def test_a_node_without_a_completed_round_serves_nothing(tmp_path: Path) -> None:
    network = _Network()
    server = StateServer(_Transport(network, A.peer_id), A, RUN, tmp_path)  # type: ignore[arg-type]
    server.register()
    with pytest.raises(ProtocolError) as info:
        _fetch(network, [A.peer_id])
    assert info.value.reason == "no_state"
    with pytest.raises(ValueError, match="standing 'sure'"):
        asyncio.run(server.attest(1, "ab", timeout=1, standing="sure"))
    assert pytest.raises(ProtocolError, _fetch, network, []).value.reason == "no_peer"


def _download(network: _Network, peers: list[str], sizes: tuple[int, ...], min_round: int):
    """The joiner's :func:`download` from ``peers`` (all at round 4), two signers needed."""
    plan = SimpleNamespace(fragments=[SimpleNamespace(numel=n) for n in sizes], digest=lambda: PLAN)
    return download(
        _Transport(network, JOINER.peer_id),  # type: ignore[arg-type]
        JOINER,
        CatchUpSettings(RUN, timeout=5),
        [SimpleNamespace(peer=p, round=4) for p in peers],  # type: ignore[misc]
        plan,  # type: ignore[arg-type]
        min_round=min_round,
        signers=2,
    )


def test_a_repeated_catch_up_failure_is_logged_at_warning_once(
    tmp_path: Path, caplog, monkeypatch
) -> None:
    monkeypatch.setattr(catchup, "_SAID", deque(maxlen=64))  # nothing said before
    network = _Network()
    server, _ = _serving(network, A, tmp_path / "a", _snapshot())
    try:
        with caplog.at_level(logging.DEBUG, logger="protocol.catchup"):
            for _ in range(3):  # a node settling a round retries, twice a second
                taken = _download(network, [A.peer_id], (10, 3), min_round=0)
                assert taken is None
    finally:
        server.close()
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "catch-up from" in r.message]
    assert len(said) == 6  # the spread try and the lone try, three times
    assert [level for level, _ in said] == [logging.WARNING] + [logging.DEBUG] * 5
    assert "unattested" in said[0][1] and len({text for _, text in said}) == 1


def test_a_source_that_dies_mid_download_is_left_for_another_that_serves_it(
    tmp_path: Path, monkeypatch
) -> None:
    """Three fragments spread over A and B: A's first fragment arrives, then A is gone
    (killed mid-download); the state is taken whole from B, which serves the same one."""
    monkeypatch.setattr(catchup, "_SAID", deque(maxlen=64))
    network = _Network()
    globals_ = (torch.arange(10, dtype=torch.float32), torch.ones(3), torch.zeros(5))
    snapshot = StateSnapshot(4, PLAN, globals_, (None, None, None), steps=40)
    a, digest = _serving(network, A, tmp_path / "a", snapshot)
    b, same = _serving(network, B, tmp_path / "b", snapshot)
    assert same == digest
    served = network.handlers[A.peer_id][catchup.RPC_NAME]
    calls = 0

    async def dies_after_one_chunk(peer: str, data: bytes) -> bytes:
        nonlocal calls
        calls += 1
        if calls > 1:
            raise ProtocolError("connection_lost", "the peer is gone", A.peer_id)
        return await served(peer, data)  # type: ignore[operator]

    network.handlers[A.peer_id][catchup.RPC_NAME] = dies_after_one_chunk
    try:
        taken = _download(network, [A.peer_id, B.peer_id], (10, 3, 5), min_round=4)
    finally:
        a.close()
        b.close()
    assert taken is not None and calls >= 2  # A answered once (fragment 0), then failed
    snap, peers = taken
    assert peers == [B.peer_id] and state_digest(snap.globals) == digest
    assert all(torch.equal(x, y) for x, y in zip(snap.globals, snapshot.globals))
