"""A local swarm: N real node processes on 127.0.0.1, a live view, and a summary.

Each node is a separate ``atoll run`` process with its own data directory under the
swarm directory, its share of the CPU cores, and its own p2pd. The first node starts
the swarm; the others join through its multiaddr. The launcher owns every process it
starts: on Ctrl-C, on an error, or when it is done it sends SIGTERM, waits, then
SIGKILLs whatever is left (each node's watchdog then ends its p2pd and DHT).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from node.config import AtollConfig
from node.load import per_round
from node.metrics import read_events, read_status
from protocol.averaging.grouping import rounds_to_mix

__all__ = [
    "QUICK_WORKLOAD",
    "NodeFailed",
    "SwarmProcess",
    "SwarmSpec",
    "butterfly_reach",
    "error_line",
    "run_swarm",
    "run_to_end",
    "summarize",
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


@dataclass
class SwarmProcess:
    """One launched node."""

    index: int
    data_dir: Path
    proc: subprocess.Popen
    log: Any

    @property
    def status(self) -> dict[str, Any]:
        return read_status(self.data_dir / "status.json") or {}


def _node_command(spec: SwarmSpec, index: int, data_dir: Path, peers: list[str]) -> list[str]:
    threads = max(1, (os.cpu_count() or 1) // (spec.nodes * spec.procs_per_node))
    # the node's stderr goes to DATA_DIR/node.log (start_node): no second copy
    cmd = [sys.executable, "-m", "node.cli", "run", "--data-dir", str(data_dir), "--log-file", "-"]
    for path in spec.config_paths:
        cmd += ["--config", path]
    start = []
    if spec.nodes > _NODES_PER_START_MINUTE:
        # all but the first start at once and share the cores: give them time to meet
        start = [f"network.min_peers_timeout={60.0 * spec.nodes / _NODES_PER_START_MINUTE:g}"]
    for item in [
        f"run.threads={threads}",
        f"network.min_peers={spec.nodes}",
        *start,
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
    popen: Callable[..., subprocess.Popen] = subprocess.Popen,
) -> SwarmProcess:
    """Start node ``index`` as a separate process (its own session, log in its data dir).

    Args:
        popen: starts the process (``subprocess.Popen``; tests pass one that starts it
            on another host of a network lab).
    """
    data_dir = spec.directory / f"node{index}"
    data_dir.mkdir(parents=True, exist_ok=True)
    log = open(data_dir / "node.log", "ab")  # noqa: SIM115 - closed in stop_all
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **spec.env}
    proc = popen(
        _node_command(spec, index, data_dir, peers),
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


def wait_for_maddrs(node: SwarmProcess, timeout: float = _START_TIMEOUT) -> list[str]:
    """Wait until a node reports its multiaddrs; raise if it dies or takes too long.

    Raises:
        NodeFailed: the node exited first, or did not come up within ``timeout``.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        maddrs = node.status.get("maddrs")
        if maddrs:
            return list(maddrs)
        if node.proc.poll() is not None:
            raise NodeFailed(node)
        time.sleep(0.2)
    raise NodeFailed(node, f"it did not come up within {timeout:.0f} s")


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
    """Start all nodes: the first one, then the rest joining through it."""
    spec.directory.mkdir(parents=True, exist_ok=True)
    nodes = [start_node(spec, 0, [])]
    try:
        peers = wait_for_maddrs(nodes[0])
        for i in range(1, spec.nodes):
            nodes.append(start_node(spec, i, peers))
    except BaseException:
        stop_all(nodes)
        raise
    return nodes


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
        _reap(helpers)
    return nodes, finished


def _reap(pids: set[int]) -> None:
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
        _reap(helpers)
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


