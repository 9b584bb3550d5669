"""The benchmarks' shared parts: the link cost model, gloo ranks in spawned processes, the CLI."""

from __future__ import annotations

import os
import time

import pytest
import torch

from benchmarks import __main__ as bench_cli
from benchmarks._common import (
    free_port,
    gloo_group,
    params_digest,
    ring_allreduce_seconds,
    run_ranks,
)
from protocol.p2p.shaper import LinkShape

_WORLD = 2


def _sum_rank(rank: int, port: int, results) -> None:
    """Spawned rank: all-reduce its rank + 1 over gloo and report the sum."""
    torch.set_num_threads(1)
    with gloo_group(port, rank, _WORLD, timeout_s=60) as dist:
        x = torch.tensor([float(rank + 1)])
        dist.all_reduce(x)
        results.put({"rank": rank, "sum": x.item(), "initialized": dist.is_initialized()})


def _die_or_wait(rank: int, seconds: float, results) -> None:
    """Spawned rank: rank 0 exits with an error at once, the others sleep."""
    if rank == 0:
        os._exit(3)
    time.sleep(seconds)
    results.put({"rank": rank})


def test_ring_allreduce_seconds_follows_the_ring_formula():
    link = LinkShape(delay_s=0.010, bandwidth_bps=100e6)
    nbytes, world = 4_000_000, 4
    expected = (2 * 3 / 4) * nbytes * 8 / 100e6 + 2 * 3 * 0.010
    assert ring_allreduce_seconds(nbytes, world, link) == pytest.approx(expected, rel=1e-3)
    assert ring_allreduce_seconds(nbytes, 1, link) == 0.0


def test_run_ranks_collects_every_rank_report_through_a_real_gloo_group():
    port = free_port()
    reports, exit_codes = run_ranks(
        _sum_rank, [(port,)] * _WORLD, expected=_WORLD, timeout=120, grace=30
    )
    assert exit_codes == [0, 0]
    assert sorted(r["rank"] for r in reports) == [0, 1]
    assert all(r["sum"] == 3.0 and r["initialized"] for r in reports)


def test_run_ranks_stops_waiting_when_a_rank_dies():
    started = time.monotonic()
    reports, exit_codes = run_ranks(
        _die_or_wait, [(60.0,)] * _WORLD, expected=_WORLD, timeout=120, grace=1
    )
    assert time.monotonic() - started < 50  # not the 60 s sleep, not the 120 s timeout
    assert exit_codes[0] == 3
    assert exit_codes[1] is not None  # the sleeper was ended, not left running
    assert reports == []


def test_params_digest_changes_with_any_parameter():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    assert params_digest(a) == params_digest(b)
    with torch.no_grad():
        b.bias[1] += 1e-6
    assert params_digest(a) != params_digest(b)


def test_cli_refuses_an_unknown_benchmark(capsys):
    assert bench_cli.main(["nope"]) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err


def test_every_registered_benchmark_imports_and_has_run():
    import importlib

    for name, module_name in bench_cli.BENCHMARKS.items():
        module = importlib.import_module(module_name)
        assert callable(module.run), name


def test_cli_steps_applies_only_where_a_benchmark_takes_it(capsys, tmp_path):
    assert bench_cli.main(["codec", "--steps", "500", "--out", str(tmp_path)]) == 2
    assert "--steps applies to convergence only" in capsys.readouterr().err
    assert bench_cli.main(["convergence", "--steps", "120", "--out", str(tmp_path)]) == 2
    assert "expected a positive multiple of 50, 100, 250" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # refused before anything ran or was written


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
    from node.data import load_corpus, validation_batches

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


def test_the_models_benchmark_counts_helper_cpu_between_the_first_and_last_round():
    from benchmarks.models import _helper_share

    def event(t: float, p2pd: float, dht: float, control: float) -> dict:
        return {
            "t": t,
            "load": {"p2pd_cpu_s": p2pd, "dht": {"cpu_s": dht}, "control": {"cpu_s": control}},
        }

    rounds = [event(100.0, 1.0, 0.5, 2.0), event(130.0, 1.0, 0.5, 2.0), event(160.0, 1.6, 0.8, 2.9)]
    assert _helper_share(rounds) == pytest.approx((0.6 + 0.3 + 0.9) / 60.0)
    assert _helper_share(rounds[:1]) is None


def test_a_failed_measurement_fails_the_run_and_a_measured_error_does_not():
    report = {
        "cells": [{"median_s": 0.5}, {"error": "TypeError: reduce() got an unexpected keyword"}],
        "calibration": {"sizes": {"4": {"error": -0.012}}},
        "errors": {"seed 1": "rank 0 reported nothing"},
    }
    found = bench_cli.failures(report)
    assert ("/cells[1]", "TypeError: reduce() got an unexpected keyword") in found
    assert ("/errors/seed 1", "rank 0 reported nothing") in found
    assert len(found) == 2
    assert bench_cli.failures({"calibration": {"error": 0.1}, "errors": {}}) == []


def test_the_models_benchmark_compares_each_node_run_with_the_bare_run_beside_it():
    from benchmarks.models import _pair_ratios

    bare = [[100.0, 110.0], [200.0, 200.0]]
    nodes = [{"tokens_per_second": [105.0, 105.0]}, {"tokens_per_second": [190.0, None]}]
    assert _pair_ratios(bare, nodes) == pytest.approx([1.0, 0.95])
