"""The benchmarks' data-parallel baseline: PyTorch DDP over gloo, one spawned process per
rank, each training on a stream of its own with the node's inner optimizer and learning
rate schedule, for a fixed number of steps.

Rank 0 evaluates at the steps a run names (0: before the first step) and reports for
all; the others wait for it in the next all-reduce. :mod:`benchmarks.convergence` (the
byte corpus) and :mod:`benchmarks.models` (BPE shards) compare Atoll against it; the
timed variant that trains for wall-clock seconds with slowed ranks and emulated links is
:func:`benchmarks._timed_ddp.run_timed_ddp`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks._common import free_port, gloo_group, params_digest, run_ranks

__all__ = ["DdpRun", "run_ddp"]


@dataclass(frozen=True)
class DdpRun:
    """One DDP baseline.

    Attributes:
        overrides: the config's ``--set`` overrides (model, data, train, seed).
        steps: optimizer steps per rank.
        workers: ranks.
        eval_at: the steps after which rank 0 evaluates (0: before training).
        shards: train on ``data.shards`` (BPE, bits per byte through the shards' bytes
            per token, the config bound to its digests) rather than the byte corpus.
        seeded_streams: key each rank's stream by ``(run.seed, rank)`` rather than
            ``("ddp", rank)``.
        gloo_timeout: seconds a collective may wait.
    """

    overrides: tuple[str, ...]
    steps: int
    workers: int
    eval_at: tuple[int, ...]
    shards: bool = False
    seeded_streams: bool = False
    gloo_timeout: float = 300.0


def run_ddp(run: DdpRun, timeout: float, grace: float = 30.0) -> dict[str, Any]:
    """Rank 0's report: ``params``, ``history`` (``step``, ``tokens``, ``val_bpb``,
    ``seconds`` at each evaluation), ``params_agree``, ``seconds`` and ``tokens`` (every
    rank's); ``{"error": ...}`` when it reported nothing. Every rank is joined,
    terminated or killed."""
    port = free_port()
    reports, codes = run_ranks(
        _worker, [(port, run)] * run.workers, expected=1, timeout=timeout, grace=grace
    )
    if not reports:
        return {"error": f"rank 0 reported nothing; exit codes {codes}"}
    return reports[0]


def _worker(rank: int, port: int, run: DdpRun, results: Any) -> None:
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from node.config import load_config
    from node.data.corpus import BatchStream, load_corpus, load_shards, validation_batches
    from node.train.bindings import bind
    from node.train.model import build_model, vocab_of
    from node.train.trainer import evaluate, lr_at, make_inner_optimizer

    torch.set_num_threads(1)
    cfg = load_config(None, list(run.overrides))
    if run.shards:
        cfg = bind(cfg)
    with gloo_group(port, rank, run.workers, timeout_s=run.gloo_timeout) as dist:
        if run.shards:
            corpus = load_shards(cfg.data.shards, cfg.model.context, vocab_of(cfg.model))
            per_token = {"bytes_per_token": corpus.bytes_per_token}
        else:
            corpus, per_token = load_corpus(cfg.data, cfg.model.context), {}
        model = build_model(cfg.model, seed=cfg.run.seed)
        ddp = DistributedDataParallel(model)
        optimizer = make_inner_optimizer(model, cfg.train)
        key = (cfg.run.seed, rank) if run.seeded_streams else ("ddp", rank)
        stream = BatchStream(corpus.train, cfg.data.batch_size, cfg.model.context, key)
        val = validation_batches(
            corpus.val, cfg.data.batch_size, cfg.model.context, cfg.train.eval_batches
        )
        params = sum(p.numel() for p in model.parameters())
        tokens_per_step = cfg.data.batch_size * cfg.model.context
        history: list[dict[str, Any]] = []
        started = time.monotonic()

        def record(step: int) -> None:
            if rank == 0 and step in run.eval_at:
                history.append(
                    {
                        "step": step,
                        "tokens": step * tokens_per_step,
                        "val_bpb": evaluate(model, val, **per_token),
                        "seconds": time.monotonic() - started,
                    }
                )

        record(0)
        for step in range(run.steps):
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
            record(step + 1)
        digests: list[Any] = [None] * run.workers
        dist.all_gather_object(digests, params_digest(model))
        if rank == 0:
            results.put(
                {
                    "params": params,
                    "history": history,
                    "params_agree": len(set(digests)) == 1,
                    "seconds": time.monotonic() - started,
                    "tokens": run.steps * tokens_per_step * run.workers,
                }
            )
