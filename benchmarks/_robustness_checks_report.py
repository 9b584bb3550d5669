"""The robustness benchmark's checks mode, its report: the goals, each attack over its
runs, whether each goal is met, the notes that say what each figure is, and the figure.

:mod:`benchmarks._robustness_checks` runs the swarms and measures each run; this turns
its runs and per-swarm costs into ``robustness-checks.json``'s summary and
``robustness-checks.png`` (rounds until flagged per attack on the left, what the checks
cost a clean swarm on the right).
"""

from __future__ import annotations

import datetime
import pathlib
from typing import Any

__all__ = ["GOAL_ROUNDS", "plot", "report", "table_row"]

GOAL_ROUNDS = 5
"""Every honest node flags the attacker by this round, for the modes in ``_GOAL_MODES``."""
_GOAL_MODES = ("random_data", "zero", "copy", "poison")
_GOAL_BPB_RATIO = 1.02
_GOAL_COST = 0.05


def _by_attack(runs: list[dict]) -> dict[str, dict[str, Any]]:
    """Per attack (mode, attackers of nodes), over its seeds: the latest round an
    attacker was flagged in (None unless every honest node flagged every attacker), by
    what, and the worst honest loss over its clean run."""
    out: dict[str, dict[str, Any]] = {}
    for r in runs:
        if r["mode"] == "clean":
            continue
        key = f"{r['mode']} {r['byzantine']}_of_{r['nodes']}"
        entry = out.setdefault(key, {"mode": r["mode"], "runs": 0, "caught": [], "ratios": []})
        entry["runs"] += 1
        entry["caught"] += r.get("attackers") or [{"rounds_to_flag": None, "flagged_by": 0}]
        entry["ratios"].append(r.get("bpb_ratio_to_clean"))
    for entry in out.values():
        caught, ratios = entry.pop("caught"), entry.pop("ratios")
        everyone = all(a["flagged_by"] and a["flagged_by"] == a.get("honest_nodes") for a in caught)
        rounds = [a["rounds_to_flag"] for a in caught]
        entry["rounds_to_flag"] = max(rounds) if everyone and rounds else None
        entry["rounds_to_flag_by_run"] = rounds
        entry["flagged_by_every_honest_node"] = everyone
        entry["flagged_through"] = sorted({a.get("flagged_through", "never") for a in caught})
        entry["bpb_ratio_to_clean_max"] = max((x for x in ratios if x is not None), default=None)
        entry["goal_rounds"] = GOAL_ROUNDS if entry["mode"] in _GOAL_MODES else None
    return out


def _verdicts(attacks: dict[str, dict], costs: dict[str, dict], runs: list[dict]) -> dict:
    """Each goal, met or not (None where nothing measured it)."""
    flagged = sum(len(r.get("honest_flagged_ever", [])) for r in runs)
    ratios = [a["bpb_ratio_to_clean_max"] for a in attacks.values()]
    time_ratios = [c["round_time_ratio"] for c in costs.values() if c["round_time_ratio"]]
    shares = [c["check_share"] for c in costs.values() if c["check_share"] is not None]
    return {
        "rounds_to_flag": {
            k: a["rounds_to_flag"] is not None and a["rounds_to_flag"] <= GOAL_ROUNDS
            for k, a in attacks.items()
            if a["goal_rounds"]
        },
        "honest_flagged": flagged == 0,
        "honest_flagged_count": flagged,
        "bpb_within": all(x <= _GOAL_BPB_RATIO for x in ratios if x) if any(ratios) else None,
        "round_time": all(x < 1 + _GOAL_COST for x in time_ratios) if time_ratios else None,
        "check_share": all(x < _GOAL_COST for x in shares) if shares else None,
    }


