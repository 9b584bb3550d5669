"""Mixing benchmark: bytes and time per round of butterfly mixing against swarm size.

For each swarm size n (as many real nodes as the machine holds: 2, 4 and 8 in quick
mode, 16 as well in full mode where there are cores for it) two swarms of real nodes
(``node.ops.swarm``) run the integration tests' tiny model in ``steps`` mode (10 inner
steps per round, two int8 fragments, one thread per node):

- ``butterfly``: ``network.group_size = 2`` (layout ``butterfly``, the default). Each
  round every node averages with one partner per fragment, and because a pair does
  not span the swarm it also averages the pair's global copies (a second all-reduce
  under ``sync.mix_codec``, fp16 by default; ``node.run.syncer``). With the same peers the
  swarm holds the exact global mean after ``rounds_to_mix(n, 2) = log2 n`` rounds
  (``protocol.averaging.grouping``), so a full mix costs ``log2 n`` rounds of constant traffic.
- ``allreduce``: ``network.group_size = n``: one swarm-wide group per fragment, a
  butterfly all-reduce in which each node sends ``2 (n - 1) / n`` of its contribution
  and which mixes fully every round.

Per node and round it records the bytes sent twice: as the node counts them (its
``sync`` events, summed over fragments; the figure uses these) and as its processes put
them on TCP (``ss -tinp``, DHT and control traffic included), each fragment's sync time
(launch to applied) and the round's wall time (between consecutive ``round`` events),
plus the final validation bits per byte and whether every sync was complete. From
those it derives, per n, the bytes one node sends for one full mix: butterfly
(measured bytes per round x ``log2 n``), swarm-wide all-reduce (measured, one round)
and all-to-all (computed, not run: every node sends its whole encoded contribution to
each of the ``n - 1`` others), each beside the value computed from encoded sizes. With
n = 2 one group of 2 is the whole swarm, so the two configurations are the same and
run once.

Run it with ``python -m benchmarks mixing [--quick]`` (quick: 4 rounds per swarm;
full: 8 rounds; ``--smoke``: n = 2 only, 2 rounds of 2 inner steps); it writes
``mixing.json`` and ``mixing.png`` into the output folder.
"""

from __future__ import annotations

import bisect
import contextlib
import datetime
import json
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from typing import Any

import psutil

from benchmarks._common import figure, machine_info
from benchmarks._mode import Mode
from node.config import AtollConfig, load_config
from node.ops import swarm
from node.ops.swarm import QUICK_WORKLOAD
from node.ops.swarm_report import log_tail
from node.run.metrics import read_events, read_status
from node.train.model import build_model
from protocol.averaging.fragments import plan_fragments
from protocol.averaging.grouping import rounds_to_mix
from protocol.wire import codec as codecs

__all__ = ["run"]

_GROUP = 2
_QUICK_SIZES = (2, 4, 8)
_FULL_SIZES = (2, 4, 8, 16)
_SMOKE_SIZES = (2,)
_SMOKE_ROUNDS = 2  # a round's time is the span from the one before
_SMOKE = ("sync.inner_steps=2", "network.matchmaking_seconds=5")
# A node is a trainer, a DHT process and a p2pd: beyond four per core on this tiny
# model the rounds measure the CPU queue, not the protocol.
_NODES_PER_CORE = 4
_GIB_PER_NODE = 1.0
_WORKLOAD = [
    "run.run_id='bench-mixing'",
    *QUICK_WORKLOAD,
    "run.threads=1",
    "sync.trigger='steps'",
    "sync.inner_steps=10",
    "sync.fragments=2",
    "sync.codec='int8'",
    "outer.momentum=0.5",
    # Generous: matchmaking ends as soon as every live peer announced, so long windows
    # cost nothing unless a node is slow, and on 2 cores with 8 nodes some are.
    "network.matchmaking_seconds=20",
    "network.round_timeout=20",
    "network.request_timeout=15",
    "network.min_peers_timeout=150",
]


# ---- bytes on the wire ------------------------------------------------------------------

_SS_SENT = re.compile(r"bytes_(?:sent|acked):(\d+)")
_SS_PID = re.compile(r"pid=(\d+),")


