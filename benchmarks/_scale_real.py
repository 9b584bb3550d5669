"""Real swarms on this machine, measured for the scale simulator's calibration.

:func:`measure` runs ``nodes`` real nodes (``node.ops.swarm``) on the integration tests'
tiny model in ``steps`` mode (10 inner steps per round, two int8 fragments, one
thread per node) with butterfly groups of 4, and returns what a simulator of large
swarms needs to be calibrated on and checked against: per node and round the bytes
its syncs sent, the DHT and control-plane operations, bytes and CPU
(:mod:`node.run.load`), round times (mean and p95), the seconds an inner step takes, the
bytes and seconds of one fragment sync, and whether the swarm finished, mixed per the
butterfly schedule and learned.
"""

from __future__ import annotations

import pathlib
import statistics
import time
from typing import Any

from node.config import load_config
from node.ops import swarm
from node.ops.swarm import QUICK_WORKLOAD
from node.run.metrics import read_events
from protocol.averaging.grouping import rounds_to_mix

__all__ = ["GROUP_SIZE", "WORKLOAD", "measure"]

GROUP_SIZE = 4
WORKLOAD = (
    "run.run_id='bench-scale'",
    *QUICK_WORKLOAD,
    "run.threads=1",
    "sync.trigger='steps'",
    "sync.inner_steps=10",
    "sync.fragments=2",
    "sync.codec='int8'",
    "outer.momentum=0.5",
    f"network.group_size={GROUP_SIZE}",
    # Generous: matchmaking ends as soon as every live peer announced, so long windows
    # cost nothing unless a node is slow, and on 2 cores with 16 nodes some are.
    "network.matchmaking_seconds=20",
    "network.round_timeout=20",
    "network.request_timeout=15",
    "network.min_peers_timeout=300",
)
"""The quick workload with groups of 4, as the integration tests run it."""


def _timeout(nodes: int, rounds: int) -> float:
    return 180.0 + 10.0 * nodes + rounds * (40.0 + 5.0 * nodes)


