"""What a local swarm did: its summary, and whether the butterfly schedule mixed it (the
views an operator reads of it are :mod:`node.ops.swarm_view`).

Everything here reads the nodes' own files (``status.json``, ``events.jsonl``); the
processes themselves are :mod:`node.ops.swarm`'s.
"""

from __future__ import annotations

import math
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node.config import AtollConfig
from node.run.load import per_round
from node.run.metrics import read_events, read_status
from protocol.averaging.grouping import rounds_to_mix

__all__ = [
    "SwarmProcess",
    "butterfly_reach",
    "copies_apart",
    "log_tail",
    "summarize",
]


@dataclass
class SwarmProcess:
    """One launched node of a local swarm."""

    index: int
    data_dir: Path
    proc: subprocess.Popen
    log: Any

    @property
    def status(self) -> dict[str, Any]:
        return read_status(self.data_dir / "status.json") or {}


_Held = dict[tuple[int, int], dict[str, dict[str, Any]]]
"""Per (round, fragment): each node's sync event."""

_PerNode = list[tuple["SwarmProcess", dict[str, Any], dict]]
"""Per honest node: its process, its last status and its round events by round."""


def summarize(
    nodes: list[SwarmProcess], cfg: AtollConfig, byzantine: Sequence[int] = ()
) -> dict[str, Any]:
    """What the swarm did, from each node's status and event log.

    Agreement and bits per byte are over the honest nodes only; faulty nodes
    (``byzantine`` indices) are listed but not averaged in. Per honest node it also
    gives what the DHT and control plane cost it per round (``dht_ops_per_round``,
    ``control_cpu_s_per_round``, ... from :func:`node.run.load.per_round`, with their means
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
        "copies_apart": None if common and not mismatched else _apart(per_node),
        "rounds_checked": len(common),
        "rounds_disagreeing": mismatched,
        "exit_codes": [n.proc.returncode for n in nodes],
        "failed_nodes": {
            str(n.index): log_tail(n.data_dir) for n in nodes if n.proc.returncode not in (0, None)
        },
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


def copies_apart(data_dirs: Sequence[Path]) -> dict[str, Any] | None:
    """How far apart the nodes' global copies are, from their newest checkpoints: of
    the round most of them checkpointed last, the largest distance of one node's copy
    from the copies' mean, over the mean's norm (None with fewer than two checkpoints
    of one round). Groups that mix hold different copies by design; this says how
    different."""
    import torch

    from node.train.checkpoint import load_latest

    by_round: dict[int, list[torch.Tensor]] = {}
    for d in data_dirs:
        found = load_latest(Path(d) / "checkpoints")
        if found is None:
            continue
        info, state = found
        globals_ = (state.get("outer") or {}).get("globals") or []
        if globals_:
            flat = torch.cat([g.detach().flatten().double() for g in globals_])
            by_round.setdefault(info.round, []).append(flat)
    if not by_round:
        return None
    round_, copies = max(by_round.items(), key=lambda kv: (len(kv[1]), kv[0]))
    if len(copies) < 2 or len({c.numel() for c in copies}) > 1:
        return None
    stacked = torch.stack(copies)
    mean = stacked.mean(dim=0)
    scale = float(mean.norm()) or 1.0
    apart = max(float((c - mean).norm()) for c in stacked) / scale
    return {"round": round_, "nodes": len(copies), "max_from_mean": round(apart, 6)}


def log_tail(data_dir: Path, lines: int = 8) -> list[str]:
    """The last ``lines`` lines of a node's log (none when it has no log): why a node
    that failed did, kept before its directory goes."""
    try:
        text = (data_dir / "node.log").read_text(errors="replace")
    except OSError:
        return []
    return text.strip().splitlines()[-lines:]


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
        each fragment has a grid of its own); ``groups`` (distinct groups of a round
        and fragment whose members all synced completely) and ``groups_agreeing`` (their members hold the same
        global copy of the fragment afterwards; with outer momentum they differ by
        each member's history).
    """
    peers = sorted(syncs)
    cells = cells_above is not None and len(peers) > cells_above
    d = None if cells else rounds_to_mix(len(peers), group_size)
    span = d
    if cells and group_size >= 2:
        span = max(1, math.ceil(math.log(len(peers)) / math.log(group_size) - 1e-9))
    held: _Held = {}
    for peer, events in syncs.items():
        for e in events:
            held.setdefault((e["round"], e["fragment"]), {})[peer] = e
    windows = _windows(held, peers, span)
    shares: dict[int, list[float]] = {}
    for f, _, share in windows:
        shares.setdefault(f, []).append(share)
    groups, agreeing = _groups(held)
    return {
        "rounds_to_mix": d,
        "window": span,
        "windows": len(windows),
        "windows_mixed": sum(mixed for _, mixed, _ in windows),
        "reach_share": sum(s for _, _, s in windows) / len(windows) if windows else None,
        "reach_by_fragment": {f: sum(per) / len(per) for f, per in shares.items()},
        "groups": groups,
        "groups_agreeing": agreeing,
    }


