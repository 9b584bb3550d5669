"""Scale benchmark: real swarms of 4, 8 and 16 nodes here, then a calibrated simulation
up to 10,000 nodes over a WAN.

1. **Real runs** (:func:`benchmarks._scale_real.measure`): ``n`` real nodes on
   127.0.0.1, the integration tests' workload in groups of 4 (10-step rounds, two int8
   fragments), per node and round: bytes its syncs sent, DHT and control-plane
   operations, bytes and CPU, round times.
2. **Calibration** (:func:`benchmarks._scale_sim.calibrate`): the simulator takes the
   real runs' step time (per n: on two shared cores it grows with n), bytes per
   fragment (from the smallest size, where one group is the swarm), sidecar CPU per
   control message and DHT CPU per operation, all nodes at one site on loopback; one
   fixed overhead per sync is fitted at the smallest size. Each size's real round time
   is then compared (target: within 20 %) with the larger of the simulator's round and
   the CPU bound ``n x measured CPU per node and round / 2 cores``: here every node
   shares the same two cores, which the simulator (nodes with hardware of their own)
   does not model.
   Two checks out of that sample: **link-bound rounds**, the same workload at 4 and 8
   nodes with every node's uplink shaped to 0.5 Mbit/s and 20 ms one way
   (``protocol.p2p.shaper``), where the link and not the shared CPU sets the round,
   against the simulator with the same link and the overhead fitted above; and the
   **cell grid on real nodes**, 16 nodes in groups of 2 above ``cells_above = 8``
   (a grid of 3 axes, lines of about 4 peers), its share of contributions in a result
   and its reach after ``ceil(log_2 16) = 4`` rounds against the simulator's on the
   same PeerIDs (so on the same grid), and the simulator's reach under 20 other sets
   of PeerIDs. Last, the 4, 8 and 16 nodes again on 20-s wall-clock rounds
   (``load_table``): what the DHT and the control plane cost a node per round,
   comparable across sizes.
3. **Simulation**: n from 16 to 10,000 (powers of 4, so butterfly groups of 4 stay
   exact, and 10,000, which has a prime factor 5 and falls back to random groups) on the
   default WAN (five regions 3,600-16,000 km apart, 10 Gbit/s per node, 1 % churn per
   round) with the reference model's int8 fragments, under three control-plane
   policies: the node before pacing (``before``), today's node (``node``: intervals
   stretched by n / 8 above 8 nodes, matchmaking on the cell grid above 256, the
   registry in ``n / 256`` shards) and bounded sampled registry reads (``sampled``, a
   design not built).

Run it with ``python -m benchmarks scale [--quick]``; it writes ``scale.json`` and
``scale.png``. Quick mode: 6 real rounds per size (4 of 20 s for the load table) and 3
simulated rounds (about 14 minutes here); full mode: 10 (6) and 6. A smoke run
(``--smoke``) runs each kind of real swarm once with 2 nodes for 2 rounds of 2 inner
steps (rounds of 4 s for the load table) and simulates 16 and 64 nodes for 1 round.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from benchmarks import _scale_real, _scale_sim
from benchmarks._common import figure, machine_info
from benchmarks._mode import Mode
from protocol.averaging.grouping import cell_dims
from protocol.p2p.shaper import ENV_VAR

__all__ = ["run"]

_REAL_SIZES = (4, 8, 16)
_SIM_SIZES = (16, 64, 256, 1024, 4096, 10_000)
_POLICIES = {
    "before": _scale_sim.CURRENT_POLICY,
    "node": _scale_sim.NODE_POLICY,
    "sampled": _scale_sim.ADAPTIVE_POLICY,
}
_SHAPED_SIZES = (4, 8)
_SHAPE_MBIT, _SHAPE_DELAY_MS = 0.5, 20.0
_SHAPED_EXTRA = (  # a fragment sync takes seconds on this link: windows to match
    "network.round_timeout=120",
    "network.request_timeout=60",
    "network.matchmaking_seconds=60",
)
_CELL_NODES, _CELL_GROUP, _CELL_ABOVE, _CELL_LAYOUTS = 16, 2, 8, 20
_WALLCLOCK = ("sync.trigger='seconds'", "sync.round_seconds=20", "network.matchmaking_seconds=5")
"""Rounds of 20 s on the wall clock, so that what a node spends per round compares
across sizes (with step-triggered rounds here rounds lengthen with the shared CPU)."""
_SMOKE = ("sync.inner_steps=2", "network.matchmaking_seconds=5")
_SMOKE_WALLCLOCK = (
    "sync.trigger='seconds'",
    "sync.round_seconds=4",
    "network.matchmaking_seconds=1",
)
_LOAD_KEYS = (
    "dht_ops_per_round",
    "dht_payload_bytes_per_round",
    "dht_bytes_per_round",
    "dht_cpu_s_per_round",
    "control_messages_per_round",
    "control_bytes_per_round",
    "control_cpu_s_per_round",
    "p2pd_cpu_s_per_round",
)
_TARGET_ROUND_ERROR = 0.20
_CORES = 2  # this machine's, which every real node shares
_LOOPBACK = _scale_sim.Site("loopback", 0.0, 0.0)
# The reference model (478,720 parameters) in 4 int8 fragments, and its fp32 state.
_REFERENCE_FRAGMENT_BYTES = 478_720 / 4 * (1 + 4 / 256)
_REFERENCE_MODEL_BYTES = 478_720 * 4 * 3  # weights, global copy, outer momentum


@dataclass(frozen=True)
class _Plan:
    """The real swarms one run measures and the sizes it simulates."""

    real_rounds: int
    sim_rounds: int
    wall_rounds: int
    real_sizes: tuple[int, ...] = _REAL_SIZES
    shaped_sizes: tuple[int, ...] = _SHAPED_SIZES
    cell_nodes: int = _CELL_NODES
    cell_layouts: int = _CELL_LAYOUTS
    sim_sizes: tuple[int, ...] = _SIM_SIZES
    wallclock: tuple[str, ...] = _WALLCLOCK
    extra: tuple[str, ...] = ()  # overrides of every real swarm


def _plan(quick: bool, smoke: bool) -> _Plan:
    if smoke:
        return _Plan(
            real_rounds=2,  # a round's time is the span from the one before
            sim_rounds=1,
            wall_rounds=2,
            real_sizes=(2,),
            shaped_sizes=(2,),
            cell_nodes=2,
            cell_layouts=2,
            sim_sizes=(16, 64),
            wallclock=(*_WALLCLOCK, *_SMOKE_WALLCLOCK),
            extra=_SMOKE,
        )
    return _Plan(6, 3, 4) if quick else _Plan(10, 6, 6)


def _per(real: dict[str, Any], key: str) -> float | None:
    return (real.get("load_mean") or {}).get(key)


def _calibration(real: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The constants the real runs give, pooled over sizes where they should not vary."""
    cpu_per_msg, dht_per_op = [], []
    for r in real.values():
        msgs, cpu = _per(r, "control_messages_per_round"), _per(r, "control_cpu_s_per_round")
        if msgs and cpu is not None:
            cpu_per_msg.append(cpu / msgs)
        ops, dcpu = _per(r, "dht_ops_per_round"), _per(r, "dht_cpu_s_per_round")
        if ops and dcpu is not None:
            dht_per_op.append(dcpu / ops)
    # At the smallest size one group spans the swarm: a sync is its exchange alone (no
    # mixing of global copies between groups), where a member sends 2 (G - 1) / G of it.
    # At the largest, groups also mix their global copies; the difference is that.
    one_group = real[min(real)].get("bytes_per_fragment_sync")
    mixing = real[max(real)].get("bytes_per_fragment_sync")
    share = 2 * (_scale_real.GROUP_SIZE - 1) / _scale_real.GROUP_SIZE
    return {
        "fragment_bytes": one_group / share if one_group else None,
        "mix_bytes": (mixing - one_group) / share if one_group and mixing else None,
        "control_cpu_per_message_s": statistics.median(cpu_per_msg) if cpu_per_msg else None,
        "dht_cpu_per_op_s": statistics.median(dht_per_op) if dht_per_op else None,
    }


