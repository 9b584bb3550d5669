"""Tests for the robustness benchmark's checks mode that start no node: its swarms, the
overrides the config must accept, what a run's round events say, and the report and
figure from stand-in runs."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from benchmarks import __main__ as bench_cli
from benchmarks import _robustness_checks as checks
from benchmarks import robustness
from node.config import load_config


def test_quick_runs_five_quiet_faults_on_six_nodes_with_two_clean_runs() -> None:
    plan = checks._plan(quick=True, smoke=False)
    (six,) = plan.swarms
    assert (six.nodes, six.seed, plan.rounds) == (6, 0, 6)
    assert six.attacks == tuple((m, 1) for m in ("random_data", "zero", "poison", "copy", "lazy"))
    assert plan.total == 7


def test_full_adds_alie_one_of_six_and_three_of_eight_for_two_seeds() -> None:
    plan = checks._plan(quick=False, smoke=False)
    assert [(s.nodes, s.seed) for s in plan.swarms] == [(6, 0), (6, 1), (8, 0), (8, 1)]
    assert plan.swarms[0].attacks[-1] == ("alie", 1)
    assert plan.swarms[2].attacks == (("alie", 3),)
    assert plan.total == 2 * (6 + 2) + 2 * (1 + 2)


def test_smoke_is_one_zero_attacker_of_three_and_a_clean_run_without_checks() -> None:
    plan = checks._plan(quick=False, smoke=True)
    (three,) = plan.swarms
    assert (three.nodes, three.attacks, three.clean_with_checks) == (3, (("zero", 1),), False)
    assert plan.total == 2 and plan.rounds == 4


@pytest.mark.parametrize("smoke", [False, True])
def test_the_config_takes_the_checks_overrides(smoke: bool) -> None:
    plan = checks._plan(quick=True, smoke=smoke)
    swarm = plan.swarms[0]
    cfg = load_config(None, plan.overrides(swarm, 2))
    assert cfg.sync.trigger == "steps" and cfg.sync.fragments == 1 and cfg.sync.codec == "int8"
    assert cfg.network.group_size == swarm.nodes
    assert cfg.trust.aggregator == "centered_clip" and cfg.trust.checkers == 2
    assert cfg.trust.quarantine_rounds == 10
    assert (cfg.sync.inner_steps, cfg.trust.check_from_round) == ((4, 1) if smoke else (12, 2))
    assert load_config(None, plan.overrides(swarm, 0)).trust.checkers == 0


def _round(r: int, t: float, flagged=(), by_checks=(), **checks_fields: Any) -> dict[str, Any]:
    counts = {"made": 1, "taken": 2, "recomputed": 1, "refused": 0, "unserved": 0}
    return {
        "event": "round",
        "round": r,
        "t": t,
        "bytes_sent": 1000 * r,
        "flagged": {p: "quarantined" for p in flagged},
        "checks": {**counts, "bytes_fetched": 100 * r, "flagged": list(by_checks), **checks_fields},
    }


def test_a_run_reports_when_each_honest_node_flagged_the_attacker_and_by_what() -> None:
    # nodes 0 and 1 are honest, 2 attacks: node 0 flags it at round 3 through its
    # checks, node 1 at round 4; rounds take 10 s, 12 s from round 3 on (checked)
    summary = {
        "peer_ids": ["A", "B", "Z"],
        "busy_seconds": [30.0, 40.0, 0.0],
        "idle_seconds": [10.0, 0.0, 0.0],
        "round_seconds_mean": 11.0,
    }
    events = {
        0: [
            _round(1, 0.0),
            _round(2, 10.0),
            _round(3, 22.0, ["Z"]),
            _round(4, 34.0, ["Z"], ["Z"], seconds=2.0),
        ],
        1: [_round(1, 0.0), _round(2, 10.0), _round(3, 22.0), _round(4, 34.0, ["Z"], seconds=4.0)],
        2: [_round(4, 34.0, ["A"])],  # what the attacker claims counts for nothing
    }
    measured = checks._measure(summary, events, [2], from_round=3)
    (caught,) = measured["attackers"]
    assert caught["rounds_to_flag"] == 4 and caught["flagged_by"] == 2
    assert caught["first_round_by_node"] == {"0": 3, "1": 4}
    assert caught["checks_flagged_by"] == 1 and caught["flagged_through"] == "checks"
    assert measured["honest_flagged_ever"] == [] and measured["honest_flagged_by_checks"] == []
    assert measured["round_seconds_checked"] == pytest.approx(12.0)
    assert measured["check_share"] == pytest.approx((2.0 / 40 + 4.0 / 40) / 2)
    assert measured["bytes_fetched_per_round"] == pytest.approx(100.0)
    assert measured["bytes_sent_per_round"] == pytest.approx(1000.0)
    assert measured["checks"]["made"] == 2 and measured["checks"]["bytes_fetched"] == 800


def test_an_attacker_flagged_by_no_one_and_an_honest_peer_flagged_are_reported() -> None:
    summary = {
        "peer_ids": ["A", "B", "Z"],
        "busy_seconds": [1.0] * 3,
        "idle_seconds": [0.0] * 3,
        "round_seconds_mean": None,
    }
    events = {0: [_round(1, 0.0, ["B"])], 1: [_round(1, 0.0)], 2: []}
    measured = checks._measure(summary, events, [2], from_round=1)
    (caught,) = measured["attackers"]
    assert (caught["rounds_to_flag"], caught["flagged_through"]) == (None, "never")
    assert measured["honest_flagged_ever"] == ["B"]


def test_an_honest_peer_flagged_is_reported_with_who_flagged_it_and_the_failing_records() -> None:
    ids = ["A", "B", "Z"]
    events = {0: [_round(3, 0.0), _round(4, 1.0, ["B"], ["B"])], 1: [_round(4, 1.0)], 2: []}
    records = {
        0: [
            {"event": "check", "checker": "Z", "peer": "B", "round": 3, "passed": False}
            | {"gains": [0.1, 0.2]},
            {"event": "check", "checker": "A", "peer": "B", "round": 3, "passed": True},
        ]
    }
    (flag,) = checks._honest_flags(ids, events, records, [2])
    assert flag["peer"] == 1 and flag["by"] == 0  # node 0 flagged honest node 1
    assert flag["flagged_from"] == 4 and flag["checks_flagged_from"] == 4
    assert flag["failing_records"] == [{"checker": 2, "round": 3, "gains": [0.1, 0.2]}]


def _node(index: int, code: int) -> SimpleNamespace:
    return SimpleNamespace(index=index, proc=SimpleNamespace(returncode=code))


def test_a_node_that_exits_badly_or_a_short_run_is_a_named_failure() -> None:
    assert checks._problem([_node(0, 0), _node(1, 0)], True, 6, 6) is None
    assert "{1: -9}" in checks._problem([_node(0, 0), _node(1, -9)], True, 6, 6)
    assert "timed out" in checks._problem([_node(0, 0)], False, 6, 6)
    assert "round 4 together, not 6" in checks._problem([_node(0, 0)], True, 4, 6)


# per mode: the round every honest node had flagged the attacker by (None: never)
_FLAGGED_AT = {"random_data": 4, "zero": 4, "poison": 5, "copy": 6, "lazy": None}


def _stand_in(
    plan: checks._Plan,
    swarm: checks._Swarm,
    attack: tuple[str, int] | None,
    checkers: int,
    base: Path,
    index: int,
) -> dict[str, Any]:
    mode = attack[0] if attack else None
    at = _FLAGGED_AT.get(mode)
    record = {
        "mode": mode or "clean",
        "nodes": swarm.nodes,
        "byzantine": attack[1] if attack else 0,
        "seed": swarm.seed,
        "checkers": checkers,
        "swarm": swarm.key,
        "val_bpb_end": 3.0 * (1.01 if mode else 1.0),
        "honest_flagged_ever": [],
        "round_seconds_checked": 10.3 if checkers else 10.0,
        "check_share": 0.02 if checkers else None,
        "bytes_fetched_per_round": 5000.0 if checkers else 0.0,
        "bytes_sent_per_round": 20000.0,
        "seconds": 0.0,
    }
    if mode:
        through = "checks" if at else "never"
        record["attackers"] = [
            {"rounds_to_flag": at, "flagged_by": 5 if at else 0, "honest_nodes": 5}
            | {"flagged_through": through}
        ]
    if mode == "copy":
        record["error"] = "RuntimeError: node 5 failed"
    return record


def test_quick_report_judges_each_goal_names_what_is_not_flagged_and_draws(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(checks, "_run_one", _stand_in)
    report = robustness.run(True, tmp_path, checks=True)
    assert report["mode"] == "checks" and report["benchmark"] == "robustness"
    assert len(report["runs"]) == 7
    attacks = report["attacks"]
    assert attacks["zero 1_of_6"]["rounds_to_flag"] == 4
    assert attacks["lazy 1_of_6"]["rounds_to_flag"] is None
    assert attacks["lazy 1_of_6"]["goal_rounds"] is None  # no goal, but reported
    assert report["not_flagged"] == ["lazy 1_of_6"]
    met = report["met"]
    assert met["rounds_to_flag"] == {
        "random_data 1_of_6": True,
        "zero 1_of_6": True,
        "poison 1_of_6": True,
        "copy 1_of_6": False,
    }
    assert met["honest_flagged"] and met["bpb_within"] and met["round_time"]
    assert met["check_share"]
    cost = report["clean"]["6_nodes_seed_0"]
    assert cost["round_time_ratio"] == pytest.approx(1.03)
    assert cost["fetched_to_sent"] == pytest.approx(0.25)
    assert attacks["zero 1_of_6"]["bpb_ratio_to_clean_max"] == pytest.approx(1.01)
    # the failed run is a named failure of the command
    assert bench_cli.failures(report) == [("/runs[5]", "RuntimeError: node 5 failed")]
    written = json.loads((tmp_path / "robustness-checks.json").read_text())
    assert written["attacks"] == attacks and not written["smoke"]
    assert (tmp_path / "robustness-checks.png").stat().st_size > 0
    assert not (tmp_path / "robustness.json").exists()


def test_the_command_takes_checks_for_robustness_only(capsys: pytest.CaptureFixture) -> None:
    assert bench_cli.main(["codec", "--checks", "--smoke"]) == 2
    assert "--checks applies to robustness only" in capsys.readouterr().err
