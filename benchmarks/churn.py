"""Churn benchmark: what nodes leaving and joining cost a swarm's mixing, simulated.

The scale simulator (:mod:`benchmarks._scale_sim`, today's node policy: the cell grid
above 256 nodes, paced registry reads) on its default WAN (five regions, 10 Gbit/s per
node) with the reference model's int8 fragments and fp16 global copies, groups of 4.
Each round every node leaves with probability ``churn`` at a uniform time of its
round (a quarter of leavers vanish without closing their connections, so peers wait
``request_timeout`` for them) and as many join on average. Two round triggers:

- ``steps`` (``sync.trigger = "steps"``): a node's round ends when it has trained its
  inner steps and applied its syncs, so nodes whose syncs failed start their next
  round early;
- ``seconds`` (``sync.trigger = "seconds"``, the shipped public configs): rounds of
  120 s on the swarm's wall clock.

Per row: the share of contributions included in their group's result, and **reach**:
the share of (contribution, node) pairs where a node holds a contribution of the
first round ``log_G n + 2`` rounds later (rounded up). Goal (issue: churn that costs
only what leaves): reach of 95 % or more at 5 % churn a round.

Run it with ``python -m benchmarks churn [--quick]``; it writes ``churn.json`` and
``churn.png``. Quick: 1,000 nodes, seed 0 (seconds); full: 1,000 and 10,000 nodes,
seeds 0-2 (a few minutes); ``--smoke``: 64 nodes, two churn rates.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import pathlib
import statistics
import time
from typing import Any

from benchmarks import _scale_sim
from benchmarks._common import figure, machine_info
from benchmarks._formats import markdown_table, pct, run_mode
from benchmarks._mode import Mode

__all__ = ["mix_rounds", "run", "table", "table_row"]

_FRAGMENT_BYTES = 478_720 / 4 * (1 + 4 / 256)  # the reference model's int8 fragment
_MODEL_BYTES = 478_720 * 4 * 3  # weights, global copy, outer momentum
_TRIGGERS = {"steps": None, "seconds": 120.0}
_CHURN = (0.0, 0.005, 0.01, 0.02, 0.05, 0.1)
_GOAL_CHURN, _GOAL_REACH = 0.05, 0.95


def _config(round_seconds: float | None, churn: float) -> _scale_sim.SimConfig:
    return dataclasses.replace(
        _scale_sim.SimConfig(),
        fragment_bytes=_FRAGMENT_BYTES,
        mix_bytes=2 * _FRAGMENT_BYTES,
        model_bytes=_MODEL_BYTES,
        control=_scale_sim.NODE_POLICY,
        churn=churn,
        round_seconds=round_seconds,
    )


def mix_rounds(n: int, group_size: int) -> int:
    """``ceil(log_G n) + 2``: the rounds the goal gives a contribution to reach every node."""
    return math.ceil(math.log(n) / math.log(group_size) - 1e-9) + 2


def _row(trigger: str, n: int, churn: float, seeds: range) -> dict[str, Any]:
    cfg = _config(_TRIGGERS[trigger], churn)
    window = mix_rounds(n, cfg.group_size)
    runs = [_scale_sim.simulate(cfg, n, window, seed, mix_rounds=window) for seed in seeds]
    reach = [float(r["reach_share"]) for r in runs]
    included = [float(r["included_share"]) for r in runs]
    return {
        "trigger": trigger,
        "n": n,
        "churn": churn,
        "rounds": window,
        "seeds": len(runs),
        "reach": statistics.fmean(reach),
        "reach_min": min(reach),
        "included": statistics.fmean(included),
        "round_seconds": statistics.fmean(r["round_seconds_mean"] for r in runs),
        "utilization": statistics.fmean(r["utilization"] for r in runs),
        "left": sum(r["left"] for r in runs),
        "joined": sum(r["joined"] for r in runs),
    }


def run(mode: Mode, out_dir: pathlib.Path) -> dict[str, Any]:
    """Every trigger, size and churn rate of the plan; writes ``churn.json`` and
    ``churn.png`` into ``out_dir``."""
    sizes, seeds, rates = (1000,), range(1), _CHURN
    if mode.smoke:
        sizes, rates = (64,), (0.0, _GOAL_CHURN)
    elif not mode.quick:
        sizes, seeds = (1000, 10_000), range(3)
    started = time.time()
    rows = []
    for n in sizes:
        for trigger in _TRIGGERS:
            for churn in rates:
                rows.append(_row(trigger, n, churn, seeds))
                r = rows[-1]
                print(
                    f"churn: {trigger} n={n} churn={churn:.1%}: reach {r['reach']:.3f}, "
                    f"included {r['included']:.3f}",
                    flush=True,
                )
    goals = {
        f"{r['trigger']} n={r['n']}": {
            "reach": r["reach"],
            "goal": _GOAL_REACH,
            "meets_goal": r["reach_min"] >= _GOAL_REACH,
        }
        for r in rows
        if r["churn"] == _GOAL_CHURN
    }
    report = {
        "benchmark": "churn",
        "quick": mode.quick,
        "smoke": mode.smoke,
        "policy": "node",
        "round_seconds": _TRIGGERS["seconds"],
        "group_size": _config(None, 0.0).group_size,
        "crash_share": _config(None, 0.0).crash_share,
        "rows": rows,
        "goals": goals,
        "seconds": time.time() - started,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
    }
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "churn.json").write_text(json.dumps(report, indent=2) + "\n")
    _plot(report, out_dir / "churn.png")
    return report


def _plot(report: dict[str, Any], path: pathlib.Path) -> None:
    with figure(path, 1, 2, figsize=(11, 4.2)) as (fig, axes):
        for ax, key, title in (
            (axes[0], "reach", "reach after ceil(log_G n) + 2 rounds"),
            (axes[1], "included", "contributions included in their group's result"),
        ):
            lines: dict[tuple[str, int], list[dict[str, Any]]] = {}
            for r in report["rows"]:
                lines.setdefault((r["trigger"], r["n"]), []).append(r)
            for (trigger, n), rows in lines.items():
                xs = [100 * r["churn"] for r in rows]
                style = "o-" if trigger == "seconds" else "s--"
                ax.plot(xs, [r[key] for r in rows], style, label=f"{trigger} trigger, n={n:,}")
            if key == "reach":
                ax.axhline(_GOAL_REACH, color="grey", lw=0.8, ls=":", label="goal at 5 %")
            ax.set_xlabel("churn: nodes leaving (and joining) per round, %")
            ax.set_ylim(0, 1.02)
            ax.set_title(title, fontsize=9)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)


# ---- the docs' rows ---------------------------------------------------------------------


def table_row(data: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The summary row: reach at the goal's churn rate per trigger and size."""
    mode = run_mode(data)
    parts = []
    for name, goal in data["goals"].items():
        mark = "" if goal["meets_goal"] else " (goal missed)"
        trigger, n = name.split(" n=")
        parts.append(f"{trigger} trigger, {int(n):,} nodes: **{pct(goal['reach'])}**{mark}")
    what = (
        f"churn, simulated ({mode} mode): reach of a round's contributions after "
        f"ceil(log_G n) + 2 rounds with {pct(_GOAL_CHURN, 0)} of nodes leaving and joining "
        "each round"
    )
    return [(what, "; ".join(parts), f"≥ {pct(_GOAL_REACH, 0)} at {pct(_GOAL_CHURN, 0)} churn")]


def table(data: dict[str, Any]) -> str:
    """Every row of ``churn.json`` as a Markdown table."""
    header = ["trigger", "nodes", "churn a round", "rounds", "included", "reach", "round"]
    body = [
        [
            r["trigger"],
            f"{r['n']:,}",
            pct(r["churn"]),
            str(r["rounds"]),
            pct(r["included"]),
            pct(r["reach"]) + (f" (min {pct(r['reach_min'])})" if r["seeds"] > 1 else ""),
            f"{r['round_seconds']:.0f} s",
        ]
        for r in data["rows"]
    ]
    return markdown_table(header, body)