def report(
    runs: list[dict], costs: dict[str, dict], setup: dict[str, Any], quick: bool, smoke: bool
) -> dict[str, Any]:
    """The checks mode's report.

    Args:
        runs: one record per swarm run.
        costs: per swarm size and seed, what the checks cost its clean swarm.
        setup: ``rounds``, ``overrides`` (after the workload's) and ``workload``.
        quick: quick mode. smoke: smoke mode.

    Returns:
        ``benchmark`` ("robustness"), ``mode`` ("checks"), the flags and ``setup``, ``runs``,
        ``clean`` (``costs``), ``attacks`` (per attack over its runs), ``not_flagged``
        (attacks some honest node never flagged), ``goals``, ``met``, ``notes``,
        ``date`` and ``machine``.
    """
    attacks = _by_attack(runs)
    return {
        "benchmark": "robustness",
        "mode": "checks",
        "quick": quick,
        "smoke": smoke,
        **setup,
        "runs": runs,
        "clean": costs,
        "attacks": attacks,
        "not_flagged": [k for k, a in attacks.items() if not a["flagged_by_every_honest_node"]],
        "goals": {
            "rounds_to_flag": f"<= {GOAL_ROUNDS} for {', '.join(_GOAL_MODES)}",
            "honest_flagged": 0,
            "bpb_ratio_to_clean": f"<= {_GOAL_BPB_RATIO}",
            "round_time_ratio": f"< {1 + _GOAL_COST}",
            "check_share": f"< {_GOAL_COST}",
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
    "round event; screens: flagged by the verifier but not by the checks; never",
    "honest_flagged_ever": "honest peers flagged by an honest node in any round",
    "bpb_ratio_to_clean": "honest val_bpb_end over the clean run with checks of the same "
    "swarm size and seed; above the goal means the attack cost more than 2 %",
    "round_time_ratio": "mean wall time between consecutive round events of honest nodes, "
    "over intervals ending at trust.check_from_round or later, with checks over without",
    "check_share": "checks.seconds at the last round over the node's training wall time "
    "(busy + idle seconds in its status), mean over honest nodes of the clean run",
    "bytes": "checks.bytes_fetched and bytes_sent at the last round over its round number: "
    "per honest node and round, mean over honest nodes",
}

_COST_BARS = (
    ("round_time_ratio", "round time with checks / without − 1"),
    ("check_share", "checks' share of training time"),
    ("fetched_to_sent", "bytes fetched to check / bytes sent"),
)


def plot(data: dict[str, Any], path: pathlib.Path) -> None:
    """Rounds until flagged per attack, and what the checks cost per swarm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    _plot_rounds(left, data["attacks"], data["rounds"])
    _plot_cost(right, data["clean"])
    honest = data["met"]["honest_flagged_count"]
    fig.suptitle(
        f"Useful-work checks, {data['rounds']} rounds; honest peers flagged: {honest}", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_rounds(ax: Any, attacks: dict[str, dict], rounds: int) -> None:
    never = rounds + 1  # where an attack whose attacker was not flagged is drawn, in gray
    heights = [a["rounds_to_flag"] or never for a in attacks.values()]
    colors = ["lightgray" if a["rounds_to_flag"] is None else "tab:blue" for a in attacks.values()]
    ax.bar(range(len(attacks)), heights, color=colors)
    for x, a in enumerate(attacks.values()):
        label = "not flagged" if a["rounds_to_flag"] is None else ", ".join(a["flagged_through"])
        ax.text(x, heights[x] + 0.1, label, ha="center", fontsize=7)
    ax.axhline(GOAL_ROUNDS, color="tab:red", linestyle="--", label=f"goal {GOAL_ROUNDS}")
    ax.set_xticks(range(len(attacks)), list(attacks), rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("round flagged by every honest node")
    ax.set_ylim(0, never + 1)
    ax.legend(fontsize=8)
    ax.set_title("rounds until flagged (gray: not flagged)", fontsize=10)


def _plot_cost(ax: Any, costs: dict[str, dict]) -> None:
    keys, width = list(costs), 0.27
    for shift, (field, label) in enumerate(_COST_BARS):
        values = [costs[k][field] for k in keys]
        if field == "round_time_ratio":
            values = [v - 1 if v is not None else None for v in values]
        shown = [100 * v if v is not None else 0.0 for v in values]
        ax.bar([i + (shift - 1) * width for i in range(len(keys))], shown, width, label=label)
    goal = f"goal for time: {100 * _GOAL_COST:g} %"
    ax.axhline(100 * _GOAL_COST, color="tab:red", linestyle="--", label=goal)
    ax.set_xticks(range(len(keys)), keys, fontsize=8)
    ax.set_ylabel("%")
    ax.legend(fontsize=8)
    ax.set_title("what the checks cost a clean swarm", fontsize=10)


def table_row(d: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The benchmark summary's row for a ``--checks`` results file (``benchmarks.tables``)."""
    parts = []
    for key, a in d["attacks"].items():
        when = "never" if a["rounds_to_flag"] is None else f"round {a['rounds_to_flag']}"
        through = "/".join(a.get("flagged_through") or []) or "-"
        name = key.replace("_of_", " of ")
        parts.append(f"`{name}` {when} ({through}, {a['bpb_ratio_to_clean_max']:.3f})")
    costs = list(d["clean"].values())
    ratio = "/".join(f"{c['round_time_ratio']:.2f}" for c in costs)
    share = "/".join(f"{100 * c['check_share']:.1f}" for c in costs)
    fetched = "/".join(f"{c['fetched_to_sent']:.2f}" for c in costs)
    result = (
        "flagged by every honest node in: " + "; ".join(parts) + " (through, honest bits/byte "
        f"over the clean run); honest peers flagged: **{d['met']['honest_flagged_count']}**; "
        f"round time with checks **{ratio}×** without, checks {share} % of training time, "
        f"{fetched}× the bytes sent fetched to check ({', '.join(d['clean'])})"
    )
    what = (
        "useful-work checks: attackers of a swarm as named, 2 checkers, rounds of 12 inner "
        "steps of the tiny model (round until flagged, through checks or screens)"
    )
    return [(what, result, "≤ 5 rounds, 0 honest flagged, within 2 %, < 5 % of round time")]


def _machine() -> dict[str, Any]:
    from benchmarks._common import machine_info  # torch: not for the docs' tables

    return machine_info()