def _local_config(real: dict[str, Any], constants: dict[str, Any]) -> _scale_sim.SimConfig:
    """The simulator set up as the real run of one size: one site, loopback links."""
    fields = {k: v for k, v in constants.items() if v is not None}
    return dataclasses.replace(
        _scale_sim.SimConfig(),
        group_size=_scale_real.GROUP_SIZE,
        fragments=2,
        inner_steps=10,
        step_seconds=real["step_seconds"],
        step_spread=0.05,
        upload_gbit=10.0,
        download_gbit=10.0,
        sites=(_LOOPBACK,),
        local_one_way_s=5e-5,
        matchmaking_seconds=20.0,
        request_timeout=15.0,
        churn=0.0,
        control=_scale_sim.NODE_POLICY,
        **fields,
    )


def _cpu_per_node_round(real: dict[str, Any]) -> float | None:
    keys = ("node_cpu_s_per_round", "p2pd_cpu_s_per_round", "dht_cpu_s_per_round")
    keys += ("control_cpu_s_per_round",)
    values = [_per(real, k) for k in keys]
    return sum(values) if all(v is not None for v in values) else None


def _check(real: dict[int, dict[str, Any]], constants: dict, rounds: int) -> dict[str, Any]:
    """Compare each size's real round time with the model's.

    Here all nodes share two cores, so a round lasts at least ``n x CPU per node and
    round / cores`` (the CPU bound, from each size's measured CPU) as well as what the
    simulator computes for nodes with hardware of their own (the protocol bound, with
    one sync overhead fitted at the smallest size, where the CPU is not saturated).
    The model's round is the larger of the two.
    """
    smallest = min(real)
    fitted = _scale_sim.calibrate(
        {"round_seconds": {smallest: real[smallest]["round_seconds_mean"]}},
        _local_config(real[smallest], constants),
        rounds,
    )
    overhead = fitted.sync_overhead_s
    rows = {}
    for n, r in real.items():
        if not r.get("round_seconds_mean"):
            continue
        cfg = dataclasses.replace(_local_config(r, constants), sync_overhead_s=overhead)
        sim = _scale_sim.simulate(cfg, n, rounds)
        cpu = _cpu_per_node_round(r)
        cpu_bound = n * cpu / _CORES if cpu is not None else None
        model = max(sim["round_seconds_mean"], cpu_bound or 0.0)
        error = model / r["round_seconds_mean"] - 1.0
        rows[n] = {
            "real_round_seconds": r["round_seconds_mean"],
            "protocol_bound_seconds": sim["round_seconds_mean"],
            "cpu_bound_seconds": cpu_bound,
            "cpu_s_per_node_round": cpu,
            "model_round_seconds": model,
            "error": error,
            "within_target": abs(error) <= _TARGET_ROUND_ERROR,
            "real_bytes_per_node_round": statistics.fmean(r["bytes_per_round"]),
            "sim_bytes_per_node_round": sim["bytes_sent_per_node_round"],
        }
    return {"sync_overhead_s": overhead, "fitted_at": smallest, "sizes": rows}


