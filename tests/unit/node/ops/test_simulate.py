import json

import pytest
import torch

from node.cli import main
from node.config import load_config
from node.ops.simulate import simulate, weighted_mean

SMALL = [
    "data.max_files=120",
    "data.batch_size=8",
    "model.context=64",
    "model.n_embd=64",
    "train.warmup_steps=5",
    "train.total_steps=60",
    "train.eval_batches=4",
    "sync.inner_steps=10",
]


def test_weighted_mean_hand_computed():
    out = weighted_mean([torch.tensor([1.0, 0.0]), torch.tensor([4.0, 3.0])], [1.0, 2.0])
    torch.testing.assert_close(out, torch.tensor([3.0, 2.0]))
    with pytest.raises(ValueError):
        weighted_mean([torch.zeros(1)], [0.0])


def test_simulation_lowers_bits_per_byte_and_is_deterministic():
    cfg = load_config(None, SMALL)
    a = simulate(cfg, replicas=2, rounds=3)
    b = simulate(cfg, replicas=2, rounds=3)
    assert a["val_bpb_start"] > 7.5
    assert a["val_bpb_end"] < a["val_bpb_start"] - 2.0
    assert a["val_bpb_end"] == b["val_bpb_end"]
    assert [h["val_bpb"] for h in a["history"]] == [h["val_bpb"] for h in b["history"]]


def test_compressed_simulation_tracks_uncompressed():
    cfg = load_config(None, SMALL + ["sync.fragments=3"])
    plain = simulate(cfg, replicas=2, rounds=2)
    int8 = simulate(cfg.replace(sync={"codec": "int8"}), replicas=2, rounds=2)
    assert int8["payload_bytes_per_replica"] < plain["payload_bytes_per_replica"] / 3
    assert abs(int8["val_bpb_end"] - plain["val_bpb_end"]) < 0.1


def test_cli_json_last_line(capsys):
    args = ["simulate", "--replicas", "2", "--rounds", "1", "--inner-steps", "5", "--json"]
    for item in SMALL:
        args += ["--set", item]
    assert main(args) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads(last)
    for key in ("replicas", "rounds", "val_bpb_start", "val_bpb_end"):
        assert key in summary
    assert summary["replicas"] == 2 and summary["rounds"] == 1


def test_cli_config_error_exit_code(capsys):
    assert main(["simulate", "--set", "sync.codec=avg"]) == 2
    assert "sync.codec = 'avg'" in capsys.readouterr().err


def test_a_late_result_keeps_the_steps_taken_while_it_was_in_flight():
    # One fragment syncs at the round's last step: applying it tau steps later is the
    # same as at once (the round ends first), bitwise.
    cfg = load_config(None, SMALL)
    now = simulate(cfg, replicas=2, rounds=2)
    late = simulate(cfg.replace(sync={"tau": 3}), replicas=2, rounds=2)
    assert [h["val_bpb"] for h in late["history"]] == [h["val_bpb"] for h in now["history"]]
    # Two fragments: the first one's result lands 3 steps after its sync, merged with
    # the steps taken meanwhile, which changes the run; it still learns.
    two = cfg.replace(sync={"fragments": 2})
    now = simulate(two, replicas=2, rounds=2)
    late = simulate(two.replace(sync={"tau": 3}), replicas=2, rounds=2)
    assert late["val_bpb_end"] != now["val_bpb_end"]
    assert late["val_bpb_end"] < late["val_bpb_start"] - 2.0
    assert abs(late["val_bpb_end"] - now["val_bpb_end"]) < 0.2


def test_topk_simulation_learns_and_counts_its_sparse_results():
    cfg = load_config(None, SMALL + ["sync.fragments=2"])
    int8 = simulate(cfg.replace(sync={"codec": "int8"}), replicas=2, rounds=2)
    topk = simulate(
        cfg.replace(sync={"codec": "topk", "topk_chunk": 256, "topk_density": 0.05}),
        replicas=2,
        rounds=2,
    )
    assert topk["syncs"] == 4
    assert topk["val_bpb_end"] < topk["val_bpb_start"] - 1.0
    # k = 13 of every 256 values in 2 bits: about a tenth of int8's payload
    assert topk["payload_bytes_per_replica"] < int8["payload_bytes_per_replica"] / 5
    # the owners' union of two members' kept values, 8 bits each: more than one part's
    # payload, at most two parts' values at 8 bits
    assert topk["payload_bytes_per_replica"] < topk["result_bytes"]
    assert topk["result_bytes"] < 3 * topk["payload_bytes_per_replica"]
    assert int8["result_bytes"] == int8["payload_bytes_per_replica"]


def test_a_gathered_topk_run_sends_no_results_and_applies_the_exact_mean():
    topk = ["sync.codec='topk'", "sync.topk_chunk=256", "sync.topk_density=0.05"]
    cfg = load_config(None, SMALL + ["sync.fragments=2", *topk])
    reduced = simulate(cfg, replicas=2, rounds=1)
    gathered = simulate(cfg.replace(sync={"exchange": "gather"}), replicas=2, rounds=1)
    assert gathered["result_bytes"] == 0 < reduced["result_bytes"]
    assert gathered["payload_bytes_per_replica"] == reduced["payload_bytes_per_replica"]
    # the owners' 8-bit union is not the mean the replicas gather: the runs part ways
    assert gathered["val_bpb_end"] != reduced["val_bpb_end"]
    assert abs(gathered["val_bpb_end"] - reduced["val_bpb_end"]) < 0.05


def test_replicas_beyond_one_group_average_in_groups_that_mix_their_copies():
    """Four replicas in pairs (butterfly): each sync averages within the pairs the node
    would form; with a plain SGD outer step a pair adopts its mean copy and steps it
    alike, so after a round its members hold one copy and the two pairs two."""
    from node.ops.simulate import _Simulation
    from protocol.averaging.grouping import form_groups

    overrides = [
        *SMALL,
        "network.group_size=2",
        "outer.optimizer='sgd'",
        "outer.momentum=0",
        "sync.mix_codec='none'",
    ]
    cfg = load_config(None, overrides)
    sim = _Simulation(cfg, 4, torch.device("cpu"))
    assert sim.mixes
    sim.round(1)
    pairs = form_groups(sim.names, 1, 0, 2, "butterfly")
    assert sorted(len(p) for p in pairs) == [2, 2]
    copies = {name: sim.outers[i].global_vector(0) for i, name in enumerate(sim.names)}
    for a, b in pairs:
        assert torch.equal(copies[a], copies[b])
    (a, _), (c, _) = pairs
    assert not torch.equal(copies[a], copies[c])
    result = simulate(cfg, replicas=4, rounds=2)
    assert result["val_bpb_end"] < result["val_bpb_start"] - 1.0
    # replica 0 sent its copy besides its pseudo-gradient: twice the bytes of one group
    alone = simulate(load_config(None, overrides[:-4] + ["sync.mix_codec='none'"]), 2, 2)
    assert result["payload_bytes_per_replica"] == 2 * alone["payload_bytes_per_replica"]
