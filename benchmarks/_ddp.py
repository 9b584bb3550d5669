"""The benchmarks' data-parallel baseline: PyTorch DDP over gloo, one rank per process,
each training on a stream of its own with the node's inner optimizer and learning rate
schedule, either for a fixed number of steps or for wall-clock seconds.

One rank function, :func:`ddp_rank`, serves both front ends:

- :func:`run_ddp` (a plan with ``steps``): rank 0 evaluates at the steps the plan names
  (0: before the first step) and reports for all; the others wait for it in the next
  all-reduce. :mod:`benchmarks.convergence` (the byte corpus), :mod:`benchmarks.models`
  and :mod:`benchmarks.islands` (BPE shards) compare Atoll against it.
- :func:`run_timed_ddp` (a plan with ``seconds``): after warm-up steps and a barrier
  every rank trains for the seconds, optionally slowed or behind an emulated link
  (:mod:`benchmarks._ddp_links`), and reports its busy and idle time.
  :mod:`benchmarks.stragglers` and :mod:`benchmarks.wan` compare Atoll against it, and
  :mod:`benchmarks._wan_netns` runs :func:`ddp_rank` on the hosts of a network lab.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks._common import free_port, gloo_group, params_digest, run_ranks
from benchmarks._ddp_links import wrap_ddp
from node.config import AtollConfig, load_config
from node.data.corpus import BatchStream, load_corpus, load_shards, validation_batches
from node.train.bindings import bind
from node.train.model import build_model, vocab_of
from node.train.trainer import evaluate, lr_at, make_inner_optimizer
from protocol.p2p.shaper import LinkShape

__all__ = ["DdpRun", "ddp_rank", "run_ddp", "run_timed_ddp"]

_WARMUP_STEPS = 3
"""Steps a timed run takes before its barrier and clock start (caches, the first tail)."""


@dataclass(frozen=True)
class DdpRun:
    """One DDP baseline: ``steps`` optimizer steps per rank, or ``seconds`` of training.

    Attributes:
        overrides: the config's ``--set`` overrides (model, data, train, seed).
        workers: ranks.
        steps: optimizer steps per rank (a fixed run, :func:`run_ddp`).
        seconds: training time after the warm-up steps (a timed run, :func:`run_timed_ddp`).
        slowdowns: one per rank, or none (all 1): rank i sleeps ``(X - 1)`` times its
            compute per step.
        eval_at: the steps after which rank 0 evaluates (0: before training); a fixed run.
        evaluate: whether rank 0 reports the final validation bits per byte; a timed run.
        shards: train on ``data.shards`` (BPE, bits per byte through the shards' bytes
            per token, the config bound to its digests) rather than the byte corpus.
        seeded_streams: key each rank's stream by ``(run.seed, rank)`` rather than
            ``("ddp", rank)``.
        link: an emulated link for the gradient all-reduce
            (:func:`benchmarks._ddp_links.ring_allreduce_seconds`), or None for plain gloo.
        delay_s: a one-way delay for a link whose bandwidth is real (gloo's traffic crosses
            a kernel-shaped link): each all-reduce completes ``2(n-1) * delay_s`` after
            gloo's. 0: no hook. Not with ``link``.
        master_addr: the address of rank 0's rendezvous.
        gloo_timeout: seconds a collective may wait; None: 300 for a fixed run, 60 for a
            timed one.

    Raises:
        ValueError: a plan with both or neither of ``steps`` and ``seconds``, ``eval_at``
            on a timed run or ``evaluate`` on a fixed one, or slowdowns not one per rank.
    """

    overrides: tuple[str, ...]
    workers: int
    steps: int | None = None
    seconds: float | None = None
    slowdowns: tuple[float, ...] = ()
    eval_at: tuple[int, ...] = ()
    evaluate: bool = False
    shards: bool = False
    seeded_streams: bool = False
    link: LinkShape | None = None
    delay_s: float = 0.0
    master_addr: str = "127.0.0.1"
    gloo_timeout: float | None = None

    def __post_init__(self) -> None:
        if (self.steps is None) == (self.seconds is None):
            raise ValueError(
                f"DdpRun: set exactly one of steps and seconds "
                f"(steps={self.steps}, seconds={self.seconds})"
            )
        if (self.eval_at and self.timed) or (self.evaluate and not self.timed):
            raise ValueError("DdpRun: eval_at is for a run of steps, evaluate for one of seconds")
        if self.slowdowns and len(self.slowdowns) != self.workers:
            raise ValueError(f"DdpRun: {len(self.slowdowns)} slowdowns for {self.workers} workers")

    @property
    def timed(self) -> bool:
        """Whether this run trains for ``seconds`` rather than ``steps``."""
        return self.seconds is not None

    @property
    def collective_timeout(self) -> float:
        """Seconds a collective may wait (``gloo_timeout``, or the default for the kind)."""
        if self.gloo_timeout is not None:
            return self.gloo_timeout
        return 60.0 if self.timed else 300.0


def run_ddp(run: DdpRun, timeout: float, grace: float = 30.0) -> dict[str, Any]:
    """Runs a plan of ``steps`` as spawned gloo ranks on 127.0.0.1.

    Returns:
        Rank 0's report: ``params``, ``history`` (``step``, ``tokens``, ``val_bpb``,
        ``seconds`` at each evaluation), ``params_agree``, ``seconds`` and ``tokens``
        (every rank's); ``{"error": ...}`` when it reported nothing. Every rank is
        joined, terminated or killed.
    """
    if run.timed:
        raise ValueError("run_ddp runs a plan of steps; a plan of seconds: run_timed_ddp")
    port = free_port()
    reports, codes = run_ranks(
        ddp_rank, [(port, run)] * run.workers, expected=1, timeout=timeout, grace=grace
    )
    if not reports:
        return {"error": f"rank 0 reported nothing; exit codes {codes}"}
    return reports[0]


def run_timed_ddp(run: DdpRun, startup_seconds: float = 180.0) -> dict[str, Any]:
    """Runs a plan of ``seconds`` as spawned gloo ranks on 127.0.0.1; always joined,
    terminated or killed.

    Returns:
        ``{"ranks": [per-rank report], "exit_codes": [...]}``, each report with ``busy``,
        ``idle`` (seconds), ``steps``, ``params``, ``params_agree`` and ``val_bpb`` (rank 0
        with ``run.evaluate``); or ``{"error": ...}`` when a rank reported nothing.
    """
    if not run.timed:
        raise ValueError("run_timed_ddp runs a plan of seconds; a plan of steps: run_ddp")
    assert run.seconds is not None
    port = free_port()
    reports, exit_codes = run_ranks(
        ddp_rank,
        [(port, run)] * run.workers,
        expected=run.workers,
        timeout=run.seconds + startup_seconds,  # spawns are slow under load
        grace=15,
    )
    by_rank = {r["rank"]: r for r in reports}
    if len(by_rank) < run.workers:
        missing = sorted(set(range(run.workers)) - set(by_rank))
        return {"error": f"ranks {missing} reported nothing; exit codes {exit_codes}"}
    return {"ranks": [by_rank[i] for i in range(run.workers)], "exit_codes": exit_codes}


def ddp_rank(rank: int, port: int, run: DdpRun, results: Any) -> None:
    """One DDP rank of ``run``: set up, train, check that every rank's parameters agree,
    and put its report on ``results`` (a timed run: every rank; a fixed run: rank 0)."""
    torch.set_num_threads(1)
    cfg = load_config(None, list(run.overrides))
    if run.shards:
        cfg = bind(cfg)
    with gloo_group(
        port, rank, run.workers, timeout_s=run.collective_timeout, addr=run.master_addr
    ) as dist:
        state = _set_up(cfg, run, rank)
        report = _timed(dist, state, run, rank) if run.timed else _fixed(dist, state, run, rank)
        if report is not None:
            results.put(report)


@dataclass
class _Rank:
    """What one rank trains with, set up once by :func:`_set_up` and stepped by :func:`_step`."""

    cfg: AtollConfig
    model: nn.Module
    ddp: Any
    optimizer: Any
    stream: BatchStream
    val_split: torch.Tensor
    per_token: dict[str, float]
    slowdown: float
    last_grad: list[float]  # when backward last accumulated a gradient
    tail: float = 0.0  # backward + optimizer compute of the previous step

    def validation(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The held-out batches every evaluation uses."""
        data = self.cfg.data
        return validation_batches(
            self.val_split, data.batch_size, self.cfg.model.context, self.cfg.train.eval_batches
        )


def _set_up(cfg: AtollConfig, run: DdpRun, rank: int) -> _Rank:
    """The corpus, the model in DDP (behind the plan's link), the optimizer and the stream."""
    if run.shards:
        corpus = load_shards(cfg.data.shards, cfg.model.context, vocab_of(cfg.model))
        per_token = {"bytes_per_token": corpus.bytes_per_token}
    else:
        corpus, per_token = load_corpus(cfg.data, cfg.model.context), {}
    model = build_model(cfg.model, seed=cfg.run.seed)
    ddp = wrap_ddp(model, run.workers, run.link, run.delay_s)
    optimizer = make_inner_optimizer(model, cfg.train)
    key = (cfg.run.seed, rank) if run.seeded_streams else ("ddp", rank)
    stream = BatchStream(corpus.train, cfg.data.batch_size, cfg.model.context, key)
    # Backward's wall time includes the wait for the all-reduce; its compute ends
    # when the last gradient is accumulated.
    last_grad = [0.0]
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda _: last_grad.__setitem__(0, time.monotonic()))
    slowdown = float(run.slowdowns[rank]) if run.slowdowns else 1.0
    return _Rank(cfg, model, ddp, optimizer, stream, corpus.val, per_token, slowdown, last_grad)


