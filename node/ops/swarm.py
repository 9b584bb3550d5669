"""A local swarm: N real node processes on 127.0.0.1, a live view, and a summary.

Each node is a separate ``atoll run`` process with its own data directory under the
swarm directory, its share of the CPU cores, and its own p2pd. The first node starts
the swarm; the others join through its multiaddr, known before it runs (the launcher
makes its identity key and picks its port), so all start at once. The launcher owns
every process it starts: on Ctrl-C or SIGTERM (:func:`interrupt_on_sigterm`), on an
error, or when it is done it sends SIGTERM, waits, then SIGKILLs whatever is left (each
node's watchdog then ends its p2pd and DHT).
What the swarm did is summarised by :mod:`node.ops.swarm_report` (and shown by
:mod:`node.ops.swarm_view`).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from node.config import AtollConfig
from node.ops import forkserver
from node.ops.swarm_report import SwarmProcess, butterfly_reach, summarize
from node.ops.swarm_view import dump_json, format_summary, render_table

__all__ = [
    "QUICK_WORKLOAD",
    "NodeFailed",
    "SwarmProcess",
    "SwarmSpec",
    "butterfly_reach",
    "dump_json",
    "error_line",
    "format_summary",
    "interrupt_on_sigterm",
    "launch",
    "reap",
    "render_table",
    "run_swarm",
    "run_to_end",
    "start_node",
    "stop_all",
    "summarize",
    "wait_for_maddrs",
]

QUICK_WORKLOAD = (
    "data.max_files=150",
    "data.batch_size=8",
    "model.context=64",
    "model.n_embd=64",
    "model.n_layer=1",
    "train.warmup_steps=5",
    "train.total_steps=60",
    "train.eval_batches=4",
)
"""Overrides for a tiny model on a slice of the corpus that trains visibly in seconds:
the workload of the integration tests and of the benchmarks' quick modes."""

_START_TIMEOUT = 90.0
_NODES_PER_START_MINUTE = 8  # larger swarms wait longer than a minute for every node
_LOG_TAIL_BYTES = 64 * 1024
_FAIL_GRACE = 3.0  # seconds for nodes started together to fail alike before one is named


class NodeFailed(Exception):
    """A node of the swarm exited with an error; names the node and its own error line."""

    def __init__(self, node: SwarmProcess, reason: str | None = None) -> None:
        self.index = node.index
        self.line = reason or error_line(node)
        super().__init__(
            f"node {node.index} failed: {self.line} (the others were stopped; "
            f"log: {node.data_dir / 'node.log'})"
        )


@dataclass
class SwarmSpec:
    """What to launch."""

    nodes: int
    config_paths: list[str]
    overrides: list[str]
    directory: Path
    rounds: int
    extra_args: dict[int, list[str]] = field(default_factory=dict)
    procs_per_node: int = 1
    """Processes (torchrun ranks) per node: each node is a site of this many."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for every node process (e.g. ``ATOLL_LINK_SHAPE``)."""

    def extra_args_byzantine(self) -> set[int]:
        """Indices of nodes started with ``--byzantine``."""
        return {i for i, args in self.extra_args.items() if "--byzantine" in args}


