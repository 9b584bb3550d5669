"""Convergence benchmark: Atoll's DiLoCo against PyTorch DDP, bits per byte and bytes sent.

Four workers train the same model on the same data for the same number of steps each
(so the same tokens per worker), with the same AdamW inner optimizer and warmup +
cosine schedule (``node.trainer.lr_at``, ``make_inner_optimizer``); worker ``i`` reads
the batch stream ``(seed, i)`` in both methods, so they see the very same batches.

- ``ddp``: four spawned processes, ``torch.distributed`` gloo on 127.0.0.1,
  ``DistributedDataParallel`` with an fp32 gradient all-reduce every step. A ring
  all-reduce sends ``2 * (n - 1) / n`` of the gradient per worker, so each worker sends
  ``steps * params * 4 * 2 * 3 / 4`` bytes.
- ``atoll``: ``node.simulate.simulate``, the single-process reference of the networked
  node's algorithm (fragments, codec with error feedback, token-weighted averaging,
  Nesterov outer step), in ``steps`` mode with ``H`` inner steps per round and
  ``steps / H`` rounds, for each ``H`` and codec. One replica's encoded
  pseudo-gradients are ``payload_bytes_per_replica``; the butterfly all-reduce sends
  about ``2 * (n - 1) / n`` of that per worker (its part to each other member, then the
  reduced parts back), so ``bytes_sent_per_worker = payload * 2 * 3 / 4``.

Everything runs on the CPU. The target is a final validation bits per byte within 1 %
of DDP's with at least 1000x fewer bytes sent per worker; each run says whether it
meets it. Each H is also run at int8 with other settings (:data:`_VARIANTS`): outer
ones, since DiLoCo's defaults are tuned for far more outer steps than a short run has,
and the other inner optimizers (Muon, SOAP) at the same lr and tokens. Quick mode (2 to 10 minutes on two cores) uses a 1-layer, 64-wide
model and 500 steps per worker; full mode the default reference model and 3000 steps
(hours on two cores); ``--steps N`` changes the length of either. Run it with
``python -m benchmarks convergence [--quick] [--steps N]``; it writes
``convergence.json`` and ``convergence.png`` into the output folder.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import sys
import time
from typing import Any

import torch

from benchmarks._common import free_port, gloo_group, machine_info, params_digest, run_ranks
from node.config import load_config

__all__ = ["run", "steps_problem"]

_WORKERS = 4
_RING_SHARE = (
    2 * (_WORKERS - 1) / _WORKERS
)  # share of a vector one worker sends in a ring/butterfly all-reduce
_FP32_BYTES = 4
_TARGET_GAP_PERCENT = 1.0
_TARGET_BYTES_RATIO = 1000.0
_INNER_STEPS = (50, 100, 250)
_CODECS = ("none", "int8", "int4")
# Settings tried besides the config's, each at every H with int8: outer-optimizer ones
# (DiLoCo's Nesterov, lr 0.7, momentum 0.9, is tuned for runs of hundreds of outer steps;
# a short run has only 2-10, where momentum 0.9 overshoots), and the other inner
# optimizers at the same lr and tokens.
_VARIANTS: dict[str, tuple[str, ...]] = {
    "nesterov lr 0.7 momentum 0.5": ("outer.momentum=0.5",),
    "plain averaging (sgd lr 1)": ("outer.optimizer='sgd'", "outer.lr=1.0", "outer.momentum=0.0"),
    "outer momentum warm-up over 3 rounds": ("outer.momentum_warmup=3",),
    "inner Muon": ("train.optimizer='muon'",),
    "inner SOAP": ("train.optimizer='soap'",),
}
_VARIANT_CODEC = "int8"
_EVAL_EVERY = min(_INNER_STEPS)  # DDP is evaluated as often as the most frequent Atoll round
# The integration tests' small model (tests/integration/conftest.py), copied because the
# benchmarks must not depend on the test suite.
_QUICK_MODEL = [
    "model.n_layer=1",
    "model.n_embd=64",
    "model.context=64",
    "data.batch_size=8",
    "data.max_files=300",
]
_QUICK_STEPS = 500
_FULL_STEPS = 3000
# Quick mode runs every (H, codec) pair; list pairs here to leave out if it must get faster.
_QUICK_SKIP: tuple[tuple[int, str], ...] = ()
# The quick model has 87k parameters: a second intra-op thread buys little, and on a
# shared box an oversubscribed OpenMP pool made steps 10-20x slower when measured here.
_SIM_THREADS = {True: 1, False: 2}


def _overrides(quick: bool, steps: int) -> list[str]:
    return [
        "run.run_id='bench-convergence'",
        "run.device='cpu'",  # DDP runs on gloo/CPU; both methods on the same device
        f"train.total_steps={steps}",
        *(_QUICK_MODEL if quick else []),
    ]


# ---- DDP, one rank per spawned process ------------------------------------------------


def _ddp_worker(
    rank: int, port: int, overrides: list[str], steps: int, eval_every: int, results: Any
) -> None:
    """One DDP rank: ``steps`` steps on its own stream; rank 0 evaluates and reports."""
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from node.data import BatchStream, load_corpus
    from node.model import build_model
    from node.trainer import evaluate, lr_at, make_inner_optimizer

    torch.set_num_threads(1)
    cfg = load_config(None, overrides)
    with gloo_group(port, rank, _WORKERS, timeout_s=300) as dist:
        corpus = load_corpus(cfg.data, cfg.model.context)
        model = build_model(cfg.model, seed=cfg.run.seed)
        ddp = DistributedDataParallel(model)
        optimizer = make_inner_optimizer(model, cfg.train)
        stream = BatchStream(
            corpus.train, cfg.data.batch_size, cfg.model.context, (cfg.run.seed, rank)
        )
        val = BatchStream(
            corpus.val, cfg.data.batch_size, cfg.model.context, "validation"
        ).fixed_batches(cfg.train.eval_batches)
        params = sum(p.numel() for p in model.parameters())
        tokens_per_step = cfg.data.batch_size * cfg.model.context
        history: list[dict[str, Any]] = []
        started = time.monotonic()

        def record(step: int) -> None:
            # Only rank 0 evaluates; the others wait for it in the next all-reduce.
            if rank == 0:
                history.append(
                    {
                        "step": step,
                        "tokens": step * tokens_per_step,
                        "bytes_sent": step * params * _FP32_BYTES * _RING_SHARE,
                        "val_bpb": evaluate(model, val),
                        "seconds": time.monotonic() - started,
                    }
                )

        record(0)
        for step in range(steps):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, cfg.train)
            inputs, targets = stream.next()
            logits = ddp(inputs)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP averages the gradients across ranks here
            if cfg.train.grad_clip > 0:
                nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
            optimizer.step()
            if (step + 1) % eval_every == 0 or step + 1 == steps:
                record(step + 1)
        digests: list[Any] = [None] * _WORKERS
        dist.all_gather_object(digests, params_digest(model))
        if rank == 0:
            results.put(
                {
                    "params": params,
                    "history": history,
                    "params_agree": len(set(digests)) == 1,
                    "seconds": time.monotonic() - started,
                }
            )


def _run_ddp(overrides: list[str], steps: int, timeout: float) -> dict[str, Any]:
    """Four DDP ranks as spawned processes; always joined, terminated or killed."""
    port = free_port()
    reports, exit_codes = run_ranks(
        _ddp_worker,
        [(port, overrides, steps, _EVAL_EVERY)] * _WORKERS,
        expected=1,  # rank 0 reports for all
        timeout=timeout,
        grace=30,
    )
    report = reports[0] if reports else None
    if report is None:
        return {"error": f"rank 0 reported nothing; exit codes {exit_codes}"}
    report["val_bpb_end"] = report["history"][-1]["val_bpb"]
    report["bytes_sent_per_worker"] = report["history"][-1]["bytes_sent"]
    return report


# ---- Atoll, through the single-process reference --------------------------------------


def _run_atoll(
    overrides: list[str],
    steps: int,
    inner_steps: int,
    codec: str,
    threads: int,
    outer: str | None = None,
) -> dict[str, Any]:
    """One simulated DiLoCo run of ``steps / inner_steps`` rounds with 4 replicas.

    ``outer`` names an entry of :data:`_VARIANTS`; None keeps the config's.
    """
    from node.simulate import simulate

    rounds = steps // inner_steps
    cfg = load_config(
        None,
        [
            *overrides,
            f"run.threads={threads}",
            "sync.trigger='steps'",
            f"sync.inner_steps={inner_steps}",
            f"sync.codec='{codec}'",
            *(_VARIANTS[outer] if outer else ()),
        ],
    )
    label = f"H={inner_steps} {codec}" + (f", {outer}" if outer else "")

    def progress(entry: dict[str, Any]) -> None:
        # A run takes about a minute even in quick mode: show that it moves.
        print(
            f"convergence atoll {label}: round {entry['round']}/{rounds} "
            f"val_bpb {entry['val_bpb']:.4f} {entry['seconds']:.0f}s",
            file=sys.stderr,
            flush=True,
        )

    result = simulate(cfg, replicas=_WORKERS, rounds=rounds, progress=progress)
    bytes_per_round = result["payload_bytes_per_replica"] / rounds * _RING_SHARE
    # Every codec's encoded size depends only on the element count, so every round
    # sends the same bytes.
    history = [
        {
            "round": h["round"],
            "step": h["round"] * inner_steps,
            "tokens": h["tokens"] // _WORKERS,
            "bytes_sent": h["round"] * bytes_per_round,
            "val_bpb": h["val_bpb"],
            "seconds": h.get("seconds", 0.0),
        }
        for h in result["history"]
    ]
    return {
        "label": label,
        "inner_steps": inner_steps,
        "codec": codec,
        "outer": cfg.to_dict()["outer"],
        "rounds": rounds,
        "fragments": result["fragments"],
        "params": result["params"],
        "val_bpb_end": result["val_bpb_end"],
        "payload_bytes_per_replica": result["payload_bytes_per_replica"],
        "bytes_sent_per_worker": result["payload_bytes_per_replica"] * _RING_SHARE,
        "seconds": result["seconds"],
        "history": history,
    }


def _judge(atoll: dict[str, Any], ddp: dict[str, Any]) -> None:
    """Adds the gap and bytes ratio to DDP, and whether the target is met."""
    if "error" in ddp:
        return
    gap = 100.0 * (atoll["val_bpb_end"] - ddp["val_bpb_end"]) / ddp["val_bpb_end"]
    ratio = ddp["bytes_sent_per_worker"] / atoll["bytes_sent_per_worker"]
    atoll["gap_to_ddp_percent"] = gap
    atoll["bytes_ratio_ddp_over_atoll"] = ratio
    atoll["meets_bpb_target"] = gap <= _TARGET_GAP_PERCENT
    atoll["meets_bytes_target"] = ratio >= _TARGET_BYTES_RATIO
    atoll["meets_target"] = atoll["meets_bpb_target"] and atoll["meets_bytes_target"]


# ---- report ---------------------------------------------------------------------------


def _plot(report: dict[str, Any], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(18, 5))
    by_tokens = fig.add_subplot(1, 3, 1)
    by_bytes = fig.add_subplot(1, 3, 2, sharey=by_tokens)
    by_outer = fig.add_subplot(1, 3, 3)
    colors = {h: c for h, c in zip(_INNER_STEPS, ("tab:blue", "tab:orange", "tab:green"))}
    styles = {"none": "-", "int8": "--", "int4": ":"}
    lines = []
    if "history" in report["ddp"]:
        lines.append(("DDP (fp32, every step)", report["ddp"]["history"], "black", "-"))
    for r in report["atoll"]:
        lines.append(
            (f"Atoll {r['label']}", r["history"], colors[r["inner_steps"]], styles[r["codec"]])
        )
    for label, history, color, style in lines:
        kw = {"color": color, "linestyle": style, "linewidth": 1.4, "label": label}
        by_tokens.plot([h["tokens"] for h in history], [h["val_bpb"] for h in history], **kw)
        # log x: the start, before anything was sent, has no place on it
        sent = [h for h in history if h["bytes_sent"] > 0]
        by_bytes.plot([h["bytes_sent"] for h in sent], [h["val_bpb"] for h in sent], **kw)
    by_tokens.set_xlabel("tokens per worker")
    by_tokens.set_ylabel("validation bits per byte")
    by_bytes.set_xlabel("bytes sent per worker (log)")
    by_bytes.set_xscale("log")
    for ax in (by_tokens, by_bytes):
        ax.grid(True, alpha=0.3)
    by_bytes.legend(fontsize=7, ncol=2)
    # The first steps fall from 8 bits per byte; zoom on where the methods end up.
    ends = [history[-1]["val_bpb"] for _, history, _, _ in lines if history]
    if ends:
        by_tokens.set_ylim(min(ends) - 0.1, max(ends) + 1.0)
    _plot_outer(report, by_outer)
    fig.suptitle(
        f"{_WORKERS} workers, {report['total_steps']} steps each "
        f"({report['params']:,} parameters, {'quick' if report['quick'] else 'full'} mode)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_outer(report: dict[str, Any], ax: Any) -> None:
    """Grouped bars: final gap to DDP per H for each setting (int8)."""
    runs = [r for r in report["atoll"] if r["codec"] == _VARIANT_CODEC]
    runs += report.get("variants", [])
    settings = ["config default (nesterov lr 0.7 momentum 0.9)", *_VARIANTS]
    width = 0.8 / len(settings)
    for i, setting in enumerate(settings):
        xs, gaps = [], []
        for j, h in enumerate(_INNER_STEPS):
            for r in runs:
                name = r.get("variant") or settings[0]
                if r["inner_steps"] == h and name == setting and "gap_to_ddp_percent" in r:
                    xs.append(j + (i - (len(settings) - 1) / 2) * width)
                    gaps.append(r["gap_to_ddp_percent"])
        ax.bar(xs, gaps, width, label=setting)
    ax.axhline(_TARGET_GAP_PERCENT, color="black", linewidth=1, linestyle="--", label="target")
    ax.set_xticks(range(len(_INNER_STEPS)), [f"H={h}" for h in _INNER_STEPS])
    ax.set_ylabel(f"final bits/byte above DDP (%), {_VARIANT_CODEC}")
    ax.set_title("outer settings and inner optimizers", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)


def steps_problem(steps: int) -> str | None:
    """Why ``steps`` cannot be a run's length (every H must run whole rounds), or None."""
    if steps < 1 or any(steps % h for h in _INNER_STEPS):
        return (
            f"steps = {steps}: expected a positive multiple of "
            f"{', '.join(map(str, _INNER_STEPS))} (every H runs whole rounds)"
        )
    return None