def measure(
    nodes: int,
    rounds: int,
    out_dir: pathlib.Path,
    extra: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run a real swarm of ``nodes`` nodes for ``rounds`` rounds and measure it.

    Args:
        nodes: how many nodes (each a process with its p2pd, DHT process and sidecar).
        rounds: rounds every node runs before it exits.
        out_dir: the swarm's directory (node data directories, logs); created.
        extra: more config overrides, applied after :data:`WORKLOAD`.
        env: extra environment variables for every node (``ATOLL_LINK_SHAPE``, say).

    Returns:
        ``nodes``, ``peer_ids``, ``rounds_reached``, ``finished``, ``exit_codes``; per node
        (lists in node order) ``bytes_per_round`` (what its syncs sent) and the
        :mod:`node.run.load` figures per round (``dht_ops``, ``dht_bytes``,
        ``dht_payload_bytes``, ``dht_cpu_s``, ``control_messages``, ``control_bytes``,
        ``control_payload_bytes``, ``control_cpu_s``, ``p2pd_cpu_s``, ``node_cpu_s``,
        each ``_per_round``);
        the round figures (:func:`_round_figures`) and the sync figures (:func:`_sync_figures`);
        ``mix`` (the butterfly schedule's reach, :func:`node.ops.swarm.butterfly_reach`);
        ``val_bpb_start``, ``val_bpb_end``, ``seconds`` and ``config``.
    """
    overrides = [*WORKLOAD, *extra]
    cfg = load_config(None, overrides)
    spec = swarm.SwarmSpec(
        nodes=nodes,
        config_paths=[],
        overrides=overrides,
        directory=pathlib.Path(out_dir),
        rounds=rounds,
        env=dict(env or {}),
    )
    started = time.monotonic()
    procs, finished = swarm.run_to_end(spec, _timeout(nodes, rounds))
    summary = swarm.summarize(procs, cfg)
    syncs = [read_events(p.data_dir / "events.jsonl", "sync") for p in procs]
    return {
        "nodes": nodes,
        "peer_ids": [p.status.get("peer_id") for p in procs],
        "group_size": cfg.network.group_size,
        "rounds": rounds,
        "rounds_reached": summary["rounds"],
        "finished": finished,
        "exit_codes": summary["exit_codes"],
        "bytes_per_round": [_sent(per) / (summary["rounds"] or 1) for per in syncs],
        **{k: v for k, v in summary.items() if k.endswith("_per_round")},
        **_round_figures(procs, summary),
        **_sync_figures(procs, syncs, nodes, summary["rounds"], cfg),
        "rounds_to_mix": rounds_to_mix(nodes, cfg.network.group_size),
        "mix": summary["mix"],
        "val_bpb_start": summary["val_bpb_start"],
        "val_bpb_end": summary["val_bpb_end"],
        "seconds": round(time.monotonic() - started, 1),
        "config": overrides,
    }


def _round_figures(procs: list[Any], summary: dict[str, Any]) -> dict[str, Any]:
    """``load_mean`` (the load figures' means per round); ``load_per_second`` (the means
    per second of a round: on a shared machine rounds lengthen with the swarm, and what
    is paced by the clock, heartbeats and registry refreshes, grows per round with
    them); ``round_seconds``, ``round_seconds_mean`` and ``round_seconds_p95``;
    ``step_seconds`` (mean busy seconds per inner step)."""
    steps = [p.status.get("step", 0) for p in procs]
    busy = [p.status.get("busy_seconds", 0.0) for p in procs]
    return {
        "load_mean": summary["load_mean"],
        "load_per_second": _per_second(summary["load_mean"], summary["round_seconds_mean"]),
        "round_seconds": summary["round_seconds"],
        "round_seconds_mean": summary["round_seconds_mean"],
        "round_seconds_p95": summary["round_seconds_p95"],
        "step_seconds": sum(busy) / sum(steps) if sum(steps) else None,
    }


def _sync_figures(
    procs: list[Any], syncs: list[list[dict[str, Any]]], nodes: int, rounds: int | None, cfg: Any
) -> dict[str, Any]:
    """``bytes_per_fragment_sync`` and ``seconds_per_fragment_sync`` (one fragment sync
    of one node, launch to applied, both exchanges of a mixing group); ``syncs``,
    ``syncs_complete``, ``syncs_failed``; ``included_share`` (of every node's
    contribution to every fragment of every round, the share found in some group's
    result)."""
    flat = [s for per in syncs for s in per]
    return {
        "bytes_per_fragment_sync": _mean([s["bytes_sent"] for s in flat]),
        "seconds_per_fragment_sync": _mean([s["seconds"] for s in flat]),
        "syncs": len(flat),
        "syncs_complete": sum(bool(s["complete"]) for s in flat),
        "syncs_failed": sum(
            len(read_events(p.data_dir / "events.jsonl", "sync_failed")) for p in procs
        ),
        "included_share": _included_share(syncs, nodes, rounds, cfg.sync.fragments),
    }


def _included_share(
    syncs: list[list[dict[str, Any]]], nodes: int, rounds: int | None, fragments: int
) -> float | None:
    """Of the ``nodes x rounds x fragments`` contributions, the share that some group's
    result holds (a contributor of any part of any sync of that round and fragment)."""
    if not rounds:
        return None
    found: dict[tuple[int, int], set[str]] = {}
    for per in syncs:
        for s in per:
            parts = s.get("contributors") or []
            found.setdefault((s["round"], s["fragment"]), set()).update(
                p for part in parts for p in part
            )
    counted = sum(
        len(found.get((r, f), ())) for r in range(1, rounds + 1) for f in range(fragments)
    )
    return counted / (nodes * rounds * fragments)


def _sent(syncs: list[dict[str, Any]]) -> int:
    """Bytes that ``syncs`` sent together."""
    return sum(s["bytes_sent"] for s in syncs)


def _mean(values: list[float]) -> float | None:
    return statistics.mean(values) if values else None


def _per_second(per_round: dict[str, float | None], seconds: float | None) -> dict[str, float]:
    if not seconds:
        return {}
    return {
        name.replace("_per_round", "_per_second"): value / seconds
        for name, value in per_round.items()
        if value is not None
    }