class _WireMeter:
    """TCP bytes each node's processes (trainer, p2pd, DHT) sent, sampled with ``ss``.

    A background thread reads every TCP socket's ``tcp_info`` (``ss -tinp``) a few
    times a second and keeps each socket's last byte count, so a node's total is what
    all of its sockets sent, TLS and stream framing and DHT traffic included. A socket
    that closes between two samples loses at most one interval of its bytes.
    """

    def __init__(self, directory: pathlib.Path, nodes: int, interval: float = 0.2) -> None:
        self.directory, self.nodes, self.interval = directory, nodes, interval
        self.available = shutil.which("ss") is not None
        self.series: list[tuple[float, list[int]]] = []
        self._sockets: dict[tuple[int, str], int] = {}
        self._closed = [0] * nodes
        self._owners: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="wire-meter", daemon=True)

    def __enter__(self) -> _WireMeter:
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def _loop(self) -> None:
        refreshed = 0.0
        while not self._stop.wait(self.interval):
            with contextlib.suppress(Exception):  # a failed sample is only a gap
                if time.monotonic() - refreshed > 2.0:
                    self._owners, refreshed = self._find_owners(), time.monotonic()
                self._sample()

    def _find_owners(self) -> dict[int, int]:
        """pid -> node index for every node process and its children."""
        owners = {}
        for i in range(self.nodes):
            pid = (read_status(self.directory / f"node{i}" / "status.json") or {}).get("pid")
            with contextlib.suppress(psutil.Error, TypeError, ValueError):
                proc = psutil.Process(pid)
                for p in [proc, *proc.children(recursive=True)]:
                    owners[p.pid] = i
        return owners

    def _sample(self) -> None:
        out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, timeout=5).stdout
        owner = None
        for line in out.splitlines():
            if not line[:1].isspace():  # a socket line; its tcp_info follows on the next
                pids = [int(p) for p in _SS_PID.findall(line)]
                owner = next((self._owners[p] for p in pids if p in self._owners), None)
                key = " ".join(line.split()[3:5])
                continue
            sent = _SS_SENT.search(line)
            if owner is None or sent is None:
                continue
            value, last = int(sent.group(1)), self._sockets.get((owner, key), 0)
            if value < last:  # the port was reused by a new connection
                self._closed[owner] += last
            self._sockets[(owner, key)] = value
        totals = list(self._closed)
        for (node, _), value in self._sockets.items():
            totals[node] += value
        self.series.append((time.time(), totals))

    def total_at(self, node: int, t: float) -> float | None:
        """Bytes node ``node`` had sent at wall time ``t`` (linear between samples)."""
        times = [s[0] for s in self.series]
        k = bisect.bisect_left(times, t)
        if k == 0 or k == len(times):
            return None
        (t0, a), (t1, b) = self.series[k - 1], self.series[k]
        return a[node] + (b[node] - a[node]) * (t - t0) / (t1 - t0)


# ---- one swarm ---------------------------------------------------------------------------


def _node_rounds(
    data_dir: pathlib.Path, fragments: int, wire: _WireMeter, index: int
) -> dict[str, Any]:
    """Per round of one node: bytes sent (its sync events, and on the wire), times."""
    events = read_events(data_dir / "events.jsonl")
    ends = {e["round"]: e["t"] for e in events if e["event"] == "round"}
    syncs = [e for e in events if e["event"] == "sync"]
    rounds = []
    for r in sorted(ends):
        mine = [s for s in syncs if s["round"] == r]
        record = {
            "round": r,
            "event_bytes_sent": sum(s["bytes_sent"] for s in mine),
            "wire_bytes_sent": None,
            "sync_seconds": [round(s["seconds"], 3) for s in mine],
            "round_seconds": None,
            "syncs": len(mine),
            "complete": len(mine) == fragments and all(s["complete"] for s in mine),
            "fallback_parts": sum(len(s.get("fallback_parts", [])) for s in mine),
            "repaired_parts": sum(len(s.get("repaired_parts", [])) for s in mine),
            "mixed": any(s["mixed"] for s in mine),
            "group_sizes": [len(s["group"]) for s in mine],
        }
        if r - 1 in ends:  # a round's span: from the previous round's end to its own
            record["round_seconds"] = round(ends[r] - ends[r - 1], 3)
            before, after = wire.total_at(index, ends[r - 1]), wire.total_at(index, ends[r])
            if before is not None and after is not None:
                record["wire_bytes_sent"] = int(after - before)
        rounds.append(record)
    failed = [e["round"] for e in events if e["event"] == "sync_failed"]
    return {"rounds": rounds, "syncs_failed_in_rounds": failed}


