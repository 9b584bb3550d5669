"""The GossipSub control channel on real nodes: heartbeats, commitments, verdicts, sidecars."""

from __future__ import annotations

import os
import signal
import time

import msgpack
import pytest

from node.run.metrics import read_events
from protocol.control.channel import ChannelSettings, ControlChannel
from protocol.control.frames import CONTROL_VERSION, sign_control, topic_name
from tests.integration.conftest import alive, wait_until
from verification.audit import AuditLog
from verification.identity import Identity

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

RUN = "itest"  # the run id of the integration workload (conftest.SMALL)


def _peers_seen(node) -> set[str]:
    return set((node.status.get("swarm") or {}).get("peers", {}))


def test_every_node_sees_every_heartbeat_within_seconds(local_swarm):
    nodes = local_swarm.launch(4, rounds=3)
    assert wait_until(
        lambda: all(n.status.get("state") in ("ready", "training") for n in nodes), 120
    )
    ready = time.monotonic()
    ids = lambda: {n.status["peer_id"] for n in nodes}  # noqa: E731
    assert wait_until(
        lambda: all(_peers_seen(n) == ids() - {n.status["peer_id"]} for n in nodes), 30, 0.2
    ), [_peers_seen(n) for n in nodes]
    seen_after = time.monotonic() - ready
    assert seen_after < 15, seen_after  # registry refresh (2 s) + dial + one heartbeat
    assert local_swarm.wait_all(200)
    assert local_swarm.summary()["params_agree"]
    for n in nodes:  # commitments on, honest nodes: no part was refused for them
        rejected = [e for e in read_events(n.data_dir / "events.jsonl", "violation")]
        assert rejected == []
        swarm = n.status["swarm"]
        assert swarm["dropped"] == {} and swarm["forged_verdicts"] == 0


@pytest.mark.parametrize(
    "mode, proof",
    [
        # two different signed commitments for one (round, fragment)
        ("equivocate", "equivocation"),
        # an owner's signed result names a digest other than the member's commitment: the
        # same path from proof to ban, so in make test-all only (its evidence rule is
        # unit-tested in tests/unit/verification/test_evidence.py)
        pytest.param("bad_owner", "bad_owner", marks=pytest.mark.slow),
    ],
)
def test_a_proven_cheat_is_banned_by_every_honest_node(local_swarm, mode, proof):
    local_swarm.launch(4, rounds=2, args={3: ["--byzantine", mode]})
    assert local_swarm.wait_all(240)
    summary = local_swarm.summary()
    cheat = local_swarm.nodes[3].status["peer_id"]
    for node in local_swarm.nodes[:3]:
        assert node.proc.returncode == 0
        proofs = [
            e
            for e in read_events(node.data_dir / "events.jsonl", "violation")
            if e["peer"] == cheat and e["reason"] == proof
        ]
        assert proofs and proofs[0]["round"] <= 2, proofs
        assert summary["flagged"][str(node.index)] == {cheat: "banned"}
    # honest members refused the cheat's parts or results and repaired those alike
    assert summary["params_agree"], summary["rounds_disagreeing"]


def _bad_owner_evidence(member: Identity, cheat: Identity, numel: int) -> dict[str, bytes]:
    """A member's signed commitment to part 1 of round 1, and a cheat's signed result
    of ``numel`` values for that part naming another digest for the member."""
    import torch

    from protocol.wire.messages import Header
    from protocol.wire.partwire import open_part, seal_part

    committed, named = b"\x01" * 32, b"\x02" * 32
    body = {"round": 1, "fragment": 0, "content": "update", "digests": [[1, committed]]}
    commit = sign_control(member, RUN, topic_name(RUN, "commit"), 1, body)
    values = torch.zeros(numel).numpy().view("uint8")
    meta = {
        "content": "update",
        "contributors": [member.peer_id],
        "digests": [named],
        "weights": [1.0],
    }
    sealed = seal_part(cheat, Header("reduced", RUN, 1, 0, 1, cheat.peer_id), meta, values)
    wire = b"".join(bytes(b) for b in sealed.buffers())
    return {"reduced": open_part(wire, max_bytes=2**28).evidence(), "commit": commit}


def _meshed(channel: ControlChannel, topic: str, peers: int) -> bool:
    """Whether ``peers`` peers are subscribed to ``topic`` and in the channel's mesh for
    it (grafted at a heartbeat, every second)."""
    stats = channel.stats(refresh=True)
    subscribed = stats.get("topic_peers", {}).get(topic, [])
    return len(subscribed) == peers and stats.get("mesh", {}).get(topic, 0) == peers