def summarize(
    nodes: list[SwarmProcess], cfg: AtollConfig, byzantine: Sequence[int] = ()
) -> dict[str, Any]:
    """What the swarm did, from each node's status and event log.

    Agreement and bits per byte are over the honest nodes only; faulty nodes
    (``byzantine`` indices) are listed but not averaged in. Per honest node it also
    gives what the DHT and control plane cost it per round (``dht_ops_per_round``,
    ``control_cpu_s_per_round``, ... from :func:`node.load.per_round`, with their means
    in ``load_mean``), the wall time of rounds, and ``mix``
    (:func:`butterfly_reach`).
    """
    per_node = []
    for n in nodes:
        if n.index in byzantine:
            continue
        events = read_events(n.data_dir / "events.jsonl")
        rounds = {e["round"]: e for e in events if e["event"] == "round"}
        status = n.status
        per_node.append((n, status, rounds))
    common = set.intersection(*(set(r) for _, _, r in per_node)) if per_node else set()
    mismatched = sorted(
        r for r in common if len({rounds[r]["global_digest"] for _, _, rounds in per_node}) > 1
    )
    last = max(common) if common else 0
    params = max((s.get("params", 0) for _, s, _ in per_node), default=0)
    n_nodes = len(nodes)
    ddp_factor = 2 * (n_nodes - 1) / n_nodes if n_nodes > 1 else 0.0
    val_end = [r[last]["val_bpb"] for _, _, r in per_node if last in r and "val_bpb" in r[last]]
    return {
        "nodes": n_nodes,
        "rounds": last,
        "val_bpb_start": _mean([s.get("val_bpb_start") for _, s, _ in per_node]),
        "val_bpb_end": _mean(val_end) if last else None,
        "bytes_sent_per_node": [s.get("bytes_sent", 0) for _, s, _ in per_node],
        # Ring all-reduce of fp32 gradients every step sends 2(N-1)/N of the model per step.
        "ddp_bytes_per_node": [
            int(s.get("steps", 0) * params * 4 * ddp_factor) for _, s, _ in per_node
        ],
        "params_agree": bool(common) and not mismatched,
        "rounds_checked": len(common),
        "rounds_disagreeing": mismatched,
        "exit_codes": [n.proc.returncode for n in nodes],
        "peer_ids": [n.status.get("peer_id") for n in nodes],
        "byzantine_nodes": sorted(byzantine),
        "busy_seconds": [round(n.status.get("busy_seconds", 0.0), 2) for n in nodes],
        "idle_seconds": [round(n.status.get("idle_seconds", 0.0), 2) for n in nodes],
        "flagged": _flagged(per_node),
        "ranks_agree": _ranks_agree(per_node),
        **_load(per_node),
        "mix": butterfly_reach(
            {
                str(s.get("peer_id")): read_events(n.data_dir / "events.jsonl", "sync")
                for n, s, _ in per_node
            },
            cfg.network.group_size,
            cfg.network.cells_above,
        ),
    }


