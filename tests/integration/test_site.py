"""Sites of several processes (torchrun, gloo on CPU): two sites of two ranks train
together and check each other's work against their ranks' assigned batches (and replay
windows of each other's training, both ranks' batches in one process); a rank
that dies stops its site cleanly while the other site goes on."""

from __future__ import annotations

import psutil
import pytest

from node.run.metrics import read_events
from tests.integration.conftest import alive, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

BATCH, CONTEXT = 8, 64  # QUICK_WORKLOAD's batch and context


def _rank_processes(node) -> dict[int, psutil.Process]:
    """The site's ranks by RANK: the children of its torchrun agent."""
    out = {}
    for child in psutil.Process(node.proc.pid).children(recursive=True):
        try:
            env = child.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if "RANK" in env and "node.cli" in " ".join(child.cmdline()):
            out[int(env["RANK"])] = child
    return out


CHECKS = [
    "trust.checkers=1",
    "trust.check_fragments=2",
    "trust.check_from_round=1",
    "trust.check_budget=1.0",
]


# FSDP's ranks are kept in step over gloo by tests/unit/node/train/test_site.py; its whole
# two-site run is in make test-all
@pytest.mark.parametrize("sharding", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_two_sites_of_two_ranks_train_together_and_their_ranks_agree(local_swarm, sharding):
    # a DDP site's windows are replayed (FSDP would need every shard's state)
    replay = ["trust.replay_steps=4"] if sharding == "ddp" else []
    extra = [f"train.sharding='{sharding}'", *CHECKS, *replay]
    nodes = local_swarm.launch(2, rounds=3, extra=extra, procs_per_node=2)
    assert wait_until(lambda: all(len(_rank_processes(n)) == 2 for n in nodes), 60)
    local_swarm.record_helpers()
    assert local_swarm.wait_all(240)
    summary = local_swarm.summary()
    assert summary["exit_codes"] == [0, 0], summary["failed_nodes"]
    assert summary["rounds"] == 3 and summary["params_agree"]
    assert summary["ranks_agree"] is True  # every rank of each site, every round
    assert summary["val_bpb_end"] < summary["val_bpb_start"]
    ids = [n.status["peer_id"] for n in nodes]
    for n in nodes:
        status = n.status
        assert status["ranks"] == 2
        # a site's tokens are the sum over its ranks
        assert status["tokens"] == status["step"] * BATCH * CONTEXT * 2
        # each site checked the other on both ranks' assigned batches: every claim
        # covers two ranks, and neither site was charged for its work
        log = read_events(n.data_dir / "events.jsonl")
        checks = [e for e in log if e["event"] == "check" and e["checker"] == status["peer_id"]]
        assert checks and all(e["peer"] in ids and e["peer"] != e["checker"] for e in checks)
        assert all(e["claimed"] > 0 and e["claimed"] % 2 == 0 for e in checks), checks
        assert any(e["measured"]["lift"] is not None for e in checks), checks
        assert not [e for e in log if e["event"] == "violation"], log
        if replay:  # the other site's windows, each rank's batches, trained again alike,
            # and what it sent is the sum of its windows (the leader's DDP module's)
            replays = [e for e in log if e["event"] == "replay"]
            assert replays and all(e["passed"] for e in replays), replays
            assert {e["sent"] for e in replays} == {True, False}, replays


def test_a_dead_rank_stops_its_site_cleanly_and_the_other_site_goes_on(local_swarm):
    # rounds enough that the site left alone does not finish them while the test looks
    nodes = local_swarm.launch(2, rounds=100_000, procs_per_node=2)
    assert wait_until(
        lambda: all(
            n.status.get("state") == "training" and n.status.get("round", 0) >= 1 for n in nodes
        ),
        150,
    )
    ranks = _rank_processes(nodes[1])
    local_swarm.record_helpers()
    site = {nodes[1].proc.pid, *(p.pid for p in ranks.values()), *nodes[1].status["helper_pids"]}
    ranks[1].kill()  # SIGKILL of a non-leader rank
    assert wait_until(lambda: nodes[1].proc.poll() is not None, 90), "the site did not stop"
    assert nodes[1].proc.returncode != 0
    # nothing of that site is left: torchrun's agent, both ranks, p2pd and its helpers
    assert wait_until(lambda: not [p for p in site if alive(p)], 30), [p for p in site if alive(p)]
    # the other site keeps training
    now = nodes[0].status["round"]
    assert wait_until(lambda: nodes[0].status.get("round", 0) >= now + 2, 120)
    assert nodes[0].proc.poll() is None
    assert len(_rank_processes(nodes[0])) == 2
