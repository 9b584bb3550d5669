"""The robustness benchmark's checks mode, its report: the goals, each attack in each
swarm shape over its runs, what the checks cost at realistic round lengths, whether each
goal is met, the notes that say what each figure is, and the figure.

:mod:`benchmarks._robustness_checks` runs the attacked and clean swarms and
:mod:`benchmarks._checks_cost` the cost runs; this turns them into
``robustness-checks.json``'s summary and ``robustness-checks.png`` (rounds until flagged
per attack and shape on the left, the tokens/s ratio per workload on the right).
"""

from __future__ import annotations

import datetime
import pathlib
from typing import Any

from benchmarks._common import figure

__all__ = ["GOAL_ROUNDS", "plot", "report", "table", "table_row"]

GOAL_ROUNDS = {"lazy": 5, "zero": 5, "copy": 5, "random_data": 5, "lazy=0.5": 10}
"""Every honest node flags the attacker by this round, per mode with a goal."""
_GOAL_BPB_RATIO = 1.02
_GOAL_COST = 0.95


def _by_attack(runs: list[dict]) -> dict[str, dict[str, Any]]:
    """Per attack (shape, mode, attackers of nodes), over its seeds: the latest round an
    attacker was flagged in (None unless every honest node flagged every attacker), by
    what, its share of the aggregate until then and the worst honest loss over clean."""
    out: dict[str, dict[str, Any]] = {}
    for r in runs:
        if r["mode"] == "clean":
            continue
        entry = out.setdefault(
            r["name"],
            {"shape": r["shape"], "mode": r["mode"], "runs": 0, "caught": [], "ratios": []},
        )
        entry["runs"] += 1
        entry["caught"] += r.get("attackers") or [{"rounds_to_flag": None, "flagged_by": 0}]
        entry["ratios"].append(r.get("bpb_ratio_to_clean"))
    for entry in out.values():
        caught, ratios = entry.pop("caught"), entry.pop("ratios")
        everyone = all(a["flagged_by"] and a["flagged_by"] == a.get("honest_nodes") for a in caught)
        rounds = [a["rounds_to_flag"] for a in caught]
        shares = [a.get("share_before_flag") for a in caught if a.get("share_before_flag")]
        entry["rounds_to_flag"] = max(rounds) if everyone and None not in rounds else None
        entry["rounds_to_flag_by_run"] = rounds
        entry["flagged_by_every_honest_node"] = everyone
        entry["flagged_through"] = sorted({a.get("flagged_through", "never") for a in caught})
        entry["share_before_flag"] = max(shares) if shares else None
        entry["share_honest_equal"] = next(
            (a["share_honest_equal"] for a in caught if "share_honest_equal" in a), None
        )
        entry["bpb_ratio_to_clean_max"] = max((x for x in ratios if x is not None), default=None)
        entry["goal_rounds"] = GOAL_ROUNDS.get(entry["mode"])
    return out


def _verdicts(attacks: dict[str, dict], costs: dict[str, dict], runs: list[dict]) -> dict:
    """Each goal, met or not (None where nothing measured it)."""
    charged = sum(len(r.get("honest_charges") or []) for r in runs)
    replays = sum(len(r.get("honest_replays_failed") or []) for r in runs)
    outliers = sum(len(r.get("honest_outliers") or []) for r in runs)
    flagged = sum(len(r.get("honest_flagged_ever", [])) for r in runs)
    ratios = [a["bpb_ratio_to_clean_max"] for a in attacks.values()]
    cost = [c["ratio"] for c in costs.values() if c.get("ratio") is not None]
    return {
        "rounds_to_flag": {
            k: a["rounds_to_flag"] is not None and a["rounds_to_flag"] <= a["goal_rounds"]
            for k, a in attacks.items()
            if a["goal_rounds"]
        },
        "honest_flagged": flagged == 0 and charged == 0 and replays == 0,
        "honest_replays_failed_count": replays,
        "honest_flagged_count": flagged,
        "honest_charges_count": charged,
        "honest_outliers_count": outliers,
        "bpb_within": all(x <= _GOAL_BPB_RATIO for x in ratios if x) if any(ratios) else None,
        "tokens_per_second": all(x >= _GOAL_COST for x in cost) if cost else None,
    }


