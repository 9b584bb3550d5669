"""What useful-work checks cost a node at realistic round lengths: its tokens per second
with checks against without, side by side.

Two workloads, each a clean swarm of real node processes on 127.0.0.1 run twice, with
the checks (``trust.checkers = 2`` and replay checks in windows of 8 steps,
``trust.replay_steps = 8``; every other ``trust.check*`` key at its default: 16 windows,
one fragment of each contributor a round, a budget of 4 % of training time)
and without (``trust.checkers = 0``), the runs alternating (with, without, without,
with; twice in the full mode) so that a machine getting busier favours neither, and
the ratio is of the means (one pair here can be 8 % off either way). Each workload
first runs once for two rounds without checks, not counted: in both stored runs before
it, the first run of each workload was the slowest of its side (files read cold, a
fresh process pool), and the order charged that to the checks.

- ``demo``: ``configs/local-swarm.toml`` as ``make demo`` runs it, 4 nodes in one group,
  2 fragments, 20-s wall-clock rounds;
- ``llama-tiny``: ``configs/llama-tiny.toml`` on BPE shards of the standard library (a
  2,048-token tokenizer), 2 nodes of one thread each, rounds of 100 inner steps.

Per run, per node: tokens trained over its training wall time (busy and idle seconds in
its status), the checks' forward and replay time over its time in inner steps, the
trace's time (both its threads) over the same, and the bytes it fetched to check over
the bytes its syncs sent. The cost is the tokens/s ratio of the
runs with checks over those without (mean over nodes and runs).
"""

from __future__ import annotations

import pathlib
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from benchmarks._common import prepare_stdlib_shards
from node.config import load_config
from node.ops.swarm import SwarmSpec, run_to_end, summarize
from node.run.metrics import read_events

__all__ = ["COST_CASES", "CostCase", "measure_costs", "overrides_of"]

_ROOT = pathlib.Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class CostCase:
    """A workload the checks' cost is measured on."""

    name: str
    nodes: int
    config: str
    overrides: tuple[str, ...]
    rounds: int
    shards: bool = False
    """Whether it trains on BPE shards prepared for the run."""


COST_CASES = {
    "demo": CostCase("demo", 4, "configs/local-swarm.toml", (), 5),
    "llama-tiny": CostCase(
        "llama-tiny",
        2,
        "configs/llama-tiny.toml",
        (
            "sync.trigger='steps'",
            "sync.inner_steps=100",
            "model.context=128",
            "train.warmup_steps=10",
            "network.round_timeout=30",
        ),
        4,
        shards=True,
    ),
}
_CHECKS = ("trust.checkers=2", "trust.aggregator='centered_clip'", "trust.replay_steps=8")


def overrides_of(case: CostCase, checks: bool, shards: pathlib.Path | None) -> list[str]:
    """A cost run's overrides after its config file."""
    out = [*case.overrides, "trust.checkers=0"]
    if checks:
        out += list(_CHECKS)
    if shards is not None:
        out.append(f"data.shards='{shards}'")
    return out