def _step(r: _Rank, step: int) -> float:
    """One optimizer step of every rank; the busy seconds of this rank's part in it.

    The slowdown sleep goes between forward and backward, so it delays the all-reduce
    inside backward exactly as slower hardware would; backward compute is timed up to
    its last gradient accumulation, so the wait for the all-reduce is not counted as busy.
    """
    t0 = time.monotonic()
    for group in r.optimizer.param_groups:
        group["lr"] = lr_at(step, r.cfg.train)
    inputs, targets = r.stream.next()
    logits = r.ddp(inputs)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    r.optimizer.zero_grad(set_to_none=True)
    t1 = time.monotonic()
    if r.slowdown > 1.0:
        time.sleep((t1 - t0 + r.tail) * (r.slowdown - 1.0))
    t2 = r.last_grad[0] = time.monotonic()
    loss.backward()  # DDP averages the gradients across ranks here
    t3 = time.monotonic()
    if r.cfg.train.grad_clip > 0:
        nn.utils.clip_grad_norm_(r.model.parameters(), r.cfg.train.grad_clip)
    r.optimizer.step()
    t4 = time.monotonic()
    r.tail = (r.last_grad[0] - t2) + (t4 - t3)
    return (t2 - t0) + r.tail


def _params_agree(dist: Any, model: nn.Module, world: int) -> bool:
    """Whether every rank holds the same parameters (a collective: every rank calls it)."""
    digests: list[Any] = [None] * world
    dist.all_gather_object(digests, params_digest(model))
    return len(set(digests)) == 1


