"""Convergence benchmark: Atoll's DiLoCo against PyTorch DDP, tuned, over seeds.

Four workers train the same model for the same number of steps each (so the same
tokens per worker), with the same warmup + cosine inner schedule
(``node.train.trainer.lr_at``); worker ``i`` of seed ``s`` reads the batch stream ``(s, i)``
in both methods, so they see the very same batches, and every run is scored on the
same held-out batches (:func:`node.data.corpus.validation_batches`: 128 batches, whatever the
seed or method).

- ``ddp``: four spawned processes, ``torch.distributed`` gloo on 127.0.0.1,
  ``DistributedDataParallel`` with an fp32 gradient all-reduce every step and the
  optimizer and lr the sweep found best for it (so the target is tuned DDP). A
  ring all-reduce sends ``2 * (n - 1) / n`` of the gradient per worker, so each worker
  sends ``steps * params * 4 * 2 * 3 / 4`` bytes.
- ``atoll``: ``node.ops.simulate.simulate``, the single-process reference of the networked
  node's algorithm (fragments, codec with error feedback, token-weighted averaging,
  outer step, late application with ``tau``), ``H`` inner steps per round and
  ``steps / H`` rounds. It scores the global copy (the averaged model every replica
  agrees on, the one a node keeps). One replica's encoded pseudo-gradients are
  ``payload_bytes_per_replica``; a butterfly all-reduce member sends about
  ``2 * (n - 1) / n`` of that, so ``bytes_sent_per_worker = payload * 2 * 3 / 4``.

**Quick mode** (about 20 minutes on two cores; 1-layer, 64-wide model, 500 steps):

1. *Sweep* at seed 0: DDP with each inner optimizer (AdamW, Muon, SOAP) at each of
   :data:`_DDP_LRS`; for each H, AdamW at each inner
   lr of :data:`_INNER_LRS` times each outer setting of :data:`_OUTER` (int8); then Muon
   and SOAP at each inner lr with the outer setting that was best for AdamW at that H.
   Where a best lr lies on an edge of the grid, lrs past it are tried (twice or half,
   up to two more) until one does no better.
2. *Seeds*: the best of each (DDP; AdamW, Muon and SOAP per H) again at seeds 1 and 2;
   AdamW's best also with codecs none and int4; and ``configs/islands.toml``'s recipe
   (its optimizer, outer and sync settings on the quick model).

Each entry reports the mean and spread (sample standard deviation) over seeds of the
final bits per byte, of the gap to DDP (paired by seed: the same batches and the same
initial model) and the *DDP-equivalent steps*: the step at which DDP of the same seed
reached that run's final bits per byte (interpolated between evaluations; None when
DDP never got there), so ``4 * equivalent / steps`` DDP workers are worth the four
replicas. Note DDP's curve comes from a run with a cosine schedule over all its steps,
so an early point of it is not what a shorter DDP run would reach.

**Long mode** (``--long``: the quick model, 10,000 steps per worker and the whole
byte corpus, so no batch is seen twice; about 50 minutes per seed on two shared
cores, two and a half hours in all) takes the quick
sweep's picks from ``convergence-picks.json`` (written by the quick mode once its sweep
is done) in the same folder and runs, over the three seeds, DDP, AdamW at the shortest
and the longest H (int8), and the other inner optimizer that did best at seed 0. A
sweep at that length would cost twenty quick runs; the picks are the short run's.

**Full mode** (neither flag): the default reference model, 3000 steps, the quick
mode's plan (many hours on two cores).

**Smoke** (``--smoke``): the quick model, 2 workers, 10 steps, one candidate of each
kind (DDP, AdamW at H=2, the islands recipe at H=5) and seed 0: the same code path in
seconds, figures that mean nothing.

Every finished run is appended to ``<name>-runs.jsonl`` in the output folder, so an
interrupted benchmark resumes where it stopped; the file is removed with the report
written.

The target is a final bits per byte within 1 % of DDP's with at least 1000x fewer bytes
sent per worker; each entry says whether it meets it. Run it with
``python -m benchmarks convergence [--quick | --long] [--steps N]``; it writes
``convergence.json`` and ``convergence.png`` (long: ``convergence-long.*``).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import pathlib
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from benchmarks._common import figure, head_bytes, machine_info
from benchmarks._ddp import DdpRun, run_ddp
from benchmarks._mode import Mode
from node.config import load_config

__all__ = [
    "ddp_equivalent_step",
    "plan_seeds",
    "run",
    "allgather_bytes",
    "sent_bytes",
    "setting_overrides",
    "with_bytes",
    "steps_problem",
]

_WORKERS = 4
_FP32_BYTES = 4
_TARGET_GAP_PERCENT = 1.0
_TARGET_BYTES_RATIO = 1000.0
_INNER_STEPS = (50, 100, 250)
_CODECS = ("none", "int8", "int4")
_SWEEP_CODEC = "int8"
_SEEDS = (0, 1, 2)
_EVAL_BATCHES = 128
_SMOKE_EVAL_BATCHES = 2
_SMOKE_STEPS = 10
_DDP_LRS = (3e-3, 6e-3, 1.2e-2)
_INNER_LRS = (1.5e-3, 3e-3, 6e-3)
_OPTIMIZERS = ("adamw", "muon", "soap")
_EDGE_STEPS = 2  # lrs tried past the grid's edge when the best lies on it
# topk: tried at seed 0 with AdamW's pick at each of these H (its inner lr), every kept
# share and value width, with error feedback under the pick's outer step or as
# SparseLoCo's accumulator (decay 0.95) under a plain outer step; the best per H at
# every seed.
_TOPK_INNER_STEPS = (50, 100)
_TOPK_DENSITIES = (0.01, 0.03)
_TOPK_BITS = (2, 4)
_TOPK_DECAY = 0.95
_SPARSELOCO_OUTER = "plain averaging (sgd lr 1)"
_TARGET_TOPK_RATIO = 10_000.0
# Longer runs of the best topk setting at the shortest H against int8 (seed 0, no DDP):
# error feedback sends a few per cent of a chunk a round, so a short run's few rounds
# leave most of the pseudo-gradients in the residual.
_ROUNDS_STUDY_STEPS = (1000, 2000)
_LONG_INNER_STEPS = (min(_INNER_STEPS), max(_INNER_STEPS))  # the long mode's AdamW runs
_PICKS = "convergence-picks.json"  # the quick sweep's picks, which the long mode runs
# Outer settings swept with AdamW, every field spelled out so that a change of the
# config's defaults does not change what a name means.
_OUTER: dict[str, tuple[str, ...]] = {
    "DiLoCo (nesterov lr 0.7, momentum 0.9)": (
        "outer.optimizer='nesterov'",
        "outer.lr=0.7",
        "outer.momentum=0.9",
        "outer.momentum_warmup=0",
        "outer.lr_schedule='constant'",
    ),
    "nesterov 0.7 / 0.9, momentum warmed up over 3 rounds": (
        "outer.optimizer='nesterov'",
        "outer.lr=0.7",
        "outer.momentum=0.9",
        "outer.momentum_warmup=3",
        "outer.lr_schedule='constant'",
    ),
    "nesterov 0.7 / 0.9, warm-up 3, outer lr cosine to 0.1x": (
        "outer.optimizer='nesterov'",
        "outer.lr=0.7",
        "outer.momentum=0.9",
        "outer.momentum_warmup=3",
        "outer.lr_schedule='cosine'",
        "outer.min_lr_ratio=0.1",
        # outer.lr_rounds: the run's round count, added per run
    ),
    "nesterov lr 0.7, momentum 0.5": (
        "outer.optimizer='nesterov'",
        "outer.lr=0.7",
        "outer.momentum=0.5",
        "outer.momentum_warmup=0",
        "outer.lr_schedule='constant'",
    ),
    "plain averaging (sgd lr 1)": (
        "outer.optimizer='sgd'",
        "outer.lr=1.0",
        "outer.momentum=0.0",
        "outer.momentum_warmup=0",
        "outer.lr_schedule='constant'",
    ),
}
_ISLANDS = pathlib.Path(__file__).resolve().parent.parent / "configs" / "islands.toml"
# From islands.toml, the recipe's own settings; the model, data, inner schedule and
# length stay the benchmark's so the row compares at the same tokens.
_ISLANDS_SECTIONS = ("outer", "sync")
_ISLANDS_TRAIN_KEYS = ("optimizer", "lr")
# The integration tests' small model (tests/integration/conftest.py), copied because the
# benchmarks must not depend on the test suite.
_QUICK_MODEL = [
    "model.n_layer=1",
    "model.n_embd=64",
    "model.context=64",
    "data.batch_size=8",
]
_QUICK_FILES = "data.max_files=300"  # quick: 3.5 MB of training bytes, 1.2 passes at 2000 steps
_LONG_FILES = "data.max_files=0"  # long: all 28.6 MB, under one pass at 10,000 steps
_SMOKE_FILES = "data.max_files=30"  # smoke: enough for 10 steps and 2 held-out batches
_QUICK_STEPS = 500
_LONG_STEPS = 10_000
_FULL_STEPS = 3000
# The quick model has 87k parameters: a second intra-op thread buys little, and on a
# shared box an oversubscribed OpenMP pool made steps 10-20x slower when measured here.
_SIM_THREADS = {"quick": 1, "long": 1, "full": 2, "smoke": 1}


@dataclass(frozen=True)
class _Grid:
    """What the sweep tries and the seeds run: the quick and full modes' grid, or a
    smoke run's single candidates."""

    workers: int = _WORKERS
    inner_steps: tuple[int, ...] = _INNER_STEPS
    ddp_lrs: tuple[float, ...] = _DDP_LRS
    inner_lrs: tuple[float, ...] = _INNER_LRS
    optimizers: tuple[str, ...] = _OPTIMIZERS
    outer: tuple[str, ...] = field(default_factory=lambda: tuple(_OUTER))
    seeds: tuple[int, ...] = _SEEDS
    edge_steps: int = _EDGE_STEPS
    islands_inner_steps: int | None = None  # None: the recipe's
    topk_inner_steps: tuple[int, ...] = _TOPK_INNER_STEPS
    topk_densities: tuple[float, ...] = _TOPK_DENSITIES
    topk_bits: tuple[int, ...] = _TOPK_BITS

    @property
    def ring_share(self) -> float:
        """Share of a vector one worker sends in a ring or butterfly all-reduce."""
        return 2 * (self.workers - 1) / self.workers


