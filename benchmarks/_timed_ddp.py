"""The timed DDP baseline: one spawned gloo rank per slowdown, training for wall-clock
seconds after a common start and reporting its busy and idle time, optionally behind an
emulated link (a DDP comm hook that finishes each bucket's all-reduce no earlier than the
link allows, or only adds the ring's delays where gloo crosses a real, shaped link).
:mod:`benchmarks.stragglers` and :mod:`benchmarks.wan` compare Atoll against it; the
fixed-steps baseline is :mod:`benchmarks._ddp`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks._common import free_port, gloo_group, params_digest, run_ranks
from protocol.p2p.shaper import LinkShape

__all__ = ["TimedDdp", "ring_allreduce_seconds", "run_timed_ddp", "timed_rank"]

_DDP_WARMUP_STEPS = 3


@dataclass(frozen=True)
class TimedDdp:
    """One DDP run: ``len(slowdowns)`` ranks training for ``seconds`` after a common start.

    Attributes:
        overrides: config overrides for the model, data and inner optimizer.
        slowdowns: one per rank; rank i sleeps ``(X - 1)`` times its compute per step.
        seconds: training time after the warm-up steps.
        link: an emulated link for the gradient all-reduce (see :func:`ring_allreduce_seconds`),
            or None for plain gloo on loopback.
        evaluate: whether rank 0 reports the final validation bits per byte.
        delay_s: a one-way delay for a link whose bandwidth is real (gloo's traffic crosses
            a kernel-shaped link): each all-reduce completes ``2(n-1) * delay_s`` after
            gloo's (see :func:`_delay_allreduce_hook`). 0: no hook. Not with ``link``.
        master_addr: the address of rank 0's rendezvous.
    """

    overrides: tuple[str, ...]
    slowdowns: tuple[float, ...]
    seconds: float
    link: LinkShape | None = None
    evaluate: bool = False
    delay_s: float = 0.0
    master_addr: str = "127.0.0.1"


def ring_allreduce_seconds(nbytes: int, world: int, link: LinkShape) -> float:
    """Time a ring all-reduce of ``nbytes`` per rank takes on ``link``.

    Each rank sends ``2 (n - 1) / n`` of the vector in ``2 (n - 1)`` steps, and every
    step waits one one-way delay: ``2(n-1)/n * bytes * 8 / bandwidth + 2(n-1) * delay``.
    """
    if world < 2:
        return 0.0
    steps = 2 * (world - 1)
    return link.transfer_seconds(int(nbytes * steps / world)) + steps * link.delay_s


class _LinkHookState:
    """The emulated link of one DDP rank: buckets queue on it one after another."""

    def __init__(self, link: LinkShape, world: int) -> None:
        self.link = link
        self.world = world
        self.free_at = 0.0
        self.lock = threading.Lock()

    def book(self, now: float, seconds: float) -> float:
        """Occupy the link for ``seconds`` from ``now`` or after earlier bookings; the end."""
        with self.lock:
            self.free_at = max(now, self.free_at) + seconds
            return self.free_at


def _hand_over(reduced, result) -> None:
    """Complete DDP's future ``result`` with gloo's all-reduce ``reduced``, or its failure."""
    try:
        result.set_result(reduced.value())
    except Exception as e:  # hand gloo's failure to DDP instead of losing it in a thread
        result.set_exception(e)


# DDP checks a hook's annotations against the real classes, and this module's annotations
# are strings (``from __future__ import annotations``): ``bucket`` and the return stay bare.
def _link_allreduce_hook(state: _LinkHookState, bucket):
    """DDP comm hook: gloo's all-reduce, finished no earlier than the emulated link allows.

    gloo's traffic cannot be shaped from here, so the bucket's future completes at
    ``max(gloo done, link free + ring time)``; the wait runs on a timer thread, so
    backward keeps computing the next buckets meanwhile, as it would on a real link.
    """
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    buffer = bucket.buffer()
    cost = ring_allreduce_seconds(buffer.numel() * buffer.element_size(), state.world, state.link)
    done_at = state.book(time.monotonic(), cost)
    result: torch.futures.Future = torch.futures.Future()

    def finish(reduced: torch.futures.Future) -> None:
        remaining = done_at - time.monotonic()
        if remaining > 0:
            threading.Timer(remaining, _hand_over, args=(reduced, result)).start()
        else:
            _hand_over(reduced, result)

    default_hooks.allreduce_hook(None, bucket).add_done_callback(finish)
    return result


def _delay_allreduce_hook(state: _LinkHookState, bucket):
    """DDP comm hook: gloo's all-reduce, then the ring's ``2(n-1)`` one-way delays.

    For a link whose bandwidth gloo's sockets really cross (tbf in a network namespace),
    so the bandwidth term is measured and only the delay is modelled (the kernels these
    run on lack netem): the bucket's future completes ``2(n-1) * delay`` after gloo's,
    and after the delays of earlier buckets, as successive ring all-reduces' steps would.
    """
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    latency = ring_allreduce_seconds(0, state.world, state.link)  # 2(n-1) * delay
    result: torch.futures.Future = torch.futures.Future()

    def finish(reduced: torch.futures.Future) -> None:
        remaining = state.book(time.monotonic(), latency) - time.monotonic()
        threading.Timer(max(0.0, remaining), _hand_over, args=(reduced, result)).start()

    default_hooks.allreduce_hook(None, bucket).add_done_callback(finish)
    return result


def timed_rank(rank: int, port: int, plan: TimedDdp, results: Any) -> None:
    """One DDP rank: train for ``plan.seconds`` after a common start, report busy and idle.

    The slowdown sleep goes between forward and backward, so it delays the all-reduce
    inside backward exactly as slower hardware would; backward compute is timed up to
    its last gradient accumulation, so the wait for the all-reduce is not counted as busy.
    """
    from node.config import load_config
    from node.data.corpus import BatchStream, load_corpus
    from node.train.model import build_model
    from node.train.trainer import evaluate, make_inner_optimizer

    torch.set_num_threads(1)
    cfg = load_config(None, list(plan.overrides))
    world = len(plan.slowdowns)
    with gloo_group(port, rank, world, timeout_s=60, addr=plan.master_addr) as dist:
        model = build_model(cfg.model, seed=cfg.run.seed)
        ddp = _wrapped(model, plan, world)
        optimizer = make_inner_optimizer(model, cfg.train)
        corpus = load_corpus(cfg.data, cfg.model.context)
        stream = BatchStream(corpus.train, cfg.data.batch_size, cfg.model.context, ("ddp", rank))
        slowdown = float(plan.slowdowns[rank])
        steps, busy, wall = _train_for(dist, ddp, optimizer, stream, cfg.train, plan, slowdown)
        digests: list[Any] = [None] * world
        dist.all_gather_object(digests, params_digest(model))
        val_bpb = None
        if plan.evaluate and rank == 0:
            val = BatchStream(
                corpus.val, cfg.data.batch_size, cfg.model.context, "validation"
            ).fixed_batches(cfg.train.eval_batches)
            val_bpb = evaluate(model, val)
        results.put(
            {
                "rank": rank,
                "busy": busy,
                "idle": max(0.0, wall - busy),
                "steps": steps - _DDP_WARMUP_STEPS,
                "params": sum(p.numel() for p in model.parameters()),
                "params_agree": len(set(digests)) == 1,
                "val_bpb": val_bpb,
            }
        )


def _wrapped(model: Any, plan: TimedDdp, world: int) -> Any:
    """``model`` in DDP, behind ``plan``'s emulated link or delay hook where it has one."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model)
    if plan.link is not None:
        ddp.register_comm_hook(_LinkHookState(plan.link, world), _link_allreduce_hook)
    elif plan.delay_s > 0:
        delay = _LinkHookState(LinkShape(plan.delay_s), world)
        ddp.register_comm_hook(delay, _delay_allreduce_hook)
    return ddp


