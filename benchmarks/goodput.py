"""Goodput of a churning swarm of real nodes: what a swarm learns of what it trains.

16 real node processes on 127.0.0.1 (``node.ops.swarm``) run the demo configuration
(``configs/local-swarm.toml``: wall-clock rounds, two fragments, int8, groups of 4 that
mix their global copies) with rounds of 30 s. From the second round until two rounds
before the end, each node but the first (the operator's, whose address joiners start
from) leaves with probability ``churn`` at a uniform time of each round: a quarter of
leavers are killed (SIGKILL, their connections left open), the rest stopped
(SIGTERM). As many new nodes join on average (a binomial draw a round), each at a
uniform time of its round, through the first node and one other live node, with a new
identity and an empty data folder, as a volunteer's ``atoll run`` would.

**Goodput** is the tokens whose work reached the global model over the tokens trained,
from every node's own events, the departed included:

- in the global model: the tokens of each applied sync, in the share of its parts whose
  result holds the node's work, with those of its failed syncs before it (their work
  stays in the local copy and is folded into the next sync); a stopped node's syncs in
  flight end before it goes (``sync_left`` events) and count the same way;
- trained: everything a node that left trained (its status's last tokens), and for a
  node that ran to the end, all it trained but what no sync of each fragment carried
  when its loop ended (its ``unsynced`` event: the tail any finite run leaves unsynced,
  not a loss to churn).

Rows at 0, 5 and 10 % churn a round (goal: 95 % or more at 5 %), with where the rest
went: work left with leavers, dropped by joiners (the round a joiner sits out), and in
syncs that failed and were never folded in.

Run ``python -m benchmarks goodput [--quick]``: quick is one swarm per row of 10 rounds
(about 18 minutes here); full has 20 rounds; ``--smoke`` is 4 nodes for 5 rounds of
15 s at 0 and 30 % churn. Writes ``goodput.json`` and ``goodput.png``.
"""

from __future__ import annotations

import json
import pathlib
import random
import signal
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from benchmarks._common import figure, machine_info
from benchmarks._formats import markdown_table, pct
from benchmarks._mode import Mode
from node.config import load_config
from node.ops.swarm import SwarmProcess, SwarmSpec, launch, reap, start_node, stop_all
from node.run.metrics import read_events

__all__ = ["Plan", "account", "run", "table", "table_row"]

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_CONFIG = str(_ROOT / "configs" / "local-swarm.toml")
_KILLED = 0.25
"""Share of leavers killed rather than stopped."""
_GOAL_CHURN, _GOAL = 0.05, 0.95
_SYNCS = ("sync", "sync_left", "sync_failed")
"""The events of a node's syncs: applied, ended in its group as the node stopped
(:meth:`node.run.syncer.Syncer.leave`), failed."""


@dataclass(frozen=True)
class Plan:
    """One benchmark run's sizes."""

    nodes: int
    rounds: int
    round_seconds: float
    churns: tuple[float, ...]
    seed: int = 0

    @property
    def calm_rounds(self) -> tuple[int, int]:
        """The first and last round in which nodes leave and join."""
        return 2, max(2, self.rounds - 2)


def plan_of(quick: bool, smoke: bool) -> Plan:
    if smoke:
        return Plan(4, 5, 15.0, (0.0, 0.3))
    return Plan(16, 10 if quick else 20, 30.0, (0.0, 0.05, 0.1))


