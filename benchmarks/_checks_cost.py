"""What useful-work checks cost a node at realistic round lengths: its tokens per second
with checks against without, side by side.

Two workloads, each a clean swarm of real node processes on 127.0.0.1 run twice, with
the checks (``trust.checkers = 2`` and replay checks in windows of 8 steps,
``trust.replay_steps = 8``; every other ``trust.check*`` key at its default: 16 windows,
one fragment of each contributor a round, a budget of 4 % of training time)
and without (``trust.checkers = 0``), the runs alternating (with, without, without,
with; twice in the full mode) so that a machine getting busier favours neither, and
the ratio is of the means (one pair here can be 8 % off either way). Each workload
first runs once for two rounds without checks, not counted: in both stored runs before
it, the first run of each workload was the slowest of its side (files read cold, a
fresh process pool), and the order charged that to the checks.

- ``demo``: ``configs/local-swarm.toml`` as ``make demo`` runs it, 4 nodes in one group,
  2 fragments, 20-s wall-clock rounds;
- ``llama-tiny``: ``configs/llama-tiny.toml`` on BPE shards of the standard library (a
  2,048-token tokenizer), 2 nodes of one thread each, rounds of 100 inner steps.

Per run, per node: tokens trained over its training wall time (busy and idle seconds in
its status), the checks' forward and replay time over its time in inner steps, the
trace's time (both its threads) over the same, and the bytes it fetched to check over
the bytes its syncs sent. The cost is the tokens/s ratio of the
runs with checks over those without (mean over nodes and runs).
"""

from __future__ import annotations

import pathlib
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from benchmarks._common import prepare_stdlib_shards
from node.config import load_config
from node.ops.swarm import SwarmSpec, run_to_end, summarize
from node.run.metrics import read_events

__all__ = ["COST_CASES", "CostCase", "measure_costs", "overrides_of"]

_ROOT = pathlib.Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class CostCase:
    """A workload the checks' cost is measured on."""

    name: str
    nodes: int
    config: str
    overrides: tuple[str, ...]
    rounds: int
    shards: bool = False
    """Whether it trains on BPE shards prepared for the run."""


COST_CASES = {
    "demo": CostCase("demo", 4, "configs/local-swarm.toml", (), 5),
    "llama-tiny": CostCase(
        "llama-tiny",
        2,
        "configs/llama-tiny.toml",
        (
            "sync.trigger='steps'",
            "sync.inner_steps=100",
            "model.context=128",
            "train.warmup_steps=10",
            "network.round_timeout=30",
        ),
        4,
        shards=True,
    ),
}
_CHECKS = ("trust.checkers=2", "trust.aggregator='centered_clip'", "trust.replay_steps=8")


def overrides_of(case: CostCase, checks: bool, shards: pathlib.Path | None) -> list[str]:
    """A cost run's overrides after its config file."""
    out = [*case.overrides, "trust.checkers=0"]
    if checks:
        out += list(_CHECKS)
    if shards is not None:
        out.append(f"data.shards='{shards}'")
    return out


