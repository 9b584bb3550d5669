"""Averaging without a swarm-wide all-reduce: butterfly mixing across groups and gossip."""

from __future__ import annotations

import pytest

from node.run.metrics import read_events
from tests.integration.conftest import Swarm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

NODES, ROUNDS = 4, 4
GOSSIP = ["sync.averaging='gossip'"]


def _run(swarm: Swarm, extra: list[str], args: dict[int, list[str]] | None = None) -> dict:
    swarm.launch(NODES, ROUNDS, extra, args)
    assert swarm.wait_all(280), "swarm did not finish"
    return swarm.summary()


def _syncs(swarm: Swarm, index: int) -> list[dict]:
    return read_events(swarm.nodes[index].data_dir / "events.jsonl", "sync")


@pytest.fixture(scope="module")
def allreduce(tmp_path_factory) -> dict:
    swarm = Swarm(tmp_path_factory.mktemp("allreduce") / "swarm")
    try:
        summary = _run(swarm, ["network.group_size=4"])
    finally:
        swarm.close()
    assert not swarm.leftovers()
    assert summary["params_agree"]
    return summary


def test_gossip_trains_within_five_percent_of_group_allreduce(allreduce, local_swarm):
    summary = _run(local_swarm, GOSSIP)
    assert summary["exit_codes"] == [0] * NODES, summary["failed_nodes"]
    for i in range(NODES):
        syncs = _syncs(local_swarm, i)
        assert len(syncs) == ROUNDS * 2  # two fragments a round
        assert all(len(s["group"]) == 2 and s["mixed"] and s["complete"] for s in syncs)
    # nodes hold different models, yet the swarm learns as fast at equal tokens
    assert not summary["params_agree"]
    # the step an in-flight sync is merged at depends on timing: runs of one setting
    # differ by a few % on a loaded machine
    assert summary["val_bpb_end"] <= allreduce["val_bpb_end"] * 1.05, (
        summary["val_bpb_end"],
        allreduce["val_bpb_end"],
    )


def test_butterfly_groups_of_two_follow_the_hypercube(allreduce, local_swarm):
    # the registry split over 2 DHT keys (network.registry_shards): every node must still
    # see every other, or the hypercube would not close (16 nodes in test_swarm16.py)
    summary = _run(local_swarm, ["network.group_size=2", "network.registry_shards=2"])
    assert summary["exit_codes"] == [0] * NODES, summary["failed_nodes"]
    partners: dict[int, list[set[str]]] = {}
    for i in range(NODES):
        me = local_swarm.nodes[i].status["peer_id"]
        for s in _syncs(local_swarm, i):
            assert len(s["group"]) == 2 and s["mixed"] and s["complete"]
            if s["fragment"] == 0:
                partners.setdefault(i, []).append(set(s["group"]) - {me})
    # 4 = 2 x 2: the axis alternates, so each node meets its two hypercube neighbours
    for seen in partners.values():
        assert seen[0] == seen[2] and seen[1] == seen[3] and seen[0] != seen[1]
    # the step an in-flight sync is merged at depends on timing: runs of one setting
    # differ by a few % on a loaded machine
    assert summary["val_bpb_end"] <= allreduce["val_bpb_end"] * 1.05, (
        summary["val_bpb_end"],
        allreduce["val_bpb_end"],
    )


def test_above_cells_above_nodes_matchmake_on_their_line_of_the_grid(allreduce, local_swarm):
    # 4 nodes > cells_above = 2: each announces and reads under its line's DHT key
    # (with G = 2 and 4 nodes the grid has one axis, so one line holds everyone)
    summary = _run(local_swarm, ["network.group_size=2", "network.cells_above=2"])
    assert summary["exit_codes"] == [0] * NODES, summary["failed_nodes"]
    groups: dict[tuple[int, int], set[frozenset[str]]] = {}
    for i in range(NODES):
        me = local_swarm.nodes[i].status["peer_id"]
        syncs = _syncs(local_swarm, i)
        assert len(syncs) == ROUNDS * 2
        for s in syncs:
            assert s["cell"] == "g2d1:*" and s["complete"] and s["mixed"]
            assert me in s["group"] and len(s["group"]) == 2
            groups.setdefault((s["round"], s["fragment"]), set()).add(frozenset(s["group"]))
    # every node computed the group its partner computed: two disjoint pairs each time
    for pairs in groups.values():
        assert len(pairs) == 2 and len(frozenset().union(*pairs)) == NODES
    assert summary["val_bpb_end"] <= allreduce["val_bpb_end"] * 1.05, (
        summary["val_bpb_end"],
        allreduce["val_bpb_end"],
    )


def test_a_byzantine_partner_in_gossip_is_screened_out_and_quarantined(allreduce, local_swarm):
    summary = _run(local_swarm, GOSSIP, {NODES - 1: ["--byzantine", "scale"]})
    attacker = local_swarm.nodes[NODES - 1].status["peer_id"]
    honest = local_swarm.nodes[: NODES - 1]
    assert [n.proc.returncode for n in honest] == [0] * (NODES - 1)
    for node in honest:
        violations = [
            e
            for e in read_events(node.data_dir / "events.jsonl", "violation")
            if e["peer"] == attacker
        ]
        partnered = any(attacker in s["group"] for s in _syncs(local_swarm, node.index))
        if partnered:  # only a node paired with the attacker sees its parts
            # refused as a partner's part (norm) or as an owner's result (owner_norm)
            assert violations and violations[0]["reason"] in ("norm", "owner_norm"), violations
            assert summary["flagged"][str(node.index)].get(attacker) == "quarantined"
        assert not set(summary["flagged"][str(node.index)]) - {attacker}
    assert summary["val_bpb_end"] <= allreduce["val_bpb_end"] * 1.05