def run(mode: Mode, out_dir: pathlib.Path) -> dict[str, Any]:
    """Every row's swarm, the report and its figure."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plan = plan_of(mode.quick, mode.smoke)
    rows = []
    with tempfile.TemporaryDirectory(prefix="atoll-goodput-") as tmp:
        for churn in plan.churns:
            began = time.monotonic()
            row = _row(plan, churn, pathlib.Path(tmp) / f"churn{round(churn * 100)}")
            row["seconds"] = round(time.monotonic() - began, 1)
            print(f"goodput: churn {churn:.0%}: {_line(row)}", flush=True)
            rows.append(row)
    goal = next((r for r in rows if r["churn"] == _GOAL_CHURN), None)
    report = {
        "benchmark": "goodput",
        "quick": mode.quick,
        "smoke": mode.smoke,
        "nodes": plan.nodes,
        "rounds": plan.rounds,
        "round_seconds": plan.round_seconds,
        "churn_rounds": list(plan.calm_rounds),
        "killed_share": _KILLED,
        "rows": rows,
        "goal": {
            "churn": _GOAL_CHURN,
            "goodput": _GOAL,
            "met": None if goal is None or goal.get("error") else goal["goodput"] >= _GOAL,
        },
        "machine": machine_info(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    (out_dir / "goodput.json").write_text(json.dumps(report, indent=2) + "\n")
    _plot(report, out_dir / "goodput.png")
    return report


# ---- one swarm ----------------------------------------------------------------------------


@dataclass
class _Swarm:
    """The nodes of one row, live and departed, and what the launcher did to them."""

    spec: SwarmSpec
    nodes: list[SwarmProcess]
    live: set[int] = field(default_factory=set)
    left: dict[int, str] = field(default_factory=dict)  # index -> "killed" or "stopped"
    joined: set[int] = field(default_factory=set)
    helpers: set[int] = field(default_factory=set)


def _row(plan: Plan, churn: float, directory: pathlib.Path) -> dict[str, Any]:
    spec = SwarmSpec(
        nodes=plan.nodes,
        config_paths=[_CONFIG],
        overrides=[
            "run.run_id='bench-goodput'",
            f"sync.round_seconds={plan.round_seconds:g}",
            "run.eval_every=1000",
            "run.checkpoint_every=1000",
        ],
        directory=directory,
        rounds=plan.rounds,
    )
    rng = random.Random(f"{plan.seed}:{churn}")
    swarm = _Swarm(spec, [])
    error = None
    try:
        swarm.nodes = launch(spec)
        swarm.live = set(range(plan.nodes))
        _drive(plan, churn, swarm, rng)
    except Exception as exc:  # a failed row is reported, the others still run
        error = f"{type(exc).__name__}: {exc}"
    finally:
        stop_all(swarm.nodes, grace=20)
        reap(swarm.helpers)
    row = {"churn": churn, **_measure(swarm)}
    if error is not None:
        row["error"] = error
    return row


def _drive(plan: Plan, churn: float, swarm: _Swarm, rng: random.Random) -> None:
    """Run the swarm to its last round, leaving and joining nodes as the plan says."""
    first, last = plan.calm_rounds
    deadline = time.monotonic() + 180 + 2 * plan.rounds * plan.round_seconds
    due: list[tuple[float, str, int]] = []  # (when, "leave" or "join", node index or 0)
    planned = 0
    while time.monotonic() < deadline:
        _watch(swarm)
        if all(n.proc.poll() is not None for n in swarm.nodes):
            return
        now = time.monotonic()
        current = _round(swarm)
        if current >= planned and first <= current + 1 <= last:
            planned = current + 1
            due += _plan_round(swarm, churn, rng, now, plan.round_seconds)
        planned = max(planned, current)
        for item in sorted(d for d in due if d[0] <= now):
            due.remove(item)
            if item[1] == "leave":
                _leave(swarm, item[2], rng)
            else:
                _join(swarm, rng)
        time.sleep(0.5)
    raise TimeoutError(f"the swarm did not finish {plan.rounds} rounds in time")


def _round(swarm: _Swarm) -> int:
    """The newest round a live node finished."""
    return max((swarm.nodes[i].status.get("round", 0) or 0 for i in swarm.live), default=0)


def _plan_round(
    swarm: _Swarm, churn: float, rng: random.Random, now: float, seconds: float
) -> list[tuple[float, str, int]]:
    """Who leaves during the next round and how many join, each at a uniform time."""
    if churn <= 0:
        return []
    out = [(now + rng.random() * seconds, "leave", i) for i in sorted(swarm.live - {0})
           if rng.random() < churn]  # fmt: skip
    joins = sum(rng.random() < churn for _ in swarm.live)
    return out + [(now + rng.random() * seconds, "join", 0) for _ in range(joins)]


def _watch(swarm: _Swarm) -> None:
    for i in list(swarm.live):
        node = swarm.nodes[i]
        swarm.helpers.update(node.status.get("helper_pids", []))
        if node.proc.poll() is not None:
            swarm.live.discard(i)


def _leave(swarm: _Swarm, index: int, rng: random.Random) -> None:
    if index not in swarm.live:
        return
    killed = rng.random() < _KILLED
    swarm.nodes[index].proc.send_signal(signal.SIGKILL if killed else signal.SIGTERM)
    swarm.live.discard(index)
    swarm.left[index] = "killed" if killed else "stopped"


def _join(swarm: _Swarm, rng: random.Random) -> None:
    """A new node joins through the first node and one other live node."""
    others = sorted(swarm.live - {0})
    sources = [0] + ([rng.choice(others)] if others else [])
    peers = [a for i in sources for a in swarm.nodes[i].status.get("maddrs", [])[:1]]
    index = len(swarm.nodes)
    swarm.nodes.append(start_node(swarm.spec, index, peers, ["network.min_peers=1"]))
    swarm.live.add(index)
    swarm.joined.add(index)


# ---- what the swarm learned -----------------------------------------------------------------


def account(
    events: list[dict[str, Any]], status: dict[str, Any], to_the_end: bool, fragments: int
) -> dict[str, int]:
    """One node's tokens trained and in the global model, from its events and status.

    Args:
        events: its events (``sync``, ``sync_left``, ``sync_failed`` and ``unsynced`` are
            read).
        status: its last status (``peer_id``, ``tokens``).
        to_the_end: it ran until the run's last round: what no sync of a fragment
            carried when its loop ended (the ``unsynced`` event) counts as neither trained
            nor lost.
        fragments: the run's fragments (each token trains every fragment once).

    Returns:
        ``trained`` and ``included`` (token-fragments), ``failed`` (in syncs whose result
        left it out, or failed and never folded into one that held it) and ``dropped``
        (trained but in no sync: a joiner's round sat out, a leaver's unsynced work).
    """
    me, tokens, tail = status.get("peer_id"), status.get("tokens") or 0, [0] * fragments
    ends = [e for e in events if e.get("event") == "unsynced"]
    if to_the_end and ends:
        tokens, tail = ends[-1]["tokens"], ends[-1]["fragments"]
    trained = included = failed = launched = 0
    for f in range(fragments):
        carried = 0
        for e in events:
            if e.get("fragment") != f or e.get("event") not in _SYNCS:
                continue
            launched += e["tokens"]
            if e["event"] == "sync_failed":
                carried += e["tokens"]
                continue
            # applied (or ended in its group as the node stopped, ``sync_left``): the
            # parts whose result holds its work; those without it lost theirs (its local
            # copy takes the result)
            work = e["tokens"] + carried
            share = _share(me, e.get("contributors", []))
            included += round(work * share)
            failed += work - round(work * share)
            carried = 0
        failed += carried
        trained += tokens - tail[f]
    return {
        "trained": trained,
        "included": included,
        "failed": failed,
        "dropped": max(0, trained - launched),
    }


def _share(me: Any, contributors: list) -> float:
    """The share of a sync's parts whose result holds ``me``'s work (``contributors``:
    per part, the peers in its result)."""
    parts = [p for p in contributors if isinstance(p, list)] or [contributors]
    return sum(me in p for p in parts) / len(parts) if parts else 0.0


def _measure(swarm: _Swarm) -> dict[str, Any]:
    rounds = swarm.spec.rounds
    fragments = load_config(swarm.spec.config_paths, swarm.spec.overrides).sync.fragments
    totals = dict.fromkeys(("trained", "included", "failed", "dropped"), 0)
    by_kind: dict[str, dict[str, int]] = {}
    contributed = 0
    for node in swarm.nodes:
        events = read_events(node.data_dir / "events.jsonl")
        status = node.status
        finished = status.get("round", 0) >= rounds and node.index not in swarm.left
        tally = account(events, status, finished, fragments)
        if node.index in swarm.joined and _contributed(status.get("peer_id"), events):
            contributed += 1
        kind = (
            "left"
            if node.index in swarm.left
            else "joined"
            if node.index in swarm.joined
            else "stayed"
        )
        into = by_kind.setdefault(kind, dict.fromkeys(totals, 0))
        for key, value in tally.items():
            totals[key] += value
            into[key] += value
    trained = max(totals["trained"], 1)
    return {
        "nodes_started": len(swarm.nodes),
        "left": len(swarm.left),
        "killed": sum(v == "killed" for v in swarm.left.values()),
        "joined": len(swarm.joined),
        "joiners_contributed": contributed,
        "goodput": round(totals["included"] / trained, 4),
        # where the rest went, disjoint: all a leaver did not get in; what joiners that
        # stayed dropped joining; the failed syncs of the nodes that stayed
        "lost_with_leavers": round(_lost(by_kind.get("left")) / trained, 4),
        "dropped_joining": round(_get(by_kind, "joined", "dropped") / trained, 4),
        "failed_syncs": round(
            (_get(by_kind, "joined", "failed") + _get(by_kind, "stayed", "failed")) / trained, 4
        ),
        "tokens": totals,
        "by_kind": by_kind,
    }


def _get(by_kind: dict[str, dict[str, int]], kind: str, key: str) -> int:
    return by_kind.get(kind, {}).get(key, 0)


def _lost(tally: dict[str, int] | None) -> int:
    return 0 if tally is None else tally["trained"] - tally["included"]


def _contributed(me: Any, events: list[dict[str, Any]]) -> bool:
    """Whether any applied sync's result holds ``me``'s work."""
    syncs = (e for e in events if e.get("event") == "sync")
    return any(_share(me, e.get("contributors", [])) > 0 for e in syncs)


# ---- report ---------------------------------------------------------------------------------


def _line(row: dict[str, Any]) -> str:
    if row.get("error"):
        return f"error: {row['error']}"
    return (
        f"goodput {row['goodput']:.1%} ({row['left']} left, {row['joined']} joined, "
        f"{row['joiners_contributed']} of them contributed), {row['seconds']:.0f} s"
    )


def table_row(d: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The docs' summary row of ``goodput.json``."""
    parts = []
    for r in d["rows"]:
        if r.get("error"):
            parts.append(f"{pct(r['churn'], 0)}: error")
            continue
        text = f"{pct(r['churn'], 0)} churn: **{pct(r['goodput'])}**"
        if r["left"] or r["joined"]:
            text += f" ({r['left']} left, {r['joined']} joined)"
        parts.append(text)
    what = (
        f"goodput of {d['nodes']} real nodes under churn (tokens in the global model over "
        f"tokens trained), {d['rounds']} wall-clock rounds of {d['round_seconds']:g} s"
    )
    return [(what, "; ".join(parts), "≥ 95 % at 5 % churn a round")]


