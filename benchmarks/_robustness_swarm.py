"""What the robustness benchmark's grid and its useful-work checks mode share: the tiny
workload, the per-codec overrides, running one swarm, and judging what it did."""

from __future__ import annotations

import math
from typing import Any

from node.ops import swarm
from node.ops.swarm import QUICK_WORKLOAD

__all__ = ["CODECS", "FLAGS", "SMALL", "finite", "judge", "launch_and_wait", "ratio"]

# The tiny workload the integration tests use too.
SMALL = [
    "run.run_id='bench-robustness'",
    *QUICK_WORKLOAD,
    "sync.fragments=2",
    "network.matchmaking_seconds=6",
    "network.round_timeout=8",
    "network.request_timeout=8",
]
# Per codec, the overrides after the workload's. topk's defaults (chunks of 4096 at 1 %)
# are sized for real models; on the tiny one, chunks of 256 at 3 % keep 8 values each.
CODECS: dict[str, tuple[str, ...]] = {
    "int8": ("sync.codec='int8'",),
    "topk": (
        "sync.codec='topk'",
        "sync.topk_chunk=256",
        "sync.topk_density=0.03",
        "sync.topk_bits=2",
    ),
}
FLAGS = ("quarantined", "banned")
"""The standings that count as flagging a peer."""


def launch_and_wait(spec: swarm.SwarmSpec, timeout: float) -> tuple[list, bool]:
    """Runs the swarm to its end (or ``timeout``); always stops nodes and their helpers."""
    return swarm.run_to_end(spec, timeout)


def judge(summary: dict[str, Any], byzantine: list[int]) -> dict[str, Any]:
    """Loss, agreement, and who flagged whom, from the swarm's summary."""
    ids = summary["peer_ids"]
    attackers = {ids[i] for i in byzantine if ids[i]}
    honest = {p for i, p in enumerate(ids) if i not in byzantine and p}
    flagged = summary["flagged"]  # honest node index -> {peer: status}
    return {
        "val_bpb_start": finite(summary["val_bpb_start"]),
        "val_bpb_end": finite(summary["val_bpb_end"]),
        "params_agree": summary["params_agree"],
        "rounds": summary["rounds"],
        # an honest node counts once however many attackers it caught
        "attacker_flagged_by": sum(
            1 for f in flagged.values() if any(f.get(a) in FLAGS for a in attackers)
        ),
        "honest_nodes": len(flagged),
        "honest_flagged": len({p for f in flagged.values() for p, s in f.items() if p in honest}),
        "exit_codes": summary["exit_codes"],
    }


def finite(value: float | None) -> float | None:
    # A diverged model reports NaN or inf, which strict JSON cannot hold.
    return value if value is not None and math.isfinite(value) else None


def ratio(cell: dict[str, Any], clean: dict[str, Any] | None) -> float | None:
    if cell.get("val_bpb_end") is None or not clean or not clean.get("val_bpb_end"):
        return None
    return cell["val_bpb_end"] / clean["val_bpb_end"]
