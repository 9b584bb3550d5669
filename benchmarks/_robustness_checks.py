"""The robustness benchmark's checks mode: how soon useful-work checks flag a faulty node
in every swarm shape, what it takes of the aggregate meanwhile, and what the checks cost.

Every run is a real swarm of node processes on 127.0.0.1 (``node.ops.swarm``) with the small
model of :mod:`benchmarks.robustness`, int8, two fragments, rounds of 24 inner steps,
centered clipping with screening, ``trust.checkers = 2`` on both fragments from round 3
with replay checks in windows of 8 steps (``trust.replay_steps = 8``; a flagged peer
sits out 10 rounds), for 10 rounds. The checks run unpaced here
(``trust.check_budget = 1``): on a model this small, rounds this short hold too little
training for the default 5 % budget (what they cost at realistic lengths is the cost
part, :mod:`benchmarks._checks_cost`). Swarm shapes, each larger than one group but the
last:

- ``groups``: 8 nodes in groups of 4 that mix global copies on the butterfly;
- ``gossip``: 8 nodes in gossip pairs;
- ``one_group``: 6 nodes in one group (full mode).

The attacked runs start their last node(s) with ``--byzantine MODE``: the quiet faults a
screen is not built to see (``lazy``, a tenth of the claimed steps; ``lazy=0.5``, half;
``zero``; ``copy``; ``random_data``; ``poison``; ``alie`` with 1 and 3 of 8; in groups
also a ``zero`` attacker that is a torchrun site of two ranks). Per shape and seed,
two clean runs, with checks and without, give the reference loss and the cost.

Per attacked run, from the honest nodes' event logs: the rounds until every honest node
flagged each attacker (per honest node the first round event whose ``flagged`` holds
it), whether the checks flagged it or only the screens, the attacker's weight in the
aggregates before that (its weight factor from the check events, and the share of a
group of equal claims that factor leaves it), honest peers flagged in any round, and the
honest loss over the clean run with checks.

Quick mode: ``groups`` and ``gossip``, seed 0, eight attacks and the site attacker (21
swarms, and four cost runs per workload, about 55 minutes here); the full mode adds
``one_group``, seed 1 and four more cost runs per workload.
Smoke: 4 nodes in pairs, one ``zero`` attacker and a clean run without checks, 5 short
rounds. A run that raised, timed out, fell short of its rounds or had a node exit with
an error carries an ``error``: the command lists it and exits 1.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks._mode import Mode
from benchmarks._robustness_swarm import CODECS, SMALL, judge, launch_and_wait, ratio
from node.config import load_config
from node.ops.swarm import SwarmSpec, summarize
from node.ops.swarm_report import log_tail
from node.run.metrics import read_events

__all__ = ["CHECKS", "Job", "Plan", "Shape", "plan_of", "run", "run_job"]

CHECKS = (
    *CODECS["int8"],
    "sync.trigger='steps'",  # inner_steps sets the round's length only under this trigger
    "sync.fragments=2",
    "sync.inner_steps=24",
    "train.total_steps=400",
    "trust.aggregator='centered_clip'",
    "trust.checkers=2",
    "trust.check_fragments=2",
    "trust.check_from_round=3",
    "trust.check_budget=1.0",
    "trust.quarantine_rounds=10",
    "trust.replay_steps=8",
)
_ROUNDS = 10
_SMOKE = ("sync.inner_steps=8", "trust.check_from_round=2", "trust.check_min_records=2")
_SWARM_TIMEOUT = 900.0


@dataclass(frozen=True)
class Shape:
    """A swarm layout: its nodes and the overrides that make it."""

    name: str
    nodes: int
    overrides: tuple[str, ...]
    group: int
    """The size of the groups its exchanges run in."""


SHAPES = {
    "groups": Shape("groups", 8, ("network.group_size=4", "sync.layout='butterfly'"), 4),
    "gossip": Shape("gossip", 8, ("sync.averaging='gossip'",), 2),
    "one_group": Shape("one_group", 6, ("network.group_size=6",), 6),
}
_QUICK_ATTACKS = (
    ("lazy", 1),
    ("lazy=0.5", 1),
    ("zero", 1),
    ("copy", 1),
    ("random_data", 1),
    ("poison", 1),
    ("alie", 1),
    ("alie", 3),
)
_FULL_ATTACKS = _QUICK_ATTACKS


@dataclass(frozen=True)
class Job:
    """One swarm: a shape and seed, an attack ``mode`` on its last ``attackers`` nodes
    (None: a clean run), with checks or without; ``site``: the attacker is a torchrun
    site of two ranks."""

    shape: Shape
    seed: int
    mode: str | None = None
    attackers: int = 0
    checkers: int = 2
    site: bool = False

    @property
    def name(self) -> str:
        mode = "clean" if self.mode is None else self.mode
        site = " site" if self.site else ""
        return f"{self.shape.name} {mode}{site} {self.attackers}_of_{self.shape.nodes}"


@dataclass(frozen=True)
class Plan:
    rounds: int
    extra: tuple[str, ...]
    jobs: tuple[Job, ...] = field(default=())

    def overrides(self, job: Job) -> list[str]:
        return [
            *SMALL,
            *CHECKS,
            *self.extra,
            *job.shape.overrides,
            f"trust.checkers={job.checkers}",
            f"run.seed={job.seed}",
        ]


def plan_of(quick: bool, smoke: bool) -> Plan:
    """The swarms of a mode (see the module docstring)."""
    if smoke:
        pairs = Shape("pairs", 4, ("network.group_size=2", "sync.layout='butterfly'"), 2)
        jobs = (Job(pairs, 0, checkers=0), Job(pairs, 0, "zero", 1))
        return Plan(5, _SMOKE, jobs)
    shapes = ("groups", "gossip") if quick else ("groups", "gossip", "one_group")
    seeds = (0,) if quick else (0, 1)
    jobs: list[Job] = []
    for seed in seeds:
        for name in shapes:
            shape = SHAPES[name]
            jobs += [Job(shape, seed, checkers=0), Job(shape, seed)]
            for mode, count in _QUICK_ATTACKS if quick else _FULL_ATTACKS:
                if count < shape.nodes // 2:
                    jobs.append(Job(shape, seed, mode, count))
            if name == "groups":
                jobs.append(Job(shape, seed, "zero", 1, site=True))
    return Plan(_ROUNDS, (), tuple(jobs))


# ---- one swarm ------------------------------------------------------------------------


def run_job(plan: Plan, job: Job, base: Any, index: int) -> dict[str, Any]:
    """One swarm run and what it measured."""
    overrides = plan.overrides(job)
    byzantine = list(range(job.shape.nodes - job.attackers, job.shape.nodes))
    directory = base / f"swarm{index:03d}"
    extra: dict[int, list[str]] = {i: ["--byzantine", str(job.mode)] for i in byzantine}
    if job.site:
        for i in byzantine:
            extra[i] += ["--nproc-per-node", "2"]
    spec = SwarmSpec(
        nodes=job.shape.nodes,
        config_paths=[],
        overrides=overrides,
        directory=directory,
        rounds=plan.rounds,
        extra_args=extra,
    )
    record: dict[str, Any] = {
        "name": job.name,
        "shape": job.shape.name,
        "mode": job.mode or "clean",
        "nodes": job.shape.nodes,
        "byzantine": job.attackers,
        "site": job.site,
        "seed": job.seed,
        "checkers": job.checkers,
    }
    started = time.monotonic()
    try:
        nodes, finished = launch_and_wait(spec, _SWARM_TIMEOUT)
        cfg = load_config(None, overrides)
        summary = summarize(nodes, cfg, byzantine)
        record.update(judge(summary, byzantine))
        logs = {n.index: read_events(n.data_dir / "events.jsonl") for n in nodes}
        record.update(_measure(summary, logs, byzantine, cfg.trust.check_from_round, job))
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


_COUNTS = (
    "made",
    "taken",
    "recomputed",
    "refused",
    "unserved",
    "forwards",
    "bytes_fetched",
    "replayed",
    "replay_failed",
    "replays_confirmed",
    "replayed_steps",
)


def _measure(
    summary: dict[str, Any],
    logs: dict[int, list[dict]],
    byzantine: list[int],
    from_round: int,
    job: Job,
) -> dict[str, Any]:
    """What the checks did in one run, from each honest node's events."""
    ids = summary["peer_ids"]
    honest = {i: log for i, log in logs.items() if i not in byzantine}
    rounds = {i: [e for e in log if e["event"] == "round"] for i, log in honest.items()}
    honest_ids = {ids[i] for i in honest if ids[i]}
    wall = [b + i for b, i in zip(summary["busy_seconds"], summary["idle_seconds"])]
    last = [(r[-1], r[-1].get("checks") or {}, wall[i]) for i, r in rounds.items() if r]
    seen = [e for r in rounds.values() for e in r]
    flagged_ever = {p for e in seen for p in e.get("flagged", {})}
    checked = any(c for _, c, _ in last)
    return {
        "attackers": [_caught(ids[i], i, rounds, honest, job.shape.group) for i in byzantine],
        "honest_flagged_ever": sorted(flagged_ever & honest_ids),
        "honest_charges": _honest_charges(ids, honest, honest_ids),
        "honest_outliers": _honest_charges(ids, honest, honest_ids, "outlier"),
        "charged_records": _charged_records(ids, honest, honest_ids),
        "honest_replays_failed": [
            [e["round"], e["checker"][-6:], e["peer"][-6:], e["why"]]
            for log in honest.values()
            for e in log
            if e["event"] == "replay" and e["peer"] in honest_ids and not e["passed"]
        ],
        "check_log": check_log(ids, honest),
        "checked_rounds": _checked_rounds(rounds, from_round),
        "round_seconds_checked": _round_seconds(rounds.values(), from_round),
        "checks": {k: sum(c.get(k, 0) for _, c, _ in last) for k in _COUNTS} if checked else None,
        "check_share": _mean_of(
            [c["compute_seconds"] / w for _, c, w in last if "compute_seconds" in c and w > 0]
        ),
        "bytes_fetched_per_round": _mean_of(
            [c["bytes_fetched"] / e["round"] for e, c, _ in last if "bytes_fetched" in c]
        ),
        "bytes_sent_per_round": _mean_of([e["bytes_sent"] / e["round"] for e, _, _ in last]),
    }