def _one(
    case: CostCase,
    checks: bool,
    base: pathlib.Path,
    shards: pathlib.Path | None,
    rounds: int,
) -> dict[str, Any]:
    overrides = overrides_of(case, checks, shards)
    directory = base / f"{case.name}-{'with' if checks else 'without'}-{time.monotonic_ns()}"
    spec = SwarmSpec(
        nodes=case.nodes,
        config_paths=[str(_ROOT / case.config)],
        overrides=overrides,
        directory=directory,
        rounds=rounds,
    )
    started = time.monotonic()
    try:
        nodes, finished = run_to_end(spec, 1800.0)
        cfg = load_config([str(_ROOT / case.config)], overrides)
        summary = summarize(nodes, cfg, [])
        per_node = [_node_costs(n) for n in nodes]
        error = (
            None
            if finished and summary["exit_codes"] == [0] * case.nodes
            else (f"finished {finished}, exit codes {summary['exit_codes']}")
        )
        return {
            "case": case.name,
            "checks": checks,
            "rounds": summary["rounds"],
            "val_bpb_end": summary["val_bpb_end"],
            "nodes": per_node,
            "seconds": round(time.monotonic() - started, 1),
            **({"error": error} if error else {}),
        }
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _node_costs(node: Any) -> dict[str, Any]:
    """What one node of a cost run spent: its throughput, busy time, the checks' time and
    bytes, and its round's check counts (from its status file and last round event)."""
    status = node.status
    rounds_seen = [e for e in read_events(node.data_dir / "events.jsonl") if e["event"] == "round"]
    wall = status.get("busy_seconds", 0) + status.get("idle_seconds", 0)
    last = rounds_seen[-1] if rounds_seen else {}
    counts = last.get("checks") or {}
    return {
        "tokens_per_second": status.get("tokens", 0) / wall if wall else None,
        "busy_seconds": status.get("busy_seconds"),
        "check_seconds": counts.get("compute_seconds"),
        "trace_seconds": counts.get("trace_seconds"),
        "bytes_fetched": counts.get("bytes_fetched"),
        "bytes_sent": status.get("bytes_sent"),
        "made": counts.get("made"),
        "taken": counts.get("taken"),
        "skipped": counts.get("skipped"),
        "replayed_steps": counts.get("replayed_steps"),
        "sent_checked": counts.get("sent_checked"),
        "unmeasured": counts.get("unmeasured"),
        "trace_kept_bytes": (last.get("trace") or {}).get("kept_bytes") if rounds_seen else None,
    }


def _mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.fmean(kept) if kept else None


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The tokens/s ratio with checks over without, the checks' share of training time
    and the bytes fetched over the bytes sent."""

    def rate(checks: bool) -> float | None:
        return _mean(
            [n["tokens_per_second"] for r in runs if r["checks"] == checks for n in r["nodes"]]
        )

    with_checks = [n for r in runs if r["checks"] for n in r["nodes"]]
    a, b = rate(True), rate(False)
    return {
        "tokens_per_second_with": a,
        "tokens_per_second_without": b,
        "ratio": a / b if a and b else None,
        "check_share": _mean(
            [
                n["check_seconds"] / n["busy_seconds"]
                for n in with_checks
                if n["check_seconds"] is not None and n["busy_seconds"]
            ]
        ),
        "trace_share": _mean(
            [
                n["trace_seconds"] / n["busy_seconds"]
                for n in with_checks
                if n.get("trace_seconds") is not None and n["busy_seconds"]
            ]
        ),
        "replayed_steps_per_node": _mean([n["replayed_steps"] for n in with_checks]),
        "fetched_to_sent": _mean(
            [
                n["bytes_fetched"] / n["bytes_sent"]
                for n in with_checks
                if n["bytes_fetched"] is not None and n["bytes_sent"]
            ]
        ),
        "records_made_per_node": _mean([n["made"] for n in with_checks]),
        "rounds_skipped_per_node": _mean([n["skipped"] for n in with_checks]),
    }


def measure_costs(quick: bool, base: pathlib.Path) -> dict[str, Any]:
    """Every cost case, its runs alternating with and without checks."""
    order = (True, False, False, True) * (1 if quick else 2)
    out: dict[str, Any] = {}
    for name, case in COST_CASES.items():
        shards = None
        if case.shards:
            shards, _ = prepare_stdlib_shards(base / f"{name}-shards", 2048)
        warmup = _one(case, False, base, shards, 2)
        print(
            f"robustness --checks cost {name}: warm-up {warmup['seconds']:.0f}s (not counted)",
            file=sys.stderr,
            flush=True,
        )
        runs = []
        for checks in order:
            run = _one(case, checks, base, shards, case.rounds)
            runs.append(run)
            rate = _mean([n["tokens_per_second"] for n in run["nodes"]]) or 0.0
            print(
                f"robustness --checks cost {name}: checks {checks} {rate:.0f} tokens/s per "
                f"node, {run['seconds']:.0f}s"
                + (f" ERROR {run['error']}" if "error" in run else ""),
                file=sys.stderr,
                flush=True,
            )
        entry = {
            "case": {**case.__dict__, "overrides": list(case.overrides)},
            "warmup": {k: warmup.get(k) for k in ("rounds", "seconds", "nodes", "error")},
            "runs": runs,
        }
        out[name] = {**entry, **_summary(runs)}
    return out