def _node_command(
    spec: SwarmSpec, index: int, data_dir: Path, peers: list[str], sets: Sequence[str] = ()
) -> list[str]:
    threads = max(1, (os.cpu_count() or 1) // (spec.nodes * spec.procs_per_node))
    # the node's stderr goes to DATA_DIR/node.log (start_node): no second copy
    cmd = [sys.executable, "-m", "node.cli", "run", "--data-dir", str(data_dir), "--log-file", "-"]
    for path in spec.config_paths:
        cmd += ["--config", path]
    start = []
    if spec.nodes > _NODES_PER_START_MINUTE:
        # all start at once and share the cores: give them time to meet
        start = [f"network.min_peers_timeout={60.0 * spec.nodes / _NODES_PER_START_MINUTE:g}"]
    for item in [
        f"run.threads={threads}",
        f"network.min_peers={spec.nodes}",
        *start,
        *sets,
        *spec.overrides,
    ]:
        cmd += ["--set", item]
    if spec.rounds:
        cmd += ["--rounds", str(spec.rounds)]
    if spec.procs_per_node > 1:
        cmd += ["--nproc-per-node", str(spec.procs_per_node)]
    if peers:
        cmd += ["--initial-peers", *peers]
    return cmd + spec.extra_args.get(index, [])


def start_node(
    spec: SwarmSpec,
    index: int,
    peers: list[str],
    sets: Sequence[str] = (),
    popen: Callable[..., subprocess.Popen] = forkserver.popen,
) -> SwarmProcess:
    """Start node ``index`` as a separate process (its own session, log in its data dir).

    Args:
        sets: ``--set`` overrides of this node only (before the spec's own).
        popen: starts the process (forked from :mod:`node.ops.forkserver` where it can be;
            tests pass one that starts it on another host of a network lab).
    """
    data_dir = spec.directory / f"node{index}"
    data_dir.mkdir(parents=True, exist_ok=True)
    log = open(data_dir / "node.log", "ab")  # noqa: SIM115 - closed in stop_all
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **spec.env}
    proc = popen(
        _node_command(spec, index, data_dir, peers, sets),
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # Ctrl-C reaches the launcher, which stops nodes in order
        env=env,
    )
    return SwarmProcess(index=index, data_dir=data_dir, proc=proc, log=log)


