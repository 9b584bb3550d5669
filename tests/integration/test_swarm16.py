"""Sixteen real nodes on one machine: butterfly groups of 4 contribute, mix and learn.

16 = 4 x 4, so with groups of 4 the butterfly layout mixes the swarm in two rounds
(rounds_to_mix(16, 4) == 2): each round a node averages with the three peers that
differ from it in one digit of the grid, the next round along the other digit. The
outer optimizer here is plain SGD (no momentum), so the members of a group adopt its
mean global copy and step it alike: they hold bit-identical copies of the fragment
after every sync, which makes agreement per the schedule checkable exactly.
"""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

import pytest

from node.run.metrics import read_events
from tests.integration.conftest import Swarm

# make test-all: two minutes of a 2-core machine for what smaller swarms in make test
# show too (butterfly mixing, the cell grid, a sharded registry: test_mixing.py)
pytestmark = [
    pytest.mark.integration,
    pytest.mark.exclusive,
    pytest.mark.slow,
    pytest.mark.timeout(900),
]

NODES, ROUNDS, FRAGMENTS = 16, 3, 2
EXTRA = [
    "network.group_size=4",
    "sync.layout='butterfly'",
    "run.threads=1",
    "outer.optimizer='sgd'",
    "outer.momentum=0",
    # 16 nodes share this machine's cores: generous windows, which cost nothing
    # unless a node is slow (matchmaking ends when every live peer has announced)
    "network.matchmaking_seconds=20",
    "network.round_timeout=20",
    "network.request_timeout=15",
    "network.min_peers_timeout=300",
    # a member whose commitment reaches the others after their commit phase closed is
    # refused (late_commit): on this loaded machine gossip can take seconds
    "control.commit_seconds=10",
    # the registry split over 4 DHT keys (network.registry_shards): every node must
    # still see every other, or matchmaking would not wait for it
    "network.registry_shards=4",
]


def _refusals(data_dir: Path) -> list[tuple]:
    """The parts this node's audit log refused: (round, fragment, sender, reason)."""
    with contextlib.closing(sqlite3.connect(data_dir / "atoll.db")) as db:
        rows = db.execute(
            "SELECT round, fragment, sender, reason FROM audit WHERE verdict = 'rejected'"
        )
        return [tuple(r) for r in rows]


def test_sixteen_nodes_in_groups_of_four_contribute_mix_and_learn(local_swarm: Swarm) -> None:
    nodes = local_swarm.launch(NODES, ROUNDS, EXTRA)
    assert local_swarm.wait_all(780), "the swarm did not finish in time"
    summary = local_swarm.summary()
    assert summary["exit_codes"] == [0] * NODES, summary["failed_nodes"]
    assert summary["rounds"] == ROUNDS
    ids = {n.status["peer_id"] for n in nodes}
    assert len(ids) == NODES

    # every node synced every fragment of every round in a complete group of 4, and
    # every node's contribution is in some group's result of every exchange
    syncs = {n.index: read_events(n.data_dir / "events.jsonl", "sync") for n in nodes}
    dirs = {n.index: n.data_dir for n in nodes}
    for index, mine in syncs.items():
        failed = read_events(dirs[index] / "events.jsonl", "sync_failed")
        assert [(s["round"], s["fragment"]) for s in mine] == [
            (r, f) for r in range(1, ROUNDS + 1) for f in range(FRAGMENTS)
        ], (index, failed)
        short = [
            (s["round"], s["fragment"], len(s["group"]), s["complete"], s["mixed"])
            for s in mine
            if not (len(s["group"]) == 4 and s["complete"] and s["mixed"])
        ]
        assert not short, (index, short, _refusals(dirs[index]))
    for r in range(1, ROUNDS + 1):
        for f in range(FRAGMENTS):
            contributed = {
                p
                for mine in syncs.values()
                for s in mine
                if (s["round"], s["fragment"]) == (r, f)
                for part in s["contributors"]
                for p in part
            }
            assert contributed == ids, (r, f, len(contributed))

    # through the sharded registry every node saw all 15 others
    seen = {
        n.index: max(e["live_peers"] for e in read_events(n.data_dir / "events.jsonl", "round"))
        for n in nodes
    }
    assert seen == {n.index: NODES - 1 for n in nodes}, seen

    # per the butterfly schedule: after any two consecutive rounds every node's value
    # has reached every other, and group members hold the same global copy
    mix = summary["mix"]
    assert mix["rounds_to_mix"] == 2
    assert mix["windows"] == (ROUNDS - 1) * FRAGMENTS
    assert mix["windows_mixed"] == mix["windows"], mix
    assert mix["groups"] == ROUNDS * FRAGMENTS * NODES // 4
    assert mix["groups_agreeing"] == mix["groups"], mix

    # and the swarm learns
    assert summary["val_bpb_end"] < summary["val_bpb_start"] - 1.0, (
        summary["val_bpb_start"],
        summary["val_bpb_end"],
    )
    # what the DHT and the control plane cost each node is reported
    assert all(v is not None and v > 0 for v in summary["control_messages_per_round"])
    assert all(v is not None and v > 0 for v in summary["dht_ops_per_round"])