def butterfly_reach(
    syncs: dict[str, list[dict[str, Any]]], group_size: int, cells_above: int | None = None
) -> dict[str, Any]:
    """Whether every node's value reached every other as the butterfly schedule says.

    With ``n`` nodes in groups of at most ``group_size``, every node's contribution is
    in every other node's global copy after ``d = rounds_to_mix(n, group_size)``
    consecutive rounds (log_G n). For each fragment and each window of ``d`` rounds
    this follows what the syncs record: after a round a node holds the values of the
    peers in every part of its result (its ``contributors``), and with them whatever
    those peers held; a node without a sync that round keeps its own.

    Args:
        syncs: per node (PeerID) its ``sync`` events.
        group_size: ``network.group_size``.
        cells_above: ``network.cells_above``: a larger swarm groups on the cell grid,
            which promises no exact window (``rounds_to_mix`` is then None, and the
            windows checked are ``ceil(log_G n)`` rounds long).

    Returns:
        ``rounds_to_mix``; ``window`` (rounds per window checked); ``windows`` checked
        and ``windows_mixed`` (every node reached every other); ``reach_share`` (the
        mean share of (source, holder) pairs reached at a window's end, None without
        a window) and ``reach_by_fragment`` (the same per fragment: on the cell grid
        each fragment has a grid of its own); ``groups`` (distinct groups of a round and fragment whose members
        all synced completely) and ``groups_agreeing`` (their members hold the same
        global copy of the fragment afterwards; with outer momentum they differ by
        each member's history).
    """
    peers = sorted(syncs)
    cells = cells_above is not None and len(peers) > cells_above
    d = None if cells else rounds_to_mix(len(peers), group_size)
    span = d
    if cells and group_size >= 2:
        span = max(1, math.ceil(math.log(len(peers)) / math.log(group_size) - 1e-9))
    held: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    for peer, events in syncs.items():
        for e in events:
            held.setdefault((e["round"], e["fragment"]), {})[peer] = e
    out: dict[str, Any] = {"rounds_to_mix": d, "window": span, "windows": 0, "windows_mixed": 0}
    rounds = sorted({r for r, _ in held})
    fragments = sorted({f for _, f in held})
    shares: dict[int, list[float]] = {}
    for f in fragments:
        for start in rounds if span else []:
            window = range(start, start + span)
            if not all((r, f) in held for r in window):
                continue
            reach = {p: {p} for p in peers}
            for r in window:
                reach = {p: _reached(p, held[(r, f)].get(p), reach) for p in peers}
            out["windows"] += 1
            out["windows_mixed"] += all(len(reach[p]) == len(peers) for p in peers)
            share = sum(len(reach[p] & set(peers)) for p in peers) / len(peers) ** 2
            shares.setdefault(f, []).append(share)
    every = [x for per in shares.values() for x in per]
    out["reach_share"] = sum(every) / len(every) if every else None
    out["reach_by_fragment"] = {f: sum(per) / len(per) for f, per in shares.items()}
    groups = agreeing = 0
    for records in held.values():
        seen: dict[tuple[str, ...], set[str]] = {}
        for e in records.values():
            members = tuple(e["group"])
            if all(records.get(m, {}).get("complete") for m in members):
                seen.setdefault(members, set()).add(str(e.get("global_digest")))
        groups += len(seen)
        agreeing += sum(len(digests) == 1 for digests in seen.values())
    out.update(groups=groups, groups_agreeing=agreeing)
    return out


def _reached(peer: str, event: dict[str, Any] | None, reach: dict[str, set[str]]) -> set[str]:
    if event is None or not event.get("contributors"):
        return set(reach[peer])
    whole = set.intersection(*(set(part) for part in event["contributors"])) | {peer}
    return set().union(*(reach.get(q, {q}) for q in whole))


def _load(per_node: list[tuple[SwarmProcess, dict[str, Any], dict]]) -> dict[str, Any]:
    """Per honest node, what the DHT and control plane cost it per round
    (:func:`node.load.per_round`) and the wall time of its rounds; with the means."""
    found = [
        per_round({r: e["load"] for r, e in rounds.items() if "load" in e}) or {}
        for _, _, rounds in per_node
    ]
    names = sorted({name for f in found for name in f})
    out: dict[str, Any] = {
        name: [round(f[name], 4) if name in f else None for f in found] for name in names
    }
    out["load_mean"] = {name: _mean(out[name]) for name in names}
    intervals, round_seconds = [], []
    for _, _, rounds in per_node:
        times = [rounds[r]["t"] for r in sorted(rounds) if "t" in rounds[r]]
        gaps = [b - a for a, b in zip(times, times[1:])]
        intervals += gaps
        round_seconds.append(round(sum(gaps) / len(gaps), 3) if gaps else None)
    out["round_seconds"] = round_seconds
    out["round_seconds_mean"] = _mean(intervals)
    out["round_seconds_p95"] = _percentile(intervals, 0.95)
    return out


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _ranks_agree(per_node: list[tuple[SwarmProcess, dict[str, Any], dict]]) -> bool | None:
    """Whether every rank of every honest site held the leader's parameters at the end
    of every round (None: no node ran as a site of several processes)."""
    checks = [
        e["ranks_agree"] for _, _, rounds in per_node for e in rounds.values() if "ranks" in e
    ]
    return all(checks) if checks else None