def test_verdicts_are_checked_forged_ones_cost_nothing_and_a_proven_one_bans(local_swarm, tmp_path):
    # Forged verdicts cost the accused nothing; a bad-owner verdict about a part of ten
    # million values (its evidence: the owner's signed head, a few kB) reaches every
    # node, each checks it and bans the owner.
    nodes = local_swarm.launch(3, rounds=15)  # long enough to outlive the forgeries
    assert wait_until(lambda: all(n.status.get("control_addrs") for n in nodes), 120)
    accused = nodes[0].status["peer_id"]
    forger = Identity.generate()
    forger.save(tmp_path / "forger.key")
    topic = topic_name(RUN, "verdict")
    commit = topic_name(RUN, "commit")
    with ControlChannel.start(
        ChannelSettings(tmp_path / "forger.key", RUN), [topic], lambda *_: None, identity=forger
    ) as channel:
        channel.connect([a for n in nodes for a in n.status["control_addrs"]])
        assert wait_until(lambda: len(channel.stats(refresh=True).get("peers", [])) == 3, 30)
        assert wait_until(lambda: _meshed(channel, topic, 3), 30), channel.stats()
        # evidence the forger signed itself, claimed to be the accused's
        fake = [
            sign_control(forger, RUN, commit, 1, {"round": 1, "fragment": 0, "digests": []}),
            sign_control(
                forger, RUN, commit, 2, {"round": 1, "fragment": 0, "digests": [[0, b"x" * 32]]}
            ),
        ]
        assert channel.publish(
            topic, {"accused": accused, "kind": "equivocation", "evidence": fake}
        )
        # a verdict whose own signature is broken never reaches a node's logic
        signed = msgpack.unpackb(sign_control(forger, RUN, topic, 3, {"accused": accused}))
        signed[2] = bytes(64)
        channel._sidecar.send({"op": "publish", "topic": topic, "data": msgpack.packb(signed)})
        others = nodes[1:]
        assert wait_until(
            lambda: all(n.status["swarm"]["forged_verdicts"] >= 1 for n in others), 30
        ), [n.status["swarm"] for n in others]
        assert wait_until(
            lambda: all(n.status["swarm"]["dropped"].get("bad_signature") for n in others), 30
        ), [n.status["swarm"]["dropped"] for n in others]
        cheat = Identity.generate()
        evidence = _bad_owner_evidence(forger, cheat, 10_000_000)
        assert len(evidence["reduced"]) < 4096
        assert channel.publish(
            topic, {"accused": cheat.peer_id, "kind": "bad_owner", "evidence": evidence}
        )
        assert wait_until(
            lambda: all(n.status.get("flagged", {}).get(cheat.peer_id) == "banned" for n in nodes),
            30,
        ), [n.status.get("flagged") for n in nodes]
    assert local_swarm.wait_all(200)
    for node in nodes:
        assert node.status["flagged"] == {cheat.peer_id: "banned"}
        assert node.status["reputations"].get(accused, {}).get("violations", 0) == 0
        violations = read_events(node.data_dir / "events.jsonl", "violation")
        assert {(e["peer"], e["reason"]) for e in violations} == {(cheat.peer_id, "bad_owner")}
    assert CONTROL_VERSION == 1


def test_uncommitted_and_late_committed_parts_are_rejected(local_swarm):
    args = {2: ["--byzantine", "skip_commit"], 3: ["--byzantine", "late_commit"]}
    local_swarm.launch(4, rounds=2, args=args)
    assert local_swarm.wait_all(240)
    skipper, late = (local_swarm.nodes[i].status["peer_id"] for i in (2, 3))
    for node in local_swarm.nodes[:2]:
        assert node.proc.returncode == 0
        log = AuditLog(node.data_dir / "atoll.db")
        try:
            reasons = {
                peer: {r.reason for r in log.rows(peer=peer) if r.verdict == "rejected"}
                for peer in (skipper, late)
            }
        finally:
            log.close()
        assert "uncommitted" in reasons[skipper], reasons
        assert "late_commit" in reasons[late], reasons


def test_a_killed_sidecar_comes_back_and_training_goes_on(local_swarm):
    nodes = local_swarm.launch(3, rounds=6)
    node = nodes[0]
    assert wait_until(lambda: (node.status.get("swarm") or {}).get("sidecar_pid"), 120)
    assert wait_until(lambda: node.status.get("round", 0) >= 1, 120, 0.1)
    first = node.status["swarm"]["sidecar_pid"]
    os.kill(first, signal.SIGKILL)
    killed_at = node.status["round"]
    assert wait_until(
        lambda: (
            node.status["swarm"].get("sidecar_pid") not in (None, first)
            and node.status["swarm"]["sidecar_restarts"] >= 1
        ),
        60,
    ), node.status["swarm"]
    assert not alive(first)
    assert local_swarm.wait_all(240)
    assert [n.proc.returncode for n in nodes] == [0, 0, 0]
    assert node.status["round"] == 6 > killed_at
    # after it came back, the others hear its heartbeats again
    for other in nodes[1:]:
        assert node.status["peer_id"] in _peers_seen(other)