def _caught(
    peer: str | None,
    index: int,
    rounds: dict[int, list[dict]],
    logs: dict[int, list[dict]],
    group: int,
) -> dict[str, Any]:
    """When the honest nodes flagged attacker ``peer``, by what, and the weight its
    contributions kept in their aggregates until then."""
    firsts = {
        i: min((e["round"] for e in r if peer and peer in e.get("flagged", {})), default=None)
        for i, r in rounds.items()
    }
    got = [r for r in firsts.values() if r is not None]
    by_checks = sum(
        bool(r and peer in (r[-1].get("checks") or {}).get("flagged", [])) for r in rounds.values()
    )
    factors = _factors(peer, logs)
    failed = [
        (i, e)
        for i, log in logs.items()
        for e in log
        if e["event"] == "replay" and e.get("peer") == peer and not e["passed"]
    ]
    flagged_at = max(got) if len(got) == len(rounds) and got else None
    before = [f for r, f in factors.items() if flagged_at is None or r < flagged_at]
    share = [f / (f + group - 1) for f in before]
    return {
        "index": index,
        "peer": peer,
        "rounds_to_flag": flagged_at,
        "flagged_by": len(got),
        "honest_nodes": len(rounds),
        "first_round_by_node": {str(i): r for i, r in firsts.items()},
        "checks_flagged_by": by_checks,
        "flagged_through": (
            ("replay" if failed else "checks") if by_checks else "screens" if got else "never"
        ),
        "replay_failed_first": min((e["round"] for _, e in failed), default=None),
        "replay_proven_by": len({i for i, e in failed if e.get("proven")}),
        "weight_factor_by_round": {str(r): round(f, 4) for r, f in factors.items()},
        "share_before_flag": round(_mean_of(share), 4) if share else None,
        "share_honest_equal": round(1 / group, 4),
    }


