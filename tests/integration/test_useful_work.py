"""Useful-work checks with real nodes.

In a swarm larger than one group (six nodes in groups of three that mix their global
copies, two fragments), one member sends nothing but zeros and one trains a tenth of the
steps it claims. Neither breaks a rule a screen can see; every honest node's checks flag
the zero member by the sent check (what it sent is not what its trace trained), and the
lazy member from replays of its trace (the windows it skipped do not replay); none flags
an honest node, every replay and sent check of an honest member passes, and the honest
nodes end near each other. In a clean swarm of one group with two fragments, the checks run every round and
charge no one."""

from __future__ import annotations

import pytest

from node.run.metrics import read_events
from tests.integration.conftest import Swarm

pytestmark = [pytest.mark.integration, pytest.mark.exclusive, pytest.mark.timeout(480)]

NODES, ROUNDS = 6, 8
CHECKS = [
    "sync.inner_steps=24",
    "network.group_size=3",
    "trust.aggregator='centered_clip'",
    "trust.checkers=2",
    "trust.check_fragments=2",
    "trust.check_from_round=3",
    "trust.check_budget=1.0",
    "trust.quarantine_rounds=10",
    "train.total_steps=400",
    "trust.replay_steps=4",
]
CHECKS_CHARGES = ("useless_work", "bad_check_record")
LAZY_ROUND = 3
"""The round by which every honest node flags the lazy and the zero member: replay and
sent checks run from the first round (they need none of the statistical checks' warm-up,
``trust.check_from_round``), so the lazy member's round-1 trace fails its checkers'
replay in round 2 and the zero member's round-1 contribution their sent checks, and
every other node checks the evidence they gossip; a round's checks run in the round
after, and a loaded machine may make them a round late."""
BOUND = 1.08
"""The honest nodes' bits per byte at most this over the best honest node's (the two
attackers cost the swarm some of its work until they are flagged)."""


@pytest.mark.parametrize(
    "exchange",
    # a gather's checkers fetch the one part each member committed to the group
    ["reduce", pytest.param("gather", marks=pytest.mark.slow)],
)
def test_a_zero_member_is_flagged_by_every_honest_node_in_mixing_groups_beside_a_lazy_one(
    local_swarm: Swarm, exchange: str
) -> None:
    local_swarm.launch(
        NODES,
        ROUNDS,
        [*CHECKS, f"sync.exchange={exchange!r}"],
        {NODES - 2: ["--byzantine", "zero"], NODES - 1: ["--byzantine", "lazy"]},
    )
    assert local_swarm.wait_all(450), "swarm did not finish"
    summary = local_swarm.summary()
    honest = local_swarm.nodes[: NODES - 2]
    zero = local_swarm.nodes[NODES - 2].status["peer_id"]
    lazy = local_swarm.nodes[NODES - 1].status["peer_id"]
    honest_ids = {n.status["peer_id"] for n in honest}
    assert [n.proc.returncode for n in honest] == [0] * len(honest), summary["failed_nodes"]
    finals = []
    for node in honest:
        log = read_events(node.data_dir / "events.jsonl")
        rounds = [e for e in log if e["event"] == "round"]
        # the checks charge no honest node (the screens' own false positives, a
        # pseudo-gradient norm past 3 times its group's median now and then in groups of
        # three whose copies sit apart, are listed in docs/limits.md)
        charged = {
            e["peer"] for e in log if e["event"] == "violation" and e["reason"] in CHECKS_CHARGES
        }
        assert not charged & honest_ids, (node.index, _charges(log, honest_ids))
        assert not {p for e in rounds for p in e["checks"]["flagged"]} & honest_ids
        first = min((e["round"] for e in rounds if zero in e["checks"]["flagged"]), default=None)
        sent = [e for e in log if e["event"] == "replay" and e["peer"] == zero and e["sent"]]
        assert first is not None and first <= LAZY_ROUND, (node.index, first, sent)
        assert any(not e["passed"] for e in sent), [
            (e["round"], e["fragment"], e["passed"], e["distance"], e["why"]) for e in sent
        ]
        # the checks ran in every mixing round from the first checked one, and the
        # zero member was flagged by them (it breaks no screen)
        checks = [e["checks"] for e in rounds if e["round"] > 3]
        assert all(c["made"] + c["taken"] > 0 for c in checks), checks
        assert zero in rounds[-1]["checks"]["flagged"], rounds[-1]["checks"]
        lazy_at = min((e["round"] for e in rounds if lazy in e["checks"]["flagged"]), default=None)
        replays = [e for e in log if e["event"] == "replay" and e["peer"] == lazy]
        assert lazy_at is not None and lazy_at <= LAZY_ROUND, (node.index, lazy_at, replays)
        # every replay and sent check of an honest member passed
        honest_replays = [e for e in log if e["event"] == "replay" and e["peer"] in honest_ids]
        assert honest_replays and all(e["passed"] for e in honest_replays), honest_replays
        assert any(e["sent"] for e in honest_replays), honest_replays
        # each member kept the start states its checkers drew, and only those (a member
        # too busy to answer in time is not this; it is counted apart)
        unserved = [e for e in log if e["event"] == "unserved"]
        assert rounds[-1]["checks"]["replay_unserved"] == 0, unserved
        assert all(e["why"] and not e["why"].startswith("it no longer") for e in unserved)
        mixed = [e for e in log if e["event"] == "sync" and e["mixed"]]
        assert mixed, "the groups never mixed"
        finals.append(next(e["val_bpb"] for e in reversed(rounds) if "val_bpb" in e))
    assert max(finals) <= BOUND * min(finals), finals
    assert not local_swarm.leftovers()


def test_a_clean_group_with_two_fragments_checks_every_round_and_charges_no_one(
    local_swarm: Swarm,
) -> None:
    nodes = 5
    clean = [c for c in CHECKS if not c.startswith("network.group_size")]
    local_swarm.launch(nodes, 8, [*clean, f"network.group_size={nodes}"])
    assert local_swarm.wait_all(400), "swarm did not finish"
    summary = local_swarm.summary()
    ids = {n.status["peer_id"] for n in local_swarm.nodes}
    assert summary["exit_codes"] == [0] * nodes, summary["failed_nodes"]
    assert summary["params_agree"], summary["rounds_disagreeing"]
    for node in local_swarm.nodes:
        log = read_events(node.data_dir / "events.jsonl")
        assert not [e for e in log if e["event"] in ("violation", "check_refused")], _charges(
            log, ids
        )
        rounds = [e for e in log if e["event"] == "round"]
        made = [e["checks"]["made"] + e["checks"]["taken"] for e in rounds]
        assert all(b > a for a, b in zip(made[3:], made[4:])), made  # every round's
        assert not rounds[-1]["checks"]["flagged"]
        # each member kept the start states its checkers drew (and dropped the rest)
        unserved = [e for e in log if e["event"] == "unserved"]
        assert rounds[-1]["checks"]["replay_unserved"] == 0, unserved
        assert rounds[-1]["checks"]["replayed"] > 0, rounds[-1]["checks"]
    assert not local_swarm.leftovers()


def _charges(log: list[dict], honest_ids: set[str]) -> list[tuple]:
    """What a node charged honest peers with, and the records it counted against them:
    a failure names its cause."""
    return [
        (e["event"], e.get("round"), e.get("peer", "")[-6:], e.get("reason"), e.get("work"))
        for e in log
        if e["event"] in ("violation", "check")
        and e.get("peer") in honest_ids
        and (e["event"] == "violation" or e.get("short"))
    ]
