"""Tests for the robustness benchmark's checks mode that start no node: its swarms in every
shape, the overrides the config must accept, what a run's events say (when each honest
node flagged the attacker, the weight it kept until then), the cost runs' overrides, and
the report and figure from stand-in runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import __main__ as bench_cli
from benchmarks import _checks_cost as cost
from benchmarks import _robustness_checks as checks
from benchmarks import robustness
from benchmarks._mode import Mode
from node.config import load_config

_ROOT = Path(__file__).resolve().parents[3]


def test_quick_runs_eight_faults_in_mixing_groups_and_gossip_pairs_and_a_site() -> None:
    plan = checks.plan_of(quick=True, smoke=False)
    names = [j.name for j in plan.jobs]
    assert plan.rounds == 10 and len(plan.jobs) == 2 * (2 + 8) + 1
    assert names[:7] == [
        "groups clean 0_of_8",
        "groups clean 0_of_8",
        "groups lazy 1_of_8",
        "groups lazy=0.5 1_of_8",
        "groups zero 1_of_8",
        "groups copy 1_of_8",
        "groups random_data 1_of_8",
    ]
    assert [j.checkers for j in plan.jobs[:2]] == [0, 2]  # one clean run without checks
    assert {j.shape.name for j in plan.jobs} == {"groups", "gossip"}
    assert names[7:11] == [
        "groups poison 1_of_8",
        "groups alie 1_of_8",
        "groups alie 3_of_8",
        "groups zero site 1_of_8",
    ]
    assert [j.name for j in plan.jobs if j.site] == ["groups zero site 1_of_8"]


def test_full_adds_one_group_and_a_second_seed() -> None:
    plan = checks.plan_of(quick=False, smoke=False)
    names = {j.name for j in plan.jobs}
    assert {"one_group lazy 1_of_6", "groups alie 3_of_8", "gossip poison 1_of_8"} <= names
    assert "one_group alie 3_of_6" not in names  # half a group of six is no minority
    sites = [j for j in plan.jobs if j.site]
    assert len(sites) == 2 and all(j.name == "groups zero site 1_of_8" for j in sites)
    assert {j.seed for j in plan.jobs} == {0, 1}
    per_seed = 3 * 2 + (8 + 8 + 7) + 1  # clean pairs, attacks per shape, the site
    assert len(plan.jobs) == 2 * per_seed


def test_smoke_is_a_zero_attacker_of_four_in_pairs_and_a_clean_run_without_checks() -> None:
    plan = checks.plan_of(quick=False, smoke=True)
    clean, zero = plan.jobs
    assert (clean.checkers, zero.mode, zero.shape.nodes, plan.rounds) == (0, "zero", 4, 5)


@pytest.mark.parametrize("shape", sorted(checks.SHAPES))
def test_the_config_takes_every_shapes_overrides(shape: str) -> None:
    job = checks.Job(checks.SHAPES[shape], 0, "lazy", 1)
    cfg = load_config(None, checks.plan_of(True, False).overrides(job))
    assert cfg.sync.trigger == "steps" and cfg.sync.fragments == 2 and cfg.sync.codec == "int8"
    assert cfg.trust.checkers == 2 and cfg.trust.check_fragments == 2
    assert cfg.trust.check_budget == 1.0 and cfg.trust.check_from_round == 3
    if shape == "gossip":
        assert cfg.sync.averaging == "gossip"
    else:
        assert cfg.network.group_size == checks.SHAPES[shape].group
    smoke = checks.plan_of(False, True)
    assert load_config(None, smoke.overrides(smoke.jobs[0])).trust.checkers == 0


@pytest.mark.parametrize("name", sorted(cost.COST_CASES))
def test_the_cost_workloads_configs_take_their_overrides(name: str) -> None:
    case = cost.COST_CASES[name]
    path = [str(_ROOT / case.config)]
    shards = Path("shards") if case.shards else None
    with_checks = load_config(path, cost.overrides_of(case, True, shards))
    without = load_config(path, cost.overrides_of(case, False, shards))
    assert with_checks.trust.checkers == 2 and without.trust.checkers == 0
    assert with_checks.trust.check_budget == 0.04  # the default budget is what is measured
    if name == "llama-tiny":
        assert with_checks.sync.inner_steps == 100 and with_checks.sync.trigger == "steps"


def _round(r: int, t: float, flagged=(), by_checks=(), **fields: Any) -> dict[str, Any]:
    counts = {"made": r, "taken": 2 * r, "recomputed": 1, "refused": 0, "unserved": 0}
    return {
        "event": "round",
        "round": r,
        "t": t,
        "bytes_sent": 1000 * r,
        "flagged": {p: "quarantined" for p in flagged},
        "checks": {**counts, "bytes_fetched": 100 * r, "flagged": list(by_checks), **fields},
    }


def _check(peer: str, factor: float) -> dict[str, Any]:
    return {"event": "check", "peer": peer, "factor": factor}


def test_a_run_reports_when_each_honest_node_flagged_the_attacker_and_its_weight() -> None:
    # nodes 0 and 1 are honest, 2 attacks; node 0 flags it at round 3 through its
    # checks, node 1 at round 4; their records cut its weight to 0.5, then 0.25
    summary = {
        "peer_ids": ["A", "B", "Z"],
        "busy_seconds": [30.0, 40.0, 0.0],
        "idle_seconds": [10.0, 0.0, 0.0],
    }
    logs = {
        0: [
            _round(1, 0.0),
            _round(2, 10.0),
            _check("Z", 0.5),
            _round(3, 22.0, ["Z"]),
            _check("Z", 0.25),
            _round(4, 34.0, ["Z"], ["Z"], compute_seconds=2.0),
        ],
        1: [
            _round(1, 0.0),
            _round(2, 10.0),
            _check("Z", 0.5),
            _round(3, 22.0),
            _round(4, 34.0, ["Z"], compute_seconds=4.0),
        ],
        2: [_round(4, 34.0, ["A"])],  # what the attacker claims counts for nothing
    }
    job = checks.Job(checks.SHAPES["groups"], 0, "zero", 1)
    measured = checks._measure(summary, logs, [2], from_round=3, job=job)
    (caught,) = measured["attackers"]
    assert caught["rounds_to_flag"] == 4 and caught["flagged_by"] == 2
    assert caught["first_round_by_node"] == {"0": 3, "1": 4}
    assert caught["checks_flagged_by"] == 1 and caught["flagged_through"] == "checks"
    assert caught["weight_factor_by_round"] == {"1": 1.0, "2": 1.0, "3": 0.5, "4": 0.375}
    # in groups of 4: a share f / (f + 3) in rounds 1-3, before every node flagged it
    assert caught["share_before_flag"] == pytest.approx((0.25 + 0.25 + 0.5 / 3.5) / 3, abs=1e-4)
    assert measured["honest_flagged_ever"] == [] and measured["honest_charges"] == []
    assert measured["round_seconds_checked"] == pytest.approx(12.0)
    assert measured["check_share"] == pytest.approx((2.0 / 40 + 4.0 / 40) / 2)
    assert measured["checked_rounds"] == 1.0  # every round after round 3 moved its counts
    assert measured["checks"]["made"] == 8 and measured["checks"]["bytes_fetched"] == 800


def test_an_attacker_flagged_by_no_one_and_an_honest_peer_charged_are_reported() -> None:
    summary = {"peer_ids": ["A", "B", "Z"], "busy_seconds": [1.0] * 3, "idle_seconds": [0.0] * 3}
    charge = {"event": "violation", "peer": "B", "round": 1, "reason": "useless_work"}
    logs = {0: [charge, _round(1, 0.0, ["B"])], 1: [_round(1, 0.0)], 2: []}
    job = checks.Job(checks.SHAPES["gossip"], 0, "lazy", 1)
    measured = checks._measure(summary, logs, [2], from_round=1, job=job)
    (caught,) = measured["attackers"]
    assert (caught["rounds_to_flag"], caught["flagged_through"]) == (None, "never")
    assert measured["honest_flagged_ever"] == ["B"]
    assert measured["honest_charges"] == [
        {"by": 0, "peer": 1, "round": 1, "reason": "useless_work"}
    ]
    assert measured["charged_records"] == {"1": []}  # no record of it in these logs


def test_the_records_behind_an_honest_peers_useless_work_charge_are_kept() -> None:
    summary = {"peer_ids": ["A", "B", "Z"], "busy_seconds": [1.0] * 3, "idle_seconds": [0.0] * 3}
    record = {"event": "check", "checker": "A", "peer": "B", "round": 3, "fragment": 0}
    record |= {"claimed": 24, "work": 0.4, "specific": -0.8, "short": True, "factor": 0.5}
    charge = {"event": "violation", "peer": "B", "round": 4, "reason": "useless_work"}
    other = {"event": "check", "checker": "A", "peer": "Z", "round": 3, "factor": 0.0}
    logs = {0: [record, other, charge, _round(4, 0.0, ["B"])], 1: [_round(4, 0.0)], 2: []}
    job = checks.Job(checks.SHAPES["groups"], 0, "zero", 1)
    measured = checks._measure(summary, logs, [2], from_round=1, job=job)
    assert measured["charged_records"] == {
        "1": [
            {
                "by": 0,
                "checker": 0,
                "round": 3,
                "fragment": 0,
                "claimed": 24,
                "work": 0.4,
                "specific": -0.8,
                "short": True,
                "factor": 0.5,
            }
        ]
    }


def test_a_node_that_exits_badly_or_a_short_run_is_a_named_failure() -> None:
    def node(index: int, code: int) -> Any:
        return type("N", (), {"index": index, "proc": type("P", (), {"returncode": code})})

    assert checks._problem([node(0, 0), node(1, 0)], True, 6, 6) is None
    assert "{1: -9}" in checks._problem([node(0, 0), node(1, -9)], True, 6, 6)
    assert "timed out" in checks._problem([node(0, 0)], False, 6, 6)
    assert "round 4 together, not 6" in checks._problem([node(0, 0)], True, 4, 6)


# per mode: the round every honest node had flagged the attacker by (None: never)
_FLAGGED_AT = {
    "lazy": 4,
    "lazy=0.5": 9,
    "zero": 4,
    "copy": 6,
    "random_data": None,
    "poison": 5,
    "alie": 4,
}


def _stand_in(plan: checks.Plan, job: checks.Job, base: Path, index: int) -> dict[str, Any]:
    at = _FLAGGED_AT.get(job.mode) if job.mode else None
    record = {
        "name": job.name,
        "shape": job.shape.name,
        "mode": job.mode or "clean",
        "nodes": job.shape.nodes,
        "byzantine": job.attackers,
        "seed": job.seed,
        "checkers": job.checkers,
        "val_bpb_end": 3.0 * (1.01 if job.mode else 1.0),
        "honest_flagged_ever": [],
        "honest_charges": [],
        "seconds": 0.0,
    }
    if job.mode:
        record["attackers"] = [
            {"rounds_to_flag": at, "flagged_by": 7 if at else 0, "honest_nodes": 7}
            | {"flagged_through": "checks" if at else "never", "share_before_flag": 0.1}
            | {"share_honest_equal": 0.25}
        ]
    if job.mode == "copy" and job.shape.name == "gossip":
        record["error"] = "RuntimeError: node 7 failed"
    return record


def _costs(quick: bool, base: Path) -> dict[str, Any]:
    return {"demo": {"ratio": 0.97, "runs": []}, "llama-tiny": {"ratio": 0.93, "runs": []}}


def test_quick_report_judges_each_goal_names_what_is_not_flagged_and_draws(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(checks, "run_job", _stand_in)
    monkeypatch.setattr("benchmarks._checks_cost.measure_costs", _costs)
    monkeypatch.setattr("benchmarks._checks_probes.tracer_probe", lambda: {"step_ratio": 1.02})
    report = robustness.run(Mode(quick=True, checks=True), tmp_path)
    assert report["mode"] == "checks" and report["benchmark"] == "robustness"
    assert len(report["runs"]) == 21
    attacks = report["attacks"]
    assert attacks["groups zero site 1_of_8"]["rounds_to_flag"] == 4
    assert attacks["groups zero 1_of_8"]["rounds_to_flag"] == 4
    assert attacks["groups lazy=0.5 1_of_8"]["goal_rounds"] == 10
    assert report["not_flagged"] == ["groups random_data 1_of_8", "gossip random_data 1_of_8"]
    met = report["met"]
    assert met["rounds_to_flag"]["groups lazy=0.5 1_of_8"] is True
    assert met["rounds_to_flag"]["groups copy 1_of_8"] is False  # round 6 > 5
    assert met["rounds_to_flag"]["groups random_data 1_of_8"] is False
    assert met["honest_flagged"] and met["bpb_within"]
    assert met["tokens_per_second"] is False  # llama-tiny's 0.93
    assert attacks["groups zero 1_of_8"]["bpb_ratio_to_clean_max"] == pytest.approx(1.01)
    assert attacks["groups zero 1_of_8"]["share_before_flag"] == 0.1
    # the failed run is a named failure of the command
    failed = [i for i, r in enumerate(report["runs"]) if "error" in r]
    assert bench_cli.failures(report) == [(f"/runs[{failed[0]}]", "RuntimeError: node 7 failed")]
    written = json.loads((tmp_path / "robustness-checks.json").read_text())
    assert written["attacks"] == attacks and not written["smoke"]
    assert (tmp_path / "robustness-checks.png").stat().st_size > 0
    assert not (tmp_path / "robustness.json").exists()


def test_the_command_takes_checks_for_robustness_only(capsys: pytest.CaptureFixture) -> None:
    assert bench_cli.main(["codec", "--checks", "--smoke"]) == 2
    assert "--checks applies to robustness only" in capsys.readouterr().err


def test_the_docs_table_is_made_from_the_results_file() -> None:
    from benchmarks._robustness_checks_report import table

    attack = {"flagged_through": ["replay"], "share_before_flag": 0.25}
    data = {
        "attacks": {
            "groups zero 1_of_8": {"shape": "groups", "rounds_to_flag": 2, **attack}
            | {"bpb_ratio_to_clean_max": 1.004},
            "gossip zero 1_of_8": {"shape": "gossip", "rounds_to_flag": None}
            | {"bpb_ratio_to_clean_max": 1.03, "flagged_through": []},
            "groups zero site 1_of_8": {"shape": "groups", "rounds_to_flag": 3, **attack},
        },
        "costs": {"demo": {"ratio": 0.961, "check_share": 0.021, "fetched_to_sent": 1.5}},
    }
    lines = table(data).splitlines()
    assert lines[0] == "| attack | groups | gossip |"
    assert lines[2] == "| `zero 1 of 8` | 2 · replay · 1.004 · 0.25 | never · 1.030 |"
    assert lines[3] == "| `zero site 1 of 8` | 3 · replay · 0.25 |  |"
    assert lines[-1] == "| demo | 0.961 | 2.1% |  |  | 1.50 |"
