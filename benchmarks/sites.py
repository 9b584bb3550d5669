"""Sites benchmark: a site of several processes against as many single-process nodes.

Two swarms train the same model on the same budget, one after the other: four
processes in both, each on batches of the same size for the same inner steps, so the
tokens per round are equal:

- ``sites``: 2 nodes of 2 ranks each (``atoll swarm --nodes 2 --procs-per-node 2``:
  torchrun, DDP over gloo inside each site); only each site's leader exchanges with
  the swarm.
- ``nodes``: 4 nodes of one process each.

``slow_link_bytes_per_round`` is what every node sends to the swarm (parts, results,
repairs) per round: in a picture of distant sites it is what crosses the slow links,
while a site's DDP traffic stays on its fast local network (not counted). With the
quick settings a group of two sites averages with one partner where four nodes
average in a group of four, so the sites send less in all; ``bytes_ratio`` says how
much. ``val_bpb_end`` is the global model's bits per byte after the last round.

``python -m benchmarks sites [--quick]`` (quick: 4 rounds of 10 inner steps, about two
minutes on two idle cores; full: 12 rounds; ``--smoke``: 2 sites of 2 ranks against 2
nodes, 1 round of 2 inner steps) writes ``sites.json`` and ``sites.png``.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import tempfile
import time
from typing import Any

from benchmarks._common import figure, machine_info
from benchmarks._mode import Mode
from node.config import load_config
from node.ops import swarm
from node.ops.swarm import QUICK_WORKLOAD
from node.run.metrics import read_events

__all__ = ["run"]

_SMALL = [
    "run.run_id='bench-sites'",
    *QUICK_WORKLOAD,
    "sync.trigger='steps'",
    "sync.inner_steps=10",
    "sync.fragments=2",
    "sync.codec='int8'",
    "outer.momentum=0.5",
    "network.matchmaking_seconds=6",
    "network.round_timeout=8",
    "network.request_timeout=8",
]
_SETUPS = {"sites": (2, 2), "nodes": (4, 1)}
"""name -> (nodes, processes per node): four processes in both."""
_SMOKE_SETUPS = {"sites": (2, 2), "nodes": (2, 1)}
_SMOKE = ["sync.inner_steps=2", "network.matchmaking_seconds=3"]


def _run(
    setup: tuple[int, int], rounds: int, directory: pathlib.Path, overrides: list[str]
) -> dict[str, Any]:
    nodes, procs = setup
    spec = swarm.SwarmSpec(
        nodes=nodes,
        config_paths=[],
        overrides=overrides,
        directory=directory,
        rounds=rounds,
        procs_per_node=procs,
    )
    started = time.monotonic()
    launched, finished = swarm.run_to_end(spec, timeout=180.0 + 30.0 * rounds)
    summary = swarm.summarize(launched, load_config(None, overrides))
    sent = summary["bytes_sent_per_node"]
    curves = []
    for n in launched:
        events = read_events(n.data_dir / "events.jsonl", "round")
        curves.append([[e["round"], e["val_bpb"]] for e in events if "val_bpb" in e])
    record = {
        "nodes": nodes,
        "procs_per_node": procs,
        "rounds": summary["rounds"],
        "tokens_per_node": [n.status.get("tokens", 0) for n in launched],
        "slow_link_bytes_per_round": round(sum(sent) / max(1, summary["rounds"])),
        "bytes_sent_per_node": sent,
        "val_bpb_start": summary["val_bpb_start"],
        "val_bpb_end": summary["val_bpb_end"],
        "params_agree": summary["params_agree"],
        "ranks_agree": summary["ranks_agree"],
        "exit_codes": summary["exit_codes"],
        "curves": curves,
        "seconds": round(time.monotonic() - started, 1),
    }
    if not finished:
        record["error"] = "timed out; stopped before every node finished"
    return record


def _plot(report: dict[str, Any], path: pathlib.Path) -> None:
    with figure(path, 1, 2, figsize=(9, 3.6)) as (fig, (bars, lines)):
        names = list(report["setups"])
        per_round = [report["setups"][k].get("slow_link_bytes_per_round", 0) / 1e3 for k in names]
        bars.bar(names, per_round, color=["tab:blue", "tab:gray"])
        bars.set_ylabel("kB sent to the swarm per round")
        bars.set_title("bytes over the slow links", fontsize=9)
        for name, color in zip(names, ["tab:blue", "tab:gray"]):
            curves = report["setups"][name].get("curves") or [[]]
            xs = [r for r, _ in curves[0]]
            ys = [v for _, v in curves[0]]
            lines.plot(xs, ys, marker="o", color=color, label=name)
        lines.set_xlabel("round")
        lines.set_ylabel("val bits/byte (global model)")
        lines.legend(fontsize=8)
        lines.set_title("same processes, same tokens per round", fontsize=9)


def run(mode: Mode, out_dir: pathlib.Path) -> dict:
    """2 sites of 2 ranks against 4 single-process nodes.

    Args:
        mode: what it runs: ``quick``: 4 rounds instead of 12; ``smoke``: 2 sites of 2 ranks
            against 2 nodes, 1 round of 2 inner steps: a check that it runs.
        out_dir: folder for ``sites.json`` and ``sites.png``; created if missing.

    Returns:
        The dict written to ``sites.json``: per setup its bytes per round over the
        slow links, tokens, bits per byte and agreement; ``bytes_ratio`` (sites over
        nodes) and ``bpb_gap`` (sites minus nodes, final bits per byte).
    """
    rounds = 1 if mode.smoke else 4 if mode.quick else 12
    overrides = [*_SMALL, *(_SMOKE if mode.smoke else [])]
    setups: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="atoll-sites-") as tmp:
        for name, setup in (_SMOKE_SETUPS if mode.smoke else _SETUPS).items():
            try:
                setups[name] = _run(setup, rounds, pathlib.Path(tmp) / name, overrides)
            except Exception as e:  # one broken setup must not cost the other
                setups[name] = {"error": f"{type(e).__name__}: {e}"}
    sites, nodes = setups["sites"], setups["nodes"]
    ratio = gap = None
    if sites.get("slow_link_bytes_per_round") and nodes.get("slow_link_bytes_per_round"):
        ratio = round(sites["slow_link_bytes_per_round"] / nodes["slow_link_bytes_per_round"], 3)
    if sites.get("val_bpb_end") is not None and nodes.get("val_bpb_end") is not None:
        gap = round(sites["val_bpb_end"] - nodes["val_bpb_end"], 4)
    report = {
        "benchmark": "sites",
        "quick": mode.quick,
        "smoke": mode.smoke,
        "rounds": rounds,
        "setups": setups,
        "bytes_ratio": ratio,
        "bpb_gap": gap,
        "notes": {
            "budget": "4 processes in both setups, batch 8 x 64 tokens each, 10 inner "
            "steps per round: equal tokens per round",
            "slow_link_bytes_per_round": "bytes every node sent to the swarm per round "
            "(a site's DDP traffic stays inside it and is not counted)",
        },
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sites.json").write_text(json.dumps(report, indent=2) + "\n")
    _plot(report, out_dir / "sites.png")
    return report
