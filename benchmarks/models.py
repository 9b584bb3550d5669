"""Real models on real data: Atoll nodes training Hugging Face Llama models on BPE shards,
against bare training loops of the same model.

The corpus is the standard library's ``.py`` files, prepared once per run with
``atoll data prepare --train-tokenizer`` (a byte-level BPE of :data:`_VOCAB` tokens).

1. **Throughput** (llama-tiny): two nodes side by side, one thread each, wall-clock
   rounds of 60 s (syncs of int8 parts with commitments and verification, evaluation
   and a checkpoint every round: the whole daemon), against two bare loops side by side
   (the same ``transformers`` model, batch, AdamW and thread count, nothing else). A
   node's tokens per second are its tokens over its whole training time (busy and
   idle); a bare loop's over its timed steps. Quick: one pair of runs; full: three,
   alternating, medians. Goal: the node at 0.95 or more of the bare loop. Beside it,
   where the difference goes: the share of a node's training time spent outside inner
   steps (syncs applied, evaluation, checkpoints), the CPU its helper processes (p2pd,
   the DHT, the control sidecar) took from the two cores, and one node with no peer
   run *at the same time* as one bare loop (one core each, so the machine's drift
   hits both): what the daemon costs an inner step when there is no sync to run.
2. **Memory** (llama-tiny, gpt2-small and llama-150m: the largest preset that fits two
   copies plus their optimizers in this machine's 24 GiB; llama-1b would need about
   40 GB): the peak resident memory of one node's process against that of a bare loop
   of the same model, optimizer and batch, per parameter. The slope between the
   presets is what a node holds per parameter beyond the model and its inner optimizer
   (the outer state and error feedback; the state it serves to joining peers is read
   from a file), measured over one round of 8 fragments that sync one after another;
   the intercept is its fixed cost (hivemind, the control channel's client). Goal: 20
   bytes per parameter or less.
3. **Convergence**: four nodes (H inner steps per round, int8) against DDP of four
   ranks (gloo, an fp32 gradient all-reduce every step) at equal tokens, the same
   inner optimizer and schedule, scored in bits per byte on the same validation
   batches. Quick: one seed; full: three.
4. **CUDA**: where a GPU is present, llama-150m in bf16 against a bare loop (tokens/s,
   and MFU from ``6 * params`` FLOPs per token over the device's bf16 peak);
   otherwise the report says none was lent.

Run ``python -m benchmarks models [--quick]``; writes ``models.json`` and ``models.png``.
A smoke run (``--smoke``) goes through every part at the smallest sizes: 40 files and a
512-token BPE, 2 rounds of 8 s per throughput swarm, llama-tiny alone for memory (so no
slope), 2 nodes against 2 DDP ranks for 1 round of 2 steps.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import torch

from benchmarks._common import (
    figure,
    machine_info,
    prepare_stdlib_shards,
    run_ranks,
    run_swarm,
)
from benchmarks._ddp import DdpRun, run_ddp
from benchmarks._mode import Mode
from node.config import load_config

__all__ = ["run"]

_VOCAB = 2048
_THREADS = 1
_TRAIN = [
    "model.arch='hf'",
    "model.preset='llama-tiny'",
    "model.context=128",
    "data.batch_size=8",
    "train.lr=3e-3",
    "train.warmup_steps=10",
    f"run.threads={_THREADS}",
]
_NODE = [
    "sync.fragments=2",
    "sync.codec='int8'",
    "train.eval_batches=4",
    "network.matchmaking_seconds=3",
    "network.round_timeout=10",
]
_ROUND_SECONDS = 60.0
"""Wall-clock rounds of the throughput runs (the GPU configs use 300 to 600 s): what a
node does once a round (evaluate, checkpoint, publish its state) costs 1 % or so of
them; in 20-s rounds it cost 4 % here (evaluation alone 3 %)."""
_MEMORY_PRESETS = ("llama-tiny", "gpt2-small", "llama-150m")
_MEMORY_STEPS = 8
"""Inner steps of the memory runs: one round of 8 fragments, one sync launched per step
(as a run of H >= F staggers them)."""
_CONV_NODES = 4


@dataclass(frozen=True)
class _Plan:
    """How much of each part one run measures."""

    pairs: int  # throughput: bare and node runs, one after the other
    seeds: int  # convergence
    round_seconds: float = _ROUND_SECONDS
    bare_seconds: float = 90.0
    throughput_rounds: int = 3
    side_rounds: int = 2
    memory_presets: tuple[str, ...] = _MEMORY_PRESETS
    conv_nodes: int = _CONV_NODES
    conv_inner: int = 20
    conv_rounds: int = 5
    vocab: int = _VOCAB
    files: int | None = None  # of the standard library's, for the corpus; None: all
    cuda_seconds: float = 60.0  # the bare loop's on a GPU; the node's rounds take half
    cuda_rounds: int = 3


def _plan(quick: bool, smoke: bool) -> _Plan:
    if smoke:
        return _Plan(
            pairs=1,
            seeds=1,
            round_seconds=8.0,
            bare_seconds=2.0,
            throughput_rounds=2,  # helper CPU is counted between the first and last
            side_rounds=1,
            memory_presets=("llama-tiny",),
            conv_nodes=2,
            conv_inner=2,
            conv_rounds=1,
            vocab=512,
            files=40,
            cuda_seconds=16.0,
            cuda_rounds=1,
        )
    return _Plan(pairs=1, seeds=1) if quick else _Plan(pairs=3, seeds=3)


_GPU_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


# ---- bare loops -------------------------------------------------------------------------


def _bare_worker(rank: int, overrides: list[str], steps: int, seconds: float, results: Any) -> None:
    """A plain loop: the model, AdamW, cross-entropy, clipping; nothing of a node's.
    ``steps`` untimed warm-up steps, then steps for ``seconds``."""
    import resource

    import torch.nn.functional as F
    from torch import nn

    from node.data.corpus import BatchStream, load_shards
    from node.train.bindings import bind
    from node.train.model import build_model, vocab_of

    cfg = bind(load_config(None, overrides))  # a preset takes the tokenizer's vocabulary
    torch.set_num_threads(cfg.run.threads or 1)
    corpus = load_shards(cfg.data.shards, cfg.model.context, vocab_of(cfg.model))
    model = build_model(cfg.model, seed=cfg.run.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.train.lr, betas=(0.9, 0.95), weight_decay=0.1
    )
    stream = BatchStream(corpus.train, cfg.data.batch_size, cfg.model.context, ("bare", rank))

    def step() -> int:
        inputs, targets = stream.next()
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        optimizer.step()
        return targets.numel()

    for _ in range(steps):
        step()
    tokens, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        tokens += step()
    elapsed = time.perf_counter() - started
    results.put(
        {
            "rank": rank,
            "tokens_per_second": tokens / elapsed if seconds > 0 else None,
            "params": sum(p.numel() for p in model.parameters()),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
    )


def _bare(overrides: list[str], ranks: int, steps: int, seconds: float) -> list[dict[str, Any]]:
    reports, codes = run_ranks(
        _bare_worker,
        [(overrides, steps, seconds)] * ranks,
        expected=ranks,
        timeout=900.0 + seconds,
        grace=20,
    )
    if len(reports) < ranks:
        raise RuntimeError(f"bare loop failed: exit codes {codes}")
    return sorted(reports, key=lambda r: r["rank"])


# ---- nodes --------------------------------------------------------------------------------


def _node_throughput(shards: pathlib.Path, plan: _Plan, where: pathlib.Path) -> dict[str, Any]:
    overrides = [
        *_TRAIN,
        *_NODE,
        f"data.shards={json.dumps(str(shards))}",
        "sync.trigger='seconds'",
        f"sync.round_seconds={plan.round_seconds:g}",
        "train.total_steps=100000",
    ]
    nodes = run_swarm(overrides, 2, plan.throughput_rounds, where)
    rates, helpers = [], []
    for n in nodes:
        st = n["status"]
        wall = st.get("busy_seconds", 0.0) + st.get("idle_seconds", 0.0)
        rates.append(st.get("tokens", 0) / wall if wall else None)
        helpers.append(_helper_share(n["rounds"]))
    return {
        "tokens_per_second": rates,
        "helper_cpu_share": helpers,
        "exit_codes": [n["exit_code"] for n in nodes],
        "busy_share": [
            n["status"].get("busy_seconds", 0.0)
            / max(1e-9, n["status"].get("busy_seconds", 0.0) + n["status"].get("idle_seconds", 0.0))
            for n in nodes
        ],
        "rounds": [len(n["rounds"]) for n in nodes],
    }


def _helper_share(rounds: list[dict]) -> float | None:
    """CPU seconds a node's p2pd, DHT process and sidecar took per second, between its
    first and last round events (from their ``load`` counters)."""
    if len(rounds) < 2:
        return None
    first, last = rounds[0], rounds[-1]

    def helpers(e: dict) -> float:
        load = e.get("load") or {}
        return (
            load.get("p2pd_cpu_s", 0.0)
            + load.get("dht", {}).get("cpu_s", 0.0)
            + load.get("control", {}).get("cpu_s", 0.0)
        )

    seconds = last["t"] - first["t"]
    return (helpers(last) - helpers(first)) / seconds if seconds > 0 else None


def _side_by_side(shards: pathlib.Path, plan: _Plan, work: pathlib.Path) -> dict[str, Any]:
    """One node with no peer and one bare loop at the same time, one core each."""
    import threading

    overrides = [
        *_TRAIN,
        *_NODE,
        f"data.shards={json.dumps(str(shards))}",
        "sync.trigger='seconds'",
        f"sync.round_seconds={plan.round_seconds:g}",
        "train.total_steps=100000",
        "network.min_peers=1",
    ]
    out: dict[str, Any] = {}
    where = work / "side-by-side"
    node = threading.Thread(
        target=lambda: out.update(nodes=run_swarm(overrides, 1, plan.side_rounds, where)),
        daemon=True,
    )
    node.start()
    time.sleep(plan.round_seconds / 2)  # the node is up and training
    bare_overrides = [*_TRAIN, f"data.shards={json.dumps(str(shards))}"]
    bare = _bare(bare_overrides, 1, 5, plan.round_seconds)
    node.join(timeout=600.0 + 240.0)
    st = out.get("nodes", [{}])[0].get("status", {})
    busy = st.get("busy_seconds", 0.0)
    node_rate = st.get("tokens", 0) / busy if busy else None
    bare_rate = bare[0]["tokens_per_second"]
    return {
        "node_tokens_per_busy_second": node_rate,
        "bare_tokens_per_second": bare_rate,
        "ratio": node_rate / bare_rate if node_rate and bare_rate else None,
    }


def _pair_ratios(bare_runs: list[list[float]], node_runs: list[dict]) -> list[float]:
    """Node over bare tokens/s of each pair of runs made one after the other (the
    machine's drift between pairs cancels out of these)."""
    out = []
    for bare, node in zip(bare_runs, node_runs):
        rates = [x for x in node["tokens_per_second"] if x]
        if bare and rates:
            out.append(statistics.fmean(rates) / statistics.fmean(bare))
    return out


def _throughput(shards: pathlib.Path, plan: _Plan, work: pathlib.Path) -> dict[str, Any]:
    bare_overrides = [*_TRAIN, f"data.shards={json.dumps(str(shards))}"]
    bare_runs, node_runs = [], []
    for i in range(plan.pairs):  # alternating, so drift in the machine's load hits both
        bare = _bare(bare_overrides, 2, steps=5, seconds=plan.bare_seconds)
        bare_runs.append([r["tokens_per_second"] for r in bare])
        node_runs.append(_node_throughput(shards, plan, work / f"throughput-{i}"))
    bare_median = statistics.median(x for run in bare_runs for x in run)
    node_values = [x for run in node_runs for x in run["tokens_per_second"] if x]
    node_median = statistics.median(node_values) if node_values else None
    ratio = node_median / bare_median if node_median else None
    pairs = _pair_ratios(bare_runs, node_runs)
    busy = [b for run in node_runs for b in run["busy_share"]]
    helpers = [h for run in node_runs for h in run["helper_cpu_share"] if h is not None]
    return {
        "preset": "llama-tiny",
        "threads_per_process": _THREADS,
        "round_seconds": plan.round_seconds,
        "bare_tokens_per_second": bare_runs,
        "node_runs": node_runs,
        "bare_median": bare_median,
        "node_median": node_median,
        "ratio": ratio,
        "pair_ratios": pairs,
        "pair_ratio_median": statistics.median(pairs) if pairs else None,
        "goal": 0.95,
        "meets_goal": ratio is not None and ratio >= 0.95,
        "outside_steps_share": 1.0 - statistics.median(busy) if busy else None,
        "helper_cores_share": statistics.median(helpers) if helpers else None,
        "side_by_side": _side_by_side(shards, plan, work),
    }


# ---- memory -------------------------------------------------------------------------------


def _memory(shards: pathlib.Path, plan: _Plan, work: pathlib.Path) -> dict[str, Any]:
    rows = []
    for preset in plan.memory_presets:
        overrides = [
            *_TRAIN,
            f"model.preset='{preset}'",
            "data.batch_size=4",
            f"data.shards={json.dumps(str(shards))}",
            "run.threads=2",
        ]
        bare = _bare(overrides, 1, steps=_MEMORY_STEPS, seconds=0.0)[0]
        node_overrides = [
            *overrides,
            *_NODE,
            "sync.fragments=8",
            "sync.trigger='steps'",
            f"sync.inner_steps={_MEMORY_STEPS}",
            "train.eval_batches=2",
        ]
        node = run_swarm(node_overrides, 1, 1, work / f"memory-{preset}")[0]
        params = bare["params"]
        last = node["rounds"][-1] if node["rounds"] else {}
        node_peak = last.get("host_peak_bytes_per_param", 0.0) * params
        rows.append(
            {
                "preset": preset,
                "params": params,
                "bare_peak_rss_bytes": bare["peak_rss_bytes"],
                "node_peak_rss_bytes": node_peak or None,
                "node_exit_code": node["exit_code"],
                "beyond_per_param": (node_peak - bare["peak_rss_bytes"]) / params
                if node_peak
                else None,
            }
        )
    ok = [r for r in rows if r["node_peak_rss_bytes"]]
    slope = intercept = None
    if len(ok) >= 2:
        xs = [r["params"] for r in ok]
        ys = [r["node_peak_rss_bytes"] - r["bare_peak_rss_bytes"] for r in ok]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        intercept = my - slope * mx
    return {
        "presets": rows,
        "beyond_bytes_per_param": slope,
        "fixed_bytes": intercept,
        "goal_bytes_per_param": 20.0,
        "meets_goal": slope is not None and slope <= 20.0,
        "not_run": {"llama-1b": "about 40 GB for a node and a bare loop; this machine has 24 GiB"},
    }


# ---- convergence --------------------------------------------------------------------------


def _convergence(shards: pathlib.Path, plan: _Plan, work: pathlib.Path) -> dict[str, Any]:
    inner, rounds, count = plan.conv_inner, plan.conv_rounds, plan.conv_nodes
    steps = inner * rounds
    entries = []
    for seed in range(plan.seeds):
        overrides = [
            *_TRAIN,
            f"data.shards={json.dumps(str(shards))}",
            f"run.seed={seed}",
            f"train.total_steps={steps}",
            "train.eval_batches=8",
        ]
        run = DdpRun(
            tuple(overrides), count, steps=steps, eval_at=(0, steps), shards=True, gloo_timeout=600
        )
        ddp = run_ddp(run, timeout=1800.0, grace=20)
        if "history" in ddp:
            ddp["val_bpb_start"] = ddp["history"][0]["val_bpb"]
            ddp["val_bpb_end"] = ddp["history"][-1]["val_bpb"]
        node_overrides = [*overrides, *_NODE, "sync.trigger='steps'", f"sync.inner_steps={inner}"]
        nodes = run_swarm(node_overrides, count, rounds, work / f"convergence-{seed}")
        finals = [n["rounds"][-1].get("val_bpb") for n in nodes if n["rounds"]]
        digests = {n["rounds"][-1].get("global_digest") for n in nodes if n["rounds"]}
        atoll = {
            "val_bpb_start": nodes[0]["status"].get("val_bpb_start"),
            "val_bpb_end": statistics.fmean(finals) if finals else None,
            "tokens": sum(n["status"].get("tokens", 0) for n in nodes),
            "bytes_sent_per_node": [n["status"].get("bytes_sent", 0) for n in nodes],
            "params_agree": len(digests) == 1,
            "exit_codes": [n["exit_code"] for n in nodes],
            "history": [
                {"round": r["round"], "val_bpb": r.get("val_bpb"), "tokens": r.get("tokens")}
                for r in nodes[0]["rounds"]
            ],
        }
        gap = None
        if atoll["val_bpb_end"] and ddp.get("val_bpb_end"):
            gap = 100.0 * (atoll["val_bpb_end"] / ddp["val_bpb_end"] - 1.0)
        entries.append({"seed": seed, "ddp": ddp, "atoll": atoll, "gap_percent": gap})
    gaps = [e["gap_percent"] for e in entries if e["gap_percent"] is not None]
    return {
        "nodes": count,
        "inner_steps": inner,
        "rounds": rounds,
        "entries": entries,
        "gap_percent_mean": statistics.fmean(gaps) if gaps else None,
    }


# ---- CUDA ---------------------------------------------------------------------------------


def _cuda(shards: pathlib.Path, plan: _Plan, work: pathlib.Path) -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device on this machine (none was lent for this run)"}
    return node_against_bare(shards, plan.cuda_seconds, plan.cuda_rounds, work / "cuda")


def peak_bf16_tflops(name: str) -> float | None:
    """The dense bf16 peak of a GPU named ``name`` (None for one not listed)."""
    return next((v for k, v in _GPU_BF16_TFLOPS.items() if k in name), None)


def node_against_bare(
    shards: pathlib.Path,
    seconds: float,
    rounds: int,
    where: pathlib.Path,
    model: tuple[str, ...] = ("model.arch='hf'", "model.preset='llama-150m'", "model.context=1024"),
    device: str = "cuda",
    precision: str = "bf16",
    batch: int = 16,
) -> dict[str, Any]:
    """One node (rounds of ``seconds / 2``) against a bare loop (``seconds`` timed) of
    ``model`` in ``precision`` on ``device``: tokens per second each, and MFU from ``6 *
    params`` FLOPs per token over the device's bf16 peak where it is known."""
    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else device
    peak = peak_bf16_tflops(name)
    overrides = [
        *model,
        f"data.batch_size={batch}",
        f"train.precision='{precision}'",
        f"run.device='{device}'",
        "run.threads=4",
        f"data.shards={json.dumps(str(shards))}",
    ]
    bare = _bare(overrides, 1, steps=5, seconds=seconds)[0]
    on_clock = ["sync.trigger='seconds'", f"sync.round_seconds={seconds / 2:g}"]
    node = run_swarm([*overrides, *_NODE, *on_clock], 1, rounds, where)[0]
    st = node["status"]
    wall = st.get("busy_seconds", 0.0) + st.get("idle_seconds", 0.0)
    node_rate = st.get("tokens", 0) / wall if wall else None

    def mfu(rate: float | None) -> float | None:
        return 6 * bare["params"] * rate / (peak * 1e12) if rate and peak else None

    return {
        "device": name,
        "precision": precision,
        "params": bare["params"],
        "bare_tokens_per_second": bare["tokens_per_second"],
        "node_tokens_per_second": node_rate,
        "node_exit_code": node["exit_code"],
        "ratio": node_rate / bare["tokens_per_second"] if node_rate else None,
        "bare_mfu": mfu(bare["tokens_per_second"]),
        "node_mfu": mfu(node_rate),
        "device_bytes_per_param": (node["rounds"][-1] if node["rounds"] else {}).get(
            "device_bytes_per_param"
        ),
    }


# ---- the run ------------------------------------------------------------------------------


def _prepare(work: pathlib.Path, plan: _Plan) -> tuple[pathlib.Path, dict[str, Any]]:
    return prepare_stdlib_shards(work / "shards", plan.vocab, plan.files)


def run(mode: Mode, out_dir: pathlib.Path) -> dict[str, Any]:
    """Throughput, memory, convergence and (with a GPU) CUDA; writes ``models.json`` and
    ``models.png`` into ``out_dir``. ``quick``: one pair of throughput runs and one seed;
    ``smoke``: the smallest sizes, a check that it runs (see the module docstring)."""
    plan = _plan(mode.quick, mode.smoke)
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = pathlib.Path(tempfile.mkdtemp(prefix="atoll-models-"))
    started = time.time()
    try:
        shards, corpus = _prepare(work, plan)
        report: dict[str, Any] = {
            "benchmark": "models",
            "quick": mode.quick,
            "smoke": mode.smoke,
            "machine": machine_info(),
            "corpus": corpus,
            "command": "python -m benchmarks models"
            + (" --quick" if mode.quick else "")
            + (" --smoke" if mode.smoke else ""),
        }
        report["throughput"] = _throughput(shards, plan, work)
        report["memory"] = _memory(shards, plan, work)
        report["convergence"] = _convergence(shards, plan, work)
        report["cuda"] = _cuda(shards, plan, work)
        report["seconds"] = time.time() - started
        report["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    (out_dir / "models.json").write_text(json.dumps(report, indent=2) + "\n")
    _plot(report, out_dir / "models.png")
    return report


def _plot(report: dict[str, Any], path: pathlib.Path) -> None:
    with figure(path, 1, 3, figsize=(15, 4.5), dpi=110) as (fig, (a, b, c)):
        t = report["throughput"]
        a.bar(
            ["bare loop", "Atoll node"],
            [t["bare_median"] or 0, t["node_median"] or 0],
            color=["#999", "#2a7"],
        )
        a.set_title(f"llama-tiny tokens/s per process (ratio {t['ratio'] or float('nan'):.3f})")
        m = report["memory"]["presets"]
        names = [r["preset"] for r in m]
        b.bar(names, [r["beyond_per_param"] or 0 for r in m], color="#27a")
        b.axhline(20, color="#a22", linestyle="--", label="goal: 20 B/param")
        slope = report["memory"]["beyond_bytes_per_param"]
        b.set_title(f"host bytes/param beyond a bare loop (slope {slope or float('nan'):.1f})")
        b.legend()
        for e in report["convergence"]["entries"]:
            hist = e["atoll"]["history"]
            c.plot(
                [h["tokens"] * report["convergence"]["nodes"] for h in hist],
                [h["val_bpb"] for h in hist],
                marker="o",
                label=f"{report['convergence']['nodes']} nodes, seed {e['seed']}",
            )
            if e["ddp"].get("val_bpb_end"):
                c.scatter(
                    [e["ddp"]["tokens"]],
                    [e["ddp"]["val_bpb_end"]],
                    marker="x",
                    s=80,
                    label=f"DDP end, seed {e['seed']}",
                )
        c.set_xlabel("tokens (all nodes)")
        c.set_ylabel("validation bits per byte")
        c.set_title(f"{report['convergence']['nodes']} nodes against DDP at equal tokens")
        c.legend()
