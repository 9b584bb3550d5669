"""Sparse pseudo-gradients where they can pay: ``topk`` against int8 on the islands'
Llama model, over enough outer steps for error feedback to pay back.

The convergence benchmark's sparse mode (``convergence --sparse``) runs on its
87k-parameter byte model for 10 rounds or fewer; it is kept as that mode's smoke scale.
Here, on :mod:`benchmarks.islands`' ``small`` Llama (0.66M parameters, BPE shards of the
standard library):

- **DDP**: 4 ranks of 8 windows, an fp32 gradient all-reduce every step, AdamW.
- **DiLoCo** (:func:`node.ops.simulate.simulate`): 4 replicas of 8 windows in one group
  (owner reduce, the shipped exchange), one fragment, the outer step the convergence
  sweep picked (Nesterov, lr 0.7, momentum 0.5), AdamW at DDP's lr, error feedback on,
  at ``H = 10`` (100 outer steps in 1,000) and ``H = 50`` (20), each with int8 and with
  ``topk`` (3 % of each chunk of 4096, 2 bits, 12-bit offsets).
- **Gathered topk** (``sync.exchange = "gather"``): the same ``topk`` parts, each sent
  whole to every other member, which reduces them itself (no owner's 8-bit result), at
  ``H = 5`` (about int8's bytes at ``H = 50``), ``10`` and ``50``.

Every run trains the same steps on the same batches and is scored in bits per byte on
the same validation windows. Bytes are what one member sends over the run
(:func:`benchmarks.convergence.sent_bytes`: its share of every part and of every result,
and the signed heads of those messages; for a gather
:func:`benchmarks.convergence.allgather_bytes`); **bits per parameter per sync** divides one
sync's bytes by the parameters, against an fp32 and a bf16 owner reduce
(``2 * (G - 1) / G * 32`` and ``* 16`` bits) and fp32 DDP's per step; beside it what an
all-gather of the same parts would send (:func:`benchmarks.convergence.allgather_bytes`:
every part to every other member with its head, no results), the exchange SparseLoCo
uses, counted from the same payloads.

Goals (each with ``meets_goal`` in the report):

- ``topk`` (reduced by owner, and gathered) at least as good as int8 (a final bits per
  byte no higher) with at least 4× fewer bytes, at the same H;
- ``topk`` with at least 10,000× fewer bytes than fp32 DDP at a gap no worse than
  int8's at the same H.

``python -m benchmarks sparse [--quick]``: quick, seed 0 (about 40 minutes here); full,
seeds 0-2; ``--smoke``: a 40-file corpus, 2 ranks, 20 steps at ``H = 2`` and ``10``.
Writes ``sparse.json`` and ``sparse.png``.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

from benchmarks import islands
from benchmarks._common import figure, machine_info, prepare_stdlib_shards
from benchmarks._formats import markdown_table, run_mode, signed
from benchmarks._mode import Mode

__all__ = ["run", "table", "table_row"]

_BATCH = 8
_EVERY = 50
_BYTES_GOAL = 4.0
_DDP_GOAL = 10_000.0
_RECIPE = [
    "sync.trigger='steps'",
    "sync.fragments=1",
    "sync.tau=0",
    "sync.error_feedback=true",
    "outer.optimizer='nesterov'",
    "outer.lr=0.7",
    "outer.momentum=0.5",
    "train.optimizer='adamw'",
]
_TOPK = ["sync.codec='topk'", "sync.topk_density=0.03", "sync.topk_bits=2"]
_GATHER = "topk 3% 2b gather"
_CODECS = {
    "int8": ["sync.codec='int8'"],
    "topk 3% 2b": _TOPK,
    _GATHER: [*_TOPK, "sync.exchange='gather'"],
}


@dataclass(frozen=True)
class _Plan:
    steps: int
    seeds: int
    ranks: int = 4
    inner_steps: tuple[int, ...] = (10, 50)
    gather_steps: tuple[int, ...] = (5, 10, 50)
    """The H of the gathered ``topk`` arms (H = 5: about int8's bytes at H = 50)."""
    files: int | None = None
    every: int = _EVERY
    threads: int = 1
    """Of each simulated run: one core, so another benchmark may run beside it."""


def _plan(quick: bool, smoke: bool) -> _Plan:
    if smoke:
        return _Plan(
            steps=20, seeds=1, ranks=2, inner_steps=(2, 10), gather_steps=(2,), files=40, every=10
        )
    return _Plan(steps=1000, seeds=1 if quick else 3)


def _arm(plan: _Plan, base: list[str], h: int, codec: str) -> dict[str, Any]:
    from benchmarks.convergence import allgather_bytes, sent_bytes
    from node.config import load_config
    from node.ops.simulate import simulate

    rounds = plan.steps // h
    cfg = load_config(
        None,
        [
            *base,
            *_RECIPE,
            *_CODECS[codec],
            f"sync.inner_steps={h}",
            f"outer.lr_rounds={rounds}",
            f"network.group_size={plan.ranks}",
            *islands.batch_overrides(_BATCH),
        ],
    )
    result = simulate(cfg, replicas=plan.ranks, rounds=rounds)
    gathered = codec == _GATHER
    sent = allgather_bytes(result, plan.ranks) if gathered else sent_bytes(result, plan.ranks)
    return {
        "inner_steps": h,
        "codec": codec,
        "outer_steps": rounds,
        "history": [
            {"step": e["round"] * h, "val_bpb": e["val_bpb"]}
            for e in result["history"]
            if e["round"] * h % plan.every == 0
        ],
        "params": result["params"],
        "syncs": result["syncs"],
        "payload_bytes_per_replica": result["payload_bytes_per_replica"],
        "result_bytes": result["result_bytes"],
        "bytes_sent_per_worker": sent,
        "bits_per_param_per_sync": 8 * sent / result["syncs"] / result["params"],
        "allgather_bits_per_param_per_sync": 8
        * allgather_bytes(result, plan.ranks)
        / result["syncs"]
        / result["params"],
        "seconds": result["seconds"],
    }


def _name(h: int, codec: str) -> str:
    return f"{codec} H={h}"


def _end(run: dict[str, Any], steps: int) -> float | None:
    return next((h["val_bpb"] for h in run.get("history", []) if h["step"] == steps), None)


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _summary(entries: list[dict[str, Any]], plan: _Plan) -> dict[str, Any]:
    """Per arm: final bits per byte and gap to DDP over seeds, bytes and bits per
    parameter per sync; the fp32 and bf16 owner reduce and DDP for comparison."""
    ddp_bytes = None
    rows: dict[str, Any] = {}
    for name in entries[0]:
        if name in ("seed",):
            continue
        ends = [e for x in entries if (e := _end(x[name], plan.steps)) is not None]
        row: dict[str, Any] = {
            "val_bpb_end": _mean(ends),
            "val_bpb_spread": statistics.stdev(ends) if len(ends) > 1 else None,
        }
        if name == "ddp":
            params = entries[0]["ddp"].get("params") or 0
            share = 2 * (plan.ranks - 1) / plan.ranks
            ddp_bytes = share * 4 * params * plan.steps
            row.update(bytes_sent_per_worker=ddp_bytes, bits_per_param_per_step=share * 32)
        else:
            gaps = [
                100 * (a / b - 1)
                for x in entries
                if (a := _end(x[name], plan.steps)) is not None
                and (b := _end(x["ddp"], plan.steps)) is not None
            ]
            first = entries[0][name]
            row.update(
                inner_steps=first["inner_steps"],
                codec=first["codec"],
                outer_steps=first["outer_steps"],
                gap_percent=_mean(gaps),
                gap_spread=statistics.stdev(gaps) if len(gaps) > 1 else None,
                bytes_sent_per_worker=first["bytes_sent_per_worker"],
                bits_per_param_per_sync=first["bits_per_param_per_sync"],
                allgather_bits_per_param_per_sync=first["allgather_bits_per_param_per_sync"],
            )
        rows[name] = row
    for name, row in rows.items():
        if name != "ddp" and ddp_bytes:
            row["bytes_ratio_ddp_over_this"] = ddp_bytes / row["bytes_sent_per_worker"]
    share = 2 * (plan.ranks - 1) / plan.ranks
    return {
        "arms": rows,
        "baselines_bits_per_param_per_sync": {
            "fp32 owner reduce": share * 32,
            "bf16 owner reduce": share * 16,
        },
    }


def _goals(summary: dict[str, Any], plan: _Plan) -> dict[str, Any]:
    arms = summary["arms"]
    goals: dict[str, Any] = {}
    for h, variant in [(h, c) for h in plan.inner_steps for c in _CODECS if c != "int8"]:
        topk, int8 = arms.get(_name(h, variant)), arms.get(_name(h, "int8"))
        if not topk or not int8 or topk["gap_percent"] is None or int8["gap_percent"] is None:
            continue
        fewer = int8["bytes_sent_per_worker"] / topk["bytes_sent_per_worker"]
        what = "topk" if variant == "topk 3% 2b" else "topk gathered"
        goals[f"H={h}: {what} as good as int8 with >= {_BYTES_GOAL:g}x fewer bytes"] = {
            "value": {
                "topk_gap_percent": topk["gap_percent"],
                "int8_gap_percent": int8["gap_percent"],
                "int8_over_topk_bytes": fewer,
            },
            "goal": _BYTES_GOAL,
            "meets_goal": fewer >= _BYTES_GOAL and topk["gap_percent"] <= int8["gap_percent"],
        }
        ratio = topk.get("bytes_ratio_ddp_over_this") or 0.0
        goals[f"H={h}: {what} >= {_DDP_GOAL:,.0f}x fewer bytes than DDP at int8's gap"] = {
            "value": ratio,
            "goal": _DDP_GOAL,
            "meets_goal": ratio >= _DDP_GOAL and topk["gap_percent"] <= int8["gap_percent"],
        }
    return goals


def run(mode: Mode, out_dir: pathlib.Path) -> dict[str, Any]:
    """DDP and every H and codec of the plan at each seed; writes ``sparse.json`` and
    ``sparse.png``."""
    plan = _plan(mode.quick, mode.smoke)
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    journal = islands.Journal(out_dir / "sparse-runs.jsonl", {"plan": repr(plan)})
    work = pathlib.Path(tempfile.mkdtemp(prefix="atoll-sparse-"))
    started = time.time()
    try:
        shards, corpus = prepare_stdlib_shards(work / "shards", islands.VOCAB, plan.files)
        model = islands.model_overrides("small", work)
        entries = []
        for seed in range(plan.seeds):
            base = islands.base_overrides(plan.steps, shards, model, seed, plan.threads)
            entry: dict[str, Any] = {
                "seed": seed,
                "ddp": journal.run(
                    f"{seed}/ddp",
                    partial(islands.ddp_arm, plan.ranks, plan.steps, plan.every, base),
                ),
            }
            arms = [(h, c) for h in plan.inner_steps for c in _CODECS if c != _GATHER]
            for h, codec in [*arms, *((h, _GATHER) for h in plan.gather_steps)]:
                name = _name(h, codec)
                entry[name] = journal.run(f"{seed}/{name}", partial(_arm, plan, base, h, codec))
                print(f"sparse: seed {seed} {name}: {_end(entry[name], plan.steps)}", flush=True)
            entries.append(entry)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = _summary(entries, plan)
    report = {
        "benchmark": "sparse",
        "quick": mode.quick,
        "smoke": mode.smoke,
        "corpus": corpus,
        "model": "small",
        "params": entries[0]["ddp"].get("params"),
        "steps": plan.steps,
        "ranks": plan.ranks,
        "seeds": plan.seeds,
        "recipe": _RECIPE,
        "codecs": _CODECS,
        "entries": entries,
        "summary": summary,
        "goals": _goals(summary, plan),
        "seconds": time.time() - started,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
    }
    (out_dir / "sparse.json").write_text(json.dumps(report, indent=2) + "\n")
    _plot(report, out_dir / "sparse.png")
    journal.path.unlink(missing_ok=True)
    return report


def _plot(report: dict[str, Any], path: pathlib.Path) -> None:
    entry = report["entries"][0]
    arms = report["summary"]["arms"]
    with figure(path, 1, 2, figsize=(12, 4.2)) as (fig, (curves, bytes_ax)):
        for name, run_ in entry.items():
            if name == "seed":
                continue
            history = [h for h in run_.get("history", []) if h["step"] > 0]
            curves.plot(
                [h["step"] for h in history],
                [h["val_bpb"] for h in history],
                "-" if name == "ddp" else "--",
                label=name,
            )
        curves.set_title(f"seed {entry['seed']}: validation bits per byte", fontsize=9)
        curves.set_xlabel("step (equal tokens)")
        curves.grid(True, alpha=0.3)
        curves.legend(fontsize=7)
        names = [n for n in arms if n != "ddp" and arms[n]["val_bpb_end"] is not None]
        bytes_ax.scatter(
            [arms[n]["bytes_sent_per_worker"] for n in names],
            [arms[n]["val_bpb_end"] for n in names],
        )
        for n in names:
            bytes_ax.annotate(n, (arms[n]["bytes_sent_per_worker"], arms[n]["val_bpb_end"]))
        bytes_ax.set_xscale("log")
        bytes_ax.set_xlabel("bytes one worker sends over the run")
        bytes_ax.set_ylabel("final bits per byte")
        bytes_ax.grid(True, alpha=0.3)


# ---- the docs' rows ---------------------------------------------------------------------


def table_row(data: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The summary row: topk against int8 at each H, and the goals."""
    arms = data["summary"]["arms"]
    parts = []
    for name, row in arms.items():
        if name == "ddp" or row.get("gap_percent") is None:
            continue
        parts.append(
            f"{name}: **{signed(row['gap_percent'])} %** to DDP, "
            f"{row['bits_per_param_per_sync']:.2f} bits/param a sync, "
            f"{row['bytes_ratio_ddp_over_this']:,.0f}× fewer bytes than DDP"
        )
    met = [g for g, v in data["goals"].items() if v["meets_goal"]]
    parts.append(f"goals met: {'; '.join(met)}" if met else "no goal met")
    what = (
        f"sparse pseudo-gradients ({run_mode(data)} mode): topk against int8 on a "
        f"{data['params']:,}-parameter Llama, {data['ranks']} replicas, {data['steps']:,} "
        f"steps, {data['seeds']} seed(s)"
    )
    target = (
        f"topk as good as int8 with ≥ {_BYTES_GOAL:g}× fewer bytes; "
        f"≥ {_DDP_GOAL:,.0f}× fewer bytes than DDP at int8's gap"
    )
    return [(what, "; ".join(parts), target)]


def table(data: dict[str, Any]) -> str:
    """Every arm: outer steps, bits per byte, gap to DDP, bits per parameter per sync and
    bytes against DDP."""
    header = [
        "run", "outer steps", "bits per byte", "gap to DDP", "bits / param / sync",
        "all-gathered", "fewer bytes than DDP",
    ]  # fmt: skip
    body = []
    for name, row in data["summary"]["arms"].items():
        end, spread = row["val_bpb_end"], row.get("val_bpb_spread")
        body.append(
            [
                name,
                str(row.get("outer_steps", "")),
                "-" if end is None else f"{end:.4f}" + (f" ± {spread:.4f}" if spread else ""),
                "" if row.get("gap_percent") is None else f"{signed(row['gap_percent'])} %",
                f"{row['bits_per_param_per_sync']:.3f}"
                if "bits_per_param_per_sync" in row
                else f"{row['bits_per_param_per_step']:.0f} a step",
                f"{row['allgather_bits_per_param_per_sync']:.3f}"
                if "allgather_bits_per_param_per_sync" in row
                else "",
                f"{row['bytes_ratio_ddp_over_this']:,.0f}×"
                if "bytes_ratio_ddp_over_this" in row
                else "",
            ]
        )
    for name, bits in data["summary"]["baselines_bits_per_param_per_sync"].items():
        body.append([name, "", "", "", f"{bits:.0f}", "", ""])
    return markdown_table(header, body)
