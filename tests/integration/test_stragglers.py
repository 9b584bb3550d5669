"""Mismatched speeds, late joiners and restarts, with real nodes on the wall clock."""

from __future__ import annotations

import os
import signal

import pytest

from node.ops.swarm import wait_for_maddrs
from node.run.metrics import read_events
from tests.integration.conftest import wait_until
from verification.audit import AuditLog

pytestmark = [pytest.mark.integration, pytest.mark.exclusive, pytest.mark.timeout(300)]

SECONDS = [
    "sync.trigger='seconds'",
    "sync.round_seconds=6",
    "network.matchmaking_seconds=1.5",
    "network.round_timeout=4",
    "run.eval_every=1000",
]
SLOWDOWNS = [1, 1, 2, 4]
# Long enough that a node restarting on a loaded 2-core machine misses few rounds.
SLOW_ROUNDS = [*SECONDS, "sync.round_seconds=10"]


def _with_slowdowns(n: int) -> dict[int, list[str]]:
    return {i: ["--slowdown", str(x)] for i, x in enumerate(SLOWDOWNS[:n])}


def _idle_share(node) -> float:
    st = node.status
    return st["idle_seconds"] / (st["idle_seconds"] + st["busy_seconds"])


def test_seconds_mode_fast_nodes_never_wait_and_globals_agree(local_swarm):
    local_swarm.launch(4, rounds=3, extra=SECONDS, args=_with_slowdowns(4))
    assert local_swarm.wait_all(200)
    summary = local_swarm.summary()
    assert summary["exit_codes"] == [0] * 4, summary["failed_nodes"]
    assert summary["rounds_checked"] == 3 and summary["params_agree"], summary
    for node in local_swarm.nodes[:2]:
        assert _idle_share(node) < 0.05, node.status
    tokens = [n.status["tokens"] for n in local_swarm.nodes]
    assert tokens[0] > 2.5 * tokens[3]  # the slow node did less and still took part
    for node in local_swarm.nodes:
        syncs = read_events(node.data_dir / "events.jsonl", "sync")
        assert all(len(s["group"]) == 4 and s["complete"] for s in syncs), syncs


def test_steps_mode_makes_fast_nodes_wait(local_swarm):
    local_swarm.launch(
        4, rounds=2, extra=["network.matchmaking_seconds=30"], args=_with_slowdowns(4)
    )
    assert local_swarm.wait_all(240)
    summary = local_swarm.summary()
    assert summary["params_agree"]
    for node in local_swarm.nodes[:2]:
        assert _idle_share(node) > 0.3, node.status  # waiting for the 4x slower node


@pytest.mark.slow
def test_late_joiner_takes_the_global_state_and_contributes(local_swarm):
    nodes = local_swarm.launch(3, rounds=7, extra=SLOW_ROUNDS)
    assert wait_until(lambda: all(n.status.get("round", 0) >= 2 for n in nodes), 120)
    peers = wait_for_maddrs(nodes[0])
    late = local_swarm.start_one(3, rounds=7, extra=SLOW_ROUNDS, peers=peers, nodes=3)
    assert local_swarm.wait_all(240)
    assert late.proc.returncode == 0
    events = read_events(late.data_dir / "events.jsonl")
    caught_up = [e["round"] for e in events if e["event"] == "catch_up"]
    assert caught_up, "the late node never took the swarm's state"
    joins = [e for e in events if e["event"] == "join"]
    assert len(joins) <= 1, joins
    if joins and "contributes_from" in joins[0]:
        # Came up after the round following its state had begun: it sits out only the
        # round in progress, which is at most two rounds past the state it took (the
        # swarm may finish a round while the joiner downloads).
        join = joins[0]
        assert join["state_round"] == caught_up[0]
        assert join["contributes_from"] == join["round"] + 1 <= caught_up[0] + 3, join
        expected = join["contributes_from"]
    elif joins:
        # Current state, but the round had begun: it joins the fragments still ahead
        # (none left: from the next round).
        join = joins[0]
        assert join["state_round"] == caught_up[0] == join["round"] - 1, join
        fragments = 2  # sync.fragments in the tests' config
        expected = join["round"] + (1 if join["from_fragment"] >= fragments else 0)
    else:
        expected = caught_up[0] + 1  # in time for the round after the state it took
    first_sync = min(e["round"] for e in events if e["event"] == "sync")
    assert first_sync == expected, (joins, caught_up, first_sync)
    mine = {e["round"]: e["global_digest"] for e in events if e["event"] == "round"}
    theirs = {
        e["round"]: e["global_digest"]
        for e in read_events(nodes[0].data_dir / "events.jsonl", "round")
    }
    after = [r for r in mine if r >= first_sync]
    assert after and all(mine[r] == theirs[r] for r in after), (mine, theirs)
    contributed = [
        e
        for e in read_events(nodes[0].data_dir / "events.jsonl", "sync")
        if late.status["peer_id"] in e["group"]
    ]
    assert contributed
    assert read_events(nodes[0].data_dir / "events.jsonl", "violation") == []


def test_sigkilled_node_restarts_from_checkpoint_without_audit_gaps(local_swarm):
    # Two nodes, each waiting for the other (min_peers = 2): the survivor trains alone
    # meanwhile and cannot attest a round with anyone; both must train together again.
    nodes = local_swarm.launch(2, rounds=6, extra=[*SLOW_ROUNDS, "network.min_peers=2"])
    victim = nodes[1]
    assert wait_until(lambda: victim.status.get("round", 0) >= 2, 120, 0.05)
    killed_after = victim.status["round"]
    os.kill(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait(10)
    peers = wait_for_maddrs(nodes[0])
    again = local_swarm.start_one(
        1, rounds=6, extra=[*SLOW_ROUNDS, "network.min_peers=2"], peers=peers, nodes=2
    )
    assert local_swarm.wait_all(240)
    assert again.proc.returncode == 0
    events = read_events(again.data_dir / "events.jsonl")
    resumed = [e for e in events if e["event"] == "resume"]
    assert resumed and resumed[-1]["round"] == killed_after
    log = AuditLog(again.data_dir / "atoll.db")
    try:
        assert log.verify()[0]
        rounds = {row.round for row in log.rows()}
    finally:
        log.close()
    final = again.status["round"]
    back = min(
        e["round"]
        for e in events
        if e["event"] == "sync" and e["round"] > killed_after and len(e["group"]) == 2
    )
    # killed and restarted in round killed_after + 1: both train together again within
    # two rounds of it (it sits out the round its start ends in when that one has begun)
    assert back <= killed_after + 3, back
    # every round before the kill and every round since its return is in the log: the
    # only gap is the interrupted round and the rounds spent restarting
    assert set(range(1, killed_after + 1)) | set(range(back, final + 1)) <= rounds
    last = {e["round"]: e["global_digest"] for e in events if e["event"] == "round"}
    theirs = {
        e["round"]: e["global_digest"]
        for e in read_events(nodes[0].data_dir / "events.jsonl", "round")
    }
    # the survivor finished too, and from the round they met again they hold one state
    assert nodes[0].proc.returncode == 0
    assert all(last[r] == theirs[r] for r in range(back, final + 1)), (back, last, theirs)
    # it came back as a joiner does, and its first contribution carried no more than its
    # share: no one charged it (the work it did while sitting a round out was dropped)
    me = again.status["peer_id"]
    for node in nodes[:1]:
        charged = [
            (e["round"], e["reason"])
            for e in read_events(node.data_dir / "events.jsonl", "violation")
            if e["peer"] == me
        ]
        assert charged == [], (node.index, charged)
