"""The robustness benchmark's checks mode: how soon useful-work checks flag a faulty node,
and what they cost the honest ones.

Every run is a real swarm of node processes on 127.0.0.1 (``node.swarm``) with the small
model of :mod:`benchmarks.robustness`, int8, one group holding every node, one fragment
synced every 12 inner steps, centered clipping with screening, and ``trust.checkers = 2``
from round 3 (a flagged peer sits out 10 rounds), for 6 rounds. The last node(s) start
with ``--byzantine MODE``: the quiet faults a screen is not built to see (``random_data``,
``zero``, ``poison``, ``copy``, ``lazy``) and, in the full mode, ``alie``. Per swarm size
and seed, two clean runs, one with the checks and one without (``trust.checkers = 0``),
give the reference loss and the cost.

Per attacked run, from the honest nodes' event logs: the rounds until each attacker is
flagged (per honest node the first round event whose ``flagged`` holds it; the run
reports the latest of those rounds and how many honest nodes got there), whether the
checks flagged it (``checks.flagged`` in the last round event) or only the screens, the
honest peers flagged in any round, and the honest loss over the clean run with checks.
Per swarm size and seed: the mean round wall time with checks over without (intervals
between round events, from ``trust.check_from_round`` on, when checks run), the checks'
seconds as a share of a node's training wall time, and the bytes a node fetched to check
per round against the bytes it sent.

Quick mode: 6 nodes, 1 attacker, seed 0 (7 swarms, about 7 minutes here); the full mode
adds ``alie`` with 1 of 6 and with 3 of 8 (an 8-node swarm with its own clean runs), and
seed 1 for everything. Smoke: 3 nodes, one ``zero`` attacker and one clean run without
checks, 4 rounds of 4 steps with checks from round 1. ``python -m benchmarks robustness
--checks [--quick]`` writes ``robustness-checks.json`` and ``robustness-checks.png``
(the goals, the summary per attack and the figure are
:mod:`benchmarks._robustness_checks_report`'s). A run that raised, timed out, fell short
of its rounds or had a node exit with an error carries an ``error``: the command lists
it and exits 1.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from benchmarks import _robustness_checks_report as report_of
from benchmarks._robustness_swarm import CODECS, SMALL, judge, launch_and_wait, ratio
from node.config import load_config
from node.metrics import read_events
from node.swarm import SwarmSpec, summarize
from node.swarm_report import log_tail

__all__ = ["run"]

_ROUNDS = 6
_CHECKS = (
    *CODECS["int8"],
    "sync.trigger='steps'",  # inner_steps sets the round's length only under this trigger
    "sync.fragments=1",
    "sync.inner_steps=12",
    "trust.aggregator='centered_clip'",
    "trust.check_from_round=2",
    "trust.quarantine_rounds=10",
)
_CHECKERS = 2
_QUICK_MODES = ("random_data", "zero", "poison", "copy", "lazy")
_SEEDS = (0, 1)
_SMOKE_ROUNDS = 4
_SMOKE = (
    "network.matchmaking_seconds=2",
    "network.round_timeout=6",
    "sync.inner_steps=4",
    "trust.check_from_round=1",
    "trust.check_min_records=2",
)
# A swarm with a quarantined node waits out deadlines; about twice the slowest seen.
_SWARM_TIMEOUT = {3: 240.0, 6: 480.0, 8: 720.0}


@dataclass(frozen=True)
class _Swarm:
    """One swarm size and seed: its clean runs and its attacks ``(mode, attackers)``."""

    nodes: int
    seed: int
    attacks: tuple[tuple[str, int], ...]
    clean_with_checks: bool = True

    @property
    def key(self) -> str:
        return f"{self.nodes}_nodes_seed_{self.seed}"


@dataclass(frozen=True)
class _Plan:
    """Every swarm of a mode, its rounds and the overrides after the checks' own."""

    rounds: int
    extra: tuple[str, ...]
    swarms: tuple[_Swarm, ...]

    def overrides(self, swarm: _Swarm, checkers: int) -> list[str]:
        return [
            *SMALL,
            *_CHECKS,
            *self.extra,
            f"network.group_size={swarm.nodes}",
            f"trust.checkers={checkers}",
            f"run.seed={swarm.seed}",
        ]

    @property
    def total(self) -> int:
        return sum(len(s.attacks) + 1 + s.clean_with_checks for s in self.swarms)