def _factors(peer: str | None, logs: dict[int, list[dict]]) -> dict[int, float]:
    """The weight factor the honest nodes gave ``peer`` as of each round's end: the
    median over nodes of each one's last factor by then (1 before any record)."""
    per_node: dict[int, dict[int, float]] = {}
    ends: set[int] = set()
    for i, log in logs.items():
        factor, mine = 1.0, {}
        for e in log:
            if e["event"] == "check" and e.get("peer") == peer:
                factor = e["factor"]
            elif e["event"] == "round":
                mine[e["round"]] = factor
                ends.add(e["round"])
        per_node[i] = mine
    return {r: statistics.median(m[r] for m in per_node.values() if r in m) for r in sorted(ends)}


def _honest_charges(
    ids: list[str | None],
    logs: dict[int, list[dict]],
    honest_ids: set[str],
    event: str = "violation",
) -> list[dict[str, Any]]:
    """Every violation an honest node charged an honest peer with, and why (``event =
    "outlier"``: every vector of an honest peer a screen left out without a charge)."""
    out = []
    for i, log in logs.items():
        for e in log:
            if e["event"] == event and e.get("peer") in honest_ids:
                out.append(
                    {
                        "by": i,
                        "peer": ids.index(e["peer"]),
                        "round": e.get("round"),
                        "reason": e.get("reason"),
                    }
                )
    return out


