"""What the benchmarks share: the machine they ran on, gloo ranks in spawned processes,
and a timed DDP baseline."""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib.metadata
import multiprocessing as mp
import os
import pathlib
import platform
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import psutil
import torch

from node.train.site import params_digest
from protocol.p2p.shaper import LinkShape

__all__ = [
    "TimedDdp",
    "end_processes",
    "figure",
    "free_port",
    "gloo_group",
    "head_bytes",
    "machine_info",
    "params_digest",
    "prepare_stdlib_shards",
    "ring_allreduce_seconds",
    "run_ranks",
    "run_swarm",
    "run_timed_ddp",
]


def machine_info() -> dict[str, Any]:
    """Platform, cores, memory, library versions and the load average at the time.

    The machines these run on may be shared: a high load average explains noisy
    times and slow or timed-out swarms, so it travels with every result.
    """
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "load_average_1_5_15m": [round(x, 2) for x in os.getloadavg()],
        "torch": torch.__version__,
        "hivemind": importlib.metadata.version("hivemind"),
    }


# ---- a timed DDP baseline --------------------------------------------------------------

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


def _ddp_worker(rank: int, port: int, plan: TimedDdp, results: Any) -> None:
    """One DDP rank: train for ``plan.seconds`` after a common start, report busy and idle.

    The slowdown sleep goes between forward and backward, so it delays the all-reduce
    inside backward exactly as slower hardware would; backward compute is timed up to
    its last gradient accumulation, so the wait for the all-reduce is not counted as busy.
    """
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from node.config import load_config
    from node.data.corpus import BatchStream, load_corpus
    from node.train.model import build_model
    from node.train.trainer import evaluate, lr_at, make_inner_optimizer

    torch.set_num_threads(1)
    cfg = load_config(None, list(plan.overrides))
    world = len(plan.slowdowns)
    slowdown = float(plan.slowdowns[rank])
    with gloo_group(port, rank, world, timeout_s=60, addr=plan.master_addr) as dist:
        model = build_model(cfg.model, seed=cfg.run.seed)
        ddp = DistributedDataParallel(model)
        if plan.link is not None:
            ddp.register_comm_hook(_LinkHookState(plan.link, world), _link_allreduce_hook)
        elif plan.delay_s > 0:
            delay = _LinkHookState(LinkShape(plan.delay_s), world)
            ddp.register_comm_hook(delay, _delay_allreduce_hook)
        optimizer = make_inner_optimizer(model, cfg.train)
        corpus = load_corpus(cfg.data, cfg.model.context)
        stream = BatchStream(corpus.train, cfg.data.batch_size, cfg.model.context, ("ddp", rank))
        # Backward's wall time includes the wait for the all-reduce; its compute ends
        # when the last gradient is accumulated.
        last_grad = [0.0]
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(
                lambda _: last_grad.__setitem__(0, time.monotonic())
            )
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
                group["lr"] = lr_at(steps, cfg.train)
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
            if cfg.train.grad_clip > 0:
                nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
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
        wall = time.monotonic() - started
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


