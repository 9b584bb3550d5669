"""The convergence benchmark: how a run is judged against DDP, and what each run is scored on."""

from __future__ import annotations

import pytest
import torch


def test_convergence_judges_gap_and_bytes_against_the_targets():
    from benchmarks.convergence import _judge

    ddp = {"val_bpb_end": 3.0, "bytes_sent_per_worker": 2_000_000.0}
    close = {"val_bpb_end": 3.02, "bytes_sent_per_worker": 1_000.0}
    _judge(close, ddp)
    assert close["gap_to_ddp_percent"] == pytest.approx(2 / 3)
    assert close["bytes_ratio_ddp_over_atoll"] == pytest.approx(2000.0)
    assert close["meets_target"]
    far = {"val_bpb_end": 3.06, "bytes_sent_per_worker": 1_000.0}
    _judge(far, ddp)
    assert far["meets_bytes_target"] and not far["meets_bpb_target"] and not far["meets_target"]


def test_ddp_equivalent_step_interpolates_between_evaluations():
    from benchmarks.convergence import ddp_equivalent_step

    history = [
        {"step": 0, "val_bpb": 8.0},
        {"step": 50, "val_bpb": 4.0},
        {"step": 100, "val_bpb": 3.0},
    ]
    assert ddp_equivalent_step(history, 3.5) == pytest.approx(75.0)
    assert ddp_equivalent_step(history, 4.0) == pytest.approx(50.0)
    assert ddp_equivalent_step(history, 9.0) == 0.0
    assert ddp_equivalent_step(history, 2.9) is None  # DDP never got that low


def test_every_method_and_seed_is_scored_on_the_same_batches():
    from benchmarks.convergence import Setting, plan_seeds, setting_overrides
    from node.config import load_config
    from node.data.corpus import load_corpus, validation_batches

    picks = {
        "ddp": Setting("ddp", lr=6e-3),
        "adamw H=50": Setting("atoll", 3e-3, "adamw", 50, "int8", "plain averaging (sgd lr 1)"),
        "muon H=50": Setting("atoll", 1.5e-3, "muon", 50, "int8", "nesterov lr 0.7, momentum 0.5"),
    }
    settings = plan_seeds(picks, long=False)
    assert {s.codec for s in settings if s.optimizer == "adamw" and s.inner_steps} == {
        "none",
        "int8",
        "int4",
    }
    assert any(s.islands for s in settings)
    seen = set()
    for s in settings:
        for seed in (0, 1, 2):
            cfg = load_config(None, setting_overrides(s, "quick", 500, seed))
            assert cfg.run.seed == seed
            seen.add((cfg.data, cfg.model.context, cfg.train.eval_batches))
    assert len(seen) == 1  # one data, context and batch count for every run
    data, context, count = seen.pop()
    assert count >= 128
    a = load_corpus(data, context)
    b = load_corpus(data, context)
    first = validation_batches(a.val, data.batch_size, context, count)
    again = validation_batches(b.val, data.batch_size, context, count)
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(first, again))


def test_the_long_mode_runs_the_quick_sweeps_picks(tmp_path):
    from benchmarks.convergence import Setting, _picks_from, _write_picks, plan_seeds

    with pytest.raises(FileNotFoundError, match="run `python -m benchmarks convergence --quick`"):
        _picks_from(tmp_path / "convergence-picks.json")
    ddp = Setting("ddp", lr=3e-3)
    adamw = Setting("atoll", 3e-3, "adamw", 50, "int8", "plain averaging (sgd lr 1)")
    muon = Setting("atoll", 6e-3, "muon", 50, "int8", "plain averaging (sgd lr 1)")
    soap = Setting("atoll", 6e-3, "soap", 100, "int8", "plain averaging (sgd lr 1)")
    scores = {ddp: 3.0, adamw: 3.3, muon: 3.2, soap: 3.1}
    picks = {"ddp": ddp, "adamw H=50": adamw, "muon H=50": muon, "soap H=100": soap}
    _write_picks(
        tmp_path / "p.json", picks, {s: {0: {"val_bpb_end": v}} for s, v in scores.items()}
    )
    read = _picks_from(tmp_path / "p.json")
    assert read["other"] == soap  # the best seed-0 score besides AdamW
    assert plan_seeds(read, long=True) == [ddp, adamw, soap]  # H=250 not picked; no codecs


def test_bytes_sent_count_parts_results_and_heads():
    from benchmarks._common import head_bytes
    from benchmarks.convergence import sent_bytes

    part_head, result_head = head_bytes(4)
    # four PeerIDs and a signature; a result also carries four signed commitments
    assert 300 < part_head < 2000 and part_head < result_head < 4000
    # a topk run: 1,000 bytes of parts and 3,000 of sparse results per replica, 10 syncs
    run = {"payload_bytes_per_replica": 1000, "result_bytes": 3000, "syncs": 10}
    want = 3 / 4 * 4000 + 10 * 3 * (part_head + result_head)
    assert sent_bytes(run, 4) == pytest.approx(want)


def test_topk_variants_and_the_sparse_mode_needs_the_quick_report(tmp_path):
    from benchmarks.convergence import _GRID, Setting, _topk_variants, run_sparse

    adamw = Setting("atoll", 3e-3, "adamw", 50, "int8", "nesterov lr 0.7, momentum 0.5")
    variants = _topk_variants(adamw, _GRID)
    assert len(variants) == 8  # 2 kept shares x 2 widths x 2 error feedbacks
    assert {v.codec for v in variants} == {"topk"}
    sparseloco = [v for v in variants if v.decay < 1]
    assert len(sparseloco) == 4 and {v.outer for v in sparseloco} == {"plain averaging (sgd lr 1)"}
    assert "topk 1% 2b EF decay 0.95" in sparseloco[0].label
    with pytest.raises(FileNotFoundError, match="convergence --quick"):
        run_sparse(tmp_path)


def test_a_journaled_run_is_counted_again_from_its_payloads():
    from benchmarks.convergence import sent_bytes, with_bytes

    history = [{"step": 50 * r, "tokens": 0, "val_bpb": 8.0 - r} for r in range(3)]
    run = {"fragments": 2, "payload_bytes_per_replica": 800, "result_bytes": 2400}
    counted = with_bytes({**run, "history": history}, 4)
    assert counted["syncs"] == 4  # two rounds of two fragments
    assert counted["bytes_sent_per_worker"] == pytest.approx(sent_bytes({**run, "syncs": 4}, 4))
    assert counted["payload_sent_per_worker"] == pytest.approx(0.75 * 3200)
    assert [h["bytes_sent"] for h in counted["history"]] == pytest.approx(
        [0.0, counted["bytes_sent_per_worker"] / 2, counted["bytes_sent_per_worker"]]
    )
    ddp = {"val_bpb_end": 3.0, "bytes_sent_per_worker": 10.0, "history": []}
    assert with_bytes(ddp, 4) is ddp


def test_an_allgather_sends_each_part_to_every_other_member():
    from benchmarks._common import head_bytes
    from benchmarks.convergence import allgather_bytes

    part_head, _ = head_bytes(4)
    run = {"payload_bytes_per_replica": 1000, "syncs": 10}
    assert allgather_bytes(run, 4) == 3 * (1000 + 10 * part_head)