def report(
    runs: list[dict], costs: dict[str, dict], setup: dict[str, Any], quick: bool, smoke: bool
) -> dict[str, Any]:
    """The checks mode's report.

    Args:
        runs: one record per swarm run.
        costs: per cost workload, its runs and the ratio of tokens/s with checks to without.
        setup: ``rounds``, ``overrides`` (after the workload's) and ``workload``.
        quick: quick mode. smoke: smoke mode.

    Returns:
        ``benchmark`` ("robustness"), ``mode`` ("checks"), the flags and ``setup``, ``runs``,
        ``costs``, ``attacks`` (per attack over its runs), ``not_flagged`` (attacks some
        honest node never flagged), ``goals``, ``met``, ``notes``, ``date``, ``machine``.
    """
    attacks = _by_attack(runs)
    return {
        "benchmark": "robustness",
        "mode": "checks",
        "quick": quick,
        "smoke": smoke,
        **setup,
        "runs": runs,
        "costs": costs,
        "attacks": attacks,
        "not_flagged": [k for k, a in attacks.items() if not a["flagged_by_every_honest_node"]],
        "goals": {
            "rounds_to_flag": {m: f"<= {r}" for m, r in GOAL_ROUNDS.items()},
            "honest_flagged": 0,
            "bpb_ratio_to_clean": f"<= {_GOAL_BPB_RATIO}",
            "tokens_per_second_ratio": f">= {_GOAL_COST}",
        },
        "met": _verdicts(attacks, costs, runs),
        "notes": _NOTES,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": _machine(),
    }


_NOTES = {
    "rounds_to_flag": "per attacker, the latest over honest nodes of the first round whose "
    "round event's flagged (quarantined or banned by the verifier) holds it; per attack, "
    "the latest over its runs, None unless every honest node flagged every attacker",
    "flagged_through": "checks: the attacker is in checks.flagged of an honest node's last "
    "round event; replay: so, and a replay of its trace failed on an honest node; "
    "screens: flagged by the verifier but not by the checks; never",
    "honest_replays_failed": "every replay of an honest peer's window that failed on an "
    "honest node (round, checker, peer, why)",
    "share_before_flag": "the attacker's weight factor (from the honest nodes' check "
    "events, median over nodes) as a share of a group of equal claims, f / (f + G - 1), "
    "averaged over the rounds before it was flagged; share_honest_equal is 1 / G",
    "honest_flagged_ever": "honest peers flagged by an honest node in any round",
    "honest_charges": "every violation an honest node charged an honest peer with",
    "honest_outliers": "every vector of an honest peer a statistical screen left out "
    "without a charge (trust.outlier_rounds: it counts when repeated)",
    "charged_records": "per honest peer charged with useless_work (by index), every "
    "check record about it: checker, round, claimed steps, work and specific ratios",
    "bpb_ratio_to_clean": "honest val_bpb_end over the clean run with checks of the same "
    "shape and seed; above the goal means the attack cost more than 2 %",
    "checked_rounds": "the share of honest nodes' rounds after trust.check_from_round "
    "whose checks made or took a record (checks that never ran would show 0)",
    "costs": "tokens/s per node (tokens over training wall time) with checks over "
    "without, mean over nodes and runs; check_share: the checks' forward and replay "
    "seconds over the node's seconds in inner steps; trace_share: the trace's seconds "
    "(both its threads) over the same; replayed_steps_per_node: steps a node replayed "
    "in the run; fetched_to_sent: bytes fetched to check over the bytes the node's "
    "syncs sent",
}


def plot(data: dict[str, Any], path: pathlib.Path) -> None:
    """Rounds until flagged per attack and shape, and what the checks cost."""
    with figure(path, 1, 2, figsize=(13, 4.8), width_ratios=[3, 1]) as (fig, (left, right)):
        _plot_rounds(left, data["attacks"], data["rounds"])
        _plot_cost(right, data["costs"])
        met = data["met"]
        fig.suptitle(
            f"Useful-work checks, {data['rounds']} rounds; honest peers flagged: "
            f"{met['honest_flagged_count']}, honest peers charged: {met['honest_charges_count']}",
            fontsize=10,
        )


def _plot_rounds(ax: Any, attacks: dict[str, dict], rounds: int) -> None:
    never = rounds + 1  # where an attack whose attacker was not flagged is drawn, in gray
    heights = [a["rounds_to_flag"] or never for a in attacks.values()]
    colors = ["lightgray" if a["rounds_to_flag"] is None else "tab:blue" for a in attacks.values()]
    ax.bar(range(len(attacks)), heights, color=colors)
    for x, a in enumerate(attacks.values()):
        label = "never" if a["rounds_to_flag"] is None else ", ".join(a["flagged_through"])
        ax.text(x, heights[x] + 0.1, label, ha="center", fontsize=6, rotation=90)
        if a["goal_rounds"]:
            ax.plot([x - 0.4, x + 0.4], [a["goal_rounds"]] * 2, color="tab:red", lw=1)
    ax.set_xticks(range(len(attacks)), list(attacks), rotation=35, ha="right", fontsize=7)
    ax.set_ylabel("round flagged by every honest node")
    ax.set_ylim(0, never + 3)
    ax.set_title("rounds until flagged (gray: not; red: goal)", fontsize=10)