def run(quick: bool, out_dir: pathlib.Path, steps: int | None = None) -> dict:
    """Trains DDP and every Atoll variant, then writes the report and the plot.

    Args:
        quick: a 1-layer, 64-wide model and 500 steps per worker (2 to 10 minutes on
            two shared cores); otherwise the default reference model and 3000 steps (hours).
        out_dir: folder for ``convergence.json`` and ``convergence.png``; created if missing.
        steps: steps per worker instead of the mode's default; a multiple of every H.

    Returns:
        The dict written to ``convergence.json``: ``ddp`` (val_bpb_end,
        bytes_sent_per_worker, history), ``atoll`` (one entry per ``H`` and codec with
        val_bpb_end, bytes_sent_per_worker, bytes_ratio_ddp_over_atoll,
        gap_to_ddp_percent, meets_target and history), ``variants`` (the same at
        int8 for each other outer-optimizer setting), ``target``, ``notes``, ``quick``,
        ``date`` and ``machine``.

    Raises:
        ValueError: ``steps`` is not a positive multiple of every H.
    """
    if steps is None:
        steps = _QUICK_STEPS if quick else _FULL_STEPS
    problem = steps_problem(steps)
    if problem:
        raise ValueError(problem)
    overrides = _overrides(quick, steps)
    cfg = load_config(None, overrides)
    started = time.monotonic()
    threads_before = torch.get_num_threads()
    try:
        ddp = _run_ddp(overrides, steps, timeout=300.0 + steps * (1.0 if quick else 10.0))
        print(
            f"convergence ddp: val_bpb {ddp.get('val_bpb_end', float('nan')):.4f} "
            f"{ddp.get('seconds', 0.0):.0f}s"
            + (f"  ERROR {ddp['error']}" if "error" in ddp else ""),
            file=sys.stderr,
            flush=True,
        )
        skipped = list(_QUICK_SKIP) if quick else []
        atoll = []
        for inner_steps in _INNER_STEPS:
            for codec in _CODECS:
                if (inner_steps, codec) in skipped:
                    continue
                result = _run_atoll(overrides, steps, inner_steps, codec, _SIM_THREADS[quick])
                _judge(result, ddp)
                atoll.append(result)
        variants = []
        for inner_steps in _INNER_STEPS:
            for outer in _VARIANTS:
                result = _run_atoll(
                    overrides, steps, inner_steps, _VARIANT_CODEC, _SIM_THREADS[quick], outer
                )
                result["variant"] = outer
                _judge(result, ddp)
                variants.append(result)
    finally:
        torch.set_num_threads(threads_before)
    report = {
        "benchmark": "convergence",
        "quick": quick,
        "workers": _WORKERS,
        "total_steps": steps,
        "tokens_per_worker": steps * cfg.data.batch_size * cfg.model.context,
        "params": atoll[0]["params"] if atoll else ddp.get("params"),
        "model": cfg.to_dict()["model"],
        "data": {"batch_size": cfg.data.batch_size, "max_files": cfg.data.max_files},
        "train": cfg.to_dict()["train"],
        "outer": cfg.to_dict()["outer"],
        "overrides": overrides,
        "target": {
            "max_gap_percent": _TARGET_GAP_PERCENT,
            "min_bytes_ratio": _TARGET_BYTES_RATIO,
            "text": "final validation bits per byte within 1 % of DDP's, with at least "
            "1000x fewer bytes sent per worker than DDP",
        },
        "ddp": ddp,
        "atoll": atoll,
        "variants": variants,
        "skipped": [f"H={h} {c}" for h, c in skipped],
        "runs_meeting_target": [r["label"] for r in atoll + variants if r.get("meets_target")],
        "seconds": round(time.monotonic() - started, 1),
        "notes": {
            "ddp_bytes": f"steps * params * 4 * 2*({_WORKERS}-1)/{_WORKERS}: fp32 gradients, "
            "ring all-reduce (each worker sends 2(n-1)/n of the vector per step)",
            "atoll_bytes": f"payload_bytes_per_replica * 2*({_WORKERS}-1)/{_WORKERS}: one "
            "replica's encoded pseudo-gradients over all rounds (codec payload only, no "
            "message headers or signatures), times the share a butterfly all-reduce "
            "member sends; an estimate, not a measurement on the wire",
            "atoll_method": "node.simulate.simulate, the single-process reference of the "
            "networked node's algorithm, steps mode, rounds = total_steps / H",
            "gap_to_ddp_percent": "100 * (atoll val_bpb_end - ddp val_bpb_end) / ddp "
            "val_bpb_end; negative means Atoll ended lower than DDP",
            "data": "worker i reads BatchStream(train, batch, context, (seed, i)) in both "
            "methods; validation is the same fixed batches for every method",
            "threads": f"DDP: 1 per process; simulate: {_SIM_THREADS[quick]}",
            "variants": "the same runs at int8 with other outer-optimizer settings or inner optimizers "
            "(overrides in each entry's outer); the main grid uses the config's",
        },
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
    }
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "convergence.json").write_text(json.dumps(report, indent=2) + "\n")
    _plot(report, out_dir / "convergence.png")
    return report