def _run_swarm(
    n: int,
    group_size: int,
    rounds: int,
    directory: pathlib.Path,
    timeout: float,
    workload: list[str],
) -> dict[str, Any]:
    """``n`` nodes with groups of ``group_size`` to their end (or ``timeout``)."""
    overrides = [*workload, f"network.group_size={group_size}", f"run.eval_every={rounds}"]
    spec = swarm.SwarmSpec(
        nodes=n, config_paths=[], overrides=overrides, directory=directory, rounds=rounds
    )
    with _WireMeter(directory, n) as wire:
        nodes, finished = swarm.run_to_end(spec, timeout)
    cfg = load_config(None, overrides)
    summary = swarm.summarize(nodes, cfg)
    per_node = [
        _node_rounds(node.data_dir, cfg.sync.fragments, wire, i) for i, node in enumerate(nodes)
    ]
    every = [r for p in per_node for r in p["rounds"]]
    full = [r for r in every if r["syncs"] == cfg.sync.fragments]
    wire_sent = [r["wire_bytes_sent"] for r in every if r["wire_bytes_sent"] is not None]
    syncs = [s for r in every for s in r["sync_seconds"]]
    record: dict[str, Any] = {
        "nodes": n,
        "group_size": group_size,
        "wire_bytes_per_round_per_node": _mean(wire_sent),
        "wire_bytes_per_round_min_max": [min(wire_sent), max(wire_sent)] if wire_sent else None,
        "event_bytes_per_round_per_node": _mean([r["event_bytes_sent"] for r in full]),
        "round_seconds": _mean([r["round_seconds"] for r in every if r["round_seconds"]]),
        "sync_seconds": _mean(syncs),
        "sync_seconds_max": round(max(syncs), 3) if syncs else None,
        "all_syncs_complete": _all_complete(per_node, rounds),
        "syncs_failed": sum(len(p["syncs_failed_in_rounds"]) for p in per_node),
        "mixed": any(r["mixed"] for r in full),
        "val_bpb_start": _round(summary["val_bpb_start"]),
        "val_bpb_end": _round(summary["val_bpb_end"]),
        "rounds_reached": summary["rounds"],
        "params_agree": summary["params_agree"],
        "exit_codes": summary["exit_codes"],
        "finished": finished,
        "wire_samples": len(wire.series),
        "per_node": per_node,
    }
    if not finished:
        record["error"] = "timed out; stopped before every node finished"
    return record


def _all_complete(per_node: list[dict[str, Any]], rounds: int) -> bool:
    """Every node ended every round with every fragment synced completely."""
    return all(
        len(p["rounds"]) == rounds
        and all(r["complete"] for r in p["rounds"])
        and not p["syncs_failed_in_rounds"]
        for p in per_node
    )


def _mean(values: list[float]) -> float | None:
    return round(statistics.mean(values), 3) if values else None


def _round(value: float | None) -> float | None:
    return round(value, 4) if value is not None else None


# ---- sizes and derived numbers -----------------------------------------------------------


def _sizes(quick: bool, smoke: bool = False) -> tuple[list[int], dict[str, str]]:
    """Swarm sizes this machine holds, and why the others were left out."""
    cores = os.cpu_count() or 1
    memory = psutil.virtual_memory().total / 2**30
    limit = min(cores * _NODES_PER_CORE, int(memory / _GIB_PER_NODE))
    sizes = _SMOKE_SIZES if smoke else _QUICK_SIZES if quick else _FULL_SIZES
    skipped = {
        str(n): f"{n} nodes exceed {_NODES_PER_CORE} per core on {cores} cores "
        f"or {_GIB_PER_NODE:g} GiB each of {memory:.0f} GiB"
        for n in sizes
        if n > limit
    }
    return [n for n in sizes if n <= limit], skipped


