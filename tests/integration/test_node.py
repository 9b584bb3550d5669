"""Real nodes, separate processes, 127.0.0.1: training, failures, restarts, bad peers."""

from __future__ import annotations

import os
import signal

import pytest

from node.run.metrics import read_events
from tests.integration.conftest import alive, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def test_three_nodes_train_and_agree_every_round(local_swarm):
    local_swarm.launch(3, rounds=3)
    assert local_swarm.wait_all(180), "swarm did not finish"
    summary = local_swarm.summary()
    assert summary["exit_codes"] == [0, 0, 0], summary["failed_nodes"]
    assert summary["rounds"] == 3 and summary["rounds_checked"] == 3
    assert summary["params_agree"], summary["rounds_disagreeing"]
    assert summary["val_bpb_end"] < summary["val_bpb_start"] - 1.5
    for node in local_swarm.nodes:
        syncs = read_events(node.data_dir / "events.jsonl", "sync")
        assert len(syncs) == 3 * 2
        assert all(s["complete"] and len(s["group"]) == 3 for s in syncs)
    assert sum(summary["bytes_sent_per_node"]) * 10 < sum(summary["ddp_bytes_per_node"])
    assert not local_swarm.leftovers()


def test_sigkilled_node_does_not_stop_the_others(local_swarm):
    nodes = local_swarm.launch(3, rounds=4)
    victim = nodes[2]
    # Kill mid-round: right after its first round ends, before its next sync point.
    assert wait_until(lambda: victim.status.get("round", 0) >= 1, 120, 0.05)
    local_swarm.record_helpers()
    helpers = victim.status["helper_pids"]
    os.kill(victim.proc.pid, signal.SIGKILL)
    killed_round = victim.status.get("round", 0) + 1
    assert wait_until(lambda: not any(alive(p) for p in helpers), 20), (
        "p2pd/DHT outlived a SIGKILLed node"
    )
    survivors = nodes[:2]
    assert wait_until(lambda: all(n.proc.poll() is not None for n in survivors), 150, 0.5)
    assert [n.proc.returncode for n in survivors] == [0, 0]
    for node in survivors:
        rounds = [e["round"] for e in read_events(node.data_dir / "events.jsonl", "round")]
        assert rounds == [1, 2, 3, 4]
        for sync in read_events(node.data_dir / "events.jsonl", "sync"):
            # matchmaking (6 s) + all-reduce deadline (8 s) + margin
            assert sync["seconds"] < 6 + 8 + 6, sync
            if sync["round"] > killed_round:
                assert victim.status["peer_id"] not in sync["group"]


def test_restart_keeps_peer_id_and_resumes_from_checkpoint(local_swarm):
    first = local_swarm.start_one(0, rounds=2)
    assert wait_until(lambda: first.proc.poll() is not None, 120, 0.5)
    assert first.proc.returncode == 0
    peer = first.status["peer_id"]
    key_mode = os.stat(first.data_dir / "identity.key").st_mode & 0o777
    assert key_mode == 0o600
    second = local_swarm.start_one(0, rounds=3)
    assert wait_until(lambda: second.proc.poll() is not None, 120, 0.5)
    assert second.proc.returncode == 0
    assert second.status["peer_id"] == peer
    events = read_events(second.data_dir / "events.jsonl")
    resumes = [e for e in events if e["event"] == "resume"]
    assert resumes and resumes[-1]["round"] == 2
    rounds = [e["round"] for e in events if e["event"] == "round"]
    assert rounds == [1, 2, 3]  # round 3 only after the restart: nothing redone
    assert local_swarm.wait_all(5)


