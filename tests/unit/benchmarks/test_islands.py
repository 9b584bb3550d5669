"""The islands and sparse benchmarks' bookkeeping: the run journal, gaps and goals, on
hand-made runs (the runs themselves in tests/integration/test_benchmark_smoke.py)."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

from benchmarks import islands, sparse


def test_the_journal_runs_each_name_once_and_resumes_from_its_file(tmp_path: Path) -> None:
    path = tmp_path / "runs.jsonl"
    calls: list[str] = []

    def work(name: str) -> dict:
        calls.append(name)
        return {"value": len(calls)}

    journal = islands.Journal(path, {"journal": 2})
    assert journal.run("a", lambda: work("a")) == {"value": 1}
    assert journal.run("a", lambda: work("a")) == {"value": 1}
    with path.open("a") as f:
        f.write('{"plan": "cut sho')  # a line an interruption cut
    again = islands.Journal(path, {"journal": 2})
    assert again.run("a", lambda: work("a")) == {"value": 1} and calls == ["a"]
    # another plan's runs are not taken for this one's
    other = islands.Journal(path, {"journal": 3})
    assert other.run("a", lambda: work("a")) == {"value": 2}
    assert [json.loads(line)["name"] for line in path.read_text().splitlines()[:1]] == ["a"]


def test_the_journal_runs_jobs_in_worker_processes_and_keeps_each(tmp_path: Path) -> None:
    path = tmp_path / "runs.jsonl"
    journal = islands.Journal(path, {"journal": 2})
    journal.run("a", lambda: {"value": 0})  # done already: not run again
    jobs = {name: partial(dict, value=i) for i, name in enumerate("abc")}
    journal.run_all(jobs, workers=2)
    assert journal.done == {"a": {"value": 0}, "b": {"value": 1}, "c": {"value": 2}}
    kept = islands.Journal(path, {"journal": 2}).done
    assert kept == journal.done


def test_the_full_plan_runs_every_arm_at_three_seeds_and_the_quick_check_reuses_its_arm(
    tmp_path: Path,
) -> None:
    full = islands._jobs(islands._plan(False, False), tmp_path / "shards", tmp_path)
    small = [n for n in full if n.startswith("small/2000/")]
    assert len(small) == 3 * 4  # DDP and three arms at seeds 0-2
    assert sorted(n for n in full if n.startswith("medium/")) == sorted(
        f"medium/600/{s}/{arm}" for s in range(3) for arm in ("ddp", islands._GOAL_ARM)
    )
    tiny = [n for n in full if n.startswith("llama-tiny/")]
    assert tiny == [f"llama-tiny/1000/{s}/4 nodes, AdamW" for s in range(3)]
    assert full[tiny[0]].args[-1] == 4  # the check's batch, not the ranks' share
    # the quick check's reference is the goal arm the quick plan runs anyway: seed 0 once
    quick = islands._jobs(islands._plan(True, False), tmp_path / "shards", tmp_path)
    assert [n for n in quick if n.endswith(islands._GOAL_ARM)] == [
        f"small/600/{s}/{islands._GOAL_ARM}" for s in range(3)
    ]
    assert len(quick) == 3 + 3  # three references, DDP, SOAP and eight cells at seed 0


def _history(end: float, steps: int = 100) -> list[dict]:
    return [
        {"step": 0, "val_bpb": 4.0},
        {"step": steps // 2, "val_bpb": end + 0.5},
        {"step": steps, "val_bpb": end},
    ]


def test_islands_gaps_are_paired_by_seed_and_the_goal_judged_on_the_worst() -> None:
    plan = islands._Plan(sizes=(islands._Size("small", 100, 2, ()),), inner_steps=50)
    entries = [
        {"model": "small", "seed": 0, "ddp": {"history": _history(2.0)},
         islands._GOAL_ARM: {"history": _history(2.01)}},
        {"model": "small", "seed": 1, "ddp": {"history": _history(2.2)},
         islands._GOAL_ARM: {"history": _history(2.244)}},
    ]  # fmt: skip
    summary = islands._summary(entries, plan)
    row = summary["small"][islands._GOAL_ARM]
    assert row["seeds"] == 2 and abs(row["gap_percent"] - 1.25) < 1e-9
    assert row["meets_goal"] is False  # seed 1 is 2 % above its DDP
    assert set(summary["small"]) == {"ddp", islands._GOAL_ARM}  # arms not run are left out
    goals = islands._goals(summary, [])
    assert list(goals) == ["small: two sites within 1 % of DDP"]
    assert goals["small: two sites within 1 % of DDP"]["meets_goal"] is False


def _arm(h: int, codec: str, end: float, sent: float) -> dict:
    return {
        "inner_steps": h, "codec": codec, "outer_steps": 100 // h, "history": _history(end),
        "bytes_sent_per_worker": sent, "bits_per_param_per_sync": 1.0,
        "allgather_bits_per_param_per_sync": 0.5,
    }  # fmt: skip


def test_sparse_goals_need_both_the_bytes_and_the_gap() -> None:
    plan = sparse._Plan(steps=100, seeds=1, inner_steps=(10, 50))
    entry = {
        "seed": 0,
        "ddp": {"history": _history(2.0), "params": 1000},
        "int8 H=10": _arm(10, "int8", 2.10, 4e5),
        "topk 3% 2b H=10": _arm(10, "topk 3% 2b", 2.08, 0.5e5),  # 8x fewer, better
        "int8 H=50": _arm(50, "int8", 2.10, 0.8e5),
        "topk 3% 2b H=50": _arm(50, "topk 3% 2b", 2.20, 0.1e5),  # 8x fewer, worse
    }
    summary = sparse._summary([entry], plan)
    # DDP: 2 * 3/4 of 4 bytes a parameter a step
    assert summary["arms"]["ddp"]["bytes_sent_per_worker"] == 1.5 * 4 * 1000 * 100
    goals = sparse._goals(summary, plan)
    assert goals["H=10: topk as good as int8 with >= 4x fewer bytes"]["meets_goal"] is True
    assert goals["H=50: topk as good as int8 with >= 4x fewer bytes"]["meets_goal"] is False
    # 600,000 / 50,000 = 12x fewer than DDP: far from 10,000x
    assert goals["H=10: topk >= 10,000x fewer bytes than DDP at int8's gap"]["value"] == 12.0
    assert not goals["H=10: topk >= 10,000x fewer bytes than DDP at int8's gap"]["meets_goal"]
    assert "| topk 3% 2b H=10 | 10 |" in sparse.table(
        {"summary": summary, "goals": goals, "params": 1000}
    )