def _model_bytes(cfg: AtollConfig) -> dict[str, int]:
    """Parameters, and one node's encoded contribution and global copy per round."""
    plan = plan_fragments(build_model(cfg.model, seed=cfg.run.seed), cfg.sync.fragments)
    block = cfg.sync.block_size
    return {
        "params": plan.numel,
        "contribution_bytes": sum(
            codecs.encoded_size(f.numel, cfg.sync.codec, block) for f in plan.fragments
        ),
        "mix_bytes": sum(
            codecs.encoded_size(f.numel, cfg.sync.mix_codec, block) for f in plan.fragments
        ),
    }


def _derived(n: int, butterfly: dict, allreduce: dict, model: dict[str, int]) -> dict[str, Any]:
    """Per-node bytes to one full mix: measured (events, wire) and computed."""
    mix_rounds = rounds_to_mix(n, _GROUP)
    contribution, mix = model["contribution_bytes"], model["mix_bytes"]
    expected = {
        "butterfly": (contribution + (mix if n > _GROUP else 0)) * _share(min(n, _GROUP)),
        "allreduce": contribution * _share(n),
    }
    out: dict[str, Any] = {
        "rounds_to_mix_butterfly": mix_rounds,
        "all_to_all_full_mix_bytes": (n - 1) * contribution,
    }
    for key, record, rounds in (("butterfly", butterfly, mix_rounds), ("allreduce", allreduce, 1)):
        events = record.get("event_bytes_per_round_per_node")
        wire = record.get("wire_bytes_per_round_per_node")
        out[f"{key}_full_mix_bytes"] = int(rounds * events) if events else None
        out[f"{key}_full_mix_bytes_expected"] = int(rounds * expected[key])
        out[f"{key}_full_mix_bytes_wire"] = int(rounds * wire) if wire else None
        out[f"{key}_events_over_expected"] = _ratio(events, expected[key])
        out[f"{key}_wire_over_expected"] = _ratio(wire, expected[key])
    return out


def _share(group: int) -> float:
    """Share of its vector one member of a ``group``-member all-reduce sends."""
    return 2 * (group - 1) / group


def _ratio(measured: float | None, expected: float) -> float | None:
    return round(measured / expected, 4) if measured and expected else None


def _nan(value: float | None) -> float:
    return float("nan") if value is None else value


# ---- figure ------------------------------------------------------------------------------


def _plot(report: dict[str, Any], path: pathlib.Path) -> None:
    per_n = report["results"]
    ns = [int(n) for n in per_n]
    with figure(path, 1, 2, figsize=(12.0, 4.8)) as (fig, (traffic, times)):
        _plot_traffic(traffic, report, ns)
        _plot_times(times, per_n, ns)
        for ax in (traffic, times):
            ax.set_xscale("log", base=2)
            ax.set_xticks(ns, [str(n) for n in ns])
            ax.set_xlabel("nodes n (log2 scale)")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(
            f"{report['rounds']} rounds of {report['config']['inner_steps']} inner steps per swarm, "
            f"real nodes on {report['machine']['cpu_count']} cores",
            fontsize=10,
        )