def _train_for(
    dist: Any, ddp: Any, optimizer: Any, stream: Any, train: Any, plan: TimedDdp, slowdown: float
) -> tuple[int, float, float]:
    """Steps until ``plan.seconds`` after the warm-up, every rank stopping after the same
    step: the steps taken (warm-up included), busy seconds and wall seconds after it."""
    import torch.nn.functional as F
    from torch import nn

    from node.train.trainer import lr_at

    model = ddp.module
    # Backward's wall time includes the wait for the all-reduce; its compute ends
    # when the last gradient is accumulated.
    last_grad = [0.0]
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda _: last_grad.__setitem__(0, time.monotonic()))
    stop, pending = torch.zeros(1), None
    tail = 0.0  # backward + optimizer compute of the previous step
    busy = 0.0
    steps = 0
    started = deadline = float("inf")
    while True:
        if steps == _DDP_WARMUP_STEPS:
            # Warm-up steps (caches, the first tail) are not counted; start together.
            dist.barrier()
            started, busy = time.monotonic(), 0.0
            deadline = started + plan.seconds
        t0 = time.monotonic()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(steps, train)
        inputs, targets = stream.next()
        logits = ddp(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        t1 = time.monotonic()
        if slowdown > 1.0:
            # Before backward, so the all-reduce in backward waits for it.
            time.sleep((t1 - t0 + tail) * (slowdown - 1.0))
        t2 = last_grad[0] = time.monotonic()
        loss.backward()
        t3 = time.monotonic()
        if train.grad_clip > 0:
            nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
        optimizer.step()
        t4 = time.monotonic()
        tail = (last_grad[0] - t2) + (t4 - t3)
        busy += (t2 - t0) + tail
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
    return steps, busy, time.monotonic() - started


def run_timed_ddp(plan: TimedDdp, startup_seconds: float = 180.0) -> dict[str, Any]:
    """Runs ``plan`` as spawned gloo ranks on 127.0.0.1; always joined, terminated or killed.

    Returns:
        ``{"ranks": [per-rank report], "exit_codes": [...]}``, each report with ``busy``,
        ``idle`` (seconds), ``steps``, ``params``, ``params_agree`` and ``val_bpb`` (rank 0
        with ``plan.evaluate``); or ``{"error": ...}`` when a rank reported nothing.
    """
    world = len(plan.slowdowns)
    port = free_port()
    reports, exit_codes = run_ranks(
        timed_rank,
        [(port, plan)] * world,
        expected=world,
        timeout=plan.seconds + startup_seconds,  # spawns are slow under load
        grace=15,
    )
    by_rank = {r["rank"]: r for r in reports}
    if len(by_rank) < world:
        missing = sorted(set(range(world)) - set(by_rank))
        return {"error": f"ranks {missing} reported nothing; exit codes {exit_codes}"}
    return {"ranks": [by_rank[i] for i in range(world)], "exit_codes": exit_codes}
