"""Useful-work checks with real nodes: six nodes in one group, one training honestly on
random bytes and one sending nothing but zeros. Neither breaks a rule a screen can see;
both are flagged by every honest node from what their contributions do to the loss,
and no honest node is."""

from __future__ import annotations

import pytest

from node.metrics import read_events
from tests.integration.conftest import Swarm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

NODES, ROUNDS = 6, 5
CHECKS = [
    "sync.fragments=1",
    "sync.inner_steps=12",
    "network.group_size=6",
    "trust.aggregator='centered_clip'",
    "trust.checkers=2",
    "trust.check_from_round=2",
    "trust.check_batches=4",
    "trust.quarantine_rounds=10",
]
GOAL_ROUNDS = 5


def test_random_data_and_zero_members_are_flagged_by_every_honest_node(
    local_swarm: Swarm,
) -> None:
    local_swarm.launch(
        NODES,
        ROUNDS,
        CHECKS,
        {NODES - 2: ["--byzantine", "random_data"], NODES - 1: ["--byzantine", "zero"]},
    )
    assert local_swarm.wait_all(400), "swarm did not finish"
    summary = local_swarm.summary()
    honest = local_swarm.nodes[: NODES - 2]
    attackers = {n.status["peer_id"] for n in local_swarm.nodes[NODES - 2 :]}
    zero = local_swarm.nodes[NODES - 1].status["peer_id"]
    honest_ids = {n.status["peer_id"] for n in honest}
    assert [n.proc.returncode for n in honest] == [0] * len(honest)
    assert summary["params_agree"], summary["rounds_disagreeing"]
    for node in honest:
        flagged = summary["flagged"][str(node.index)]
        assert not honest_ids & set(flagged), (
            f"node {node.index} flagged an honest peer: {flagged}",
            _charges(node, honest_ids),
        )
        assert attackers <= set(flagged), (node.index, flagged)
        rounds = read_events(node.data_dir / "events.jsonl", "round")
        first = {
            p: min((e["round"] for e in rounds if p in e["flagged"]), default=None)
            for p in attackers
        }
        assert all(r is not None and r <= GOAL_ROUNDS for r in first.values()), first
        # the zero member breaks no screen: the checks flag it; every failing record a
        # node counted it made itself or recomputed first
        checks = read_events(node.data_dir / "events.jsonl", "check")
        assert not any(c["flagged"] for c in checks if c["peer"] in honest_ids)
        last = rounds[-1]["checks"]
        assert zero in last["flagged"] and last["recomputed"] > 0, last
    assert not local_swarm.leftovers()


def _charges(node, honest_ids: set[str]) -> list[tuple]:
    """What ``node`` charged honest peers with, and the records it refused: a failure
    names its cause."""
    whom = {"violation": "peer", "check_refused": "checker", "check": "peer"}
    return [
        (e["event"], e.get("round"), e[whom[e["event"]]][-6:], e.get("reason"))
        for e in read_events(node.data_dir / "events.jsonl")
        if e["event"] in whom and e[whom[e["event"]]] in honest_ids and e.get("passed") is not True
    ]