_GRID = _Grid()
_SMOKE_GRID = _Grid(
    workers=2,
    inner_steps=(2,),
    ddp_lrs=(6e-3,),
    inner_lrs=(3e-3,),
    optimizers=("adamw",),
    outer=("nesterov lr 0.7, momentum 0.5",),
    seeds=(0,),
    edge_steps=0,
    islands_inner_steps=5,
    topk_inner_steps=(2,),
    topk_densities=(0.03,),
    topk_bits=(2,),
)


@dataclass(frozen=True)
class Setting:
    """One trained configuration; ``method`` is ``ddp`` or ``atoll``."""

    method: str
    lr: float
    optimizer: str = "adamw"
    inner_steps: int = 0
    codec: str = "none"
    outer: str = ""
    islands: bool = False
    density: float = 0.0
    """topk: the share of each chunk kept."""
    bits: int = 0
    """topk: bits per kept value."""
    decay: float = 1.0
    """Error feedback's decay (below 1: SparseLoCo's accumulator)."""

    @property
    def label(self) -> str:
        if self.method == "ddp":
            return f"DDP {self.optimizer} lr {self.lr:g}"
        if self.islands:
            return f"islands.toml (H={self.inner_steps})"
        codec = self.codec
        if codec == "topk":
            codec = f"topk {100 * self.density:g}% {self.bits}b"
            if self.decay < 1:
                codec += f" EF decay {self.decay:g}"
        return f"{self.optimizer} H={self.inner_steps} {codec} lr {self.lr:g}, {self.outer}"


def _eval_batches(mode: str) -> int:
    return _SMOKE_EVAL_BATCHES if mode == "smoke" else _EVAL_BATCHES


def _base(mode: str, steps: int) -> list[str]:
    files = {"quick": [_QUICK_FILES], "smoke": [_SMOKE_FILES], "long": [_LONG_FILES]}
    return [
        "run.run_id='bench-convergence'",
        "run.device='cpu'",  # DDP runs on gloo/CPU; both methods on the same device
        f"train.total_steps={steps}",
        f"train.eval_batches={_eval_batches(mode)}",
        *(_QUICK_MODEL if mode in ("quick", "long", "smoke") else []),
        *files.get(mode, []),
    ]


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)  # numbers, and strings as TOML literal strings


def _islands_recipe() -> dict[str, Any]:
    import tomllib

    return tomllib.loads(_ISLANDS.read_text())


def _islands_overrides() -> list[str]:
    recipe = _islands_recipe()
    out = [
        f"{s}.{k}={_toml_value(v)}" for s in _ISLANDS_SECTIONS for k, v in recipe.get(s, {}).items()
    ]
    out += [f"train.{k}={_toml_value(recipe['train'][k])}" for k in _ISLANDS_TRAIN_KEYS]
    return out


def _islands_inner_steps() -> int:
    return int(_islands_recipe()["sync"]["inner_steps"])


def setting_overrides(setting: Setting, mode: str, steps: int, seed: int) -> list[str]:
    """Config overrides of one run: the mode's model and data, then the setting's."""
    out = [*_base(mode, steps), f"run.seed={seed}"]
    if setting.method == "ddp":
        return [*out, f"train.lr={setting.lr!r}", f"train.optimizer='{setting.optimizer}'"]
    if setting.islands:
        # the recipe's H, or a smoke run's shorter one
        islands = [f"sync.inner_steps={setting.inner_steps}"]
        return [*out, *_islands_overrides(), *islands, "sync.trigger='steps'"]
    rounds = steps // setting.inner_steps
    return [
        *out,
        f"train.lr={setting.lr!r}",
        f"train.optimizer='{setting.optimizer}'",
        "sync.trigger='steps'",
        f"sync.inner_steps={setting.inner_steps}",
        f"sync.codec='{setting.codec}'",
        *_OUTER[setting.outer],
        f"outer.lr_rounds={rounds}",
        *_topk_overrides(setting),
    ]


