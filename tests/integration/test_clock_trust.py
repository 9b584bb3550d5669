"""Without a run spec, an outsider cannot set a joining node's round clock: manifests
from signers the joiner does not trust, or with another round length, are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from node.config import load_config
from node.ops.swarm import wait_for_maddrs
from node.run.metrics import read_events
from node.spec import settings_digest
from node.train.bindings import bind
from protocol.p2p.transport import Transport, TransportConfig
from protocol.wire.messages import Header, seal
from tests.integration.conftest import SMALL, wait_until
from verification.identity import Identity

pytestmark = [pytest.mark.integration, pytest.mark.exclusive, pytest.mark.timeout(240)]

SECONDS = [
    "sync.trigger='seconds'",
    "sync.round_seconds=12",
    "network.matchmaking_seconds=3",
    "control.commit_seconds=2",
]


def _forge(transport: Transport, identity: Identity, run_id: str, body: dict) -> None:
    header = Header("manifest", run_id, 0, 0, 0, identity.peer_id)
    stored = transport.run(
        transport.dht_store(
            f"{run_id}:manifest", identity.peer_id, seal(identity, header, body), 3600.0, timeout=10
        ),
        20,
    )
    assert stored


def test_a_forged_round_clock_is_refused_and_the_joiner_trains(local_swarm, tmp_path: Path) -> None:
    # the first node starts its clock after a short wait for the second, which joins
    # once the forged manifests are stored
    first = local_swarm.start_one(
        0, rounds=3, extra=[*SECONDS, "network.min_peers_timeout=5"], nodes=2
    )
    maddrs = wait_for_maddrs(first)
    assert wait_until(lambda: first.status.get("state") == "training", 90)
    cfg = bind(load_config(None, [*SMALL, *SECONDS]))
    digest = settings_digest(cfg)
    outsiders = []
    try:
        for name, length in (("shifted", 12.0), ("short", 1.0)):
            identity = Identity.generate()
            identity.save(tmp_path / name)
            transport = Transport.start(
                TransportConfig(
                    identity_path=tmp_path / name, initial_peers=tuple(maddrs), request_timeout=10
                )
            )
            outsiders.append(transport)
            # an earlier t0 than the run's: the earliest manifest used to win
            _forge(
                transport,
                identity,
                cfg.run.run_id,
                {"t0": 1.0e9, "round_seconds": length, "spec": digest},
            )
        second = local_swarm.start_one(1, rounds=3, extra=SECONDS, peers=maddrs, nodes=2)
        assert local_swarm.wait_all(180), "nodes did not finish"
        summary = local_swarm.summary()
        assert summary["exit_codes"] == [0, 0], summary["failed_nodes"]
        assert summary["rounds_checked"] >= 2
        assert summary["params_agree"], summary
        log = (second.data_dir / "node.log").read_text()
        for transport in outsiders:
            assert f"round clock under {transport.peer_id} refused" in log
        assert "untrusted_signer" in log and "wrong_round_seconds" in log
        rounds = [e["round"] for e in read_events(second.data_dir / "events.jsonl", "round")]
        assert rounds and max(rounds) <= 3  # its clock is the run's, not one of round 10^8
        # the joiner signed the clock it took: nodes joining through it trust it
        found = outsiders[0].run(outsiders[0].dht_get(f"{cfg.run.run_id}:manifest", timeout=10), 20)
        assert second.status["peer_id"] in found and first.status["peer_id"] in found
    finally:
        for transport in outsiders:
            transport.shutdown()
