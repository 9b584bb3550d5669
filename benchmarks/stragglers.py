"""Stragglers benchmark: how much of the compute that is there each method uses.

Four workers run at slowdowns 1, 1, 2 and 4 (speeds 1, 1, 0.5 and 0.25), emulated the
way ``atoll run --slowdown X`` does it: after a step's compute the worker sleeps
``(X - 1)`` times that compute, and the sleep counts as busy, because slower hardware
would be computing then. Three methods run one after another on the same small model
and data (the integration tests' config):

- ``atoll_seconds``: real nodes (``node.ops.swarm``) with ``sync.trigger = seconds``: each
  node syncs on the swarm's wall clock with whatever it finished, so no node waits.
- ``atoll_steps``: the same swarm with ``sync.trigger = steps`` (10 inner steps per
  round) and a long matchmaking window, so the fast nodes wait for the slow one.
- ``ddp``: PyTorch ``DistributedDataParallel`` over gloo on 127.0.0.1, four processes,
  a gradient all-reduce every step, for as long as the ``atoll_seconds`` swarm trains.
  The slowdown sleep goes between forward and backward, so it delays the all-reduce
  inside backward exactly as slower hardware would; backward compute is timed up to
  its last gradient accumulation, so the wait for the all-reduce is not counted as busy.

Per worker, ``busy`` is compute plus the slowdown sleep and ``idle`` is the rest of its
training wall time (waiting for peers). Two figures come out of that:

- ``utilization = sum(busy) / sum(busy + idle)``: the share of worker-seconds spent
  computing. A synchronous method steps at the slowest worker's pace (4 time units per
  step) while worker i is busy ``X_i`` units of it: ``(1 + 1 + 2 + 4) / (4 * 4) = 50 %``.
- ``compute_utilization``: the same with each worker's seconds weighted by its speed
  ``1 / X_i``, i.e. useful compute over available compute. Each worker does one step
  per 4 units where it could do ``4 / X_i``: ``4 / (4 + 4 + 2 + 1) = 36.4 %``, the
  figure in the design notes. Atoll's seconds mode should reach nearly 100 % on both;
  its target is that the two fast workers are idle less than 5 % of the time.

Run it with ``python -m benchmarks stragglers [--quick]`` (quick: 3 rounds of 6 s,
about 3 minutes on two idle cores; full: 10 rounds; ``--smoke``: two workers at
slowdowns 1 and 2, 1 round of 5 s or 2 steps, 5 s of DDP); it writes ``stragglers.json``
and ``stragglers.png`` into the output folder.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import tempfile
import time
from typing import Any

from benchmarks._common import figure, machine_info
from benchmarks._ddp import DdpRun, run_timed_ddp
from benchmarks._mode import Mode
from node.config import load_config
from node.ops import swarm
from node.ops.swarm import QUICK_WORKLOAD
from node.run.metrics import read_events

__all__ = ["run"]

_SLOWDOWNS = (1, 1, 2, 4)
_ROUND_SECONDS = 6
_SMOKE_SLOWDOWNS = (1, 2)
_SMOKE_ROUND_SECONDS = 5  # matchmaking and commit may take at most 80 % of a round
# The tiny workload the integration tests use too.
_SMALL = [
    "run.run_id='bench-stragglers'",
    *QUICK_WORKLOAD,
    "sync.fragments=2",
    "sync.codec='int8'",
    "network.request_timeout=8",
    "run.eval_every=1000",  # evaluation is neither useful compute nor waiting: leave it out
]
_SECONDS = [
    "sync.trigger='seconds'",
    "network.matchmaking_seconds=1.5",
    "network.round_timeout=4",
]
# A matchmaking window longer than the slow node's round makes every node wait for it.
_STEPS = [
    "sync.trigger='steps'",
    "sync.inner_steps=10",
    "network.matchmaking_seconds=30",
    "network.round_timeout=8",
]
_SMOKE_STEPS = ["sync.inner_steps=2", "network.matchmaking_seconds=5"]


# ---- Atoll swarms ---------------------------------------------------------------------


def _run_atoll(
    overrides: list[str],
    rounds: int,
    directory: pathlib.Path,
    timeout: float,
    slowdowns: tuple[float, ...],
) -> dict[str, Any]:
    """One swarm to its end (or ``timeout``); per-worker busy and idle, and agreement."""
    spec = swarm.SwarmSpec(
        nodes=len(slowdowns),
        config_paths=[],
        overrides=overrides,
        directory=directory,
        rounds=rounds,
        extra_args={i: ["--slowdown", str(x)] for i, x in enumerate(slowdowns)},
    )
    nodes, finished = swarm.run_to_end(spec, timeout)
    summary = swarm.summarize(nodes, load_config(None, overrides))
    busy = summary["busy_seconds"]
    idle = [i + _closing_wait(n.data_dir) for i, n in zip(summary["idle_seconds"], nodes)]
    record = _method(busy, idle, [n.status.get("steps", 0) for n in nodes], slowdowns)
    record.update(
        params_agree=summary["params_agree"],
        rounds=summary["rounds"],
        exit_codes=summary["exit_codes"],
    )
    if not finished:
        record["error"] = "timed out; stopped before every node finished"
    return record


def _closing_wait(data_dir: pathlib.Path) -> float:
    """Seconds from a node's last step to the end of its last round.

    A node reports idle time with each step, so a wait after its last step (in steps
    mode: the last round's sync, waiting for the slow node) is not in its status. A
    sync that saw no step between its launch and its result was all waiting.
    """
    events = read_events(data_dir / "events.jsonl")
    rounds = [e for e in events if e["event"] == "round"]
    if not rounds:
        return 0.0
    last = rounds[-1]
    syncs = [e for e in events if e["event"] == "sync" and e["round"] == last["round"]]
    waits = [last["t"] - (s["t"] - s["seconds"]) for s in syncs if s["overlap_steps"] == 0]
    return max(0.0, max(waits, default=0.0))


def _run_ddp(seconds: float, slowdowns: tuple[float, ...]) -> dict[str, Any]:
    """A DDP rank per slowdown (``benchmarks._ddp.run_timed_ddp``)."""
    run = DdpRun(tuple(_SMALL), len(slowdowns), seconds=seconds, slowdowns=slowdowns)
    result = run_timed_ddp(run)
    if "error" in result:
        return {"error": result["error"], "per_worker": []}
    ordered = result["ranks"]
    record = _method(
        [r["busy"] for r in ordered],
        [r["idle"] for r in ordered],
        [r["steps"] for r in ordered],
        slowdowns,
    )
    record["params_agree"] = all(r["params_agree"] for r in ordered)
    record["exit_codes"] = result["exit_codes"]
    return record


# ---- figures ---------------------------------------------------------------------------


def _expected(synchronous: bool, slowdowns: tuple[float, ...]) -> tuple[float, float]:
    """Ideal (utilization, compute_utilization) at ``slowdowns``."""
    if not synchronous:
        return 1.0, 1.0
    slowest = max(slowdowns)
    time_share = sum(slowdowns) / (len(slowdowns) * slowest)
    return time_share, len(slowdowns) / sum(slowest / x for x in slowdowns)


def _method(
    busy: list[float], idle: list[float], steps: list[int], slowdowns: tuple[float, ...]
) -> dict[str, Any]:
    """Utilizations, per-worker records and the fast workers' idle shares."""
    per_worker = [
        {
            "slowdown": x,
            "busy": round(b, 3),
            "idle": round(i, 3),
            "idle_share": round(i / (b + i), 4) if b + i > 0 else None,
            "steps": s,
        }
        for x, b, i, s in zip(slowdowns, busy, idle, steps)
    ]
    total = sum(busy) + sum(idle)
    # Weighting a worker's seconds by its speed 1/X turns time into compute.
    useful = sum(b / x for b, x in zip(busy, slowdowns))
    walls = [b + i for b, i in zip(busy, idle)]
    available = sum(w / x for w, x in zip(walls, slowdowns))
    return {
        "utilization": round(sum(busy) / total, 4) if total else None,
        "compute_utilization": round(useful / available, 4) if available else None,
        "fast_idle_share": [w["idle_share"] for w in per_worker if w["slowdown"] == 1],
        # Inner steps of all workers together per second of training: the work done.
        "steps_per_second": round(sum(steps) * len(walls) / sum(walls), 2) if total else None,
        "per_worker": per_worker,
    }


def _plot(report: dict[str, Any], path: pathlib.Path) -> None:
    methods = report["methods"]
    # Own y scales: the steps-mode swarm trains for far less time than the others.
    with figure(path, 1, len(methods), figsize=(4.2 * len(methods), 3.8)) as (fig, axes):
        for ax, (name, m) in zip(axes, methods.items()):
            workers = m.get("per_worker", [])
            xs = range(len(workers))
            ax.bar([x - 0.2 for x in xs], [w["busy"] for w in workers], 0.4, label="busy")
            ax.bar([x + 0.2 for x in xs], [w["idle"] for w in workers], 0.4, label="idle")
            ax.set_xticks(list(xs), [f"slowdown {w['slowdown']}" for w in workers], fontsize=8)
            if m.get("utilization") is None:
                ax.set_title(f"{name}: no result", fontsize=9)
                continue
            ax.set_title(
                f"{name}\nutilization {m['utilization']:.0%} (ideal {m['expected_utilization']:.0%})"
                f"\ncompute {m['compute_utilization']:.0%} "
                f"(ideal {m['expected_compute_utilization']:.0%})",
                fontsize=9,
            )
        axes[0].set_ylabel("seconds per worker")
        axes[0].legend(fontsize=8, loc="center right")
        slowdowns = report["slowdowns"]
        fig.suptitle(
            f"{len(slowdowns)} workers at slowdowns {', '.join(map(str, slowdowns))}", fontsize=10
        )


_NOTES = {
    "utilization": "sum(busy) / sum(busy + idle) over workers; busy = compute "
    "plus the slowdown sleep, idle = waiting for peers",
    "compute_utilization": "useful compute / available compute: each worker's "
    "seconds weighted by its speed 1/slowdown (the design notes' 36 % for DDP)",
    "expected": "ideal values: 1.0 for a method that never waits; for a "
    "synchronous one, every step takes the slowest worker's time",
    "fast_idle_share": "idle / (busy + idle) of the slowdown-1 workers; Atoll "
    "seconds-mode target < 0.05",
    "steps_per_second": "inner steps of all workers together per second of "
    "training (mean wall time per worker)",
    "atoll_idle": "from each node's status (idle = training wall - busy at its last "
    "step) plus the wait from its last step to the end of its last round",
}
"""How each figure of the report was taken."""


def run(mode: Mode, out_dir: pathlib.Path) -> dict:
    """Measures utilization under stragglers for Atoll (seconds, steps) and DDP.

    Args:
        mode: what it runs: ``quick``: 3 rounds per swarm and 18 s of DDP (about 3 minutes);
            otherwise 10 rounds and 60 s; ``smoke``: two workers, 1 round per swarm and 5 s
            of DDP: a check that it runs.
        out_dir: folder for ``stragglers.json`` and ``stragglers.png``; created if missing.

    Returns:
        The dict written to ``stragglers.json``: ``slowdowns``, ``methods`` (per method:
        ``utilization``, ``compute_utilization``, their ideal values, ``fast_idle_share``,
        ``per_worker`` busy/idle/idle_share/steps and ``params_agree``), ``quick``,
        ``date`` and ``machine``.
    """
    rounds = 1 if mode.smoke else 3 if mode.quick else 10
    slowdowns = _SMOKE_SLOWDOWNS if mode.smoke else _SLOWDOWNS
    round_seconds = _SMOKE_ROUND_SECONDS if mode.smoke else _ROUND_SECONDS
    seconds = rounds * round_seconds  # the seconds-mode swarm's training time
    methods: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="atoll-stragglers-") as tmp:
        base = pathlib.Path(tmp)
        on_clock = [*_SMALL, *_SECONDS, f"sync.round_seconds={round_seconds}"]
        on_steps = [*_SMALL, *_STEPS, *(_SMOKE_STEPS if mode.smoke else [])]
        plans = {  # name -> (synchronous, swarm overrides and timeout; None: DDP)
            "atoll_seconds": (False, on_clock, 150.0 + 2 * seconds),
            "atoll_steps": (True, on_steps, 150.0 + 40.0 * rounds),
            "ddp": (True, None, 0.0),
        }
        for name, (synchronous, overrides, timeout) in plans.items():
            started = time.monotonic()
            try:
                if overrides is None:
                    record = _run_ddp(seconds, slowdowns)
                else:
                    record = _run_atoll(overrides, rounds, base / name, timeout, slowdowns)
            except Exception as e:  # one broken method must not cost the others
                record = {"error": f"{type(e).__name__}: {e}", "per_worker": []}
            record["seconds"] = round(time.monotonic() - started, 1)
            record["expected_utilization"], record["expected_compute_utilization"] = (
                round(v, 4) for v in _expected(synchronous, slowdowns)
            )
            methods[name] = record
    report = {
        "benchmark": "stragglers",
        "slowdowns": list(slowdowns),
        "methods": methods,
        "quick": mode.quick,
        "smoke": mode.smoke,
        "rounds": rounds,
        "ddp_seconds": seconds,
        "notes": dict(_NOTES),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
    }
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "stragglers.json").write_text(json.dumps(report, indent=2) + "\n")
    _plot(report, out_dir / "stragglers.png")
    return report