def _topk_overrides(setting: Setting) -> list[str]:
    if setting.codec != "topk":
        return []
    return [
        f"sync.topk_density={setting.density!r}",
        f"sync.topk_bits={setting.bits}",
        f"sync.feedback_decay={setting.decay!r}",
    ]


# ---- DDP, one rank per spawned process ------------------------------------------------


def _run_ddp(overrides: list[str], steps: int, eval_every: int, workers: int) -> dict[str, Any]:
    """DDP ranks as spawned processes (:mod:`benchmarks._ddp`), each on the stream of
    ``(run.seed, rank)``, rank 0 evaluating every ``eval_every`` steps and at the end;
    with the bytes a rank would have sent by each evaluation (a ring all-reduce of fp32
    gradients every step)."""
    eval_at = (*range(0, steps, eval_every), steps)
    run = DdpRun(tuple(overrides), workers, steps=steps, eval_at=eval_at, seeded_streams=True)
    report = run_ddp(run, timeout=300.0 + steps * 1.0)
    if "error" in report:
        return report
    ring_share = _Grid(workers=workers).ring_share
    for entry in report["history"]:
        entry["bytes_sent"] = entry["step"] * report["params"] * _FP32_BYTES * ring_share
    report["val_bpb_end"] = report["history"][-1]["val_bpb"]
    report["bytes_sent_per_worker"] = report["history"][-1]["bytes_sent"]
    return report


# ---- Atoll, through the single-process reference --------------------------------------


def sent_bytes(result: dict[str, Any], workers: int) -> float:
    """Bytes one member of a group of ``workers`` sends over a simulated run, as the wire
    would carry them: its part of every other owner's part (``(n - 1) / n`` of its
    encoded pseudo-gradients), its own part's result to every other member (``(n - 1) /
    n`` of the results), and the signed heads of those ``2 (n - 1)`` messages per sync
    (:func:`benchmarks._common.head_bytes`)."""
    share = (workers - 1) / workers
    payload = share * (result["payload_bytes_per_replica"] + result["result_bytes"])
    part_head, result_head = head_bytes(workers)
    return payload + result["syncs"] * (workers - 1) * (part_head + result_head)


def _run_atoll(
    overrides: list[str], steps: int, threads: int, label: str, grid: _Grid
) -> dict[str, Any]:
    """One simulated DiLoCo run of ``steps / H`` rounds with a replica per worker."""
    from node.ops.simulate import simulate

    cfg = load_config(None, [*overrides, f"run.threads={threads}"])
    inner_steps = cfg.sync.inner_steps
    rounds = steps // inner_steps

    def progress(entry: dict[str, Any]) -> None:
        if entry["round"] in (rounds // 2, rounds):  # a sign of life, not a flood
            print(
                f"convergence {label}: round {entry['round']}/{rounds} "
                f"val_bpb {entry['val_bpb']:.4f} {entry['seconds']:.0f}s",
                file=sys.stderr,
                flush=True,
            )

    result = simulate(cfg, replicas=grid.workers, rounds=rounds, progress=progress)
    run = {
        "params": result["params"],
        "fragments": result["fragments"],
        "syncs": result["syncs"],
        "val_bpb_end": result["val_bpb_end"],
        "payload_bytes_per_replica": result["payload_bytes_per_replica"],
        "result_bytes": result["result_bytes"],
        "seconds": result["seconds"],
        "history": [
            {
                "step": h["round"] * inner_steps,
                "tokens": h["tokens"] // grid.workers,
                "val_bpb": h["val_bpb"],
            }
            for h in result["history"]
        ],
    }
    return with_bytes(run, grid.workers)


def allgather_bytes(run: dict[str, Any], workers: int) -> float:
    """What a member would send if the group all-gathered its sparse parts instead of
    owners reducing them (SparseLoCo's choice): its whole encoded pseudo-gradient to
    each of the other ``workers - 1`` members, each message with a part's signed head,
    and no results."""
    part_head, _ = head_bytes(workers)
    return (workers - 1) * (run["payload_bytes_per_replica"] + run["syncs"] * part_head)


def with_bytes(run: dict[str, Any], workers: int) -> dict[str, Any]:
    """``run`` with its bytes counted from its payloads (:func:`sent_bytes`): a
    journaled run is counted again on reading, so a change in what is counted never
    needs the run trained again. Runs without payloads (DDP) come back unchanged."""
    if "result_bytes" not in run:
        return run
    rounds = len(run["history"]) - 1
    syncs = run.get("syncs", rounds * run["fragments"])
    sent = sent_bytes({**run, "syncs": syncs}, workers)
    payload = (workers - 1) / workers * (run["payload_bytes_per_replica"] + run["result_bytes"])
    # every round sends about the same bytes (exactly, for the dense codecs)
    history = [
        {**h, "bytes_sent": sent * i / rounds if rounds else 0.0}
        for i, h in enumerate(run["history"])
    ]
    return {
        **run,
        "syncs": syncs,
        "bytes_sent_per_worker": sent,
        "payload_sent_per_worker": payload,
        "history": history,
    }


def _train(
    setting: Setting, mode: str, steps: int, seed: int, eval_every: int, grid: _Grid
) -> dict:
    overrides = setting_overrides(setting, mode, steps, seed)
    if setting.method == "ddp":
        result = _run_ddp(overrides, steps, eval_every, grid.workers)
    else:
        label = f"{setting.label} seed {seed}"
        result = _run_atoll(overrides, steps, _SIM_THREADS[mode], label, grid)
    print(
        f"convergence {setting.label} seed {seed}: "
        f"val_bpb {result.get('val_bpb_end', float('nan')):.4f} "
        f"{result.get('seconds', 0.0):.0f}s"
        + (f" ERROR {result['error']}" if "error" in result else ""),
        file=sys.stderr,
        flush=True,
    )
    return result


# ---- judging ---------------------------------------------------------------------------


def ddp_equivalent_step(history: Sequence[dict[str, Any]], val_bpb: float) -> float | None:
    """The (interpolated) step at which a DDP history first reached ``val_bpb``.

    None when it never did. Between two evaluations the curve is taken as a straight line.
    """
    previous = None
    for point in history:
        if point["val_bpb"] <= val_bpb:
            if previous is None:
                return float(point["step"])
            s0, b0 = previous["step"], previous["val_bpb"]
            s1, b1 = point["step"], point["val_bpb"]
            return s0 + (s1 - s0) * (b0 - val_bpb) / (b0 - b1)
        previous = point
    return None


def _judge(atoll: dict[str, Any], ddp: dict[str, Any]) -> None:
    """Adds the gap and bytes ratio to DDP, and whether the target is met."""
    if "error" in ddp or "error" in atoll:
        return
    gap = 100.0 * (atoll["val_bpb_end"] - ddp["val_bpb_end"]) / ddp["val_bpb_end"]
    ratio = ddp["bytes_sent_per_worker"] / atoll["bytes_sent_per_worker"]
    atoll["gap_to_ddp_percent"] = gap
    atoll["bytes_ratio_ddp_over_atoll"] = ratio
    if atoll.get("payload_sent_per_worker"):
        atoll["payload_ratio_ddp_over_atoll"] = (
            ddp["bytes_sent_per_worker"] / atoll["payload_sent_per_worker"]
        )
    atoll["meets_bpb_target"] = gap <= _TARGET_GAP_PERCENT
    atoll["meets_bytes_target"] = ratio >= _TARGET_BYTES_RATIO
    atoll["meets_target"] = atoll["meets_bpb_target"] and atoll["meets_bytes_target"]


def _spread(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "std": None}
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
    }


