"""What the benchmarks share: the machine they ran on, gloo ranks in spawned processes,
node swarms, figures, stdlib shards and the signed heads' sizes."""

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
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import psutil
import torch

from node.train.site import params_digest

__all__ = [
    "end_processes",
    "figure",
    "free_port",
    "gloo_group",
    "head_bytes",
    "machine_info",
    "params_digest",
    "prepare_stdlib_shards",
    "run_ranks",
    "run_swarm",
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