def _plan(quick: bool, smoke: bool) -> _Plan:
    if smoke:
        zero = _Swarm(3, 0, (("zero", 1),), clean_with_checks=False)
        return _Plan(_SMOKE_ROUNDS, _SMOKE, (zero,))
    seeds = _SEEDS[:1] if quick else _SEEDS
    six = tuple((mode, 1) for mode in _QUICK_MODES) + (() if quick else (("alie", 1),))
    swarms = [_Swarm(6, seed, six) for seed in seeds]
    if not quick:
        swarms += [_Swarm(8, seed, (("alie", 3),)) for seed in seeds]
    return _Plan(_ROUNDS, (), tuple(swarms))


# ---- one swarm ------------------------------------------------------------------------


def _run_one(
    plan: _Plan,
    swarm: _Swarm,
    attack: tuple[str, int] | None,
    checkers: int,
    base: pathlib.Path,
    index: int,
) -> dict[str, Any]:
    """One swarm: ``attack`` ``(mode, attackers)`` on its last nodes (None: a clean run)."""
    mode, count = attack or (None, 0)
    overrides = plan.overrides(swarm, checkers)
    byzantine = list(range(swarm.nodes - count, swarm.nodes))
    directory = base / f"swarm{index:03d}"
    spec = SwarmSpec(
        nodes=swarm.nodes,
        config_paths=[],
        overrides=overrides,
        directory=directory,
        rounds=plan.rounds,
        extra_args={i: ["--byzantine", mode] for i in byzantine},
    )
    record: dict[str, Any] = {
        "mode": mode or "clean",
        "nodes": swarm.nodes,
        "byzantine": count,
        "seed": swarm.seed,
        "checkers": checkers,
        "swarm": swarm.key,
    }
    started = time.monotonic()
    try:
        nodes, finished = launch_and_wait(spec, _SWARM_TIMEOUT.get(swarm.nodes, 720.0))
        cfg = load_config(None, overrides)
        summary = summarize(nodes, cfg, byzantine)
        record.update(judge(summary, byzantine))
        logs = {n.index: read_events(n.data_dir / "events.jsonl") for n in nodes}
        events = {i: [e for e in log if e["event"] == "round"] for i, log in logs.items()}
        record.update(_measure(summary, events, byzantine, cfg.trust.check_from_round))
        records = {i: [e for e in log if e["event"] == "check"] for i, log in logs.items()}
        record["honest_flags"] = _honest_flags(summary["peer_ids"], events, records, byzantine)
        problem = _problem(nodes, finished, summary["rounds"], plan.rounds)
        if problem:
            record["error"] = problem
            record["failed_nodes"] = {str(n.index): log_tail(n.data_dir) for n in nodes}
    except Exception as e:  # one broken run must not cost the others their figures
        record.update(error=f"{type(e).__name__}: {e}", val_bpb_end=None)
    finally:
        record["seconds"] = round(time.monotonic() - started, 1)
        shutil.rmtree(directory, ignore_errors=True)
    return record


def _problem(nodes: list, finished: bool, reached: int, rounds: int) -> str | None:
    """Why a run's figures cannot stand: a node that exited with an error, a swarm
    stopped at its deadline, or honest nodes that fell short of the rounds asked for."""
    bad = {n.index: n.proc.returncode for n in nodes if n.proc.returncode != 0}
    if bad:
        return f"node(s) exited with an error: {bad} (index: exit code)"
    if not finished:
        return "timed out; stopped before every node finished"
    if reached < rounds:
        return f"the honest nodes reached round {reached} together, not {rounds}"
    return None