_RECORD_KEYS = ("round", "fragment", "claimed", "work", "specific", "short", "factor")
_MEASURED = ("gain", "ref_gain", "lift", "ref_lift")


def check_log(ids: list[str | None], logs: dict[int, list[dict]]) -> dict[str, list[list]]:
    """Per honest node, in its order, every check record it counted and every round's
    end: ``["r", round]`` and ``["c", checker, peer, round, fragment, claimed, *m]``, with
    peers as node indices (-1: not a node of the swarm) and ``m`` each measured estimate's
    mean and standard error (None where absent). What :mod:`benchmarks._checks_replay`
    replays through the scores under other settings."""

    def index(peer: str | None) -> int:
        return ids.index(peer) if peer in ids else -1

    out: dict[str, list[list]] = {}
    for i, log in logs.items():
        entries: list[list] = []
        for e in log:
            if e["event"] == "round":
                entries.append(["r", e["round"]])
            elif e["event"] == "check" and e.get("measured"):
                m = e["measured"]
                flat = [x for k in _MEASURED for x in (m.get(k) or [None, None])]
                entries.append(
                    [
                        "c",
                        index(e.get("checker")),
                        index(e.get("peer")),
                        e["round"],
                        e["fragment"],
                        e["claimed"],
                        *flat,
                    ]
                )
        out[str(i)] = entries
    return out


def _charged_records(
    ids: list[str | None], logs: dict[int, list[dict]], honest_ids: set[str]
) -> dict[str, list[dict[str, Any]]]:
    """For each honest peer an honest node charged with ``useless_work``, every check
    record about it in the honest nodes' events (who checked, of which round, what it
    measured): the evidence a check false positive is diagnosed from, kept because the
    swarm's folder is not."""
    charged = {
        e["peer"]
        for log in logs.values()
        for e in log
        if e["event"] == "violation" and e.get("reason") == "useless_work"
    }
    out: dict[str, list[dict[str, Any]]] = {}
    for peer in sorted(charged & honest_ids):
        records = []
        for i, log in logs.items():
            for e in log:
                if e["event"] == "check" and e.get("peer") == peer:
                    checker = e.get("checker")
                    record = {k: e.get(k) for k in _RECORD_KEYS}
                    records.append(
                        {"by": i, "checker": ids.index(checker) if checker in ids else None}
                        | record
                    )
        out[str(ids.index(peer))] = records
    return out


def _checked_rounds(rounds: dict[int, list[dict]], from_round: int) -> float | None:
    """The share of honest nodes' rounds from ``from_round`` on whose events show checks
    made or records taken (``checks`` counts only grow: a round counts when it moved)."""
    moved, total = 0, 0
    for events in rounds.values():
        before = 0
        for e in events:
            c = e.get("checks") or {}
            now = c.get("made", 0) + c.get("taken", 0)
            if e["round"] > from_round:
                total += 1
                moved += now > before
            before = now
    return moved / total if total else None


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