def _flagged(per_node: list[tuple[SwarmProcess, dict[str, Any], dict]]) -> dict[str, dict]:
    """Per honest node: the peers it quarantined or banned (from its last round)."""
    out = {}
    for n, _, rounds in per_node:
        last = rounds[max(rounds)] if rounds else {}
        out[str(n.index)] = last.get("flagged", {})
    return out


def _mean(values: list[Any]) -> float | None:
    vals = [float(v) for v in values if isinstance(v, (int, float))]
    return sum(vals) / len(vals) if vals else None


def format_summary(summary: dict[str, Any]) -> str:
    """A short human-readable summary."""
    sent = summary["bytes_sent_per_node"]
    ddp = summary["ddp_bytes_per_node"]
    ratio = (sum(ddp) / sum(sent)) if sum(sent) else float("nan")
    start, end = summary["val_bpb_start"], summary["val_bpb_end"]
    bpb = f"{start:.3f} -> {end:.3f}" if start is not None and end is not None else "n/a"
    return (
        f"swarm of {summary['nodes']} nodes, {summary['rounds']} rounds in "
        f"{summary['seconds']:.0f}s; val bits/byte {bpb}; params agree: "
        f"{summary['params_agree']}{_mix_line(summary)}{_ranks_line(summary)}; "
        f"sent {sum(sent) / 2**20:.1f} MiB in all "
        f"({ratio:.0f}x less than fp32 DDP for the same steps)\n"
        f"logs and checkpoints: {summary['directory']}"
    )


def _mix_line(summary: dict[str, Any]) -> str:
    """Groups that do not span the swarm hold different copies by design: say whether
    every node reached every other as the butterfly schedule says instead."""
    mix = summary.get("mix") or {}
    d = mix.get("rounds_to_mix")
    if not d or d < 2 or not mix.get("windows"):
        return ""
    return (
        f" (groups mix: every node reached every other within {d} rounds in "
        f"{mix['windows_mixed']} of {mix['windows']} windows)"
    )


def _ranks_line(summary: dict[str, Any]) -> str:
    procs = summary.get("procs_per_node", 1)
    if procs <= 1:
        return ""
    return f"; {procs} ranks per node, ranks agree: {summary.get('ranks_agree')}"


def render_table(nodes: list[SwarmProcess]) -> Any:
    """A rich table with one row per node (for the live view)."""
    from rich.table import Table

    table = Table(title="atoll swarm", expand=False)
    for col in (
        "node",
        "peer",
        "state",
        "round",
        "step",
        "loss (nats)",
        "val bits/byte",
        "peers",
        "sent MiB",
    ):
        table.add_column(col, justify="right" if col not in ("peer", "state") else "left")
    for n in nodes:
        s = n.status
        state = s.get("state", "starting")
        if n.proc.poll() is not None and state != "stopped":
            state = f"exited {n.proc.returncode}"
        table.add_row(
            str(n.index),
            str(s.get("peer_id", ""))[-8:],
            state,
            str(s.get("round", 0)),
            str(s.get("step", 0)),
            f"{s['loss']:.3f}" if isinstance(s.get("loss"), float) else "-",
            f"{s['val_bpb']:.3f}" if isinstance(s.get("val_bpb"), float) else "-",
            str(s.get("peers", "-")),
            f"{s.get('bytes_sent', 0) / 2**20:.2f}",
        )
    return table


def dump_json(summary: dict[str, Any]) -> str:
    return json.dumps(summary, sort_keys=True)
