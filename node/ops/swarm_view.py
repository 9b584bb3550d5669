"""The views an operator reads of a local swarm: the one-paragraph summary of what it
did (:func:`node.ops.swarm_report.summarize`), the live table, and the summary as JSON.
"""

from __future__ import annotations

import json
from typing import Any

from node.ops.swarm_report import SwarmProcess

__all__ = ["dump_json", "format_summary", "render_table"]


def format_summary(summary: dict[str, Any]) -> str:
    """A short human-readable summary."""
    sent = summary["bytes_sent_per_node"]
    ddp = summary["ddp_bytes_per_node"]
    ratio = (sum(ddp) / sum(sent)) if sum(sent) else float("nan")
    start, end = summary["val_bpb_start"], summary["val_bpb_end"]
    bpb = f"{start:.3f} -> {end:.3f}" if start is not None and end is not None else "n/a"
    return (
        f"swarm of {summary['nodes']} nodes, {summary['rounds']} rounds in "
        f"{summary['seconds']:.0f}s; val bits/byte {bpb}; params agree: "
        f"{summary['params_agree']}{_apart_line(summary)}{_mix_line(summary)}"
        f"{_ranks_line(summary)}; "
        f"sent {sum(sent) / 2**20:.1f} MiB in all "
        f"({ratio:.0f}x less than fp32 DDP for the same steps)\n"
        f"{_failed_lines(summary)}"
        f"logs and checkpoints: {summary['directory']}"
    )


def _failed_lines(summary: dict[str, Any]) -> str:
    """Each node that exited with an error, with the last lines of its log."""
    out = []
    failed = summary.get("failed_nodes") or {}
    for index, tail in sorted(failed.items(), key=lambda t: int(t[0])):
        out.append(f"node {index} exited with an error; its log ends:\n")
        out += [f"  {line}\n" for line in tail]
    return "".join(out)


def _mix_line(summary: dict[str, Any]) -> str:
    """Groups that do not span the swarm hold different copies by design: say whether
    every node reached every other as the butterfly schedule says instead."""
    mix = summary.get("mix") or {}
    d = mix.get("rounds_to_mix")
    if not d or d < 2 or not mix.get("windows"):
        return ""
    return (
        f" (groups mix: every node reached every other within {d} rounds in "
        f"{mix['windows_mixed']} of {mix['windows']} windows)"
    )


def _apart_line(summary: dict[str, Any]) -> str:
    """Copies that differ: by how much (groups that mix differ by design)."""
    apart = summary.get("copies_apart")
    if summary.get("params_agree") or not apart:
        return ""
    return (
        f" (copies of round {apart['round']} up to {100 * apart['max_from_mean']:.2g} % "
        f"of their norm from their mean; groups that mix hold different copies by design)"
    )


def _ranks_line(summary: dict[str, Any]) -> str:
    procs = summary.get("procs_per_node", 1)
    if procs <= 1:
        return ""
    return f"; {procs} ranks per node, ranks agree: {summary.get('ranks_agree')}"


def render_table(nodes: list[SwarmProcess]) -> Any:
    """A rich table with one row per node (for the live view)."""
    from rich.table import Table

    table = Table(title="atoll swarm", expand=False)
    for col in (
        "node",
        "peer",
        "state",
        "round",
        "step",
        "loss (nats)",
        "val bits/byte",
        "peers",
        "sent MiB",
    ):
        table.add_column(col, justify="right" if col not in ("peer", "state") else "left")
    for n in nodes:
        s = n.status
        state = s.get("state", "starting")
        if n.proc.poll() is not None and state != "stopped":
            state = f"exited {n.proc.returncode}"
        table.add_row(
            str(n.index),
            str(s.get("peer_id", ""))[-8:],
            state,
            str(s.get("round", 0)),
            str(s.get("step", 0)),
            f"{s['loss']:.3f}" if isinstance(s.get("loss"), float) else "-",
            f"{s['val_bpb']:.3f}" if isinstance(s.get("val_bpb"), float) else "-",
            str(s.get("peers", "-")),
            f"{s.get('bytes_sent', 0) / 2**20:.2f}",
        )
    return table


def dump_json(summary: dict[str, Any]) -> str:
    """The summary as one JSON line, keys sorted."""
    return json.dumps(summary, sort_keys=True)
