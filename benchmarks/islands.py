"""Compute islands in miniature: two sites that train one model over a slow link, and
eight cells that mix in pairs, against DDP over the same ranks at equal tokens.

The case this project starts from trained one model on two clusters 14,000 km apart,
syncing fragments in 50-step windows with asynchronous updates, a Shampoo-family
optimizer and int4 pseudo-gradients with stochastic rounding and error feedback, and
ended 0.9 % better than standard training at the same compute. Here, at the scale two
cores allow:

- **Data**: BPE shards of the standard library (``atoll data prepare
  --train-tokenizer``, :data:`VOCAB` tokens), windows of :data:`_CONTEXT` tokens.
- **Models**: Llama models from ``transformers``, built from configs: ``small``
  (hidden 128, 2 layers, 0.66M parameters) and, in full mode, ``medium`` (hidden 192,
  3 layers, 1.7M); ``llama-tiny`` (3.7M) takes three times ``small``'s step here, too
  long for three seeds of every arm in the time the full mode is given: it runs the
  real swarm's check.
- **DDP** (:func:`benchmarks._ddp.run_ddp`): :data:`_RANKS` ranks of :data:`_BATCH`
  windows each, an fp32 gradient all-reduce every step, AdamW.
- **Two sites** (:func:`node.ops.simulate.simulate`, the reference of the networked node's
  algorithm): 2 replicas, each a site of ``_RANKS / 2`` ranks (a batch of
  ``_RANKS / 2 * _BATCH`` windows a step: what a torchrun site's gradient all-reduce
  trains on), the ``configs/islands.toml`` recipe at ``H = 50``: 5 fragments staggered
  over each 50-step round (one sync every 10 steps), a result applied 5 steps after
  its sync started, int4 with stochastic rounding and error feedback, the outer step
  the convergence sweep picked for ``H = 50`` (Nesterov, lr 0.7, momentum 0.5); inner
  AdamW and SOAP, both at the lr the sweep picked for AdamW (3e-3), as DDP's AdamW.
- **Eight cells in pairs**: 8 replicas of ``_RANKS * _BATCH / 8`` windows in groups of
  2 (butterfly layout: no all-reduce over the swarm, the pairs mix their global
  copies in fp16), the same recipe with AdamW; scored on replica 0's copy.

**The real swarm against its reference**: the AdamW recipe again as real Atoll nodes
(``sync.trigger = "steps"``, one core each, on the batches their PeerIDs are assigned),
against ``node.ops.simulate`` at seeds 0-2 (:class:`_Check`): in quick mode the two-site
arm of ``small`` as two nodes; in full mode four ``llama-tiny`` nodes (3.7M parameters)
at H = 50 for 20 rounds, a batch of 4 windows each. The real swarm's final bits per
byte should lie within two standard deviations of the reference's seeds.

Every run trains the same number of steps, so the same tokens; each is scored in bits
per byte on the same :data:`_EVAL_WINDOWS` validation windows every 50 steps. A run's **gap** is its final
bits per byte over DDP's of the same seed, less one, in %; the gap at half the run is
reported beside it (how the gap moves with the run's length). Goal: the two sites
within 1 % of DDP or better, as in the case study.

Run ``python -m benchmarks islands [--quick]``: quick, the small model for 600 steps,
seed 0 (16 minutes here); full, ``small`` for 2,000 steps with DDP and every arm at
seeds 0-2, ``medium`` for 600 steps (the quick length, so its gap stands beside
``small``'s there) with DDP and the goal arm at seeds 0-2, and the ``llama-tiny`` check,
one core a simulated run and two runs at once (the real swarms alone first); every
finished run is journaled in ``islands-runs.jsonl`` so an interrupted run resumes;
``--smoke``: a 40-file corpus, 20 steps, 2 ranks.
Writes ``islands.json`` and ``islands.png``.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import pathlib
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from functools import partial
from typing import Any

from benchmarks._common import figure, machine_info, prepare_stdlib_shards, run_swarm
from benchmarks._ddp import DdpRun, run_ddp
from benchmarks._formats import markdown_table, run_mode, signed
from benchmarks._mode import Mode

__all__ = ["run", "table", "table_row"]

VOCAB = 2048
_CONTEXT = 128
_BATCH = 8
_RANKS = 4
H = 50
_THREADS = 2
_EVAL_WINDOWS = 128
"""Validation windows every evaluation scores: each arm takes them in batches of its own
size, drawn from one seeded stream, so every arm is scored on the very same windows."""
_GOAL_GAP_PERCENT = 1.0
_GOAL_ARM = "two sites, AdamW"
"""The arm the goal is for: the one whose inner optimizer is DDP's (SOAP's gap is to DDP
with AdamW, so it says what SOAP buys as much as what the sites cost)."""

_SIZES = {
    "small": {
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
    },
    "medium": {
        "hidden_size": 192,
        "intermediate_size": 576,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 48,
    },
    "llama-tiny": {},
}
"""Llama models between the byte model and ``llama-tiny``: 0.66M and 1.7M parameters at
:data:`VOCAB` tokens (``llama-tiny``'s 3.7M takes three times ``small``'s step here)."""

RECIPE = [
    "sync.trigger='steps'",
    f"sync.inner_steps={H}",
    "sync.fragments=5",
    "sync.tau=5",
    "sync.codec='int4'",
    "sync.stochastic_rounding=true",
    "sync.error_feedback=true",
    "outer.optimizer='nesterov'",
    "outer.lr=0.7",
    "outer.momentum=0.5",
]
"""``configs/islands.toml``'s sync settings at ``H = 50``, with the outer step the
convergence sweep picked for ``H = 50`` (``convergence-picks.json``: Nesterov, lr 0.7,
momentum 0.5; the config's momentum 0.9 is for runs of hundreds of outer steps)."""


@dataclass(frozen=True)
class _Size:
    """One model of the plan: its steps, the seeds of DDP and of the goal arm, the other
    arms and their seeds, and the threads of each simulated run."""

    model: str
    steps: int
    seeds: int
    others: tuple[str, ...]
    threads: int = _THREADS
    other_seeds: int = 1


_ALL_OTHERS = ("two sites, SOAP", "eight cells in pairs, AdamW")


@dataclass(frozen=True)
class _Check:
    """Real nodes against ``node.ops.simulate``: ``nodes`` real AdamW nodes of ``model`` for
    ``steps`` steps at seed 0, against the reference at seeds ``0 .. seeds - 1``, each
    node (and each replica) taking ``batch`` windows a step."""

    model: str
    steps: int
    nodes: int
    batch: int
    seeds: int = 3

    @property
    def arm(self) -> str:
        return _GOAL_ARM if self.nodes == 2 else f"{self.nodes} nodes, AdamW"


@dataclass(frozen=True)
class _Plan:
    sizes: tuple[_Size, ...]
    ranks: int = _RANKS
    files: int | None = None
    inner_steps: int = H
    checks: tuple[_Check, ...] = ()
    workers: int = 1
    """Simulated and DDP runs at once (one core each: ``threads`` is 1 where this is 2)."""


def _plan(quick: bool, smoke: bool) -> _Plan:
    if smoke:
        return _Plan(
            sizes=(_Size("small", 20, 1, _ALL_OTHERS),),
            ranks=2,
            files=40,
            inner_steps=10,
            checks=(_Check("small", 20, 2, _BATCH),),
        )
    if quick:
        return _Plan(
            sizes=(_Size("small", 600, 1, _ALL_OTHERS),),
            checks=(_Check("small", 600, 2, _RANKS * _BATCH // 2),),
        )
    # two runs at once, one core each; medium at the quick mode's length, so its gap
    # stands beside small's there; the real swarm against its reference on llama-tiny,
    # four nodes at H = 50 for 20 rounds (a batch of 4 windows a node, so three seeds of
    # the reference fit the time the full mode is given)
    return _Plan(
        sizes=(
            _Size("small", 2000, 3, _ALL_OTHERS, threads=1, other_seeds=3),
            _Size("medium", 600, 3, (), threads=1),
        ),
        checks=(_Check("llama-tiny", 20 * H, 4, 4),),
        workers=2,
    )


def model_overrides(name: str, work: pathlib.Path) -> list[str]:
    preset = json.loads(
        (pathlib.Path(__file__).resolve().parents[1] / "node/presets/llama-tiny.json").read_text()
    )
    path = work / f"{name}.json"
    path.write_text(json.dumps({**preset, **_SIZES[name], "vocab_size": VOCAB}))
    return ["model.arch='hf'", f"model.hf_config={json.dumps(str(path))}"]


def base_overrides(
    steps: int, shards: pathlib.Path, model: list[str], seed: int, threads: int = _THREADS
) -> list[str]:
    return [
        *model,
        f"model.context={_CONTEXT}",
        f"data.shards={json.dumps(str(shards))}",
        f"run.seed={seed}",
        f"run.threads={threads}",
        "train.lr=3e-3",
        f"train.warmup_steps={max(2, steps // 20)}",
        f"train.total_steps={steps}",
        "train.grad_clip=1.0",
    ]


def batch_overrides(size: int) -> list[str]:
    """A batch of ``size`` windows, evaluated on :data:`_EVAL_WINDOWS` windows."""
    return [f"data.batch_size={size}", f"train.eval_batches={_EVAL_WINDOWS // size}"]


def ddp_arm(ranks: int, steps: int, every: int, base: list[str]) -> dict[str, Any]:
    """DDP over ``ranks`` ranks of :data:`_BATCH` windows for ``steps`` steps, scored every
    ``every`` steps: its history of bits per byte."""
    eval_at = tuple(range(0, steps + 1, every))
    run = DdpRun(
        (*base, *batch_overrides(_BATCH), "run.threads=1"),
        ranks,
        steps=steps,
        eval_at=eval_at,
        shards=True,
        seeded_streams=True,
        gloo_timeout=900,
    )
    out = run_ddp(run, timeout=6 * 3600.0, grace=30)
    if "history" not in out:
        return out
    return {
        "history": [{"step": h["step"], "val_bpb": h["val_bpb"]} for h in out["history"]],
        "params": out.get("params"),
        "seconds": out.get("seconds"),
    }


def _diloco(
    plan: _Plan, steps: int, base: list[str], replicas: int, extra: list[str], batch: int = 0
) -> dict[str, Any]:
    """``replicas`` simulated replicas of ``batch`` windows (0: the plan's ranks' share)."""
    from node.config import load_config
    from node.ops.simulate import simulate

    batch = batch or plan.ranks * _BATCH // replicas
    recipe = [*RECIPE, f"sync.inner_steps={plan.inner_steps}"]
    cfg = load_config(None, [*base, *recipe, *batch_overrides(batch), *extra])
    result = simulate(cfg, replicas=replicas, rounds=steps // plan.inner_steps)
    return {
        "history": [
            {"step": h["round"] * plan.inner_steps, "val_bpb": h["val_bpb"]}
            for h in result["history"]
        ],
        "params": result["params"],
        "batch": batch,
        "payload_bytes_per_replica": result["payload_bytes_per_replica"],
        "seconds": result["seconds"],
    }


_ARMS = {
    "two sites, AdamW": (2, ["train.optimizer='adamw'"]),
    "two sites, SOAP": (2, ["train.optimizer='soap'"]),
    "eight cells in pairs, AdamW": (
        8,
        ["train.optimizer='adamw'", "network.group_size=2", "sync.layout='butterfly'"],
    ),
}


def _real(plan: _Plan, check: _Check, base: list[str], where: pathlib.Path) -> dict[str, Any]:
    """``check.nodes`` real Atoll nodes with AdamW (``atoll swarm``'s way, one core each,
    ``sync.trigger = "steps"``): the same model, recipe, seed and batch size as the
    reference, on the batches each node's PeerID is assigned (so not the reference's
    batches: they agree within the seeds' spread, not bit for bit)."""
    overrides = [
        *base,
        *RECIPE,
        f"sync.inner_steps={plan.inner_steps}",
        *batch_overrides(check.batch),
        "train.optimizer='adamw'",
        "run.threads=1",
        "network.matchmaking_seconds=10",
        "network.round_timeout=60",
    ]
    rounds = check.steps // plan.inner_steps
    started = time.time()
    nodes = run_swarm(overrides, check.nodes, rounds, where)
    finals = [n["rounds"][-1].get("val_bpb") for n in nodes if n["rounds"]]
    return {
        "nodes": check.nodes,
        "exit_codes": [n["exit_code"] for n in nodes],
        "rounds": [len(n["rounds"]) for n in nodes],
        "digests_agree": len({n["rounds"][-1].get("global_digest") for n in nodes if n["rounds"]})
        == 1,
        "history": [
            {"step": r["round"] * plan.inner_steps, "val_bpb": r.get("val_bpb")}
            for r in (nodes[0]["rounds"] if nodes else [])
        ],
        "val_bpb_ends": finals,
        "val_bpb_end": statistics.fmean(finals) if finals else None,
        "seconds": time.time() - started,
    }


def _judge_check(
    check: _Check, references: list[dict[str, Any]], real: dict[str, Any]
) -> dict[str, Any]:
    """Real nodes against ``node.ops.simulate``: the real swarm's final bits per byte against
    the reference's mean and spread over its seeds."""
    ends = [e for r in references if (e := _at(r.get("history", []), check.steps)) is not None]
    mean = statistics.fmean(ends) if ends else None
    spread = statistics.stdev(ends) if len(ends) > 1 else None
    end = real["val_bpb_end"]
    agrees = None
    if end is not None and mean is not None and spread is not None:
        agrees = abs(end - mean) <= 2 * spread
    return {
        "arm": check.arm,
        "model": check.model,
        "nodes": check.nodes,
        "batch": check.batch,
        "steps": check.steps,
        "reference_val_bpb_end": ends,
        "reference_mean": mean,
        "reference_spread": spread,
        "real": real,
        "difference_percent": None if end is None or not mean else 100 * (end / mean - 1),
        "agrees_within_two_spreads": agrees,
    }


def _at(history: list[dict[str, Any]], step: int) -> float | None:
    return next((h["val_bpb"] for h in history if h["step"] == step), None)


def _gap(run: dict[str, Any], ddp: dict[str, Any], step: int) -> float | None:
    mine, theirs = _at(run.get("history", []), step), _at(ddp.get("history", []), step)
    if mine is None or theirs is None:
        return None
    return 100.0 * (mine / theirs - 1.0)


def _summary(entries: list[dict[str, Any]], plan: _Plan) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for size in plan.sizes:
        steps = size.steps
        half = steps // 2 // plan.inner_steps * plan.inner_steps
        mine = [e for e in entries if e["model"] == size.model]
        arms: dict[str, Any] = {}
        for arm in ["ddp", *_ARMS]:
            ran = [e for e in mine if "history" in e.get(arm, {})]
            if not ran:
                continue  # an arm this size does not run
            finals = [f for e in ran if (f := _at(e[arm]["history"], steps)) is not None]
            row: dict[str, Any] = {
                "steps": steps,
                "seeds": len(ran),
                "val_bpb_end": statistics.fmean(finals) if finals else None,
                "val_bpb_spread": statistics.stdev(finals) if len(finals) > 1 else None,
            }
            if arm != "ddp":
                gaps = [g for e in ran if (g := _gap(e[arm], e["ddp"], steps)) is not None]
                halves = [g for e in ran if (g := _gap(e[arm], e["ddp"], half)) is not None]
                row.update(
                    gap_percent=statistics.fmean(gaps) if gaps else None,
                    gap_spread=statistics.stdev(gaps) if len(gaps) > 1 else None,
                    gap_percent_at_half=statistics.fmean(halves) if halves else None,
                    half_steps=half,
                )
                if arm == _GOAL_ARM:  # the arm whose inner optimizer is DDP's
                    row["goal_percent"] = _GOAL_GAP_PERCENT
                    row["meets_goal"] = bool(gaps) and max(gaps) <= _GOAL_GAP_PERCENT
            arms[arm] = row
        out[size.model] = arms
    return out


def _goals(summary: dict[str, Any], checks: list[dict[str, Any]]) -> dict[str, Any]:
    """Each goal of the benchmark and whether it is met."""
    goals: dict[str, Any] = {}
    for model, arms in summary.items():
        row = arms[_GOAL_ARM]
        goals[f"{model}: two sites within {_GOAL_GAP_PERCENT:g} % of DDP"] = {
            "value": row["gap_percent"],
            "goal": _GOAL_GAP_PERCENT,
            "meets_goal": row["meets_goal"],
        }
    for check in checks:
        goals[
            f"{check['model']}: {check['nodes']} real nodes within two spreads of node.ops.simulate"
        ] = {
            "value": check["difference_percent"],
            "goal": "within 2 sd of the reference's seeds",
            "meets_goal": bool(check["agrees_within_two_spreads"]),
        }
    return goals


Work = Callable[[], dict[str, Any]]


class Journal:
    """Every finished run, appended to ``islands-runs.jsonl`` in the output folder, so an
    interrupted benchmark resumes where it stopped (removed once the report is written)."""

    def __init__(self, path: pathlib.Path, key: dict[str, Any]) -> None:
        self.path = path
        self.key = json.dumps(key, sort_keys=True)
        self.done: dict[str, Any] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by the interruption
                if row.get("plan") == self.key:
                    self.done[row["name"]] = row["result"]

    def _keep(self, name: str, result: dict[str, Any]) -> None:
        self.done[name] = result
        with self.path.open("a") as f:
            f.write(json.dumps({"plan": self.key, "name": name, "result": result}) + "\n")

    def run(self, name: str, work: Work) -> dict[str, Any]:
        if name not in self.done:
            self._keep(name, work())
        return self.done[name]

    def run_all(self, jobs: dict[str, Work], workers: int) -> None:
        """Every job not done yet, ``workers`` at once in their own processes (each job
        must pickle), kept in the journal as each ends."""
        todo = {name: work for name, work in jobs.items() if name not in self.done}
        if workers <= 1:
            for name, work in todo.items():
                self.run(name, work)
            return
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(workers, mp_context=context) as pool:
            running = {pool.submit(work): name for name, work in todo.items()}
            for done in as_completed(running):
                self._keep(running[done], done.result())
                print(f"islands: {running[done]} done", flush=True)


def _name(model: str, steps: int, seed: int, arm: str) -> str:
    return f"{model}/{steps}/{seed}/{arm}"


def _jobs(plan: _Plan, shards: pathlib.Path, work: pathlib.Path) -> dict[str, Work]:
    """Every simulated and DDP run of the plan, by journal name: the checks' references
    first, then seed by seed, every size at a seed before the next seed (an interrupted
    run has both sizes before it has more seeds of one)."""
    jobs: dict[str, Work] = {}
    for check in plan.checks:
        model = model_overrides(check.model, work)
        replicas = check.nodes
        for seed in range(check.seeds):
            base = base_overrides(check.steps, shards, model, seed, plan.sizes[0].threads)
            jobs[_name(check.model, check.steps, seed, check.arm)] = partial(
                _diloco, plan, check.steps, base, replicas, ["train.optimizer='adamw'"], check.batch
            )
    for seed in range(max(size.seeds for size in plan.sizes)):
        for size in plan.sizes:
            if seed >= size.seeds:
                continue
            model = model_overrides(size.model, work)
            base = base_overrides(size.steps, shards, model, seed, size.threads)
            jobs[_name(size.model, size.steps, seed, "ddp")] = partial(
                ddp_arm, plan.ranks, size.steps, plan.inner_steps, base
            )
            for arm, (replicas, extra) in _ARMS.items():
                if arm == _GOAL_ARM or (arm in size.others and seed < size.other_seeds):
                    jobs[_name(size.model, size.steps, seed, arm)] = partial(
                        _diloco, plan, size.steps, base, replicas, extra
                    )
    return jobs


def _entries(plan: _Plan, done: dict[str, Any]) -> list[dict[str, Any]]:
    """DDP and the arms of every size at every seed, from the journal."""
    entries = []
    for size in plan.sizes:
        for seed in range(size.seeds):
            entry: dict[str, Any] = {"model": size.model, "seed": seed}
            for arm in ["ddp", *_ARMS]:
                name = _name(size.model, size.steps, seed, arm)
                if name in done:
                    entry[arm] = done[name]
            entries.append(entry)
    return entries


def _checks(plan: _Plan, shards: pathlib.Path, work: pathlib.Path, journal: Journal) -> None:
    """The real swarm of each check, one after another and alone on the machine."""
    for check in plan.checks:
        model = model_overrides(check.model, work)
        base = base_overrides(check.steps, shards, model, 0, 1)
        name = _name(check.model, check.steps, 0, f"real, {check.nodes} nodes")
        journal.run(name, partial(_real, plan, check, base, work / f"real-{check.nodes}"))


def _reference_checks(plan: _Plan, journal: Journal) -> list[dict[str, Any]]:
    """Each reference check judged: the simulated arm's seeds against its real nodes."""
    checks = [
        _judge_check(
            check,
            [
                journal.done[_name(check.model, check.steps, s, check.arm)]
                for s in range(check.seeds)
            ],
            journal.done[_name(check.model, check.steps, 0, f"real, {check.nodes} nodes")],
        )
        for check in plan.checks
    ]
    for check in checks:
        print(f"islands: {check['model']}: real nodes {check['difference_percent']} % off")
    return checks


def run(mode: Mode, out_dir: pathlib.Path) -> dict[str, Any]:
    """Every model, seed and arm of the plan; writes ``islands.json`` and ``islands.png``."""
    plan = _plan(mode.quick, mode.smoke)
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    journal = Journal(out_dir / "islands-runs.jsonl", {"journal": 2})
    work = pathlib.Path(tempfile.mkdtemp(prefix="atoll-islands-"))
    started = time.time()
    try:
        shards, corpus = prepare_stdlib_shards(work / "shards", VOCAB, plan.files)
        _checks(plan, shards, work, journal)
        journal.run_all(_jobs(plan, shards, work), plan.workers)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    entries = _entries(plan, journal.done)
    checks = _reference_checks(plan, journal)
    summary = _summary(entries, plan)
    first = plan.sizes[0]
    report = {
        "benchmark": "islands",
        "quick": mode.quick,
        "smoke": mode.smoke,
        "corpus": corpus,
        "steps": first.steps,
        "sizes": [
            {
                "model": z.model,
                "steps": z.steps,
                "seeds": z.seeds,
                "other_arms": list(z.others),
                "other_arms_seeds": z.other_seeds,
                "threads": z.threads,
            }
            for z in plan.sizes
        ],
        "ranks": plan.ranks,
        "batch_per_rank": _BATCH,
        "context": _CONTEXT,
        "eval_windows": _EVAL_WINDOWS,
        "inner_steps": plan.inner_steps,
        "workers": plan.workers,
        "recipe": RECIPE,
        "entries": entries,
        "summary": summary,
        "reference_checks": checks,
        "goals": _goals(summary, checks),
        "seconds": time.time() - started,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
    }
    (out_dir / "islands.json").write_text(json.dumps(report, indent=2) + "\n")
    _plot(report, out_dir / "islands.png")
    journal.path.unlink(missing_ok=True)
    return report


def _plot(report: dict[str, Any], path: pathlib.Path) -> None:
    models = list(report["summary"])
    with figure(path, 1, len(models), figsize=(6.5 * len(models), 4.2), squeeze=False) as (
        fig,
        axes,
    ):
        for ax, model in zip(axes[0], models, strict=True):
            entry = next(e for e in report["entries"] if e["model"] == model)
            for arm in ["ddp", *_ARMS]:
                if arm not in entry:
                    continue  # an arm this size does not run
                history = entry[arm].get("history") or []
                steps = [h["step"] for h in history if h["step"] > 0]
                values = [h["val_bpb"] for h in history if h["step"] > 0]
                ax.plot(steps, values, "-" if arm == "ddp" else "--", label=arm)
            ax.set_title(f"{model}, seed {entry['seed']}: validation bits per byte", fontsize=9)
            ax.set_xlabel("step (equal tokens)")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)


# ---- the docs' rows ---------------------------------------------------------------------


def table_row(data: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The summary row: each model's two-site gaps to DDP."""
    mode = run_mode(data)
    parts = []
    for model, arms in data["summary"].items():
        for arm, row in arms.items():
            if arm == "ddp" or row.get("gap_percent") is None:
                continue
            spread = row.get("gap_spread")
            parts.append(
                f"{model}, {arm}: **{signed(row['gap_percent'])} %**"
                + (f" ± {spread:.1f}" if spread else "")
            )
    sizes = data.get("sizes") or [{"model": m, "steps": data["steps"]} for m in data["summary"]]
    lengths = ", ".join(f"{z['model']} {z['steps']:,} steps" for z in sizes)
    what = (
        f"compute islands ({mode} mode): simulated sites against DDP over {data['ranks']} "
        f"ranks at equal tokens ({lengths}), H = {data['inner_steps']}, int4 with stochastic "
        "rounding and error feedback"
    )
    checks = data.get("reference_checks") or [c for c in [data.get("reference_check")] if c]
    for check in checks:
        if check.get("difference_percent") is None:
            continue
        nodes = check.get("nodes", 2)
        parts.append(
            f"{nodes} real {check.get('model', '')} nodes "
            f"{abs(check['difference_percent']):.1f} % from `node.ops.simulate`'s "
            f"mean over {len(check['reference_val_bpb_end'])} seeds"
            + (" (within 2 sd)" if check["agrees_within_two_spreads"] else " (outside 2 sd)")
        )
    target = f"two sites within {_GOAL_GAP_PERCENT:g} % of DDP (both AdamW)"
    return [(what, "; ".join(parts), target)]


def table(data: dict[str, Any]) -> str:
    """Every model and arm: final bits per byte, gap to DDP and at half the run."""
    header = [
        "model", "run", "steps", "seeds", "bits per byte", "gap to DDP (AdamW)",
        "gap at half the run", "goal",
    ]  # fmt: skip
    body = []
    for model, arms in data["summary"].items():
        for arm, row in arms.items():
            end = row["val_bpb_end"]
            spread = row.get("val_bpb_spread")
            gap, half = row.get("gap_percent"), row.get("gap_percent_at_half")
            goal = "" if "meets_goal" not in row else ("met" if row["meets_goal"] else "missed")
            body.append(
                [
                    model,
                    arm,
                    str(row.get("steps", data["steps"])),
                    str(row.get("seeds", "")),
                    "-" if end is None else f"{end:.4f}" + (f" ± {spread:.4f}" if spread else ""),
                    "" if gap is None else f"{signed(gap)} %",
                    "" if half is None else f"{signed(half)} %",
                    goal,
                ]
            )
    return markdown_table(header, body)
