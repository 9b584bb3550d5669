"""Summary rows of sparse pseudo-gradients: the convergence benchmark's sparse mode
(``convergence-sparse.json``: topk against tuned DDP and int8 at each H, and how the gap
to int8 moves with the rounds) and the all-reduce benchmark's codec rows.
Standard library only, like :mod:`benchmarks.tables`."""

from __future__ import annotations

from typing import Any

__all__ = ["allreduce_codecs_row", "sparse_row"]

from benchmarks._formats import size


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
        f"sparse pseudo-gradients (topk) at the smoke scale: the {d['params']:,}-parameter "
        f"byte model, {d['workers']} workers, {d['total_steps']:,} steps, "
        f"{len(d['seeds'])} seeds (the `sparse` benchmark measures the Llama); bytes as the "
        f"wire carries them (parts, 8-bit union results, heads of {heads['part']} + "
        f"{heads['result']} B)"
    )
    return [(what, "; ".join(parts), d["goal"]["text"])]


def allreduce_codecs_row(d: dict[str, Any], mode: str) -> tuple[str, str, str]:
    """The all-reduce benchmark's int8 and topk rows, per size and plane."""
    r, q = d["results"], d["ratios"]
    sizes = sorted(q["topk_vs_int8_p2pd"], key=int)
    parts = []
    for n in sizes:
        plane = ", ".join(
            f"{name} {r[f'int8_{p}'][n]['median_s']:.3f} → {r[f'topk_{p}'][n]['median_s']:.3f} s "
            f"(**{q[f'topk_vs_int8_{p}'][n]:.2f}×**)"
            for p, name in (("p2pd", "over p2pd"), ("direct", "direct TCP"))
        )
        parts.append(
            f"{size(int(n))}: {plane}; bytes a peer sends {q['bytes_topk_vs_int8_p2pd'][n]:.3f}× int8's"
        )
    what = (
        f"all-reduce with codecs, {d['peers']} processes, {mode} mode: int8 against topk "
        "(1 % of each chunk of 4096, 2 bits; 8-bit union results), encode + exchange + decode"
    )
    return (what, "; ".join(parts), "")
