"""A flapping link, again and again: is a node's return to the swarm luck?

Each run is ``tests/integration/test_partitions.py``'s: three hosts of a network lab
(root only), wall-clock rounds of 10 s, one host's cable pulled for 5 s in each of
three 20-s windows from round 2, then left in; where in its window each cut begins is
drawn at random (seeded by the run's number), so the cuts fall on every phase of a
round's syncs over the runs. A run passes when the two stable nodes agree
bitwise every round and the flapping node agrees with them in every round that began
two rounds or more after its link came back. Reported per run: those rounds, the ones
it was late for, rounds where the stable nodes disagreed, exit codes, and the syncs
the flapping node averaged alone.

Run ``python -m benchmarks partitions [--quick]`` (quick: 3 runs; full: 10; ``--smoke``:
1; about 3 minutes a run); writes ``partitions.json`` and ``partitions.png``.
"""

from __future__ import annotations

import json
import pathlib
import random
import tempfile
import time
from datetime import datetime, timezone
from typing import Any

from benchmarks._common import figure, machine_info
from benchmarks._mode import Mode
from node.ops.swarm_report import log_tail

__all__ = ["run"]


def run(mode: Mode, out_dir: pathlib.Path) -> dict[str, Any]:
    """Repeats the flapping-link run (``smoke``: once) and writes the report and figure;
    ``{"skipped": reason}`` where no network lab can be built."""
    from tests.netlab import netlab_available

    ok, why = netlab_available()
    if not ok:
        return {"skipped": f"the network lab is unavailable: {why}"}
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for i in range(1 if mode.smoke else 3 if mode.quick else 10):
        runs.append(_one_run(i))
        print(f"partitions: run {i}: passed {runs[-1]['passed']}", flush=True)
    report = {
        "benchmark": "partitions",
        "quick": mode.quick,
        "smoke": mode.smoke,
        "machine": machine_info(),
        "command": f"python -m benchmarks partitions{' --quick' if mode.quick else ''}",
        "runs": runs,
        "passed": sum(r["passed"] for r in runs),
        "of": len(runs),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    (out_dir / "partitions.json").write_text(json.dumps(report, indent=2) + "\n")
    _plot(report, out_dir / "partitions.png")
    return report


def _one_run(i: int) -> dict[str, Any]:
    """Run ``i``: a fresh network lab, the flapping-link run with cut offsets drawn from
    seed ``i``, and its verdict."""
    from node.run.metrics import read_events
    from tests.integration.test_partitions import FLAP_SECONDS, OFFSETS, flap_run, judge
    from tests.netlab import NetLab, cleanup_stale

    cleanup_stale()
    with NetLab() as lab, tempfile.TemporaryDirectory(prefix="atoll-flap-") as root:
        started = time.time()
        rng = random.Random(i)
        offsets = tuple(round(rng.uniform(0.0, FLAP_SECONDS / 2), 1) for _ in range(len(OFFSETS)))
        result = flap_run(lab, pathlib.Path(root), offsets)
        verdict = _verdict(judge, result)
        flapper = result["nodes"][2]
        status = flapper.status
        syncs = read_events(flapper.data_dir / "events.jsonl", "sync")
        return {
            "run": i,
            "seconds": round(time.time() - started, 1),
            "exit_codes": result["exit_codes"],
            "finished": result["finished"],
            "flaps": len(result["downs"]),
            "offsets": list(offsets),
            **verdict,
            "passed": bool(
                result["finished"]
                and result["exit_codes"] == [0, 0, 0]
                and not verdict["stable_apart"]
                and verdict["due"]
                and not verdict["late"]
            ),
            "alone_syncs": status.get("alone_syncs", 0),
            "groups": [len(s["group"]) for s in syncs],
        }


def _verdict(judge: Any, result: dict[str, Any]) -> dict[str, Any]:
    """``judge``'s verdict on one run; for a run where a node has no record of some round
    (it stopped early), an ``error`` naming it and the last lines of its log."""
    try:
        return judge(result)
    except KeyError as e:
        tails = {n.index: log_tail(n.data_dir, 3) for n in result["nodes"] if n.proc.returncode}
        return {
            "stable_apart": [],
            "due": [],
            "late": [],
            "error": f"a node has no record of round {e}: exit codes {result['exit_codes']}, "
            f"finished {result['finished']}; {tails}",
        }


def _plot(report: dict[str, Any], path: pathlib.Path) -> None:
    with figure(path, figsize=(8, 3 + 0.3 * len(report["runs"])), dpi=110) as (fig, ax):
        for i, r in enumerate(report["runs"]):
            ax.scatter(
                r["due"],
                [i] * len(r["due"]),
                color="#2a7",
                marker="s",
                label="agreed" if i == 0 else None,
            )
            ax.scatter(
                r["late"],
                [i] * len(r["late"]),
                color="#a22",
                marker="x",
                s=80,
                label="late" if i == 0 else None,
            )
        ax.set_xlabel("round")
        ax.set_ylabel("run")
        ax.set_title(f"flapping node back in the swarm: {report['passed']} of {report['of']} runs")
        ax.legend()
