"""The GPU study: one script, at most eight minutes on one H200, for the first GPU machine
lent to this project.

1. **Node against a bare loop** (:func:`benchmarks.models.node_against_bare`):
   llama-150m in bf16, 1,024-token windows, a batch of 16; one Atoll node (wall-clock
   rounds, int8 syncs, evaluation and checkpoints: the whole daemon) against a plain
   loop of the same model, optimizer and batch. Tokens per second each, and MFU from
   ``6 * params`` FLOPs per token over the GPU's dense bf16 peak.
2. **Four DiLoCo replicas against DDP on one GPU**: :func:`node.ops.simulate.simulate` with
   four replicas, one after another on the one device (the islands recipe: ``H = 50``
   in five streamed fragments, int4 with stochastic rounding and error feedback, the
   outer step the sweep picked), against the data-parallel update of the same four
   ranks (one process whose batch is the four ranks' batches: DDP's averaged gradient
   of equal ranks is that batch's gradient). The model is the largest of
   :data:`_CANDIDATES` that reaches about :data:`_TOKENS_PER_PARAM` tokens per parameter
   in the time left, from a measured step time; both arms train the same tokens and are
   scored in bits per byte on the same validation windows.
3. **A torchrun site** (:mod:`benchmarks.cuda_site`): a site of two ranks on the GPU in
   bf16 and a CPU node train together for a few rounds.

The report names the GPU, torch's and CUDA's versions and each part's seconds. Without
CUDA it reports ``skipped`` and writes nothing, except with ``--smoke``, which runs
every part on the CPU at the smallest sizes (fp32, a 2-layer model, seconds-long
rounds; the site part needs CUDA and is skipped) so the code path is tested here.

On a GPU machine that has torch and none of this project's environment,
``dev/gpu-study.sh`` installs the other dependencies from a wheelhouse made here
(``make wheelhouse``) into a virtual environment that sees the machine's torch, and runs
``python -m benchmarks gpu --out DIR`` with the source on ``PYTHONPATH``. Writes
``gpu.json``.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import shutil
import tempfile
import time
from typing import Any

import torch

from benchmarks import cuda_site, islands, models
from benchmarks._common import machine_info, prepare_stdlib_shards
from benchmarks._mode import Mode

__all__ = ["run"]

_BUDGET_SECONDS = 480.0
_SITE_RESERVE_SECONDS = 120.0
"""What the site part is given at most; the replicas take what is left before it."""
_VOCAB = 8192
_CONTEXT = 256
_BATCH = 16
_EVAL_WINDOWS = 128
"""Validation windows both arms score (each in batches of its own size)."""
_RANKS = 4
_TOKENS_PER_PARAM = 20.0
_CANDIDATES = {
    "hidden 1024, 16 layers": (1024, 16, 16),
    "hidden 768, 12 layers": (768, 12, 12),
    "hidden 512, 8 layers": (512, 8, 8),
    "hidden 384, 6 layers": (384, 6, 6),
    "hidden 256, 4 layers": (256, 4, 4),
}
"""Llama shapes for the replicas, largest first: hidden size, layers, heads (MLP three
times the hidden size, two key/value heads fewer than the heads where they divide)."""
_SMOKE_SHAPE = {"hidden 64, 2 layers": (64, 2, 2)}


def _shape_file(work: pathlib.Path, name: str, shape: tuple[int, int, int]) -> pathlib.Path:
    hidden, layers, heads = shape
    preset = json.loads(
        (pathlib.Path(__file__).resolve().parents[1] / "node/presets/llama-tiny.json").read_text()
    )
    config = {
        **preset,
        "hidden_size": hidden,
        "intermediate_size": 3 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads // 2,
        "head_dim": hidden // heads,
        "vocab_size": _VOCAB,
    }
    path = work / f"{name.replace(' ', '-').replace(',', '')}.json"
    path.write_text(json.dumps(config))
    return path


def _overrides(
    shards: pathlib.Path,
    model: pathlib.Path,
    steps: int,
    device: str,
    precision: str,
    context: int = _CONTEXT,
) -> list[str]:
    return [
        "model.arch='hf'",
        f"model.hf_config={json.dumps(str(model))}",
        f"model.context={context}",
        f"data.shards={json.dumps(str(shards))}",
        f"run.device='{device}'",
        f"train.precision='{precision}'",
        "run.seed=0",
        "train.optimizer='adamw'",
        "train.lr=3e-3",
        f"train.warmup_steps={max(2, steps // 20)}",
        f"train.total_steps={steps}",
        "train.grad_clip=1.0",
    ]


def _batch(size: int, windows: int) -> list[str]:
    """A batch of ``size`` windows, scored on ``windows`` validation windows."""
    return [f"data.batch_size={size}", f"train.eval_batches={max(1, windows // size)}"]


def _simulate(overrides: list[str], replicas: int, rounds: int) -> dict[str, Any]:
    from node.config import load_config
    from node.ops.simulate import simulate

    result = simulate(load_config(None, overrides), replicas=replicas, rounds=rounds)
    return {
        "val_bpb_end": result["val_bpb_end"],
        "params": result["params"],
        "tokens": result["tokens"],
        "seconds": result["seconds"],
        "history": [{"round": h["round"], "val_bpb": h["val_bpb"]} for h in result["history"]],
    }


_DATA_PARALLEL = [
    "sync.trigger='steps'",
    "sync.fragments=1",
    "sync.tau=0",
    "sync.codec='none'",
    "outer.optimizer='sgd'",
    "outer.lr=1.0",
    "outer.momentum=0.0",
    "outer.momentum_warmup=0",
    "outer.lr_schedule='constant'",
]
"""One replica whose outer step applies its inner model as it is: plain training, the
reference the replicas are held to (scored every ``H`` steps, as they are)."""


def _step_seconds(
    shards: pathlib.Path, model: pathlib.Path, device: str, precision: str, batch: int, context: int
) -> float:
    """Seconds of one inner step of one replica, after two untimed ones."""
    from node.config import load_config
    from node.data.corpus import BatchStream, load_data
    from node.train.bindings import bind
    from node.train.model import build_model, vocab_of
    from node.train.trainer import InnerTrainer

    cfg = bind(load_config(None, _overrides(shards, model, 10, device, precision, context)))
    corpus = load_data(cfg.data, cfg.model.context, vocab_of(cfg.model))
    net = build_model(cfg.model, seed=0).to(device)
    trainer = InnerTrainer(
        net, cfg.train, BatchStream(corpus.train, batch, context, "probe"), device
    )
    for _ in range(2):
        trainer.step()
    _sync(device)
    started = time.perf_counter()
    for _ in range(4):
        trainer.step()
    _sync(device)
    return (time.perf_counter() - started) / 4


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _replicas(
    shards: pathlib.Path, work: pathlib.Path, seconds: float, device: str, smoke: bool
) -> dict[str, Any]:
    """The largest candidate that trains :data:`_TOKENS_PER_PARAM` tokens per parameter
    in both arms within ``seconds``, then DiLoCo against the data-parallel reference."""
    precision = "fp32" if smoke else "bf16"
    candidates = _SMOKE_SHAPE if smoke else _CANDIDATES
    batch, context, windows = (2, 32, 8) if smoke else (_BATCH, _CONTEXT, _EVAL_WINDOWS)
    probes: dict[str, Any] = {}
    chosen = None
    started = time.monotonic()
    for name, shape in candidates.items():
        path = _shape_file(work, name, shape)
        step = _step_seconds(shards, path, device, precision, batch, context)
        params = _params(path)
        # both arms: the replicas' steps, one after another, and the reference's, four
        # batches a step (about four times one replica's step)
        steps = max(1, round(_TOKENS_PER_PARAM * params / (_RANKS * batch * context)))
        need = 2 * _RANKS * steps * step
        left = seconds - (time.monotonic() - started)
        probes[name] = {"params": params, "step_seconds": step, "steps": steps, "need": need}
        if need <= 0.8 * left or smoke:
            chosen = name
            break
    if chosen is None:
        return {"skipped": "no candidate fits the time left", "probes": probes}
    h = 2 if smoke else islands.H
    steps = max(h, probes[chosen]["steps"] // h * h)
    if smoke:
        steps = 2 * h
    path = _shape_file(work, chosen, candidates[chosen])
    base = _overrides(shards, path, steps, device, precision, context)
    recipe = [*islands.RECIPE, f"sync.inner_steps={h}"]
    diloco = _simulate([*base, *recipe, *_batch(batch, windows)], _RANKS, steps // h)
    reference = _simulate(
        [*base, *_DATA_PARALLEL, f"sync.inner_steps={h}", *_batch(_RANKS * batch, windows)],
        1,
        steps // h,
    )
    gap = 100 * (diloco["val_bpb_end"] / reference["val_bpb_end"] - 1)
    return {
        "model": chosen,
        "params": probes[chosen]["params"],
        "steps": steps,
        "inner_steps": h,
        "tokens_per_param": _RANKS * batch * context * steps / probes[chosen]["params"],
        "precision": precision,
        "probes": probes,
        "diloco": diloco,
        "data_parallel": reference,
        "gap_percent": gap,
    }


def _params(path: pathlib.Path) -> int:
    from node.config import load_config
    from node.train.model import build_model

    cfg = load_config(None, ["model.arch='hf'", f"model.hf_config={json.dumps(str(path))}"])
    return sum(p.numel() for p in build_model(cfg.model, seed=0).parameters())


def _node_against_bare(
    shards: pathlib.Path, work: pathlib.Path, device: str, smoke: bool
) -> dict[str, Any]:
    """A node against a bare loop: ``llama-tiny`` for 16 s on ``device`` in a smoke run,
    otherwise the byte model for 60 s, three pairs."""
    if smoke:
        return models.node_against_bare(
            shards,
            16.0,
            1,
            work,
            model=("model.arch='hf'", "model.preset='llama-tiny'", "model.context=128"),
            device=device,
            precision="fp32",
            batch=2,
        )
    return models.node_against_bare(shards, 60.0, 3, work)


def _goals(throughput: dict[str, Any], started: float) -> dict[str, dict[str, Any]]:
    """The study's goals: the node's share of the bare loop's speed, and its time."""
    return {
        "node at 0.95 of the bare loop or more": {
            "value": throughput.get("ratio"),
            "goal": 0.95,
            "meets_goal": (throughput.get("ratio") or 0.0) >= 0.95,
        },
        f"the study within {_BUDGET_SECONDS:.0f} s": {
            "value": time.monotonic() - started,
            "goal": _BUDGET_SECONDS,
            "meets_goal": time.monotonic() - started <= _BUDGET_SECONDS,
        },
    }