def error_line(node: SwarmProcess) -> str:
    """The node's own one-line error (``atoll: ...`` in its log), else its exit code."""
    try:
        with open(node.data_dir / "node.log", "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - _LOG_TAIL_BYTES))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        tail = ""
    lines = [x for x in tail.splitlines() if x.startswith("atoll: ")]
    if lines:
        return lines[-1].removeprefix("atoll: ")
    return f"exited with code {node.proc.returncode}"


def wait_for_maddrs(
    node: SwarmProcess, timeout: float = _START_TIMEOUT, others: Sequence[SwarmProcess] = ()
) -> list[str]:
    """Wait until a node reports its multiaddrs; raise if it dies or takes too long, or
    if one of ``others`` (started beside it) exits with an error meanwhile.

    Raises:
        NodeFailed: the node exited first, or one of ``others`` failed (nodes started
            together often fail alike: the first by index of those that exit within
            ``_FAIL_GRACE`` seconds is named), or it did not come up within ``timeout``.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        maddrs = node.status.get("maddrs")
        if maddrs:
            return list(maddrs)
        if node.proc.poll() is not None or any(_failed(n) for n in others):
            _wait_until_exited([node, *others], _FAIL_GRACE)
            raise NodeFailed(node if node.proc.poll() is not None else _first_failed(others))
        time.sleep(0.2)
    raise NodeFailed(node, f"it did not come up within {timeout:.0f} s")


def _failed(node: SwarmProcess) -> bool:
    return node.proc.poll() not in (None, 0)


def _first_failed(nodes: Sequence[SwarmProcess]) -> SwarmProcess:
    return next(n for n in nodes if _failed(n))


def _wait_until_exited(nodes: Sequence[SwarmProcess], seconds: float) -> None:
    """Wait up to ``seconds`` for every one of ``nodes`` to exit."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(n.proc.poll() is None for n in nodes):
        time.sleep(0.1)


def interrupt_on_sigterm() -> None:
    """Make SIGTERM to a launcher stop its swarm as Ctrl-C does: a ``KeyboardInterrupt``
    in the main thread, so the launcher's ``finally`` stops every node it started (the
    default action would end the launcher alone and leave its nodes running). For
    ``atoll swarm`` and the benchmarks, never for a node itself, which stops its own
    way on SIGTERM."""

    def interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


def stop_all(nodes: list[SwarmProcess], grace: float = 30.0) -> None:
    """SIGTERM every node, wait up to ``grace`` seconds, SIGKILL the rest, reap all."""
    for n in nodes:
        if n.proc.poll() is None:
            n.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for n in nodes:
        try:
            n.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            n.proc.kill()
            n.proc.wait(10)
        n.log.close()


def launch(spec: SwarmSpec) -> list[SwarmProcess]:
    """Start all nodes, the rest joining through the first.

    Where the first node's address can be known beforehand (on this machine, its port
    left to the launcher), every node starts at once: the others import and build while
    the first comes up, and keep trying it until it answers (``network.join_timeout``).
    Otherwise the first starts alone and the others once it reports its address."""
    spec.directory.mkdir(parents=True, exist_ok=True)
    first = _first_address(spec)
    nodes: list[SwarmProcess] = []
    try:
        if first is None:
            nodes.append(start_node(spec, 0, []))
            peers = wait_for_maddrs(nodes[0])
        else:
            port, peers = first
            nodes.append(start_node(spec, 0, [], [f"network.port={port}"]))
        for i in range(1, spec.nodes):
            nodes.append(start_node(spec, i, peers))
        if first is not None:
            wait_for_maddrs(nodes[0], others=nodes[1:])
    except BaseException:
        stop_all(nodes)
        raise
    return nodes


def _first_address(spec: SwarmSpec) -> tuple[int, list[str]] | None:
    """The port and multiaddr the first node will have, where the launcher can choose
    them: a swarm on 127.0.0.1 whose config leaves the port open and no node of which
    brings its own initial peers or run spec (None otherwise)."""
    from node.config import load_config
    from verification.identity import Identity

    if any("--initial-peers" in a or "--spec" in a for a in spec.extra_args.values()):
        return None
    cfg = load_config(spec.config_paths or None, spec.overrides)
    if cfg.network.port or cfg.network.host not in ("127.0.0.1", "localhost"):
        return None
    port = _free_port()
    if port is None:
        return None
    # a swarm directory used before keeps node 0's PeerID
    identity = Identity.load_or_create(spec.directory / "node0" / "identity.key")
    return port, [f"/ip4/127.0.0.1/tcp/{port}/p2p/{identity.peer_id}"]


def _free_port(tries: int = 20) -> int | None:
    """A TCP port on 127.0.0.1 free now, below the kernel's ephemeral range (from
    32768), where no port another process binds to 0 is handed out in the meantime."""
    for _ in range(tries):
        port = random.randint(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    return None


def run_to_end(spec: SwarmSpec, timeout: float) -> tuple[list[SwarmProcess], bool]:
    """Launch, wait until every node exits or ``timeout``; always stop nodes and helpers.

    Returns:
        The nodes and whether all of them finished on their own.
    """
    nodes: list[SwarmProcess] = []
    helpers: set[int] = set()
    finished = False
    try:
        nodes = launch(spec)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for n in nodes:
                helpers.update(n.status.get("helper_pids", []))
            if all(n.proc.poll() is not None for n in nodes):
                finished = True
                break
            time.sleep(0.5)
    finally:
        stop_all(nodes, grace=20)
        reap(helpers)
    return nodes, finished


def reap(pids: set[int]) -> None:
    """End the helper processes ``pids`` (p2pd, the DHT) that outlived their node."""
    # A node's watchdog ends its p2pd and DHT process; this covers a watchdog that died too.
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.append(psutil.Process(pid))
    _, alive = psutil.wait_procs(procs, timeout=10)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=5)


def run_swarm(
    spec: SwarmSpec,
    cfg: AtollConfig,
    on_tick: Callable[[list[SwarmProcess]], None] | None = None,
    tick_seconds: float = 0.5,
    max_seconds: float | None = None,
) -> dict[str, Any]:
    """Launch the swarm, wait until every node exits (or ``max_seconds``), summarise.

    Ctrl-C stops every node cleanly; the summary then covers what was done.

    Raises:
        NodeFailed: a node exited with an error (it did not start, say); the others
            were stopped.
    """
    nodes = launch(spec)
    started = time.monotonic()
    interrupted = False
    failed: SwarmProcess | None = None
    helpers: set[int] = set()
    try:
        while any(n.proc.poll() is None for n in nodes):
            for n in nodes:
                helpers.update(n.status.get("helper_pids", []))
            failed = next((n for n in nodes if n.proc.poll() not in (None, 0)), None)
            if failed is not None:
                break
            if on_tick:
                on_tick(nodes)
            if max_seconds is not None and time.monotonic() - started > max_seconds:
                break
            time.sleep(tick_seconds)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        stop_all(nodes)
        reap(helpers)
    if failed is not None:
        raise NodeFailed(failed)
    if on_tick:
        on_tick(nodes)
    summary = summarize(nodes, cfg, sorted(spec.extra_args_byzantine()))
    summary["procs_per_node"] = spec.procs_per_node
    summary["seconds"] = time.monotonic() - started
    summary["interrupted"] = interrupted
    summary["directory"] = str(spec.directory)
    return summary