def _summarize(
    setting: Setting,
    runs: dict[int, dict[str, Any]],
    ddp_runs: dict[int, dict[str, Any]],
    steps: int,
    workers: int = _WORKERS,
) -> dict[str, Any]:
    """Mean and spread over seeds; gaps and DDP-equivalent steps paired by seed."""
    ok = {s: r for s, r in runs.items() if "error" not in r}
    entry: dict[str, Any] = {
        "label": setting.label,
        "setting": setting.__dict__,
        "seeds": sorted(runs),
        "errors": {s: r["error"] for s, r in runs.items() if "error" in r},
        "val_bpb_end": _spread([r["val_bpb_end"] for r in ok.values()]),
        "per_seed": {
            s: {k: r.get(k) for k in ("val_bpb_end", "seconds", "gap_to_ddp_percent")}
            for s, r in ok.items()
        },
    }
    if ok:
        entry["bytes_sent_per_worker"] = next(iter(ok.values()))["bytes_sent_per_worker"]
    if setting.method == "ddp":
        return entry
    gaps, equivalents = [], []
    for s, r in ok.items():
        ddp = ddp_runs.get(s)
        if ddp is None or "error" in ddp:
            continue
        _judge(r, ddp)
        gaps.append(r["gap_to_ddp_percent"])
        entry["per_seed"][s]["gap_to_ddp_percent"] = r["gap_to_ddp_percent"]
        eq = ddp_equivalent_step(ddp["history"], r["val_bpb_end"])
        entry["per_seed"][s]["ddp_equivalent_steps"] = eq
        equivalents.append(eq)
        entry["bytes_ratio_ddp_over_atoll"] = r["bytes_ratio_ddp_over_atoll"]
        entry["payload_ratio_ddp_over_atoll"] = r.get("payload_ratio_ddp_over_atoll")
    entry["gap_to_ddp_percent"] = _spread(gaps)
    reached = [e for e in equivalents if e is not None]
    entry["ddp_equivalent_steps"] = _spread(reached) if len(reached) == len(equivalents) else None
    entry["ddp_equivalent_note"] = (
        None
        if len(reached) == len(equivalents)
        else f"{len(equivalents) - len(reached)} seed(s) ended below DDP's final bits per byte"
    )
    if entry["ddp_equivalent_steps"] and entry["ddp_equivalent_steps"]["mean"] is not None:
        entry["worth_ddp_workers"] = workers * entry["ddp_equivalent_steps"]["mean"] / steps
    gap = entry["gap_to_ddp_percent"]["mean"]
    ratio = entry.get("bytes_ratio_ddp_over_atoll")
    entry["meets_target"] = (
        gap is not None
        and gap <= _TARGET_GAP_PERCENT
        and ratio is not None
        and ratio >= _TARGET_BYTES_RATIO
    )
    return entry


# ---- the plan --------------------------------------------------------------------------


def _best(results: dict[Setting, dict[int, dict]], keep: Any) -> Setting | None:
    """The setting with the lowest seed-0 final bits per byte among those ``keep`` takes."""
    scored = [
        (r[0]["val_bpb_end"], i, s)
        for i, (s, r) in enumerate(results.items())
        if keep(s) and 0 in r and "error" not in r[0] and math.isfinite(r[0]["val_bpb_end"])
    ]
    return min(scored)[2] if scored else None


def plan_seeds(picks: dict[str, Setting], long: bool, grid: _Grid = _GRID) -> list[Setting]:
    """What runs at every seed: the picks, and in quick/full mode the codecs and islands."""
    out = [picks["ddp"]]
    for h in _LONG_INNER_STEPS if long else grid.inner_steps:
        adamw = picks.get(f"adamw H={h}")
        if adamw is None:
            continue
        out.append(adamw)
        if not long:
            out += [replace(adamw, codec=c) for c in _CODECS if c != adamw.codec]
            out += [picks[k] for k in (f"muon H={h}", f"soap H={h}") if k in picks]
    if not long:
        out += [picks[f"topk H={h}"] for h in grid.topk_inner_steps if f"topk H={h}" in picks]
    if long and "other" in picks:
        out.append(picks["other"])
    if not long:
        h = grid.islands_inner_steps or _islands_inner_steps()
        out.append(Setting("atoll", lr=0.0, inner_steps=h, islands=True))
    return out


def _extend(
    best: Setting, results: dict[Setting, dict[int, dict]], train: Any, edge_steps: int
) -> Setting:
    """While the best lr lies on an edge of those tried for its setting, try one more
    past it (twice or half), up to ``edge_steps`` times; returns the best."""

    def score(s: Setting) -> float:
        r = results[s][0]
        return r["val_bpb_end"] if "error" not in r else math.inf

    for _ in range(edge_steps):
        tried = sorted(s.lr for s in results if replace(s, lr=0.0) == replace(best, lr=0.0))
        if best.lr == tried[-1]:
            candidate = replace(best, lr=best.lr * 2)
        elif best.lr == tried[0]:
            candidate = replace(best, lr=best.lr / 2)
        else:
            return best
        train(candidate, 0)
        if not score(candidate) < score(best):
            return best
        best = candidate
    return best


def _sweep(train: Any, results: dict[Setting, dict[int, dict]], grid: _Grid) -> dict[str, Setting]:
    """Seed 0 of every candidate; returns the picks (best DDP; best per H per optimizer)."""
    for optimizer in grid.optimizers:
        for lr in grid.ddp_lrs:
            train(Setting("ddp", lr=lr, optimizer=optimizer), 0)
    best = _best(results, lambda s: s.method == "ddp")
    if best is None:
        errors = [r[0].get("error") for s, r in results.items() if s.method == "ddp"]
        raise RuntimeError(f"every DDP run of the sweep failed: {errors}")
    picks = {"ddp": _extend(best, results, train, grid.edge_steps)}
    for h in grid.inner_steps:
        for outer in grid.outer:
            for lr in grid.inner_lrs:
                train(Setting("atoll", lr, "adamw", h, _SWEEP_CODEC, outer), 0)
        best = _best(results, lambda s, h=h: s.optimizer == "adamw" and s.inner_steps == h)
        picks[f"adamw H={h}"] = best = _extend(best, results, train, grid.edge_steps)
        for optimizer in grid.optimizers[1:]:
            for lr in grid.inner_lrs:
                train(Setting("atoll", lr, optimizer, h, _SWEEP_CODEC, best.outer), 0)
            found = _best(
                results, lambda s, h=h, o=optimizer: s.optimizer == o and s.inner_steps == h
            )
            picks[f"{optimizer} H={h}"] = _extend(found, results, train, grid.edge_steps)
    picks.update(_sweep_topk(train, results, picks, grid))
    return picks


