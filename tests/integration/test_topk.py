"""Real nodes with sparse pseudo-gradients (``sync.codec = "topk"``): they learn, agree
bitwise, catch a scaling attacker, and mix across groups of two."""

from __future__ import annotations

import pytest

from node.ops.swarm import butterfly_reach
from node.run.metrics import read_events
from tests.integration.conftest import Swarm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

# chunks of 256 keeping 8 values (3 %) in 2 bits: the small model's fragments hold tens of
# thousands of values, so every part keeps a few hundred
TOPK = [
    "sync.codec='topk'",
    "sync.topk_chunk=256",
    "sync.topk_density=0.03",
    "sync.topk_bits=2",
]


def _syncs(swarm: Swarm, index: int) -> list[dict]:
    return read_events(swarm.nodes[index].data_dir / "events.jsonl", "sync")


def _contain_a_scaling_attacker(
    swarm: Swarm, nodes: int, rounds: int, settings: list[str]
) -> tuple[dict, dict[str, list[dict]]]:
    """A swarm whose last node scales its parts: every honest node finished, agreed,
    learned and flagged the attacker and no one else, and synced every fragment of
    every round. The summary, and each honest node's syncs by its PeerID."""
    swarm.launch(nodes, rounds, settings, {nodes - 1: ["--byzantine", "scale"]})
    assert swarm.wait_all(280), "swarm did not finish"
    summary = swarm.summary()
    honest = swarm.nodes[: nodes - 1]
    attacker = swarm.nodes[nodes - 1].status["peer_id"]
    assert [n.proc.returncode for n in honest] == [0] * (nodes - 1)
    assert summary["params_agree"], summary["rounds_disagreeing"]
    assert summary["val_bpb_end"] < summary["val_bpb_start"] - 1.0
    honest_ids = {n.status["peer_id"] for n in honest}
    syncs = {}
    for node in honest:
        flagged = summary["flagged"][str(node.index)]
        assert not honest_ids & set(flagged), f"an honest peer was flagged: {flagged}"
        assert flagged.get(attacker) in ("quarantined", "banned"), flagged
        # every round synced both fragments (the attacker's parts left out: not complete)
        mine = syncs[node.status["peer_id"]] = _syncs(swarm, node.index)
        assert {(s["round"], s["fragment"]) for s in mine} == {
            (r, f) for r in range(1, rounds + 1) for f in (0, 1)
        }
    return summary, syncs


def test_five_nodes_learn_agree_and_flag_a_scaling_attacker(local_swarm: Swarm) -> None:
    settings = [*TOPK, "network.group_size=5", "trust.aggregator='centered_clip'"]
    summary, _ = _contain_a_scaling_attacker(local_swarm, 5, 3, settings)
    # sparse parts and their union results: far below the int8 codec's bytes (the int8
    # three-node test sends under a tenth of DDP's; topk sends under a hundredth here)
    assert sum(summary["bytes_sent_per_node"]) * 100 < sum(summary["ddp_bytes_per_node"])
    assert not local_swarm.leftovers()


def test_butterfly_groups_of_two_mix_with_topk(local_swarm: Swarm) -> None:
    nodes, rounds = 4, 4
    local_swarm.launch(nodes, rounds, [*TOPK, "network.group_size=2"])
    assert local_swarm.wait_all(280), "swarm did not finish"
    summary = local_swarm.summary()
    assert summary["exit_codes"] == [0] * nodes, summary["failed_nodes"]
    for i in range(nodes):
        syncs = _syncs(local_swarm, i)
        assert len(syncs) == rounds * 2
        # the pseudo-gradients travel as topk, the global copies as fp16 (sync.mix_codec)
        assert all(len(s["group"]) == 2 and s["mixed"] and s["complete"] for s in syncs)
    # every node's contribution reached every other within log2(4) = 2 rounds
    syncs = {local_swarm.nodes[i].status["peer_id"]: _syncs(local_swarm, i) for i in range(nodes)}
    mix = butterfly_reach(syncs, group_size=2)
    assert mix["rounds_to_mix"] == 2 and mix["windows"] > 0, mix
    assert mix["windows_mixed"] == mix["windows"], mix
    assert summary["val_bpb_end"] < summary["val_bpb_start"] - 1.0
    assert not local_swarm.leftovers()


@pytest.mark.slow
def test_gathering_nodes_agree_and_each_screens_a_scaling_attacker_itself(
    local_swarm: Swarm,
) -> None:
    # sync.exchange = "gather": every member sends its whole sparse part to every other
    # and reduces the group's parts itself; no owner answers with a result, and each
    # honest node screened the attacker's part itself
    settings = [*TOPK, "sync.exchange='gather'", "trust.aggregator='centered_clip'"]
    _, syncs = _contain_a_scaling_attacker(local_swarm, 4, 3, settings)
    for me, mine in syncs.items():
        assert all(s["owners"] == [me] for s in mine)
    assert not local_swarm.leftovers()


def test_a_gathering_member_that_sends_one_member_other_bytes_cannot_split_the_group(
    local_swarm: Swarm,
) -> None:
    # --byzantine split commits to one part and sends its first other member another
    # (one token more claimed): that member refuses it and takes the committed part from
    # a member that holds it, so honest members still reduce the same parts
    nodes, rounds = 4, 3
    local_swarm.launch(
        nodes, rounds, [*TOPK, "sync.exchange='gather'"], {nodes - 1: ["--byzantine", "split"]}
    )
    assert local_swarm.wait_all(280), "swarm did not finish"
    summary = local_swarm.summary()
    honest = local_swarm.nodes[: nodes - 1]
    splitter = local_swarm.nodes[nodes - 1].status["peer_id"]
    assert [n.proc.returncode for n in honest] == [0] * (nodes - 1)
    assert summary["params_agree"], summary["rounds_disagreeing"]  # every round
    assert summary["val_bpb_end"] < summary["val_bpb_start"] - 1.0
    # the member handed other bytes refused them, charged the splitter, and was relayed
    # the committed part
    logs = [(n.data_dir / "node.log").read_text(errors="replace") for n in honest]
    assert any("commit_mismatch" in log for log in logs)
    assert any(f"took {splitter[:16]}'s part from" in log for log in logs)
    assert any(splitter in summary["flagged"][str(n.index)] for n in honest), summary["flagged"]
    assert not local_swarm.leftovers()