def _link_check(
    shaped: dict[int, dict[str, Any]], constants: dict, overhead: float, rounds: int
) -> dict[str, Any]:
    """Real rounds on shaped uplinks against the simulator with the same links.

    Here the link sets the round, not the CPU the nodes share (``cpu_bound_seconds``
    below the real round says so), so the simulator's protocol timing is what is
    checked, with the sync overhead fitted on the unshaped runs' smallest size.
    """
    rows = {}
    for n, r in shaped.items():
        if not r.get("round_seconds_mean"):
            continue
        cfg = dataclasses.replace(
            _local_config(r, constants),
            sync_overhead_s=overhead,
            upload_gbit=_SHAPE_MBIT / 1000,
            local_one_way_s=_SHAPE_DELAY_MS / 1000,
        )
        sim = _scale_sim.simulate(cfg, n, rounds)
        cpu = _cpu_per_node_round(r)
        error = sim["round_seconds_mean"] / r["round_seconds_mean"] - 1.0
        rows[n] = {
            "real_round_seconds": r["round_seconds_mean"],
            "sim_round_seconds": sim["round_seconds_mean"],
            "cpu_bound_seconds": n * cpu / _CORES if cpu is not None else None,
            "error": error,
            "within_target": abs(error) <= _TARGET_ROUND_ERROR,
            "real_bytes_per_node_round": statistics.fmean(r["bytes_per_round"]),
            "sim_bytes_per_node_round": sim["bytes_sent_per_node_round"],
            "syncs_complete": f"{r['syncs_complete']}/{r['syncs']}",
        }
    return {"uplink_mbit": _SHAPE_MBIT, "one_way_ms": _SHAPE_DELAY_MS, "sizes": rows}