def _windows(held: _Held, peers: list[str], span: int | None) -> list[tuple[int, bool, float]]:
    """Every window of ``span`` rounds in which a fragment synced every round:
    ``(fragment, every node reached every other, share of (source, holder) pairs
    reached)``, fragment by fragment."""
    found = []
    rounds = sorted({r for r, _ in held})
    for f in sorted({f for _, f in held}):
        for start in rounds if span else []:
            window = range(start, start + span)
            if not all((r, f) in held for r in window):
                continue
            reach = {p: {p} for p in peers}
            for r in window:
                reach = {p: _reached(p, held[(r, f)].get(p), reach) for p in peers}
            mixed = all(len(reach[p]) == len(peers) for p in peers)
            share = sum(len(reach[p] & set(peers)) for p in peers) / len(peers) ** 2
            found.append((f, mixed, share))
    return found


def _groups(held: _Held) -> tuple[int, int]:
    """Distinct groups (of a round and fragment) whose members all synced completely,
    and how many of them hold one global copy afterwards."""
    groups = agreeing = 0
    for records in held.values():
        seen: dict[tuple[str, ...], set[str]] = {}
        for e in records.values():
            members = tuple(e["group"])
            if all(records.get(m, {}).get("complete") for m in members):
                seen.setdefault(members, set()).add(str(e.get("global_digest")))
        groups += len(seen)
        agreeing += sum(len(digests) == 1 for digests in seen.values())
    return groups, agreeing


def _reached(peer: str, event: dict[str, Any] | None, reach: dict[str, set[str]]) -> set[str]:
    if event is None or not event.get("contributors"):
        return set(reach[peer])
    whole = set.intersection(*(set(part) for part in event["contributors"])) | {peer}
    return set().union(*(reach.get(q, {q}) for q in whole))


def _load(per_node: _PerNode) -> dict[str, Any]:
    """Per honest node, what the DHT and control plane cost it per round
    (:func:`node.run.load.per_round`) and the wall time of its rounds; with the means."""
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


def _ranks_agree(per_node: _PerNode) -> bool | None:
    """Whether every rank of every honest site held the leader's parameters at the end
    of every round (None: no node ran as a site of several processes)."""
    checks = [
        e["ranks_agree"] for _, _, rounds in per_node for e in rounds.values() if "ranks" in e
    ]
    return all(checks) if checks else None


def _flagged(per_node: _PerNode) -> dict[str, dict]:
    """Per honest node: the peers it quarantined or banned (from its last round)."""
    out = {}
    for n, _, rounds in per_node:
        last = rounds[max(rounds)] if rounds else {}
        out[str(n.index)] = last.get("flagged", {})
    return out


def _mean(values: list[Any]) -> float | None:
    vals = [float(v) for v in values if isinstance(v, (int, float))]
    return sum(vals) / len(vals) if vals else None


def _apart(per_node: list[tuple[SwarmProcess, dict, dict]]) -> dict[str, Any] | None:
    try:
        return copies_apart([n.data_dir for n, _, _ in per_node])
    except (OSError, RuntimeError, ValueError):  # a summary never fails on a bad file
        return None
