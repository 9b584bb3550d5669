"""Single-process DiLoCo reference: K replicas, pseudo-gradients averaged in memory.

This is the algorithm the networked node must match: every replica trains its own
copy on its own shard, each fragment syncs at its staggered point of the round, its
pseudo-gradient goes through the configured codec (with error feedback), the decoded
pseudo-gradients are averaged weighted by tokens, and every replica applies the same
outer step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from node.config import AtollConfig
from node.data import BatchStream, load_data, site_slice
from node.model import build_model
from node.outer import OuterOptimizer, sync_schedule
from node.trainer import InnerTrainer, evaluate
from protocol.averaging.fragments import plan_fragments
from protocol.wire import codec as codecs

__all__ = ["resolve_device", "simulate", "weighted_mean"]


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when present, else CPU; ``cuda:N`` must name a device present.

    Raises:
        ValueError: CUDA asked for where there is none, or fewer devices than ``N + 1``.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ValueError(f"config error: run.device = {name!r} but no CUDA device is available")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ValueError(
            f"config error: run.device = {name!r} but this machine has {count} CUDA "
            f"device(s): cuda:0 to cuda:{count - 1}"
        )
    return device


def weighted_mean(vectors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """Mean of ``vectors`` weighted by ``weights`` (need not sum to one)."""
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("weights must have a positive sum")
    out = torch.zeros_like(vectors[0])
    for v, w in zip(vectors, weights):
        out.add_(v, alpha=w / total)
    return out


def simulate(
    cfg: AtollConfig,
    replicas: int,
    rounds: int,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Train ``replicas`` DiLoCo replicas for ``rounds`` rounds of ``sync.inner_steps`` steps.

    Returns:
        A summary with ``replicas``, ``rounds``, ``val_bpb_start``, ``val_bpb_end``,
        the per-round ``history`` and ``payload_bytes_per_replica``.
    """
    if replicas < 1 or rounds < 1:
        raise ValueError("replicas and rounds must be >= 1")
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    device = resolve_device(cfg.run.device)
    corpus = load_data(cfg.data, cfg.model.context, cfg.model.vocab_size)
    train = site_slice(corpus.train, cfg.data.site, cfg.data.sites, cfg.model.context)
    base = build_model(cfg.model, seed=cfg.run.seed).to(device)
    models = [build_model(cfg.model, seed=cfg.run.seed).to(device) for _ in range(replicas)]
    plan = plan_fragments(base, cfg.sync.fragments)
    outers = [OuterOptimizer(m, plan, cfg.outer) for m in models]
    trainers = [
        InnerTrainer(
            m,
            cfg.train,
            BatchStream(train, cfg.data.batch_size, cfg.model.context, (cfg.run.seed, i)),
            device,
        )
        for i, m in enumerate(models)
    ]
    feedback = [
        [
            codecs.ErrorFeedback(
                cfg.sync.codec,
                block_size=cfg.sync.block_size,
                stochastic=cfg.sync.stochastic_rounding,
                generator=torch.Generator().manual_seed(cfg.run.seed * 1000 + i * 31 + f),
            )
            for f in range(len(plan))
        ]
        for i in range(replicas)
    ]
    val_batches = BatchStream(
        corpus.val, cfg.data.batch_size, cfg.model.context, "validation"
    ).fixed_batches(cfg.train.eval_batches)
    schedule = sync_schedule(cfg.sync.inner_steps, len(plan))

    start = time.perf_counter()
    bpb_start = evaluate(models[0], val_batches, device)
    history: list[dict[str, Any]] = [{"round": 0, "val_bpb": bpb_start, "tokens": 0}]
    payload_bytes = 0
    if progress:
        progress(dict(history[0], seconds=0.0, loss=float("nan")))
    for r in range(1, rounds + 1):
        round_tokens = [0] * replicas
        losses = []
        for step in range(1, cfg.sync.inner_steps + 1):
            for i, trainer in enumerate(trainers):
                result = trainer.step()
                round_tokens[i] += result.tokens
                losses.append(result.loss)
            for f in schedule.get(step, []):
                decoded = []
                for i, model in enumerate(models):
                    pg = outers[i].pseudo_gradient(model, f)
                    enc = (
                        feedback[i][f].encode(pg)
                        if cfg.sync.error_feedback
                        else codecs.encode(pg, cfg.sync.codec, block_size=cfg.sync.block_size)
                    )
                    if i == 0:
                        payload_bytes += len(enc.payload)
                    decoded.append(codecs.decode(enc, expected_numel=pg.numel()))
                avg = weighted_mean(decoded, [float(t) for t in round_tokens])
                for i, model in enumerate(models):
                    outers[i].apply(model, f, avg.to(device), r)
        bpb = evaluate(models[0], val_batches, device)
        entry = {
            "round": r,
            "val_bpb": bpb,
            "tokens": sum(t.tokens for t in trainers),
            "loss": sum(losses) / len(losses),
            "seconds": time.perf_counter() - start,
        }
        history.append(entry)
        if progress:
            progress(entry)
    return {
        "replicas": replicas,
        "rounds": rounds,
        "inner_steps": cfg.sync.inner_steps,
        "fragments": len(plan),
        "codec": cfg.sync.codec,
        "params": plan.numel,
        "val_bpb_start": bpb_start,
        "val_bpb_end": history[-1]["val_bpb"],
        "tokens": history[-1]["tokens"],
        "payload_bytes_per_replica": payload_bytes,
        "seconds": time.perf_counter() - start,
        "history": history,
        "device": str(device),
    }