def test_stop_with_sigterm_ends_the_syncs_in_flight_and_leaves_nothing_behind(local_swarm):
    """A node stopped while a sync is in flight lets it end: its peer's result holds its
    work. On the wall clock a sync's result is taken once it is done, and this node
    takes its results only a million steps after each sync starts (``sync.tau``, its own
    setting), so its first syncs stay in flight until it stops. Stopped nodes leave no
    process behind."""
    seconds = ["sync.trigger='seconds'", "sync.round_seconds=6", "network.matchmaking_seconds=1.5"]
    late = {0: ["--set", "sync.tau=1000000"]}
    node, peer = local_swarm.launch(2, rounds=50, extra=seconds, args=late)
    assert wait_until(lambda: node.status.get("in_flight"), 120, 0.02), node.status
    node.proc.send_signal(signal.SIGTERM)
    in_flight = {tuple(s) for s in node.status["in_flight"]}
    local_swarm.record_helpers()
    assert local_swarm.helper_pids, "node reported no p2pd/DHT helpers"
    assert wait_until(lambda: node.proc.poll() is not None, 60)
    assert node.proc.returncode == 0
    assert node.status["state"] == "stopped"
    me = node.status["peer_id"]
    left = read_events(node.data_dir / "events.jsonl", "sync_left")
    # what was in flight as the signal went (a sync launched since may have joined it)
    assert in_flight <= {(e["round"], e["fragment"]) for e in left}, (left, in_flight)
    assert all(me in part for e in left for part in e["contributors"]), left
    peer.proc.send_signal(signal.SIGTERM)
    assert wait_until(lambda: peer.proc.poll() is not None, 60)
    theirs = [
        e
        for e in read_events(peer.data_dir / "events.jsonl")
        if e["event"] in ("sync", "sync_left") and (e["round"], e["fragment"]) in in_flight
    ]
    assert theirs and all(me in part for e in theirs for part in e["contributors"]), theirs
    assert wait_until(lambda: not local_swarm.leftovers(), 15)


def test_raw_client_bad_messages_are_rejected_and_node_keeps_training(local_swarm, tmp_path):
    from protocol.errors import ProtocolError
    from protocol.p2p.transport import Transport, TransportConfig
    from protocol.wire.messages import Header, seal
    from verification.identity import Identity

    node = local_swarm.start_one(0, rounds=60, extra=["network.max_message_mb=1"])
    assert wait_until(lambda: node.status.get("state") == "training", 90)
    me, other = Identity.generate(), Identity.generate()
    me.save(tmp_path / "raw.key")
    client = Transport.start(
        TransportConfig(
            identity_path=tmp_path / "raw.key", initial_peers=tuple(node.status["maddrs"])
        )
    )
    try:
        target = node.status["peer_id"]
        header = Header("part", "itest", 1, 0, 0, me.peer_id)
        forged = seal(other, Header("part", "itest", 1, 0, 0, other.peer_id), {})
        signed = bytearray(seal(me, header, {"group": [me.peer_id], "weight": 1, "data": {}}))
        signed[-5] ^= 0xFF  # corrupt the signature
        bad = {
            "garbage": b"\x00\xffnot msgpack",
            "oversized": b"x" * (2 * 2**20),
            "unsigned": bytes(signed[:-64]) + bytes(64),
            "wrong_signer": forged,
            "bad_signature": bytes(signed),
        }
        step_before = node.status.get("step", 0)
        reasons = {}
        for name, payload in bad.items():
            for rpc in ("atoll.part", "atoll.state"):
                with pytest.raises(ProtocolError) as info:
                    client.run(client.call(target, rpc, payload, timeout=10), 15)
                reasons[(name, rpc)] = info.value.reason
        assert reasons[("oversized", "atoll.part")] == "oversized"
        unexpected = {k: r for k, r in reasons.items() if r not in ("remote_error", "oversized")}
        assert not unexpected, unexpected
        assert wait_until(lambda: node.status.get("step", 0) > step_before + 5, 60)
        assert node.proc.poll() is None
    finally:
        client.shutdown()
    log = (node.data_dir / "node.log").read_text()
    for reason in ("malformed", "sender_mismatch", "bad_signature", "oversized"):
        assert reason in log, reason