def _measure(
    summary: dict[str, Any], events: dict[int, list[dict]], byzantine: list[int], from_round: int
) -> dict[str, Any]:
    """What the checks did in one run, from each honest node's round events."""
    ids = summary["peer_ids"]
    honest = {i: rounds for i, rounds in events.items() if i not in byzantine}
    honest_ids = {ids[i] for i in honest if ids[i]}
    wall = [b + i for b, i in zip(summary["busy_seconds"], summary["idle_seconds"])]
    # per honest node: its last round event, that event's checks, its training wall time
    last = [(rounds[-1], _checks(rounds[-1]), wall[i]) for i, rounds in honest.items() if rounds]
    seen = [e for rounds in honest.values() for e in rounds]
    flagged_ever = {p for e in seen for p in e.get("flagged", {})}
    by_checks_ever = {p for e in seen for p in _checks(e).get("flagged", [])}
    checked = any("checks" in e for e, _, _ in last)
    return {
        "attackers": [_caught(ids[i], i, honest) for i in byzantine],
        "honest_flagged_ever": sorted(flagged_ever & honest_ids),
        "honest_flagged_by_checks": sorted(by_checks_ever & honest_ids),
        "round_seconds_checked": _round_seconds(honest.values(), from_round),
        "round_seconds_mean": summary["round_seconds_mean"],
        "checks": {k: sum(c.get(k, 0) for _, c, _ in last) for k in _COUNTS} if checked else None,
        "check_share": _mean_of([c["seconds"] / w for _, c, w in last if "seconds" in c and w > 0]),
        "bytes_fetched_per_round": _mean_of(
            [c["bytes_fetched"] / e["round"] for e, c, _ in last if "bytes_fetched" in c]
        ),
        "bytes_sent_per_round": _mean_of([e["bytes_sent"] / e["round"] for e, _, _ in last]),
    }


_COUNTS = ("made", "taken", "recomputed", "refused", "unserved", "bytes_fetched")


def _checks(event: dict[str, Any]) -> dict[str, Any]:
    """A round event's ``checks`` (empty where the node ran none)."""
    return event.get("checks") or {}


def _caught(peer: str | None, index: int, honest: dict[int, list[dict]]) -> dict[str, Any]:
    """When the honest nodes flagged attacker ``peer``: per node the first round whose
    event's ``flagged`` holds it, the latest of those, and what flagged it."""
    firsts = {
        i: min((e["round"] for e in rounds if peer and peer in e.get("flagged", {})), default=None)
        for i, rounds in honest.items()
    }
    got = [r for r in firsts.values() if r is not None]
    by_checks = sum(
        bool(rounds and peer in _checks(rounds[-1]).get("flagged", []))
        for rounds in honest.values()
    )
    return {
        "index": index,
        "peer": peer,
        "rounds_to_flag": max(got) if got else None,
        "flagged_by": len(got),
        "honest_nodes": len(honest),
        "first_round_by_node": {str(i): r for i, r in firsts.items()},
        "checks_flagged_by": by_checks,
        "flagged_through": "checks" if by_checks else "screens" if got else "never",
    }


def _honest_flags(
    ids: list[str | None],
    events: dict[int, list[dict]],
    records: dict[int, list[dict]],
    byzantine: list[int],
) -> list[dict[str, Any]]:
    """Each honest peer an honest node flagged: by which node, from which round (its
    verifier's, its checks'), and the failing check records about it that node counted."""
    honest = [i for i in events if i not in byzantine and ids[i]]
    out = []
    for i in honest:
        for j in honest:
            peer, rounds = ids[j], events[i]
            flagged = [e["round"] for e in rounds if peer in e.get("flagged", {})]
            by_checks = [e["round"] for e in rounds if peer in _checks(e).get("flagged", [])]
            if not flagged and not by_checks:
                continue
            failing = [
                {"checker": ids.index(c["checker"]) if c["checker"] in ids else None}
                | {k: c.get(k) for k in ("round", "gains")}
                for c in records.get(i, [])
                if c.get("peer") == peer and not c.get("passed", True)
            ]
            out.append(
                {
                    "peer": j,
                    "by": i,
                    "flagged_from": min(flagged, default=None),
                    "checks_flagged_from": min(by_checks, default=None),
                    "failing_records": failing,
                }
            )
    return out


def _round_seconds(per_node: Any, from_round: int) -> float | None:
    """Mean wall time between consecutive round events, over the intervals that end at
    ``from_round`` or later (the rounds whose exchanges were checked)."""
    gaps = []
    for rounds in per_node:
        timed = [(e["round"], e["t"]) for e in rounds]
        gaps += [b - a for (_, a), (r, b) in zip(timed, timed[1:]) if r >= from_round]
    return _mean_of(gaps)