def run(mode: Mode, out_dir: pathlib.Path) -> dict[str, Any]:
    """Every part on the GPU (``smoke``: on the CPU at the smallest sizes, the site part
    skipped); writes ``gpu.json``."""
    cuda = torch.cuda.is_available()
    if not cuda and not mode.smoke:
        return {"skipped": "no CUDA device on this machine"}
    device = "cuda" if cuda else "cpu"
    started = time.monotonic()
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = pathlib.Path(tempfile.mkdtemp(prefix="atoll-gpu-"))
    seconds: dict[str, float] = {}
    try:
        shards, corpus = prepare_stdlib_shards(
            work / "shards", 512 if mode.smoke else _VOCAB, 40 if mode.smoke else None
        )
        seconds["data"] = time.monotonic() - started
        mark = time.monotonic()
        throughput = _node_against_bare(shards, work / "node", device, mode.smoke)
        seconds["node_against_bare"] = time.monotonic() - mark
        mark = time.monotonic()
        left = _BUDGET_SECONDS - (mark - started) - _SITE_RESERVE_SECONDS
        replicas = _replicas(shards, work, max(30.0, left), device, mode.smoke)
        seconds["replicas"] = time.monotonic() - mark
        mark = time.monotonic()
        site = (
            cuda_site.run(Mode(quick=True, smoke=mode.smoke), work / "site")
            if cuda
            else {"skipped": "no CUDA device on this machine"}
        )
        seconds["cuda_site"] = time.monotonic() - mark
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {
        "benchmark": "gpu",
        "quick": mode.quick,
        "smoke": mode.smoke,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "gpus": torch.cuda.device_count() if cuda else 0,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "corpus": corpus,
        "node_against_bare": throughput,
        "replicas": replicas,
        "cuda_site": site,
        "goals": _goals(throughput, started),
        "seconds": seconds,
        "total_seconds": time.monotonic() - started,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
    }
    (out_dir / "gpu.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