def _topk_variants(adamw: Setting, grid: _Grid) -> list[Setting]:
    out = []
    for density in grid.topk_densities:
        for bits in grid.topk_bits:
            topk = replace(adamw, codec="topk", density=density, bits=bits)
            out.append(topk)  # error feedback, the pick's outer step on top
            out.append(replace(topk, decay=_TOPK_DECAY, outer=_SPARSELOCO_OUTER))
    return out


def _sweep_topk(
    train: Any, results: dict[Setting, dict[int, dict]], picks: dict[str, Setting], grid: _Grid
) -> dict[str, Setting]:
    """Seed 0 of every topk variant at each H of ``grid.topk_inner_steps``, with AdamW's
    pick at that H; returns the best per H."""
    out = {}
    for h in grid.topk_inner_steps:
        adamw = picks.get(f"adamw H={h}")
        if adamw is None:
            continue
        variants = _topk_variants(adamw, grid)
        for setting in variants:
            train(setting, 0)
        best = _best(results, lambda s, v=variants: s in v)
        if best is not None:
            out[f"topk H={h}"] = best
    return out


def _write_picks(path: pathlib.Path, picks: dict[str, Setting], results: dict) -> None:
    """The sweep's picks with their seed-0 scores: what the long mode runs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {
        k: {"setting": v.__dict__, "val_bpb_end_seed0": results[v][0].get("val_bpb_end")}
        for k, v in picks.items()
    }
    path.write_text(json.dumps(body, indent=2) + "\n")


def _picks_from(path: pathlib.Path) -> dict[str, Setting]:
    """The quick sweep's picks (``convergence-picks.json``); the long mode's plan, with
    ``other``: the inner optimizer besides AdamW that did best at seed 0, at its H."""
    if not path.exists():
        raise FileNotFoundError(
            f"{path}: the long mode takes the quick sweep's picks from it; run "
            "`python -m benchmarks convergence --quick` with the same --out first"
        )
    body = json.loads(path.read_text())
    picks = {k: Setting(**v["setting"]) for k, v in body.items()}
    others = [
        (v["val_bpb_end_seed0"], k)
        for k, v in body.items()
        if v["setting"]["method"] == "atoll"
        and v["setting"]["optimizer"] != "adamw"
        and v["val_bpb_end_seed0"] is not None
    ]
    if others:
        picks["other"] = picks[min(others)[1]]
    return picks


# ---- report ----------------------------------------------------------------------------


def _mean_history(runs: dict[int, dict[str, Any]]) -> list[dict[str, float]]:
    ok = [r["history"] for r in runs.values() if "history" in r]
    if not ok:
        return []
    length = min(len(h) for h in ok)
    return [
        {
            "tokens": ok[0][i]["tokens"],
            "bytes_sent": ok[0][i]["bytes_sent"],
            "val_bpb": statistics.fmean(h[i]["val_bpb"] for h in ok),
        }
        for i in range(length)
    ]


def _plot(report: dict[str, Any], curves: dict[str, list[dict]], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(18, 5.5))
    by_tokens = fig.add_subplot(1, 3, 1)
    by_bytes = fig.add_subplot(1, 3, 2, sharey=by_tokens)
    bars = fig.add_subplot(1, 3, 3)
    for label, history in curves.items():
        kw = {"linewidth": 1.2, "label": label}
        if label.startswith("DDP"):
            kw.update(color="black", linewidth=2.0)
        by_tokens.plot([h["tokens"] for h in history], [h["val_bpb"] for h in history], **kw)
        sent = [h for h in history if h["bytes_sent"] > 0]  # log x: the start has no place
        by_bytes.plot([h["bytes_sent"] for h in sent], [h["val_bpb"] for h in sent], **kw)
    by_tokens.set_xlabel("tokens per worker")
    by_tokens.set_ylabel("validation bits per byte (mean over seeds)")
    by_bytes.set_xlabel("bytes sent per worker (log)")
    by_bytes.set_xscale("log")
    for ax in (by_tokens, by_bytes):
        ax.grid(True, alpha=0.3)
    by_bytes.legend(fontsize=6)
    ends = [h[-1]["val_bpb"] for h in curves.values() if h]
    if ends:  # the first steps fall from 8 bits per byte; zoom on where the methods end up
        by_tokens.set_ylim(min(ends) - 0.1, max(ends) + 0.8)
    rows = [
        e
        for e in report["entries"]
        if e["setting"]["method"] == "atoll"
        and e.get("gap_to_ddp_percent", {}).get("mean") is not None
    ]
    names = [e["label"].split(",")[0] for e in rows]
    means = [e["gap_to_ddp_percent"]["mean"] for e in rows]
    stds = [e["gap_to_ddp_percent"]["std"] for e in rows]
    bars.barh(range(len(rows)), means, xerr=stds, color="tab:blue", alpha=0.7)
    bars.set_yticks(range(len(rows)), names, fontsize=6)
    bars.axvline(_TARGET_GAP_PERCENT, color="black", linestyle="--", linewidth=1, label="target")
    bars.set_xlabel("final bits/byte above DDP (%), mean ± sd over seeds")
    bars.grid(True, axis="x", alpha=0.3)
    bars.legend(fontsize=7)
    fig.suptitle(
        f"{report['workers']} workers, {report['total_steps']} steps each, "
        f"{len(report['seeds'])} seeds "
        f"({report['params']:,} parameters, {report['mode']} mode, each method at its best lr)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def steps_problem(steps: int, grid: _Grid = _GRID) -> str | None:
    """Why ``steps`` cannot be a run's length (every H must run whole rounds), or None."""
    lengths = sorted({*grid.inner_steps, grid.islands_inner_steps or _islands_inner_steps()})
    if steps < 1 or any(steps % h for h in lengths):
        return (
            f"steps = {steps}: expected a positive multiple of "
            f"{', '.join(map(str, lengths))} "
            "(every H runs whole rounds)"
        )
    return None