@contextlib.contextmanager
def figure(path: pathlib.Path, *grid: int, dpi: int = 120, **options: Any) -> Iterator[Any]:
    """A headless matplotlib figure, ``(fig, axes)`` of ``plt.subplots(*grid,
    **options)``, laid out and saved to ``path`` when the block ends (and closed
    whatever happens): every benchmark's PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(*grid, **options)
    try:
        yield fig, axes
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a gloo rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def gloo_group(
    port: int, rank: int, world: int, timeout_s: float, addr: str = "127.0.0.1"
) -> Iterator[Any]:
    """``torch.distributed`` with a gloo group on ``addr``:``port``; always destroyed.

    On a host with several interfaces gloo binds to the one ``GLOO_SOCKET_IFNAME`` names.
    """
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{addr}:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        yield dist
    finally:
        dist.destroy_process_group()


def run_ranks(
    target: Callable[..., None],
    args: Sequence[tuple],
    expected: int,
    timeout: float,
    grace: float,
) -> tuple[list[dict[str, Any]], list[int | None]]:
    """Spawns ``target(rank, *args[rank], results)`` for every rank and collects reports.

    Each rank may put report dicts on ``results``; this returns once ``expected`` have
    arrived, ``timeout`` seconds have passed, or a rank has died (the others would wait
    for it until their gloo timeout). Every process is joined, terminated or killed.

    Returns:
        The reports in arrival order (fewer than ``expected`` on failure) and the ranks'
        exit codes.
    """
    ctx = mp.get_context("spawn")  # never fork a parent whose torch may hold threads
    results = ctx.Queue()
    procs = [
        ctx.Process(target=target, args=(rank, *rank_args, results), daemon=True)
        for rank, rank_args in enumerate(args)
    ]
    started: list[Any] = []
    reports: list[dict[str, Any]] = []
    try:
        for p in procs:
            p.start()
            started.append(p)
        deadline = time.monotonic() + timeout
        while len(reports) < expected and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                reports.append(results.get(timeout=1.0))
            if len(reports) < expected and any(p.exitcode not in (None, 0) for p in procs):
                break
    finally:
        end_processes(started, grace=grace)
        results.close()
    return reports, [p.exitcode for p in procs]


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
        _ddp_worker,
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


def end_processes(procs: list, grace: float) -> None:
    """Join ``multiprocessing`` children for ``grace`` seconds, then terminate, then kill."""
    for p in procs:
        p.join(timeout=grace)
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


@functools.cache
def head_bytes(members: int) -> tuple[int, int]:
    """Bytes a part message and a result message carry besides their payload, in a
    group of ``members`` (one fragment of at most one body chunk; the commit phase on,
    as by default, so a result carries each contributor's signed commitment): built and
    sealed as a node builds them, with real keys and signatures."""
    import hashlib

    from protocol.averaging.resultmeta import result_fields
    from protocol.control.frames import sign_control, topic_name
    from protocol.wire.messages import Header
    from protocol.wire.partwire import seal_part
    from verification.identity import Identity
    from verification.records import Contribution

    ids = [Identity.from_seed(hashlib.sha256(b"head %d" % i).digest()) for i in range(members)]
    group = [i.peer_id for i in ids]
    codec = {"c": "topk", "n": 1 << 20, "b": 4096, "k": 41, "q": 2}
    body = b"\0" * 1000
    part = seal_part(
        ids[0],
        Header("part", "bench-convergence", 100, 0, 1, group[0]),
        {"content": "update", "group": group, "owners": group, "weight": 10**6, **codec},
        body,
    )
    kept = [
        Contribution(peer=p, vector=torch.zeros(1), weight=1e6, digest=bytes(32), tokens=10**6)
        for p in group
    ]
    commits = [
        sign_control(
            i,
            "bench-convergence",
            topic_name("bench-convergence", "commit"),
            100,
            {
                "round": 100,
                "fragment": 0,
                "content": "update",
                "digests": [[j, bytes(32)] for j in range(members)],
            },
        )
        for i in ids
    ]
    result = seal_part(
        ids[1],
        Header("reduced", "bench-convergence", 100, 0, 1, group[1]),
        {**result_fields("update", kept, {}, commits), **codec},
        body,
    )
    return len(part.to_bytes()) - len(body), len(result.to_bytes()) - len(body)


def run_swarm(overrides: list[str], nodes: int, rounds: int, where: pathlib.Path) -> list[dict]:
    """Run ``nodes`` real nodes (``atoll swarm``'s way, in ``where``) for ``rounds``
    rounds to the end; each node's exit code, status and round events."""
    from node.ops import swarm
    from node.run.metrics import read_events

    spec = swarm.SwarmSpec(
        nodes=nodes, config_paths=[], overrides=overrides, directory=where, rounds=rounds
    )
    procs, finished = swarm.run_to_end(spec, timeout=600.0 + 120.0 * rounds)
    out = []
    for n in procs:
        events = read_events(n.data_dir / "events.jsonl")
        out.append(
            {
                "exit_code": n.proc.returncode,
                "finished": finished,
                "status": n.status,
                "rounds": [e for e in events if e["event"] == "round"],
            }
        )
    return out


def prepare_stdlib_shards(
    out: Any, vocab: int, files: int | None = None
) -> tuple[Any, dict[str, Any]]:
    """BPE shards of the standard library's UTF-8 ``.py`` files (the first ``files`` of
    them; None: all) with a tokenizer of ``vocab`` tokens trained on them, in ``out``
    (``atoll data prepare --train-tokenizer``): the folder and its corpus figures."""
    from node.data.corpus import stdlib_files
    from node.data.prepare import prepare

    kept = []
    for _, path in stdlib_files()[:files]:
        data = path.read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue  # the standard library's tests hold a few files that are not text
        if b"\0" not in data:
            kept.append(str(path))
    meta = prepare(kept, out, train_vocab=vocab, workers=2)
    keys = ("train_tokens", "val_tokens", "bytes_per_token", "vocab_size")
    return out, {k: meta[k] for k in keys}