def _cell_check(
    real: dict[str, Any],
    constants: dict,
    overhead: float,
    rounds: int,
    nodes: int = _CELL_NODES,
    layouts: int = _CELL_LAYOUTS,
) -> dict:
    """The cell grid on real nodes against the simulator's grid of the same swarm."""
    cfg = dataclasses.replace(
        _local_config(real, constants),
        group_size=_CELL_GROUP,
        sync_overhead_s=overhead,
        control=dataclasses.replace(_scale_sim.NODE_POLICY, cells_above=_CELL_ABOVE),
    )
    ids = [p for p in real.get("peer_ids") or () if p]
    sim = _scale_sim.simulate(cfg, nodes, rounds, names=ids)
    # where peers fall on the grid decides how far a contribution gets: the same
    # swarm's reach under other PeerIDs
    reach = [
        _scale_sim.simulate(cfg, nodes, rounds, names=[f"layout{k}-peer{i}" for i in range(nodes)])[
            "reach_share"
        ]
        for k in range(layouts)
    ]
    mix = real.get("mix") or {}
    return {
        "nodes": nodes,
        "group_size": _CELL_GROUP,
        "cells_above": _CELL_ABOVE,
        "dims": cell_dims(nodes, _CELL_GROUP),
        "window": mix.get("window"),
        "real_included_share": real.get("included_share"),
        "sim_included_share": sim["included_share"],
        # the simulator follows fragment 0 (each fragment has a grid of its own)
        "real_reach_share": (mix.get("reach_by_fragment") or {}).get(0),
        "real_reach_by_fragment": mix.get("reach_by_fragment"),
        "sim_reach_share": sim["reach_share"],
        "sim_same_peers": len(ids) == nodes,
        "sim_reach_other_layouts": {
            "layouts": len(reach),
            "mean": statistics.fmean(reach),
            "min": min(reach),
            "max": max(reach),
        },
        "sim_mix_rounds": sim["mix_rounds"],
        "syncs_complete": f"{real.get('syncs_complete')}/{real.get('syncs')}",
        "real_round_seconds": real.get("round_seconds_mean"),
    }