def run(mode: Mode, out_dir: pathlib.Path) -> dict:
    """Sweeps, then trains the picks over three seeds, then writes the report and plot.

    Args:
        mode: what it runs: ``quick``: the 1-layer, 64-wide model and 500 steps per
            worker (about 20 minutes on two cores); otherwise the default reference model
            and 3000 steps (many hours); ``steps``: steps per worker instead of the mode's
            default, a multiple of every H; ``long``: the quick model, 10,000 steps, the
            whole corpus, the picks of the quick report in ``out_dir`` (no sweep); writes
            ``convergence-long.*``; ``smoke``: 2 workers, 10 steps, one candidate of each
            kind, seed 0: a check that it runs (see the module docstring); ``sparse``:
            only the topk rows (:func:`run_sparse`), on the quick report in ``out_dir``;
            writes ``convergence-sparse.*``.
        out_dir: folder for the JSON and PNG; created if missing.

    Returns:
        The dict written to the JSON: ``picks`` (best setting per method), ``sweep``
        (seed 0 of every candidate), ``entries`` (mean and spread over seeds of each
        pick: val_bpb_end, gap_to_ddp_percent, ddp_equivalent_steps,
        bytes_ratio_ddp_over_atoll, meets_target), ``ddp``, ``target``, ``notes``,
        ``mode``, ``date`` and ``machine``.

    Raises:
        ValueError: ``steps`` is not a positive multiple of every H.
        FileNotFoundError: long mode without the quick report in ``out_dir``.
    """
    if mode.sparse:
        return run_sparse(pathlib.Path(out_dir), mode.steps or _QUICK_STEPS)
    plan = _Plan.of(mode)
    out_dir = pathlib.Path(out_dir)
    cfg = load_config(None, _base(plan.kind, plan.steps))
    started = time.monotonic()
    # Each finished run is appended to the journal, so an interrupted benchmark resumes
    # where it stopped; the file goes once the report is written.
    journal = out_dir / f"{plan.name}-runs.jsonl"
    runs = _Runs(journal, plan.kind, plan.steps, plan.eval_every, plan.grid)
    with _threads_kept():
        if plan.long:
            picks = _picks_from(out_dir / _PICKS)
        else:
            picks = _sweep(runs.train, runs.results, plan.grid)
            _write_picks(out_dir / _PICKS, picks, runs.results)
        for seed in plan.grid.seeds:
            for s in plan_seeds(picks, plan.long, plan.grid):
                runs.train(s, seed)
    entries, curves = _entries(plan, picks, runs.results)
    report = _report(mode, plan, cfg, runs.results, picks, entries)
    report["seconds"] = round(time.monotonic() - started, 1)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{plan.name}.json").write_text(json.dumps(report, indent=2) + "\n")
    _plot(report, curves, out_dir / f"{plan.name}.png")
    journal.unlink(missing_ok=True)
    return report


@dataclass(frozen=True)
class _Plan:
    """What one run of :func:`run` trains: its mode's name (``long``, ``smoke``,
    ``quick`` or ``full``), the steps per worker and the grid swept."""

    kind: str
    steps: int
    grid: _Grid
    long: bool

    @classmethod
    def of(cls, mode: Mode) -> _Plan:
        """The plan of ``mode``.

        Raises:
            ValueError: ``mode.steps`` is not a positive multiple of every H.
        """
        kind = "long" if mode.long else "smoke" if mode.smoke else "quick" if mode.quick else "full"
        grid = _SMOKE_GRID if mode.smoke else _GRID
        steps = mode.steps
        if steps is None:
            steps = {"quick": _QUICK_STEPS, "long": _LONG_STEPS, "full": _FULL_STEPS}.get(
                kind, _SMOKE_STEPS
            )
        problem = steps_problem(steps, grid)
        if problem:
            raise ValueError(problem)
        return cls(kind, steps, grid, mode.long)

    @property
    def name(self) -> str:
        """The files' name: ``convergence`` or ``convergence-long``."""
        return "convergence-long" if self.long else "convergence"

    @property
    def eval_every(self) -> int:
        """Steps between evaluations."""
        return min(self.grid.inner_steps) if not self.long else 2 * min(_INNER_STEPS)


class _Runs:
    """Every run trained so far, by setting and seed, each also appended to a journal
    that an interrupted benchmark resumes from."""

    def __init__(
        self, journal: pathlib.Path, kind: str, steps: int, eval_every: int, grid: _Grid
    ) -> None:
        self.journal = journal
        self.kind = kind
        self.steps = steps
        self.eval_every = eval_every
        self.grid = grid
        self.results: dict[Setting, dict[int, dict]] = {}
        self.done = _read_journal(journal)

    def train(self, setting: Setting, seed: int) -> dict[str, Any]:
        """``setting`` at ``seed``: from this run, the journal, or trained now."""
        runs = self.results.setdefault(setting, {})
        if seed not in runs:
            run = _Run(setting, self.kind, self.steps, seed, self.eval_every, self.grid)
            runs[seed] = _journaled(run, self.done, self.journal)
        return runs[seed]


@contextlib.contextmanager
def _threads_kept() -> Iterator[None]:
    """Restores torch's intra-op thread count on the way out (training changes it)."""
    before = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _entries(
    plan: _Plan, picks: dict[str, Setting], results: dict[Setting, dict[int, dict]]
) -> tuple[list[dict[str, Any]], dict[str, list[dict]]]:
    """Each planned pick's summary over seeds, and the mean curves the plot draws."""
    planned = plan_seeds(picks, plan.long, plan.grid)
    ddp_runs = results[picks["ddp"]]
    entries = [_summarize(s, results[s], ddp_runs, plan.steps, plan.grid.workers) for s in planned]
    curves = {
        e["label"]: _mean_history(results[s])
        for s, e in zip(planned, entries)
        if s.method == "ddp" or (s.codec == _SWEEP_CODEC or s.islands)
    }
    return entries, curves


def _report(
    mode: Mode,
    plan: _Plan,
    cfg: Any,
    results: dict[Setting, dict[int, dict]],
    picks: dict[str, Setting],
    entries: list[dict[str, Any]],
) -> dict[str, Any]:
    """The dict written to the JSON (its ``seconds`` filled in by the caller)."""
    ddp_runs = results[picks["ddp"]]
    sweep = [
        {"label": s.label, "setting": s.__dict__, "val_bpb_end_seed0": r[0].get("val_bpb_end")}
        for s, r in results.items()
        if 0 in r and not plan.long
    ]
    return {
        "benchmark": "convergence",
        "mode": plan.kind,
        "quick": mode.quick,
        "smoke": mode.smoke,
        "workers": plan.grid.workers,
        "seeds": list(plan.grid.seeds),
        "total_steps": plan.steps,
        "tokens_per_worker": plan.steps * cfg.data.batch_size * cfg.model.context,
        "params": next(
            (r["params"] for runs in results.values() for r in runs.values() if "params" in r),
            None,
        ),
        "model": cfg.to_dict()["model"],
        "data": {"batch_size": cfg.data.batch_size, "max_files": cfg.data.max_files},
        "eval_batches": _eval_batches(plan.kind),
        "picks": {k: v.__dict__ for k, v in picks.items()},
        "entries": entries,
        "sweep": sweep,
        "ddp": {
            "label": picks["ddp"].label,
            "val_bpb_end": entries[0]["val_bpb_end"],
            "bytes_sent_per_worker": entries[0].get("bytes_sent_per_worker"),
            "params_agree": all(r.get("params_agree") for r in ddp_runs.values()),
        },
        "target": {
            "max_gap_percent": _TARGET_GAP_PERCENT,
            "min_bytes_ratio": _TARGET_BYTES_RATIO,
            "text": "final validation bits per byte within 1 % of DDP's, with at least "
            "1000x fewer bytes sent per worker than DDP",
        },
        "runs_meeting_target": [e["label"] for e in entries if e.get("meets_target")],
        "seconds": None,  # filled in by run, where the clock started
        "notes": _notes(plan),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
    }