def _mean_of(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


# ---- every swarm ----------------------------------------------------------------------


def _progress(done: int, total: int, record: dict[str, Any]) -> None:
    # Quick mode takes minutes, the full one about half an hour: say where it is.
    bpb = record.get("val_bpb_end")
    caught = ", ".join(
        f"flagged by {a['flagged_by']} of {a['honest_nodes']}, the last at round "
        f"{a['rounds_to_flag']} ({a['flagged_through']})"
        if a["flagged_by"]
        else "not flagged"
        for a in record.get("attackers", [])
    )
    print(
        f"robustness --checks {done}/{total}: {record['byzantine']} of {record['nodes']} "
        f"{record['mode']:>11} checkers {record['checkers']} seed {record['seed']}  "
        f"val_bpb_end {f'{bpb:.3f}' if bpb is not None else 'n/a'}  {caught}  "
        f"{record['seconds']:.0f}s" + (f"  ERROR {record['error']}" if record.get("error") else ""),
        file=sys.stderr,
        flush=True,
    )


def _run_all(plan: _Plan, base: pathlib.Path) -> tuple[list[dict], dict[str, dict]]:
    """Every swarm's clean runs, then its attacks; returns the runs and, per swarm, its
    clean runs and what the checks cost."""
    runs: list[dict[str, Any]] = []
    clean: dict[str, dict[str, Any]] = {}
    for s in plan.swarms:
        jobs = [(None, 0)] + [(None, _CHECKERS)] * s.clean_with_checks
        jobs += [(attack, _CHECKERS) for attack in s.attacks]
        reference = None
        for attack, checkers in jobs:
            record = _run_one(plan, s, attack, checkers, base, len(runs))
            if attack is None and checkers:
                reference = record
            record["bpb_ratio_to_clean"] = ratio(record, reference) if attack else None
            runs.append(record)
            _progress(len(runs), plan.total, record)
        plain = next(r for r in runs if r["swarm"] == s.key and not r["checkers"])
        clean[s.key] = _cost(reference, plain)
    return runs, clean


def _cost(with_checks: dict[str, Any] | None, plain: dict[str, Any]) -> dict[str, Any]:
    """What the checks cost a clean swarm: round time with them over without, their
    share of a node's training time, and the bytes fetched against the bytes sent."""
    checked = with_checks or {}
    a, b = checked.get("round_seconds_checked"), plain.get("round_seconds_checked")
    fetched, sent = checked.get("bytes_fetched_per_round"), checked.get("bytes_sent_per_round")
    return {
        "val_bpb_end_with_checks": checked.get("val_bpb_end"),
        "val_bpb_end_without": plain.get("val_bpb_end"),
        "bpb_ratio_without_to_with": ratio(plain, with_checks),
        "round_seconds_with_checks": a,
        "round_seconds_without": b,
        "round_time_ratio": a / b if a and b else None,
        "check_share": checked.get("check_share"),
        "bytes_fetched_per_round": fetched,
        "bytes_sent_per_round": sent,
        "fetched_to_sent": fetched / sent if fetched is not None and sent else None,
    }


def run(quick: bool, out_dir: pathlib.Path, smoke: bool = False) -> dict[str, Any]:
    """Runs the checks' swarms and writes ``robustness-checks.json`` and ``.png``.

    Args:
        quick: 6 nodes, seed 0: 1 attacker for each of random_data, zero, poison, copy
            and lazy, and two clean runs (7 swarms); otherwise also alie with 1 of 6 and
            3 of 8 (and the 8-node swarm's clean runs), for seeds 0 and 1.
        out_dir: the output folder; created if missing.
        smoke: 3 nodes, 1 zero attacker and a clean run without checks, 4 short rounds.

    Returns:
        The report: ``runs`` (one per swarm), ``clean`` (per swarm size and seed, what
        the checks cost), ``attacks`` (per attack over its seeds: rounds to flag, by
        what, the honest loss over clean), ``not_flagged``, ``goals`` and ``met``.
    """
    plan = _plan(quick, smoke)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="atoll-robustness-checks-") as tmp:
        runs, costs = _run_all(plan, pathlib.Path(tmp))
    setup = {
        "rounds": plan.rounds,
        "overrides": plan.overrides(plan.swarms[0], _CHECKERS)[len(SMALL) :],
        "workload": list(SMALL),
    }
    report = report_of.report(runs, costs, setup, quick, smoke)
    report["seconds"] = round(time.monotonic() - started, 1)
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "robustness-checks.json").write_text(json.dumps(report, indent=2) + "\n")
    report_of.plot(report, out_dir / "robustness-checks.png")
    return report