def _load_table(wallclock: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per size, the means per node and 20-s round of what the DHT and control plane
    cost a node, and its syncs."""
    return {
        n: {
            **{k: (r.get("load_mean") or {}).get(k) for k in _LOAD_KEYS},
            "syncs_complete": f"{r.get('syncs_complete')}/{r.get('syncs')}",
        }
        for n, r in wallclock.items()
    }


def _wan(
    constants: dict, overhead: float | None, rounds: int, sizes: tuple[int, ...] = _SIM_SIZES
) -> dict[str, Any]:
    """Every simulated size under every policy on the default WAN."""
    base = dataclasses.replace(
        _scale_sim.SimConfig(),
        fragment_bytes=_REFERENCE_FRAGMENT_BYTES,
        model_bytes=_REFERENCE_MODEL_BYTES,
        churn=0.01,
        **{
            k: v
            for k, v in constants.items()
            if v is not None and k not in ("fragment_bytes", "mix_bytes")  # reference model's
        },
        mix_bytes=2 * _REFERENCE_FRAGMENT_BYTES,  # fp16 global copies
        **({"sync_overhead_s": overhead} if overhead is not None else {}),
    )
    out: dict[str, Any] = {}
    for name, policy in _POLICIES.items():
        cfg = dataclasses.replace(base, control=policy)
        rows = {}
        for n in sizes:
            started = time.perf_counter()
            rows[n] = _scale_sim.simulate(cfg, n, rounds)
            rows[n]["sim_seconds"] = round(time.perf_counter() - started, 2)
            print(
                f"scale sim {name} n={n}: {rows[n]['round_seconds_mean']:.2f}s/round",
                file=sys.stderr,
            )
        out[name] = rows
    return out


def _plot(report: dict[str, Any], path: pathlib.Path) -> None:
    with figure(path, 1, 5, figsize=(25, 4.8), dpi=110) as (fig, axes):
        # keyed by size: ints as measured, strings once read back from the JSON
        real = _by_size(report["real"])
        check = _by_size(report["calibration"]["sizes"])
        ns = sorted(check)
        ax = axes[0]
        ax.plot(ns, [check[n]["real_round_seconds"] for n in ns], "o-", label="real")
        ax.plot(ns, [check[n]["model_round_seconds"] for n in ns], "s--", label="model")
        ax.plot(ns, [check[n]["protocol_bound_seconds"] for n in ns], ":", label="simulator alone")
        link = _by_size(report["calibration"].get("link_check", {}).get("sizes", {}))
        if link:
            ls = sorted(link)
            ax.plot(ls, [link[n]["real_round_seconds"] for n in ls], "^-", label="real, shaped")
            ax.plot(
                ls, [link[n]["sim_round_seconds"] for n in ls], "v--", label="simulator, shaped"
            )
        ax.set_title("round seconds here (2 shared cores)", fontsize=9)
        ax.set_xlabel("nodes")
        ax.legend(fontsize=7)
        ax = axes[1]
        for key, label in (
            ("control_messages_per_second", "control msgs / s"),
            ("dht_ops_per_second", "DHT ops / s"),
            ("control_cpu_s_per_second", "sidecar CPU (x100 %)"),
        ):
            xs = [n for n in sorted(real) if (real[n].get("load_per_second") or {}).get(key)]
            scale = 100.0 if "cpu" in key else 1.0
            ax.plot(xs, [real[n]["load_per_second"][key] * scale for n in xs], "o-", label=label)
        ax.set_title(
            "real: per node and second (rounds here last as long as the CPU makes them)", fontsize=8
        )
        ax.set_xlabel("nodes")
        ax.legend(fontsize=7)
        sims = report["simulated"]
        for ax, key, title in (
            (
                axes[2],
                "control_cpu_s_per_node_round",
                "simulated WAN: control CPU s per node-round",
            ),
            (axes[3], "dht_bytes_per_node_round", "simulated WAN: DHT bytes per node-round"),
            (
                axes[4],
                "dht_hotspot_bytes_per_round",
                "simulated WAN: busiest DHT node, bytes/round",
            ),
        ):
            for name, rows in sims.items():
                rows = _by_size(rows)
                xs = sorted(rows)
                ax.plot(xs, [rows[n]["control"][key] for n in xs], "o-", label=name)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("nodes")
            ax.set_title(title, fontsize=9)
            ax.legend(fontsize=7)
        for ax in axes:
            ax.grid(True, alpha=0.3)


def _by_size(rows: dict[Any, Any]) -> dict[int, Any]:
    return {int(n): r for n, r in rows.items()}


def _say(kind: str, n: int, r: dict[str, Any]) -> None:
    print(
        f"scale {kind} n={n}: {r['rounds_reached']} rounds, {r['round_seconds_mean']}s/round",
        file=sys.stderr,
    )


def _measure_real(plan: _Plan) -> tuple[dict, dict, dict, dict]:
    """The real swarms: per size plain and (where shaped) link-bound, the cell grid, and
    per size on wall-clock rounds; their folders removed after."""
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="atoll-scale-"))
    real: dict[int, dict[str, Any]] = {}
    shaped: dict[int, dict[str, Any]] = {}
    wallclock: dict[int, dict[str, Any]] = {}
    shape = {ENV_VAR: f"mbit={_SHAPE_MBIT},delay_ms={_SHAPE_DELAY_MS}"}
    cells_extra = (f"network.group_size={_CELL_GROUP}", f"network.cells_above={_CELL_ABOVE}")
    rounds, extra = plan.real_rounds, plan.extra
    try:
        for n in plan.real_sizes:
            real[n] = _scale_real.measure(n, rounds, scratch / f"n{n}", extra)
            _say("real", n, real[n])
        for n in plan.shaped_sizes:
            shaped[n] = _scale_real.measure(
                n, rounds, scratch / f"shaped{n}", (*extra, *_SHAPED_EXTRA), env=shape
            )
            _say("shaped", n, shaped[n])
        n = plan.cell_nodes
        cells = _scale_real.measure(n, rounds, scratch / "cells", (*extra, *cells_extra))
        _say("cells", n, cells)
        for n in plan.real_sizes:
            where = scratch / f"wall{n}"
            wallclock[n] = _scale_real.measure(n, plan.wall_rounds, where, plan.wallclock)
            _say("wall-clock rounds", n, wallclock[n])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return real, shaped, cells, wallclock


_NOTES = {
    "real": "n real nodes on 127.0.0.1 sharing two cores: step time and round time "
    "grow with n because the CPU is shared, not because of the protocol",
    "calibration": "one sync overhead fitted (median over sizes); each size's "
    f"simulated round time compared with its real one, target within "
    f"{_TARGET_ROUND_ERROR:.0%}",
    "policies": "before: heartbeat every 1 s, every record read every 2 s, every "
    "commitment gossiped to every node; node: the same up to 8 nodes, above it "
    "intervals stretched by n/8 and commitments sent to the group only, and above "
    "256 nodes matchmaking on the cell grid (a node reads its line's announcements "
    "only) and the registry in n/256 shards (network.registry_shards); sampled: as node, with at most 32 heartbeats a second swarm-wide and "
    "registry reads of at most 32 records (not built)",
    "wan": "five regions 3,600-16,000 km apart (5 us/km one way), 10 Gbit/s per "
    "node, 1 % churn per round, the reference model's int8 fragments",
}
"""How each figure of the report was taken."""


def run(mode: Mode, out_dir: pathlib.Path) -> dict:
    """Runs the real swarms, calibrates, simulates, and writes ``scale.json``/``.png``.

    Args:
        mode: what it runs: ``quick``: the quick mode's rounds (see the module docstring);
            ``smoke``: each kind of real swarm once with 2 nodes, 2 short rounds: a check
            that it runs.
        out_dir: folder for ``scale.json`` and ``scale.png``; created if missing.

    Returns:
        The report: ``real`` (per size, :func:`benchmarks._scale_real.measure`'s
        figures), ``shaped`` and ``cells`` (the same for the link-bound and the
        cell-grid runs), ``load_table`` (per size, DHT and control-plane cost per
        node and 20-s round), ``calibration`` (constants, the fitted sync overhead, per size
        the real and simulated round time and bytes per node, ``link_check`` and
        ``cell_check``), ``simulated`` (per policy and
        size, :func:`benchmarks._scale_sim.simulate`'s figures), ``date``, ``machine``.
    """
    plan = _plan(mode.quick, mode.smoke)
    started = time.monotonic()
    real, shaped, cells, wallclock = _measure_real(plan)
    constants = _calibration(real)
    calibration = {"constants": constants, **_check(real, constants, plan.sim_rounds)}
    overhead = calibration["sync_overhead_s"]
    calibration["link_check"] = _link_check(shaped, constants, overhead, plan.sim_rounds)
    calibration["cell_check"] = _cell_check(
        cells, constants, overhead, plan.real_rounds, plan.cell_nodes, plan.cell_layouts
    )
    report = {
        "benchmark": "scale",
        "quick": mode.quick,
        "smoke": mode.smoke,
        "real_rounds": plan.real_rounds,
        "sim_rounds": plan.sim_rounds,
        "real": {n: {k: v for k, v in r.items() if k != "config"} for n, r in real.items()},
        "shaped": {n: {k: v for k, v in r.items() if k != "config"} for n, r in shaped.items()},
        "cells": {k: v for k, v in cells.items() if k != "config"},
        "load_table": _load_table(wallclock),
        "workload": real[plan.real_sizes[0]]["config"],
        "calibration": calibration,
        "simulated": _wan(constants, overhead, plan.sim_rounds, plan.sim_sizes),
        "notes": dict(_NOTES),
        "seconds": round(time.monotonic() - started, 1),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
    }
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "scale.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    _plot(report, out_dir / "scale.png")
    return report
