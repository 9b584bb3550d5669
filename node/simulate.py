"""Single-process DiLoCo reference: K replicas, pseudo-gradients averaged in memory.

This is the algorithm the networked node must match: every replica trains its own
copy on its own shard, each fragment syncs at its staggered point of the round, its
pseudo-gradient goes through the configured codec (with error feedback), the decoded
pseudo-gradients are averaged weighted by tokens, and every replica applies the same
outer step: ``sync.tau`` inner steps after the sync started (or at the round's end,
whichever comes first), merging the steps taken meanwhile as the node does
(:meth:`~node.outer.OuterOptimizer.merge_local`, with ``sync.alpha``). Each round's
score is the global copy's validation bits per byte.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from node.bindings import bind
from node.config import AtollConfig
from node.data import BatchStream, load_data, site_slice, validation_batches
from node.model import build_model, vocab_of
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
    cfg = bind(cfg)
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    device = resolve_device(cfg.run.device)
    corpus = load_data(cfg.data, cfg.model.context, vocab_of(cfg.model))
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
    val_batches = validation_batches(
        corpus.val, cfg.data.batch_size, cfg.model.context, cfg.train.eval_batches
    )
    schedule = sync_schedule(cfg.sync.inner_steps, len(plan))

    # What is scored is the global copy (the averaged model every replica agrees on, the
    # one a node evaluates and a user keeps), loaded into a model of its own.
    scored = build_model(cfg.model, seed=cfg.run.seed).to(device)

    def score() -> float:
        outers[0].write_globals(scored)
        return evaluate(scored, val_batches, device, corpus.bytes_per_token)

    start = time.perf_counter()
    bpb_start = score()
    history: list[dict[str, Any]] = [{"round": 0, "val_bpb": bpb_start, "tokens": 0}]
    payload_bytes = 0
    if progress:
        progress(dict(history[0], seconds=0.0, loss=float("nan")))
    tau, alpha = cfg.sync.tau, cfg.sync.alpha
    for r in range(1, rounds + 1):
        round_tokens = [0] * replicas
        losses = []
        # (step launched, fragment, averaged pseudo-gradient, local copies it came from)
        pending: list[tuple[int, int, torch.Tensor, list[torch.Tensor]]] = []
        for step in range(1, cfg.sync.inner_steps + 1):
            for i, trainer in enumerate(trainers):
                result = trainer.step()
                round_tokens[i] += result.tokens
                losses.append(result.loss)
            for f in schedule.get(step, []):
                decoded, sent_from = [], []
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
                    if tau or alpha:
                        sent_from.append(outers[i].local_vector(model, f))
                avg = weighted_mean(decoded, [float(t) for t in round_tokens])
                pending.append((step, f, avg.to(device), sent_from))
            due = [p for p in pending if step - p[0] >= tau or step == cfg.sync.inner_steps]
            for p in due:  # a round ends with every sync applied, as on a node
                pending.remove(p)
                _, f, avg, sent_from = p
                for i, model in enumerate(models):
                    if sent_from:
                        outers[i].step(f, avg, r)
                        outers[i].merge_local(model, f, alpha, sent_from[i])
                    else:
                        outers[i].apply(model, f, avg, r)
        bpb = score()
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