def progress(done: int, total: int, record: dict[str, Any]) -> None:
    """One line per swarm on stderr (the full mode takes over an hour)."""
    bpb = record.get("val_bpb_end")
    caught = ", ".join(
        f"flagged by {a['flagged_by']} of {a['honest_nodes']}, all by round "
        f"{a['rounds_to_flag']} ({a['flagged_through']})"
        if a["flagged_by"]
        else "not flagged"
        for a in record.get("attackers", [])
    )
    honest = len(record.get("honest_charges") or [])
    print(
        f"robustness --checks {done}/{total}: {record['name']} checkers {record['checkers']} "
        f"seed {record['seed']}  val_bpb_end {f'{bpb:.3f}' if bpb is not None else 'n/a'}  "
        f"{caught}  honest charged {honest}  {record['seconds']:.0f}s"
        + (f"  ERROR {record['error']}" if record.get("error") else ""),
        file=sys.stderr,
        flush=True,
    )


def run_all(plan: Plan, base: Any) -> list[dict[str, Any]]:
    """Every job in order, each attacked run's loss set against its clean run's."""
    runs: list[dict[str, Any]] = []
    clean: dict[tuple[str, int], dict[str, Any]] = {}
    for job in plan.jobs:
        record = run_job(plan, job, base, len(runs))
        if job.mode is None and job.checkers:
            clean[(job.shape.name, job.seed)] = record
        reference = clean.get((job.shape.name, job.seed))
        record["bpb_ratio_to_clean"] = ratio(record, reference) if job.mode else None
        runs.append(record)
        progress(len(runs), len(plan.jobs), record)
    return runs


def run(mode: Mode, out_dir: Any) -> dict[str, Any]:
    """Runs the checks' swarms and cost runs; writes ``robustness-checks.json`` and ``.png``.

    Args:
        mode: what it runs: ``quick``: ``groups`` and ``gossip``, seed 0, eight attacks and
            the site, and cost runs with, without, without and with checks per workload;
            otherwise every shape, seeds 0 and 1, and those cost runs twice; ``smoke``: 4
            nodes in pairs, one zero attacker and a clean run without checks; no cost runs.
        out_dir: the output folder; created if missing.

    Returns:
        The report (:func:`benchmarks._robustness_checks_report.report`).
    """
    import gzip
    import json
    import pathlib
    import tempfile

    from benchmarks import _robustness_checks_report as report_of
    from benchmarks._checks_cost import measure_costs
    from benchmarks._checks_probes import replay_probe, tracer_probe

    plan = plan_of(mode.quick, mode.smoke)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="atoll-robustness-checks-") as tmp:
        runs = run_all(plan, pathlib.Path(tmp))
        costs = {} if mode.smoke else measure_costs(mode.quick, pathlib.Path(tmp))
        replay = None if mode.smoke else replay_probe()
        tracer = None if mode.smoke else tracer_probe()
    setup = {
        "rounds": plan.rounds,
        "overrides": [*CHECKS, *plan.extra],
        "shapes": {s.name: list(s.overrides) for s in {j.shape for j in plan.jobs}},
        "workload": list(SMALL),
    }
    logs = [
        {k: r.get(k) for k in ("name", "shape", "mode", "seed", "checkers", "nodes", "byzantine")}
        | {"log": r.pop("check_log", None)}
        for r in runs
    ]
    report = report_of.report(runs, costs, setup, mode.quick, mode.smoke)
    report["replay"] = replay
    report["tracer"] = tracer
    report["seconds"] = round(time.monotonic() - started, 1)
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "robustness-checks.json").write_text(json.dumps(report, indent=2) + "\n")
    with gzip.open(out / "robustness-checks-records.json.gz", "wt") as f:
        json.dump({"overrides": setup["overrides"], "runs": logs}, f)
    report_of.plot(report, out / "robustness-checks.png")
    return report