def table(d: dict[str, Any]) -> str:
    """Every row of ``goodput.json`` as a Markdown table: where the tokens went."""
    header = ["churn a round", "left (killed)", "joined (contributed)", "goodput",
              "left with leavers", "dropped joining", "failed syncs"]  # fmt: skip
    body = []
    for r in d["rows"]:
        if r.get("error"):
            body.append([pct(r["churn"], 0), "", "", f"error: {r['error']}", "", "", ""])
            continue
        body.append([
            pct(r["churn"], 0),
            f"{r['left']} ({r['killed']})",
            f"{r['joined']} ({r['joiners_contributed']})",
            f"**{pct(r['goodput'])}**",
            pct(r["lost_with_leavers"]),
            pct(r["dropped_joining"]),
            pct(r["failed_syncs"]),
        ])  # fmt: skip
    return markdown_table(header, body)


def _plot(report: dict[str, Any], path: pathlib.Path) -> None:
    rows = [r for r in report["rows"] if not r.get("error")]
    with figure(path, figsize=(6, 3.2), dpi=110) as (fig, ax):
        x = [f"{r['churn']:.0%}" for r in rows]
        bottom = [0.0] * len(rows)
        for key, label, color in (
            ("goodput", "in the global model", "#2a7"),
            ("lost_with_leavers", "left with leavers", "#c84"),
            ("dropped_joining", "dropped by joiners", "#88c"),
            ("failed_syncs", "failed syncs", "#a22"),
        ):
            values = [r[key] for r in rows]
            ax.bar(x, values, bottom=bottom, color=color, label=label)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.axhline(_GOAL, color="k", lw=0.8, ls="--")
        ax.set_ylim(0, max([1.05, *bottom]))
        ax.set_xlabel("nodes leaving (and joining) a round")
        ax.set_ylabel("share of tokens trained")
        ax.set_title(f"goodput of {report['nodes']} real nodes under churn")
        ax.legend(fontsize=7, loc="lower left")