def _one(
    case: CostCase,
    checks: bool,
    base: pathlib.Path,
    shards: pathlib.Path | None,
    rounds: int,
) -> dict[str, Any]:
    overrides = overrides_of(case, checks, shards)
    directory = base / f"{case.name}-{'with' if checks else 'without'}-{time.monotonic_ns()}"
    spec = SwarmSpec(
        nodes=case.nodes,
        config_paths=[str(_ROOT / case.config)],
        overrides=overrides,
        directory=directory,
        rounds=rounds,
    )
    started = time.monotonic()
    try:
        nodes, finished = run_to_end(spec, 1800.0)
        cfg = load_config([str(_ROOT / case.config)], overrides)
        summary = summarize(nodes, cfg, [])
        per_node = []
        for n in nodes:
            status, rounds_seen = (
                n.status,
                [e for e in read_events(n.data_dir / "events.jsonl") if e["event"] == "round"],
            )
            wall = status.get("busy_seconds", 0) + status.get("idle_seconds", 0)
            counts = (rounds_seen[-1].get("checks") or {}) if rounds_seen else {}
            per_node.append(
                {
                    "tokens_per_second": status.get("tokens", 0) / wall if wall else None,
                    "busy_seconds": status.get("busy_seconds"),
                    "check_seconds": counts.get("compute_seconds"),
                    "trace_seconds": counts.get("trace_seconds"),
                    "bytes_fetched": counts.get("bytes_fetched"),
                    "bytes_sent": status.get("bytes_sent"),
                    "made": counts.get("made"),
                    "taken": counts.get("taken"),
                    "skipped": counts.get("skipped"),
                    "replayed_steps": counts.get("replayed_steps"),
                    "sent_checked": counts.get("sent_checked"),
                    "unmeasured": counts.get("unmeasured"),
                    "trace_kept_bytes": (rounds_seen[-1].get("trace") or {}).get("kept_bytes")
                    if rounds_seen
                    else None,
                }
            )
        error = (
            None
            if finished and summary["exit_codes"] == [0] * case.nodes
            else (f"finished {finished}, exit codes {summary['exit_codes']}")
        )
        return {
            "case": case.name,
            "checks": checks,
            "rounds": summary["rounds"],
            "val_bpb_end": summary["val_bpb_end"],
            "nodes": per_node,
            "seconds": round(time.monotonic() - started, 1),
            **({"error": error} if error else {}),
        }
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.fmean(kept) if kept else None


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The tokens/s ratio with checks over without, the checks' share of training time
    and the bytes fetched over the bytes sent."""

    def rate(checks: bool) -> float | None:
        return _mean(
            [n["tokens_per_second"] for r in runs if r["checks"] == checks for n in r["nodes"]]
        )

    with_checks = [n for r in runs if r["checks"] for n in r["nodes"]]
    a, b = rate(True), rate(False)
    return {
        "tokens_per_second_with": a,
        "tokens_per_second_without": b,
        "ratio": a / b if a and b else None,
        "check_share": _mean(
            [
                n["check_seconds"] / n["busy_seconds"]
                for n in with_checks
                if n["check_seconds"] is not None and n["busy_seconds"]
            ]
        ),
        "trace_share": _mean(
            [
                n["trace_seconds"] / n["busy_seconds"]
                for n in with_checks
                if n.get("trace_seconds") is not None and n["busy_seconds"]
            ]
        ),
        "replayed_steps_per_node": _mean([n["replayed_steps"] for n in with_checks]),
        "fetched_to_sent": _mean(
            [
                n["bytes_fetched"] / n["bytes_sent"]
                for n in with_checks
                if n["bytes_fetched"] is not None and n["bytes_sent"]
            ]
        ),
        "records_made_per_node": _mean([n["made"] for n in with_checks]),
        "rounds_skipped_per_node": _mean([n["skipped"] for n in with_checks]),
    }


def measure_costs(quick: bool, base: pathlib.Path) -> dict[str, Any]:
    """Every cost case, its runs alternating with and without checks."""
    order = (True, False, False, True) * (1 if quick else 2)
    out: dict[str, Any] = {}
    for name, case in COST_CASES.items():
        shards = None
        if case.shards:
            shards, _ = prepare_stdlib_shards(base / f"{name}-shards", 2048)
        warmup = _one(case, False, base, shards, 2)
        print(
            f"robustness --checks cost {name}: warm-up {warmup['seconds']:.0f}s (not counted)",
            file=sys.stderr,
            flush=True,
        )
        runs = []
        for checks in order:
            run = _one(case, checks, base, shards, case.rounds)
            runs.append(run)
            rate = _mean([n["tokens_per_second"] for n in run["nodes"]]) or 0.0
            print(
                f"robustness --checks cost {name}: checks {checks} {rate:.0f} tokens/s per "
                f"node, {run['seconds']:.0f}s"
                + (f" ERROR {run['error']}" if "error" in run else ""),
                file=sys.stderr,
                flush=True,
            )
        entry = {
            "case": {**case.__dict__, "overrides": list(case.overrides)},
            "warmup": {k: warmup.get(k) for k in ("rounds", "seconds", "nodes", "error")},
            "runs": runs,
        }
        out[name] = {**entry, **_summary(runs)}
    return out


def replay_probe(steps: int = 40, window: int = 5) -> dict[str, Any]:
    """What the replay direction would cost and whether it is exact, on the demo model.

    A member that kept a signed trace of its inner steps (the batches, and a hash and a
    low-dimensional sketch of its state every few steps) could be checked by replaying a
    window of it from its start state. Here: train ``steps`` steps, keep the state (the
    parameters and the inner optimizer's moments), replay ``window`` steps from it twice
    on one thread and once on two, and compare the end states bitwise and by a seeded
    64-value sketch; time a replayed step against a check's forward of the same batch.
    """
    import copy

    import torch

    from node.data.corpus import BatchStream, load_data
    from node.train.model import build_model, vocab_of
    from node.train.trainer import InnerTrainer, window_losses

    cfg = load_config([str(_ROOT / "configs/local-swarm.toml")], [])
    corpus = load_data(cfg.data, cfg.model.context, vocab_of(cfg.model))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        model = build_model(cfg.model, seed=0)
        stream = BatchStream(corpus.train, cfg.data.batch_size, cfg.model.context, "probe")
        trainer = InnerTrainer(model, cfg.train, stream)
        for _ in range(steps):
            trainer.step()
        start = (copy.deepcopy(model.state_dict()), copy.deepcopy(trainer.optimizer.state_dict()))
        params = sum(p.numel() for p in model.parameters())
        moments = sum(
            v.numel() * v.element_size()
            for s in trainer.optimizer.state.values()
            for v in s.values()
            if torch.is_tensor(v) and v.numel() > 1
        )
        projection = torch.randn(64, params, generator=torch.Generator().manual_seed(7))

        def replay(n_threads: int) -> tuple[torch.Tensor, float]:
            torch.set_num_threads(n_threads)
            model.load_state_dict(start[0])
            trainer.optimizer.load_state_dict(copy.deepcopy(start[1]))  # loading aliases it
            trainer.steps = steps  # the same place in the learning-rate schedule
            torch.manual_seed(steps)  # dropout's draws: a trace would name their seed
            trainer.stream = BatchStream(corpus.train, cfg.data.batch_size, cfg.model.context, "w")
            began = time.perf_counter()
            for _ in range(window):
                trainer.step()
            took = (time.perf_counter() - began) / window
            flat = torch.cat([p.detach().flatten() for p in model.parameters()])
            return flat, took

        one, step_seconds = replay(1)
        again, _ = replay(1)
        two, _ = replay(2)
        torch.set_num_threads(1)
        x, y = BatchStream(corpus.train, cfg.data.batch_size, cfg.model.context, "f").next()
        began = time.perf_counter()
        window_losses(model, x, y, dict(model.named_parameters()))
        forward = time.perf_counter() - began
        sketch_one, sketch_two = projection @ one, projection @ two
    finally:
        torch.set_num_threads(threads)
    return {
        "model_params": params,
        "trained_steps": steps,
        "window": window,
        "bitwise_on_one_thread": bool(torch.equal(one, again)),
        "bitwise_one_vs_two_threads": bool(torch.equal(one, two)),
        "max_relative_difference_one_vs_two_threads": float(
            ((one - two).abs().max() / one.abs().max()).item()
        ),
        "sketch_relative_difference_one_vs_two_threads": float(
            ((sketch_one - sketch_two).norm() / sketch_one.norm()).item()
        ),
        "replayed_step_seconds": step_seconds,
        "forward_seconds_same_batch": forward,
        "start_state_bytes": params * 4 + moments,
        "start_state_bytes_per_param": (params * 4 + moments) / params,
    }


def tracer_probe(window: int = 4, steps: int = 24, repeats: int = 2) -> dict[str, Any]:
    """What the trace costs the training thread on llama-tiny (the cost case's model and
    context, a 2,048-token vocabulary, one thread): inner steps with and without a
    :class:`node.checks.trace.Tracer` in windows of ``window``, alternating (ABBA, ``repeats``
    times), and one start state's copy and hash timed apart."""
    import torch

    from node.checks.trace import Tracer, TraceSettings
    from node.data.corpus import BatchStream
    from node.train.model import build_model
    from node.train.trainer import InnerTrainer
    from node.train.trainstate import Snapshot
    from protocol.averaging.fragments import plan_fragments
    from verification.identity import Identity

    case = COST_CASES["llama-tiny"]
    cfg = load_config([str(_ROOT / case.config)], [*case.overrides, "model.vocab_size=2048"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_model(cfg.model, seed=0)
        tokens = torch.randint(0, 2048, (1 << 20,), generator=torch.Generator().manual_seed(0))
        stream = BatchStream(
            tokens.to(torch.int16).view(torch.uint16), cfg.data.batch_size, cfg.model.context, "t"
        )
        trainer = InnerTrainer(model, cfg.train, stream)
        trainer.step()
        plan = plan_fragments(model, cfg.sync.fragments)
        tracer = Tracer(TraceSettings("probe", window, 1), Identity.from_seed(b"\x01" * 32), plan)

        def run(traced: bool) -> float:
            began = time.perf_counter()
            for i in range(steps):
                if traced:
                    tracer.before(model, trainer.optimizer, trainer.steps, (1, i))
                result = trainer.step()
                if traced:
                    tracer.after(model, result.loss)
            if traced:
                tracer.seal()
                tracer.keep([])
            return (time.perf_counter() - began) / steps

        timed: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(repeats):
            for traced in (False, True, True, False):
                timed[traced].append(run(traced))
        params = list(model.parameters())
        began = time.perf_counter()
        snapshot = Snapshot(params, trainer.optimizer)
        copy_and_hash = time.perf_counter() - began
        began = time.perf_counter()
        snapshot._hash()
        hash_only = time.perf_counter() - began
        began = time.perf_counter()
        tracer.sketcher.sketch(params)
        sketch = time.perf_counter() - began
        tracer.close()
    finally:
        torch.set_num_threads(threads)
    without, with_ = statistics.fmean(timed[False]), statistics.fmean(timed[True])
    return {
        "model_params": sum(p.numel() for p in params),
        "window": window,
        "step_seconds_without": without,
        "step_seconds_with": with_,
        "step_ratio": with_ / without,
        "start_state_bytes": snapshot.size,
        "copy_and_hash_seconds": copy_and_hash,
        "hash_seconds": hash_only,
        "sketch_seconds": sketch,
    }