def _plot_cost(ax: Any, costs: dict[str, dict]) -> None:
    keys = list(costs)
    values = [costs[k].get("ratio") or 0.0 for k in keys]
    ax.bar(range(len(keys)), values, color="tab:green")
    ax.axhline(_GOAL_COST, color="tab:red", linestyle="--", label=f"goal {_GOAL_COST}")
    ax.set_xticks(range(len(keys)), keys, fontsize=8)
    ax.set_ylim(0.8, 1.05)
    ax.set_ylabel("tokens/s with checks / without")
    ax.legend(fontsize=8)
    ax.set_title("what the checks cost", fontsize=10)


def table_row(d: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The benchmark summary's row for a ``--checks`` results file (``benchmarks.tables``)."""
    parts = []
    for key, a in d["attacks"].items():
        when = "never" if a["rounds_to_flag"] is None else f"round {a['rounds_to_flag']}"
        ratio = a["bpb_ratio_to_clean_max"]
        parts.append(
            f"`{key.replace('_of_', ' of ')}` {when}" + (f" ({ratio:.3f})" if ratio else "")
        )
    costs = "; ".join(
        f"{k} **{c['ratio']:.3f}**" for k, c in d["costs"].items() if c.get("ratio") is not None
    )
    met = d["met"]
    result = (
        "flagged by every honest node in: " + "; ".join(parts) + " (honest bits/byte over "
        f"the clean run); honest peers flagged: **{met['honest_flagged_count']}**, charged: "
        f"**{met['honest_charges_count']}** (outliers left out, not charged: "
        f"{met.get('honest_outliers_count', 0)}); tokens/s with checks over without: {costs}"
    )
    what = (
        "useful-work checks: attackers in each swarm shape (groups of 4 that mix, gossip "
        "pairs, one group), 2 checkers, rounds of 24 inner steps of the tiny model; cost "
        "at the demo config and llama-tiny with 100-step rounds"
    )
    goals = "≤ 5 rounds (half the steps: ≤ 10), 0 honest flagged, within 2 %, ≥ 0.95"
    return [(what, result, goals)]


def table(d: dict[str, Any]) -> str:
    """The docs' detail table of a ``--checks`` results file: per attack, per swarm shape,
    the round by which every honest node flagged it, how, the honest bits per byte over
    the clean run's and the attacker's share of its group's aggregate before its flag;
    then the cost per workload."""
    shapes = list(dict.fromkeys(a["shape"] for a in d["attacks"].values()))
    rows: dict[str, dict[str, str]] = {}
    for key, a in d["attacks"].items():
        attack = key.split(" ", 1)[1].replace("_of_", " of ")
        how = ", ".join(a.get("flagged_through") or [])
        cells = [
            "never" if a["rounds_to_flag"] is None else str(a["rounds_to_flag"]),
            how,
            _fmt(a.get("bpb_ratio_to_clean_max"), "{:.3f}"),
            _fmt(a.get("share_before_flag"), "{:.2f}"),
        ]
        rows.setdefault(attack, {})[a["shape"]] = " · ".join(c for c in cells if c)
    lines = [
        "| attack | " + " | ".join(shapes) + " |",
        "|---" * (len(shapes) + 1) + "|",
        *(
            f"| `{attack}` | " + " | ".join(cells.get(s, "") for s in shapes) + " |"
            for attack, cells in rows.items()
        ),
        "",
        "| cost workload | tokens/s with checks / without | checks' share | trace's share "
        "| steps replayed a node | bytes fetched / sent |",
        "|---|---|---|---|---|---|",
    ]
    for name, c in d["costs"].items():
        cells = [
            _fmt(c.get("ratio"), "{:.3f}"),
            _fmt(c.get("check_share"), "{:.1%}"),
            _fmt(c.get("trace_share"), "{:.1%}"),
            _fmt(c.get("replayed_steps_per_node"), "{:.1f}"),
            _fmt(c.get("fetched_to_sent"), "{:.2f}"),
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _fmt(value: float | None, spec: str) -> str:
    return "" if value is None else spec.format(value)


def _machine() -> dict[str, Any]:
    from benchmarks._common import machine_info  # torch: not for the docs' tables

    return machine_info()