def _plot_traffic(traffic: Any, report: dict[str, Any], ns: list[int]) -> None:
    """The bytes panel: what one node sends for a full mix, measured and computed."""
    per_n = report["results"]
    series = (
        (
            "butterfly_full_mix_bytes",
            f"butterfly mixing, groups of {_GROUP} (measured)",
            "o-",
            "tab:blue",
        ),
        ("butterfly_full_mix_bytes_expected", "butterfly mixing (computed)", ":", "tab:blue"),
        ("all_to_all_full_mix_bytes", "all-to-all (computed)", "s--", "tab:orange"),
        ("allreduce_full_mix_bytes", "swarm-wide all-reduce (measured)", "^-", "tab:green"),
        (
            "allreduce_full_mix_bytes_expected",
            "swarm-wide all-reduce (computed)",
            ":",
            "tab:green",
        ),
    )
    for key, label, style, color in series:
        points = [(n, per_n[str(n)]["derived"].get(key)) for n in ns]
        points = [(n, v / 1e3) for n, v in points if v]
        xs, ys = [n for n, _ in points], [v for _, v in points]
        traffic.plot(xs, ys, style, color=color, label=label)
        if "expected" in key:
            continue
        for n, v in points:
            traffic.annotate(
                f"{v:.0f}", (n, v), textcoords="offset points", xytext=(4, 4), fontsize=7
            )
    model = report["model"]
    traffic.set_title(
        f"bytes one node sends for one full mix (measured: the nodes' sync events)\n"
        f"{model['params']:,} params: {report['config']['codec']} contribution "
        f"{model['contribution_bytes'] / 1e3:.0f} kB, {report['config']['mix_codec']} global "
        f"copy {model['mix_bytes'] / 1e3:.0f} kB",
        fontsize=10,
    )
    traffic.set_ylabel("kB per node")
    traffic.margins(x=0.08)


def _plot_times(times: Any, per_n: dict[str, Any], ns: list[int]) -> None:
    """The time panel: each configuration's round and fragment sync per n."""
    for key, label, color in (
        ("butterfly", f"butterfly, groups of {_GROUP}", "tab:blue"),
        ("allreduce", "swarm-wide all-reduce", "tab:green"),
    ):
        rounds = [_nan(per_n[str(n)][key].get("round_seconds")) for n in ns]
        syncs = [_nan(per_n[str(n)][key].get("sync_seconds")) for n in ns]
        times.plot(ns, rounds, "o-", color=color, label=f"{label}: round (wall)")
        times.plot(ns, syncs, "o:", color=color, label=f"{label}: fragment sync")
    times.set_title("time per round and per fragment sync (mean over nodes)", fontsize=10)
    times.set_ylabel("seconds")
    times.set_ylim(bottom=0)


# ---- entry point -------------------------------------------------------------------------


def _measure(
    n: int, rounds: int, directory: pathlib.Path, workload: list[str]
) -> dict[str, dict[str, Any]]:
    """Both configurations at ``n`` nodes (one run when a group of 2 is the whole swarm)."""
    out: dict[str, dict[str, Any]] = {}
    for key, group_size in (("butterfly", _GROUP), ("allreduce", n)):
        if n <= _GROUP and out:
            out[key] = {**out["butterfly"], "same_run_as": "butterfly"}
            continue
        out[key] = _attempts(n, group_size, rounds, directory / f"n{n}-{key}", workload)
    return out


def _attempts(
    n: int, group_size: int, rounds: int, directory: pathlib.Path, workload: list[str]
) -> dict[str, Any]:
    """One swarm; started a second time if a node fails to come up (a busy machine)."""
    timeout = 150.0 + 10.0 * n + rounds * (40.0 + 5.0 * n)
    started, failures = time.monotonic(), []
    for attempt in range(2):
        try:
            where = directory / f"try{attempt}"
            record = _run_swarm(n, group_size, rounds, where, timeout, workload)
            break
        except Exception as e:  # one broken swarm must not cost the others
            record = {"error": f"{type(e).__name__}: {e}", "nodes": n, "group_size": group_size}
            failures.append({**record, "log_tail": _log_tail(str(e))})
            if "during start" not in str(e) and "did not come up" not in str(e):
                break
    record["start_failures"] = failures
    record["seconds"] = round(time.monotonic() - started, 1)
    return record


def _log_tail(message: str, lines: int = 8) -> list[str]:
    """The last lines of the node log an error message points to."""
    found = re.search(r"see (\S+node\.log)", message)
    if not found:
        return []
    return log_tail(pathlib.Path(found.group(1)).parent, lines)


