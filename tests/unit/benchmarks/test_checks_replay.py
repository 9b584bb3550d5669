"""Replaying recorded check records through the scores under other settings."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from benchmarks import _checks_replay as replay
from benchmarks._checks_replay import Setting, replay_node, replay_runs
from verification import workscores


def _log(rounds: range, attacker: int = 3, nodes: int = 4) -> list[list]:
    """Every node checks every other each round: honest gains about 1 and lifts 0.5,
    the attacker's a tenth of that."""
    entries: list[list] = []
    for r in rounds:
        for checker in range(nodes):
            for peer in range(nodes):
                if peer == checker:
                    continue
                wobble = 0.05 * ((checker + 2 * peer + r) % 3 - 1)
                gain, lift = (0.1, 0.0) if peer == attacker else (1.0 + wobble, 0.5 + wobble)
                own = 1.0 if checker != attacker else 0.1
                entries.append(
                    ["c", checker, peer, r, 0, 24, gain, 0.05, own, 0.05, lift, 0.05, 0.5, 0.05]
                )
        entries.append(["r", r])
    return entries


def test_the_attacker_is_flagged_once_two_rounds_hold_enough_records() -> None:
    log = _log(range(1, 8))
    assert replay_node(log, Setting(from_round=3)) == {3: 4}
    assert replay_node(log, Setting(from_round=5)) == {3: 6}
    # one round suffices when the rules allow it (3 checkers, 3 records)
    assert replay_node(log, Setting(from_round=3, min_rounds=1, min_records=3)) == {3: 3}


def test_the_scores_constants_are_restored_after_a_replay() -> None:
    before = workscores.MIN_ROUNDS, workscores.Z
    replay_node(_log(range(1, 4)), Setting(min_rounds=5, z=3.0))
    assert before == (workscores.MIN_ROUNDS, workscores.Z)


def test_runs_give_rounds_to_flag_and_honest_flags(tmp_path, capsys) -> None:
    attacked = {"name": "groups zero 1_of_4", "nodes": 4, "byzantine": 1}
    logs = {str(i): _log(range(1, 8)) for i in range(3)}
    clean = {"name": "groups clean 0_of_4", "nodes": 4, "byzantine": 0}
    runs = [attacked | {"log": logs}, clean | {"log": logs}]
    result = replay_runs(runs, Setting())
    assert result["attacks"] == {"groups zero 1_of_4": [4]}
    # in the clean run node 3 is honest, and its tenth of the work flags it
    assert sorted({tuple(x[1:]) for x in result["honest_flagged"]}) == [
        (0, 3, 4),
        (1, 3, 4),
        (2, 3, 4),
    ]
    path = tmp_path / "records.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"runs": runs}, f)
    replay.main([str(path)])
    out = capsys.readouterr().out
    assert "honest 3" in out and "groups zero 1_of_4: [4]" in out


def test_a_recorded_false_flag_is_gone_with_records_held_near_their_reference() -> None:
    """The honest nodes' check records of a CI run of the six-node useful-work test
    (groups of 3, a zero and a lazy member, 8 rounds) in which the checks flagged an
    honest member in round 5: pooled as measured it is flagged again; held within
    ``1 ± CLIP`` of their references no honest peer is, and both attackers still are."""
    path = Path(__file__).parent / "data" / "useful_work_ci.json"
    runs = json.loads(path.read_text())["runs"]
    raw = replay_runs(runs, Setting(clip=None))
    assert {(by, peer) for _, by, peer, _ in raw["honest_flagged"]} == {(2, 1)}
    held = replay_runs(runs, Setting())
    assert held["honest_flagged"] == []
    assert held["attacks"] == {"useful-work test, CI 2026-12-06": [5, 6]}