def _fixed(dist: Any, r: _Rank, run: DdpRun, rank: int) -> dict[str, Any] | None:
    """``run.steps`` steps, rank 0 evaluating at ``run.eval_at``; rank 0's report."""
    assert run.steps is not None
    val = r.validation() if rank == 0 and run.eval_at else []
    tokens_per_step = r.cfg.data.batch_size * r.cfg.model.context
    history: list[dict[str, Any]] = []
    started = time.monotonic()

    def record(step: int) -> None:
        if rank == 0 and step in run.eval_at:
            history.append(
                {
                    "step": step,
                    "tokens": step * tokens_per_step,
                    "val_bpb": evaluate(r.model, val, **r.per_token),
                    "seconds": time.monotonic() - started,
                }
            )

    record(0)
    for step in range(run.steps):
        _step(r, step)
        record(step + 1)
    agree = _params_agree(dist, r.model, run.workers)
    if rank != 0:
        return None
    return {
        "params": sum(p.numel() for p in r.model.parameters()),
        "history": history,
        "params_agree": agree,
        "seconds": time.monotonic() - started,
        "tokens": run.steps * tokens_per_step * run.workers,
    }


def _timed(dist: Any, r: _Rank, run: DdpRun, rank: int) -> dict[str, Any]:
    """Warm-up steps, a barrier, then steps until ``run.seconds`` have passed, every rank
    stopping after the same step; this rank's report of its busy and idle time."""
    assert run.seconds is not None
    stop, pending = torch.zeros(1), None
    busy, steps = 0.0, 0
    started = deadline = float("inf")
    while True:
        if steps == _WARMUP_STEPS:
            # Warm-up steps (caches, the first tail) are not counted; start together.
            dist.barrier()
            started, busy = time.monotonic(), 0.0
            deadline = started + run.seconds
        busy += _step(r, steps)
        steps += 1
        # Every rank must stop after the same step, or the others hang in backward.
        # The vote runs in the background during the next step, so it adds no
        # synchronisation point of its own; ranks stop one step after the deadline.
        if pending is not None:
            pending.wait()
            if stop.item():
                break
        stop = torch.tensor([float(time.monotonic() >= deadline)])
        pending = dist.all_reduce(stop, op=dist.ReduceOp.MAX, async_op=True)
    wall = time.monotonic() - started
    agree = _params_agree(dist, r.model, run.workers)
    val_bpb = None
    if run.evaluate and rank == 0:
        val_bpb = evaluate(r.model, r.validation(), **r.per_token)
    return {
        "rank": rank,
        "busy": busy,
        "idle": max(0.0, wall - busy),
        "steps": steps - _WARMUP_STEPS,
        "params": sum(p.numel() for p in r.model.parameters()),
        "params_agree": agree,
        "val_bpb": val_bpb,
    }