def run(mode: Mode, out_dir: pathlib.Path) -> dict:
    """Measures bytes and time per round of butterfly mixing and a swarm-wide all-reduce.

    Args:
        mode: what it runs: ``quick``: n = 2, 4, 8 and 4 rounds per swarm (about 4 minutes
            on 2 cores); otherwise n up to 16 where the machine holds it, and 8 rounds;
            ``smoke``: n = 2 only, 2 rounds of 2 inner steps: a check that it runs.
        out_dir: folder for ``mixing.json`` and ``mixing.png``; created if missing.

    Returns:
        The dict written to ``mixing.json``: ``results`` (per n: ``butterfly`` and
        ``allreduce`` runs with per-node, per-round records, and ``derived`` bytes to a
        full mix), ``model``, ``config``, ``skipped``, ``notes``, ``date`` and ``machine``.
    """
    rounds = _SMOKE_ROUNDS if mode.smoke else 4 if mode.quick else 8
    sizes, skipped = _sizes(mode.quick, mode.smoke)
    workload = [*_WORKLOAD, *(_SMOKE if mode.smoke else ())]
    cfg = load_config(None, workload)
    model = _model_bytes(cfg)
    started = time.monotonic()
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="atoll-mixing-") as tmp:
        for n in sizes:
            runs = _measure(n, rounds, pathlib.Path(tmp), workload)
            a, b = runs["butterfly"], runs["allreduce"]
            runs["derived"] = _derived(n, a, b, model)
            results[str(n)] = runs
    report = {
        "benchmark": "mixing",
        "quick": mode.quick,
        "smoke": mode.smoke,
        "rounds": rounds,
        "sizes": sizes,
        "skipped": skipped,
        "model": model,
        "config": {
            "workload": workload,
            "codec": cfg.sync.codec,
            "mix_codec": cfg.sync.mix_codec,
            "fragments": cfg.sync.fragments,
            "inner_steps": cfg.sync.inner_steps,
            "block_size": cfg.sync.block_size,
            "butterfly_group_size": _GROUP,
            "layout": cfg.sync.layout,
        },
        "results": results,
        "seconds": round(time.monotonic() - started, 1),
        "notes": _NOTES,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
    }
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "mixing.json").write_text(json.dumps(report, indent=2) + "\n")
    _plot(report, out_dir / "mixing.png")
    return report


_NOTES = {
    "event_bytes": "measured, used for the figure: the nodes' own count, bytes_sent of "
    "their sync events summed over a round's fragments (envelopes and signatures "
    "included). Biased: each all-reduce reports the change of one per-node counter over "
    "its run, so the two all-reduces a mixing group runs at once (pseudo-gradients in "
    "sync.codec, global copies in sync.mix_codec) count each other's bytes (over), and a "
    "reply served after a run returned is counted by no run (under); *_events_over_expected "
    "shows by how much",
    "wire_bytes": "measured: all TCP bytes a node's processes (trainer, p2pd, DHT) sent in "
    "a round, from ss -tinp (tcp_info bytes_sent) sampled every 0.2 s and interpolated at "
    "the node's round ends (rounds 2..R): the all-reduces plus TLS and stream framing, "
    "DHT matchmaking polls, registry records and state attestations, which grow with "
    "the round's wall time",
    "expected": "computed from encoded sizes: butterfly (contribution + global copy in "
    "mix_codec) x 2(G-1)/G with G=2 per round; swarm-wide contribution x 2(n-1)/n; "
    "without envelopes",
    "butterfly_full_mix_bytes": "rounds_to_mix(n, 2) = log2 n rounds x bytes per round "
    "per node (constant in n: groups of 2)",
    "allreduce_full_mix_bytes": "one round of the swarm-wide group, which mixes fully every round",
    "all_to_all_full_mix_bytes": "computed, not run: (n-1) x the encoded contribution "
    "(all fragments, sync.codec, block scales included), every node sending its whole "
    "contribution to every other node in one round",
    "round_seconds": "wall time between consecutive round events of a node (rounds 2..R; "
    "the last includes the final evaluation); sync_seconds: one fragment sync from launch "
    "to applied",
    "n_2": "with 2 nodes a group of 2 is the whole swarm: no mixing, one run for both",
    "all_syncs_complete": "every node synced every fragment in every round, every sync "
    "complete (no part kept at its local value), and no sync_failed event",
    "params_agree": "bitwise equal global parameters across nodes; not expected for "
    "butterfly mixing, whose groups step with their own mean pseudo-gradient",
    "cpu": "all nodes share the machine's cores (and its load: see machine): round times "
    "include CPU contention that grows with n, independent of the protocol",
}