def _notes(plan: _Plan) -> dict[str, str]:
    """How each figure of the report was taken."""
    workers = plan.grid.workers
    return {
        "ddp_bytes": f"steps * params * 4 * 2*({workers}-1)/{workers}: fp32 "
        "gradients, "
        "ring all-reduce (each worker sends 2(n-1)/n of the vector per step)",
        "atoll_bytes": f"({workers}-1)/{workers} * (payload_bytes_per_replica + "
        "result_bytes) + syncs * "
        f"({workers}-1) * (part head + result head): a group member sends its "
        "encoded pseudo-gradient's parts to the other owners and its own part's result "
        "(topk: the union of the kept values, 8 bits each) to the other members, each "
        "message with its signed head (benchmarks._common.head_bytes: "
        f"{sum(head_bytes(workers))} bytes a part and result); "
        "payload_ratio_ddp_over_atoll leaves the heads out. Payloads are the codec's "
        "real encodings in the simulation; the swarm's sync events count the same "
        "messages on the wire",
        "atoll_method": "node.ops.simulate.simulate, the single-process reference of the "
        "networked node's algorithm, steps mode, rounds = total_steps / H; it scores "
        "the global copy (the averaged model every replica agrees on)",
        "gap_to_ddp_percent": "100 * (atoll - ddp) / ddp final bits per byte, paired "
        "by seed, then mean and sample standard deviation over seeds",
        "ddp_equivalent_steps": "the step at which DDP of the same seed reached the "
        "run's final bits per byte, interpolated between evaluations; "
        "worth_ddp_workers = 4 * that / steps",
        "picks": "the lowest seed-0 final bits per byte of each method's sweep"
        + (" (long mode: the quick report's picks)" if plan.long else ""),
        "data": "worker i of seed s reads BatchStream(train, batch, context, (s, i)) in "
        f"both methods; validation: the same {_eval_batches(plan.kind)} held-out batches "
        "for every method and seed",
        "threads": f"DDP: 1 per process; simulate: {_SIM_THREADS[plan.kind]}",
    }


