"""The summary row of the convergence benchmark's sparse mode (``convergence-sparse.json``):
topk against tuned DDP and int8 at each H, and how the gap to int8 moves with the rounds.
Standard library only, like :mod:`benchmarks.tables`."""

from __future__ import annotations

from typing import Any

__all__ = ["sparse_row"]


def _verdict(h: str, v: dict[str, Any]) -> str:
    payload = v.get("payload_ratio")
    payload_text = f", {payload:,.0f}× without the heads" if payload else ""
    return (
        f"{h}: {v['topk'].split(',')[0].split(' ', 2)[2].rsplit(' lr', 1)[0]} "
        f"**{v['gap_percent']:+.1f} %** to DDP (int8 {v['int8_gap_percent']:+.1f} %), "
        f"**{v['bytes_ratio']:,.0f}×** fewer bytes than DDP{payload_text}"
    )


def _study(s: dict[str, Any]) -> str:
    over = s.get("topk_over_int8_percent")
    if over is None:
        return f"{s['steps']:,} steps: no result"
    return (
        f"{s['steps']:,} steps ({s['rounds']} rounds): {over:+.1f} % above int8 with "
        f"{s['bytes_int8_over_topk']:.0f}× fewer bytes"
    )


def sparse_row(d: dict[str, Any]) -> list[tuple[str, str, str]]:
    """One row: what was measured, the verdict per H and the rounds study, the goal."""
    parts = [_verdict(h, v) for h, v in d["verdicts"].items()]
    if d.get("rounds_study"):
        parts.append(
            "seed 0, best topk at the shortest H: " + "; ".join(map(_study, d["rounds_study"]))
        )
    met = [h for h, v in d["verdicts"].items() if v["meets_bytes_goal"] and v["meets_gap_goal"]]
    parts.append(f"goal met at {', '.join(met)}" if met else "goal not met")
    heads = d["head_bytes"]
    what = (
        f"sparse pseudo-gradients (topk), {d['workers']} workers, {d['total_steps']:,} steps, "
        f"{len(d['seeds'])} seeds, {d['params']:,} parameters; bytes as the wire carries "
        f"them (parts, 8-bit union results, heads of {heads['part']} + {heads['result']} B)"
    )
    return [(what, "; ".join(parts), d["goal"]["text"])]