def _stored_ddp(report: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """DDP's runs per seed as a quick report stored them (no history: DDP-equivalent
    steps are not computed from it)."""
    ddp = report["entries"][0]
    return {
        int(seed): {
            "val_bpb_end": r["val_bpb_end"],
            "bytes_sent_per_worker": ddp["bytes_sent_per_worker"],
            "history": [],
        }
        for seed, r in ddp["per_seed"].items()
    }


def run_sparse(out_dir: pathlib.Path, steps: int = _QUICK_STEPS) -> dict[str, Any]:
    """The topk rows alone: the quick sweep's AdamW picks at each H of
    :data:`_TOPK_INNER_STEPS` with every topk variant at seed 0, the best per H at every
    seed, judged against the DDP runs and set beside the int8 rows of the quick report
    stored in ``out_dir`` (``convergence.json``, ``convergence-picks.json``: the same
    seeds, batches and model). Writes ``convergence-sparse.json`` and ``.png``.

    Raises:
        FileNotFoundError: no quick report in ``out_dir``.
    """
    stored = _stored_quick_report(out_dir, steps)
    picks = _picks_from(out_dir / _PICKS)
    ddp_runs = _stored_ddp(stored)
    started = time.monotonic()
    journal = out_dir / "convergence-sparse-runs.jsonl"
    runs = _Runs(journal, "quick", steps, min(_INNER_STEPS), _GRID)
    with _threads_kept():
        best = _sweep_topk(runs.train, runs.results, picks, _GRID)
        for seed in _SEEDS:
            for setting in best.values():
                runs.train(setting, seed)
        study = _rounds_study(best, picks, runs.done, journal)
    entries = [_summarize(s, runs.results[s], ddp_runs, steps) for s in best.values()]
    sweep = _sparse_sweep(runs.results, ddp_runs)
    report = _sparse_report(stored, steps, entries, sweep, study)
    report["seconds"] = round(time.monotonic() - started, 1)
    (out_dir / "convergence-sparse.json").write_text(json.dumps(report, indent=2) + "\n")
    _plot_sparse(report, out_dir / "convergence-sparse.png")
    journal.unlink(missing_ok=True)
    return report


def _stored_quick_report(out_dir: pathlib.Path, steps: int) -> dict[str, Any]:
    """The quick report of ``steps`` steps in ``out_dir``, whose picks and DDP runs the
    sparse mode takes.

    Raises:
        FileNotFoundError: no quick report in ``out_dir``.
        ValueError: the report there is not a quick one of ``steps`` steps.
    """
    stored_path = out_dir / "convergence.json"
    if not stored_path.exists():
        raise FileNotFoundError(
            f"{stored_path}: the sparse mode takes the quick report's picks and DDP runs "
            "from it; run `python -m benchmarks convergence --quick` with the same --out first"
        )
    stored = json.loads(stored_path.read_text())
    if stored.get("mode") != "quick" or stored.get("total_steps") != steps:
        raise ValueError(f"{stored_path} is not a quick report of {steps} steps")
    return stored


def _sparse_sweep(
    results: dict[Setting, dict[int, dict]], ddp_runs: dict[int, dict[str, Any]]
) -> list[dict[str, Any]]:
    """Seed 0 of every topk candidate that trained, judged against DDP's seed 0."""
    sweep = []
    for s, r in results.items():
        if 0 in r and "error" not in r[0]:
            one = dict(r[0])
            _judge(one, ddp_runs[0])
            sweep.append(
                {
                    "label": s.label,
                    "setting": s.__dict__,
                    "val_bpb_end_seed0": one["val_bpb_end"],
                    "gap_to_ddp_percent_seed0": one.get("gap_to_ddp_percent"),
                    "bytes_ratio_ddp_over_atoll": one.get("bytes_ratio_ddp_over_atoll"),
                    "payload_ratio_ddp_over_atoll": one.get("payload_ratio_ddp_over_atoll"),
                    "result_over_part": one["result_bytes"] / one["payload_bytes_per_replica"],
                    "owner_reduce_over_allgather": one["bytes_sent_per_worker"]
                    / allgather_bytes(one, _WORKERS),
                }
            )
    return sweep


def _int8_rows(stored: dict[str, Any]) -> dict[int, dict[str, Any] | None]:
    """The quick report's AdamW int8 entry at each H of :data:`_TOPK_INNER_STEPS`."""
    return {
        h: next(
            (
                e
                for e in stored["entries"]
                if e["setting"]["method"] == "atoll"
                and e["setting"]["optimizer"] == "adamw"
                and e["setting"]["inner_steps"] == h
                and e["setting"]["codec"] == "int8"
            ),
            None,
        )
        for h in _TOPK_INNER_STEPS
    }


def _verdicts(
    entries: list[dict[str, Any]], int8: dict[int, dict[str, Any] | None]
) -> dict[str, dict[str, Any]]:
    """Per H, whether the best topk entry meets the bytes goal and int8's gap."""
    verdicts = {}
    for h in _TOPK_INNER_STEPS:
        e = next((e for e in entries if e["setting"]["inner_steps"] == h), None)
        ref = int8.get(h)
        if e is None or ref is None or e["gap_to_ddp_percent"]["mean"] is None:
            continue
        verdicts[f"H={h}"] = {
            "topk": e["label"],
            "bytes_ratio": e.get("bytes_ratio_ddp_over_atoll"),
            "payload_ratio": e.get("payload_ratio_ddp_over_atoll"),
            "gap_percent": e["gap_to_ddp_percent"]["mean"],
            "int8_gap_percent": ref["gap_to_ddp_percent"]["mean"],
            "int8_bytes_ratio_payload_only": ref.get("bytes_ratio_ddp_over_atoll"),
            "meets_bytes_goal": (e.get("bytes_ratio_ddp_over_atoll") or 0) >= _TARGET_TOPK_RATIO,
            "meets_gap_goal": e["gap_to_ddp_percent"]["mean"] <= ref["gap_to_ddp_percent"]["mean"],
        }
    return verdicts


def _sparse_report(
    stored: dict[str, Any],
    steps: int,
    entries: list[dict[str, Any]],
    sweep: list[dict[str, Any]],
    study: list[dict[str, Any]],
) -> dict[str, Any]:
    """The dict written to ``convergence-sparse.json`` (its ``seconds`` filled in by the
    caller)."""
    int8 = _int8_rows(stored)
    return {
        "benchmark": "convergence",
        "mode": "sparse",
        "workers": _WORKERS,
        "seeds": list(_SEEDS),
        "total_steps": steps,
        "params": stored.get("params"),
        "quick_report_date": stored.get("date"),
        "entries": entries,
        "sweep": sweep,
        "int8": {f"H={h}": e for h, e in int8.items()},
        "goal": {
            "min_bytes_ratio": _TARGET_TOPK_RATIO,
            "text": "at least 10,000x fewer bytes than fp32 DDP with a gap to DDP no worse "
            "than int8's at the same H",
        },
        "verdicts": _verdicts(entries, int8),
        "rounds_study": study,
        "head_bytes": dict(zip(("part", "result"), head_bytes(_WORKERS))),
        "seconds": None,  # filled in by run_sparse, where the clock started
        "notes": {
            "int8": "the quick report's AdamW int8 rows; their byte ratios there count "
            "payloads only (the quick report predates heads in the count)",
            "ddp": "the quick report's DDP runs, paired by seed",
        },
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
    }


def _rounds_study(
    best: dict[str, Setting],
    picks: dict[str, Setting],
    done: dict[str, dict[str, Any]],
    journal: pathlib.Path,
) -> list[dict[str, Any]]:
    """The best topk setting at the shortest H and AdamW's int8 pick there, at seed 0,
    for each length of :data:`_ROUNDS_STUDY_STEPS`: how the gap between them moves
    with the number of rounds."""
    h = min(_TOPK_INNER_STEPS)
    topk, int8 = best.get(f"topk H={h}"), picks.get(f"adamw H={h}")
    if topk is None or int8 is None:
        return []
    out = []
    for steps in _ROUNDS_STUDY_STEPS:
        runs = {}
        for name, setting in (("topk", topk), ("int8", int8)):
            runs[name] = _journaled(_Run(setting, "quick", steps, 0, h, _GRID), done, journal)
        ok = all("error" not in r for r in runs.values())
        out.append(
            {
                "steps": steps,
                "rounds": steps // h,
                "topk": topk.label,
                "int8": int8.label,
                "val_bpb_end": {k: r.get("val_bpb_end") for k, r in runs.items()},
                "topk_over_int8_percent": 100
                * (runs["topk"]["val_bpb_end"] / runs["int8"]["val_bpb_end"] - 1)
                if ok
                else None,
                "bytes_int8_over_topk": runs["int8"]["bytes_sent_per_worker"]
                / runs["topk"]["bytes_sent_per_worker"]
                if ok
                else None,
            }
        )
    return out


def _plot_sparse(report: dict[str, Any], path: pathlib.Path) -> None:
    with figure(path, figsize=(9, 5.5)) as (fig, ax):
        for h, marker in zip(_TOPK_INNER_STEPS, ("o", "s")):
            rows = [r for r in report["sweep"] if r["setting"]["inner_steps"] == h]
            ax.scatter(
                [r["bytes_ratio_ddp_over_atoll"] for r in rows],
                [r["gap_to_ddp_percent_seed0"] for r in rows],
                marker=marker,
                label=f"topk variants, H={h} (seed 0)",
            )
            ref = report["int8"].get(f"H={h}")
            if ref and ref.get("gap_to_ddp_percent", {}).get("mean") is not None:
                ax.scatter(
                    [ref["bytes_ratio_ddp_over_atoll"]],
                    [ref["gap_to_ddp_percent"]["mean"]],
                    marker=marker,
                    color="black",
                    label=f"int8, H={h} (mean of seeds, payload only)",
                )
        ax.axvline(_TARGET_TOPK_RATIO, color="gray", linestyle="--", label="10,000x goal")
        ax.set_xscale("log")
        ax.set_xlabel("bytes DDP sends / bytes Atoll sends, per worker (heads included)")
        ax.set_ylabel("final bits/byte above DDP (%)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        ax.set_title(f"topk on the quick model ({report['params']:,} parameters)", fontsize=10)


@dataclass(frozen=True)
class _Run:
    """One training run: what :func:`_train` takes."""

    setting: Setting
    mode: str
    steps: int
    seed: int
    eval_every: int
    grid: _Grid


def _journaled(run: _Run, done: dict[str, dict[str, Any]], journal: pathlib.Path) -> dict:
    """``run``'s result from the journal of an interrupted benchmark (``done``, its bytes
    counted again), or trained now and appended to the journal."""
    key = json.dumps([run.mode, run.steps, run.seed, run.setting.__dict__], sort_keys=True)
    if key not in done:
        done[key] = _train(run.setting, run.mode, run.steps, run.seed, run.eval_every, run.grid)
        journal.parent.mkdir(parents=True, exist_ok=True)
        with journal.open("a") as f:
            f.write(json.dumps({"key": key, "result": done[key]}) + "\n")
    return with_bytes(done[key], run.grid.workers)


def _read_journal(path: pathlib.Path) -> dict[str, dict[str, Any]]:
    """Finished runs of an interrupted benchmark (a torn last line is ignored)."""
    done: dict[str, dict[str, Any]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
                done[entry["key"]] = entry["result"]
            except (ValueError, KeyError, TypeError):
                continue
    return done
