"""WAN benchmark: round time and utilization of Atoll and DDP on emulated long links.

Each link is a one-way delay (0, 10 or 70 ms) and a bandwidth cap (1 Gbit/s or
100 Mbit/s) emulated on 127.0.0.1; four workers train the integration tests' tiny
model (``node.ops.swarm.QUICK_WORKLOAD``) for the same wall time with each method:

- ``atoll``: four real nodes (``node.ops.swarm``) in ``seconds`` mode (a sync of one of
  two int8 fragments every 3 s), each node process started with
  ``ATOLL_LINK_SHAPE`` set, so every Atoll RPC it sends waits the delay and is paced at
  the line rate by its own shaper (``protocol.p2p.shaper``: one uplink per node). DHT
  traffic (matchmaking announcements among it) is not shaped.
- ``ddp``: PyTorch ``DistributedDataParallel`` over gloo, four processes, a gradient
  all-reduce every step. gloo's sockets cannot be shaped from Python, so a DDP
  communication hook (``benchmarks._common``) lets each bucket's all-reduce finish no
  earlier than a ring all-reduce would on the link:
  ``2(n-1)/n * bytes * 8 / bandwidth + 2(n-1) * delay`` after the bucket was ready.
  This is an emulation of the link's cost, not a measurement through a shaped socket.

Per method and link it records the round time (Atoll: mean wall time between round
ends and mean fragment sync time from launch to applied, from the nodes' event logs;
DDP: wall time per step), utilization (``sum(busy) / sum(busy + idle)``: the share of
worker-seconds spent computing), bytes sent per worker (Atoll: what its all-reduce
sent, from the nodes' status; DDP: ``steps * params * 4 * 2(n-1)/n``) and the final
validation bits per byte (Atoll: of the global parameters; DDP: rank 0's model).

With ``--netns`` the bandwidth of both methods is measured instead: each worker runs
on its own host of a network lab (``benchmarks._wan_netns``: namespaces on a bridge,
each host's link capped both ways by tbf), Atoll's nodes shape only the delay, and gloo's
real all-reduce crosses the capped links, with a comm hook adding only the ring's
``2(n-1) * delay``. Each method's record then says where its figures come from
(``sources``) and adds the bytes each host put on the wire (``eth0`` counters). It needs
root, iproute2 and nftables, and is skipped with the reason otherwise.

Run it with ``python -m benchmarks wan [--quick] [--netns]`` (quick: 3 links, 3 rounds
of 6 s; full: all 6 links, 5 rounds; ``--smoke``: two workers on one link, 2 rounds
of 5 s); it writes ``wan.json`` and ``wan.png`` into the output folder.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from benchmarks._common import machine_info
from benchmarks._ddp import DdpRun, run_timed_ddp
from benchmarks._ddp_links import ring_allreduce_seconds
from benchmarks._mode import Mode
from node.config import load_config
from node.ops import swarm
from node.ops.swarm import QUICK_WORKLOAD
from node.run.metrics import read_events
from protocol.p2p.shaper import ENV_VAR, LinkShape

if TYPE_CHECKING:
    from tests.netlab import NetLab

__all__ = ["run"]

_WORKERS = 4
_ROUND_SECONDS = 6
_FP32_BYTES = 4
_MBIT, _GBIT = 100e6, 1e9
_FULL_LINKS = tuple(LinkShape(d, bw) for bw in (_GBIT, _MBIT) for d in (0.0, 0.010, 0.070))
_QUICK_LINKS = (LinkShape(0.0, _MBIT), LinkShape(0.070, _MBIT), LinkShape(0.010, _GBIT))
_WORKLOAD = [
    "run.run_id='bench-wan'",
    *QUICK_WORKLOAD,
    "sync.fragments=2",
    "sync.codec='int8'",
    "sync.trigger='seconds'",
    "network.matchmaking_seconds=1.5",
    "network.round_timeout=4",
    "network.request_timeout=8",
]


@dataclass(frozen=True)
class _Plan:
    """Who runs on which links, and for how long."""

    links: tuple[LinkShape, ...]
    rounds: int
    workers: int = _WORKERS
    round_seconds: float = _ROUND_SECONDS

    @property
    def seconds(self) -> float:
        """Training time of each method (Atoll's rounds on the wall clock, DDP the same)."""
        return self.rounds * self.round_seconds

    @property
    def workload(self) -> list[str]:
        """The nodes' and the DDP ranks' config overrides."""
        return [*_WORKLOAD, f"sync.round_seconds={self.round_seconds:g}"]

    @property
    def ring_share(self) -> float:
        """Share of a vector one worker sends in a ring all-reduce."""
        return 2 * (self.workers - 1) / self.workers


def _plan(quick: bool, smoke: bool) -> _Plan:
    if smoke:
        # two rounds: the report's round time is the wall between two round ends
        return _Plan(_QUICK_LINKS[:1], rounds=2, workers=2, round_seconds=5)
    return _Plan(_QUICK_LINKS, 3) if quick else _Plan(_FULL_LINKS, 5)


# ---- Atoll ------------------------------------------------------------------------------


def _run_atoll(
    link: LinkShape,
    plan: _Plan,
    directory: pathlib.Path,
    timeout: float,
    lab: NetLab | None = None,
) -> dict[str, Any]:
    """Shaped nodes to their end (or ``timeout``); times, utilization, bytes, bpb.

    On 127.0.0.1, or one per host of ``lab`` (tbf the bandwidth, the shaper the delay).
    """
    # Evaluate only at the last round: evaluation is neither compute nor waiting.
    overrides = [*plan.workload, f"run.eval_every={plan.rounds}"]
    spec = swarm.SwarmSpec(
        nodes=plan.workers,
        config_paths=[],
        overrides=overrides,
        directory=directory,
        rounds=plan.rounds,
        env={ENV_VAR: link.to_env()},
    )
    if lab is None:
        nodes, finished = swarm.run_to_end(spec, timeout)
    else:
        from benchmarks import _wan_netns

        spec.env = _wan_netns.atoll_env(link)
        nodes, finished = _wan_netns.run_nodes(lab, spec, timeout)
    summary = swarm.summarize(nodes, load_config(None, overrides))
    busy, idle = summary["busy_seconds"], summary["idle_seconds"]
    intervals, syncs, failed = [], [], 0
    for n in nodes:
        events = read_events(n.data_dir / "events.jsonl")
        ends = sorted(e["t"] for e in events if e["event"] == "round")
        intervals += [b - a for a, b in zip(ends, ends[1:])]
        syncs += [e["seconds"] for e in events if e["event"] == "sync"]
        failed += sum(e["event"] == "sync_failed" for e in events)
    total = sum(busy) + sum(idle)
    sent = summary["bytes_sent_per_node"]
    steps = [n.status.get("steps", 0) for n in nodes]
    record: dict[str, Any] = {
        "round_seconds": _mean(intervals),
        "sync_seconds": _mean(syncs),
        "sync_seconds_max": round(max(syncs), 3) if syncs else None,
        "syncs": len(syncs),
        "syncs_failed": failed,
        "utilization": round(sum(busy) / total, 4) if total else None,
        "bytes_sent_per_worker": int(statistics.mean(sent)) if sent else None,
        "val_bpb_end": summary["val_bpb_end"],
        "steps_per_worker": statistics.mean(steps) if steps else None,
        "rounds": summary["rounds"],
        "params_agree": summary["params_agree"],
        "exit_codes": summary["exit_codes"],
        "busy_seconds": busy,
        "idle_seconds": idle,
    }
    if not finished:
        record["error"] = "timed out; stopped before every node finished"
    return record


# ---- DDP --------------------------------------------------------------------------------


def _run_ddp(
    link: LinkShape,
    plan: _Plan,
    lab: NetLab | None = None,
    directory: pathlib.Path | None = None,
) -> dict[str, Any]:
    """DDP ranks with the link-emulating comm hook, for ``plan.seconds`` of training.

    With ``lab``: one rank per host (logs in ``directory``), gloo's traffic through the
    tbf-capped links, and a comm hook for the delay only.
    """
    seconds = plan.seconds
    if lab is None:
        timed = DdpRun(
            tuple(plan.workload), plan.workers, seconds=seconds, link=link, evaluate=True
        )
        result = run_timed_ddp(timed)
    else:
        from benchmarks import _wan_netns

        first = next(iter(lab.hosts.values()))
        timed = DdpRun(
            tuple(plan.workload),
            plan.workers,
            seconds=seconds,
            evaluate=True,
            delay_s=link.delay_s,
            master_addr=first.ip,
        )
        assert directory is not None
        result = _wan_netns.run_ddp(lab, timed, directory, timeout=seconds + 180.0)
    if "error" in result:
        return {"error": result["error"]}
    ranks = result["ranks"]
    busy = [r["busy"] for r in ranks]
    walls = [r["busy"] + r["idle"] for r in ranks]
    steps = [r["steps"] for r in ranks]
    params = ranks[0]["params"]
    return {
        "step_seconds": round(statistics.mean(w / s for w, s in zip(walls, steps) if s), 4),
        # The model fits DDP's first 25 MiB bucket: one emulated all-reduce per step.
        ("emulated" if lab is None else "ring_model") + "_allreduce_seconds": round(
            ring_allreduce_seconds(params * _FP32_BYTES, plan.workers, link), 4
        ),
        "utilization": round(sum(busy) / sum(walls), 4) if sum(walls) else None,
        "bytes_sent_per_worker": int(
            statistics.mean(steps) * params * _FP32_BYTES * plan.ring_share
        ),
        "val_bpb_end": ranks[0]["val_bpb"],
        "steps_per_worker": statistics.mean(steps),
        "params": params,
        "params_agree": all(r["params_agree"] for r in ranks),
        "exit_codes": result["exit_codes"],
        "busy_seconds": [round(b, 2) for b in busy],
        "idle_seconds": [round(r["idle"], 2) for r in ranks],
    }


def _mean(values: list[float]) -> float | None:
    return round(statistics.mean(values), 3) if values else None


def _run_in_lab(
    method: str, link: LinkShape, plan: _Plan, directory: pathlib.Path
) -> dict[str, Any]:
    """One method on the hosts of a fresh lab; every process and namespace ends."""
    from benchmarks import _wan_netns

    with _wan_netns.open_lab(link, plan.workers) as lab:
        if method == "atoll":
            result = _run_atoll(link, plan, directory, _atoll_timeout(plan.seconds), lab)
        else:
            result = _run_ddp(link, plan, lab, directory)
        wire = _wan_netns.wire_bytes(lab)
    result["wire_bytes_sent_per_worker"] = int(statistics.mean(wire))
    result["wire_bytes_sent"] = wire
    result["sources"] = _wan_netns.sources(method, link)
    return result


def _atoll_timeout(seconds: float) -> float:
    return 150.0 + 2 * seconds


# ---- figure -----------------------------------------------------------------------------


def _plot(report: dict[str, Any], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = report["links"]
    netns = report.get("mode") == "netns"
    labels = [r["link"].replace(", ", "\n") for r in links]
    xs = list(range(len(links)))
    width = max(10.0, 2.6 * len(links))
    if netns:  # a third panel: the bytes each worker sent, counted and on the wire
        fig, (util, times, sent) = plt.subplots(1, 3, figsize=(1.5 * width, 5.0))
    else:
        fig, (util, times) = plt.subplots(1, 2, figsize=(width, 5.0))
    hatch = "//" if netns else None  # marks figures measured through tbf-capped links
    names = {
        "atoll": "Atoll (seconds mode)" + (", tbf link" if netns else ""),
        "ddp": "DDP (gloo through tbf, delay hook)" if netns else "DDP (emulated link)",
    }
    _plot_utilization(util, links, names, hatch)
    _plot_times(times, links, hatch)
    axes = [util, times]
    if netns:
        from benchmarks import _wan_netns

        _wan_netns.plot_bytes(sent, links, xs)
        axes.append(sent)
    for ax in axes:
        ax.set_xticks(xs, labels, fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
        # below the axes: the bars fill the panels from top to bottom
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    where = (
        "one network namespace each, bandwidth by tbf per host link, delay in-process"
        if netns
        else "emulated links (one-way delay, bandwidth per uplink)"
    )
    fig.suptitle(
        f"{report['workers']} workers on {where}, {report['seconds_per_method']:g} s of training "
        "per method",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _values(links: list[dict[str, Any]], method: str, key: str) -> list[float]:
    """``method``'s ``key`` on every link (0 where it has none)."""
    return [r[method].get(key) or 0.0 for r in links]


def _plot_utilization(
    util: Any, links: list[dict[str, Any]], names: dict[str, str], hatch: str | None
) -> None:
    """The utilization panel: Atoll's and DDP's bars side by side per link."""
    xs = list(range(len(links)))
    for offset, method, color in ((-0.2, "atoll", "tab:blue"), (0.2, "ddp", "tab:orange")):
        shares = _values(links, method, "utilization")
        xy = ([x + offset for x in xs], [100 * v for v in shares])
        bars = util.bar(*xy, 0.4, color=color, hatch=hatch)
        bars.set_label(names[method])
        for x, v in zip(xs, shares):
            util.annotate(f"{v:.0%}", (x + offset, 100 * v), ha="center", va="bottom", fontsize=8)
    util.set_ylim(0, 110)
    util.set_ylabel("utilization (% of wall time computing)")
    util.set_title("utilization", fontsize=10)


def _plot_times(times: Any, links: list[dict[str, Any]], hatch: str | None) -> None:
    """The time panel: Atoll's round and fragment sync and DDP's step per link (log)."""
    xs = list(range(len(links)))
    series = (
        (-0.27, "atoll", "round_seconds", "Atoll round (wall between round ends)", "tab:blue"),
        (0.0, "atoll", "sync_seconds", "Atoll fragment sync (launch to applied)", "tab:cyan"),
        (0.27, "ddp", "step_seconds", "DDP step", "tab:orange"),
    )
    for offset, method, key, label, color in series:
        seconds = _values(links, method, key)
        times.bar([x + offset for x in xs], seconds, 0.27, label=label, color=color, hatch=hatch)
        for x, v in zip(xs, seconds):
            times.annotate(f"{v:.2g}", (x + offset, v), ha="center", va="bottom", fontsize=7)
    times.set_yscale("log")
    times.set_ylabel("seconds (log)")
    times.set_title("time per round / sync / step", fontsize=10)


# ---- entry point ------------------------------------------------------------------------


def run(mode: Mode, out_dir: pathlib.Path) -> dict:
    """Measures Atoll and DDP on each emulated link.

    Args:
        mode: what it runs: ``quick``: 3 links (0 and 70 ms at 100 Mbit/s, 10 ms at
            1 Gbit/s) and 3 rounds of 6 s; otherwise all 6 links and 5 rounds; ``netns``:
            each worker on its own network namespace, the bandwidth by tbf (see the
            module docstring); without a lab here nothing runs or is written; ``smoke``:
            two workers on one link (0 ms, 100 Mbit/s), 2 rounds of 5 s: a check that it
            runs.
        out_dir: folder for ``wan.json`` and ``wan.png``; created if missing.

    Returns:
        The dict written to ``wan.json``: ``links`` (per link: ``link``, ``env`` and, for
        ``atoll`` and ``ddp``, round or step time, utilization, bytes sent per worker,
        val_bpb_end; with ``netns`` also ``sources`` and ``wire_bytes_sent_per_worker``),
        ``quick``, ``notes``, ``date`` and ``machine``; or, with ``netns`` where no lab
        can be built, ``{"benchmark": "wan", "skipped": reason}``.
    """
    if mode.netns:
        from benchmarks import _wan_netns

        ok, why = _wan_netns.available()
        if not ok:
            return {"benchmark": "wan", "skipped": f"--netns needs a network lab: {why}"}
    plan = _plan(mode.quick, mode.smoke)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="atoll-wan-") as tmp:
        records = [
            _measure_link(i, link, plan, pathlib.Path(tmp), mode.netns)
            for i, link in enumerate(plan.links)
        ]
    report = _report(mode, plan, records, round(time.monotonic() - started, 1))
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "wan.json").write_text(json.dumps(report, indent=2) + "\n")
    _plot(report, out_dir / "wan.png")
    return report


def _measure_link(
    i: int, link: LinkShape, plan: _Plan, tmp: pathlib.Path, netns: bool
) -> dict[str, Any]:
    """Atoll's and DDP's runs on link ``i`` (a failed one holds its ``error``)."""
    record: dict[str, Any] = {"link": link.label, "env": f"{ENV_VAR}={link.to_env()}"}
    if netns:
        from benchmarks import _wan_netns

        shaped = _wan_netns.atoll_env(link).get(ENV_VAR)
        record["env"] = f"{ENV_VAR}={shaped}" if shaped else f"{ENV_VAR} unset"
        record["tbf_mbit"] = link.bandwidth_bps / 1e6 if link.bandwidth_bps else None
    for method in ("atoll", "ddp"):
        t0 = time.monotonic()
        try:
            if netns:
                result = _run_in_lab(method, link, plan, tmp / f"link{i}-{method}")
            elif method == "atoll":
                timeout = _atoll_timeout(plan.seconds)
                result = _run_atoll(link, plan, tmp / f"link{i}", timeout)
            else:
                result = _run_ddp(link, plan)
        except Exception as e:  # one broken run must not cost the others
            result = {"error": f"{type(e).__name__}: {e}"}
        result["seconds"] = round(time.monotonic() - t0, 1)
        record[method] = result
    return record


def _report(mode: Mode, plan: _Plan, records: list[dict], seconds: float) -> dict[str, Any]:
    """The dict written to ``wan.json``, with the notes on how each figure was taken."""
    report: dict[str, Any] = {
        "benchmark": "wan",
        "quick": mode.quick,
        "smoke": mode.smoke,
        "workers": plan.workers,
        "rounds": plan.rounds,
        "seconds_per_method": plan.seconds,
        "workload": plan.workload,
        "links": records,
        "seconds": seconds,
        "notes": {
            "link": "one-way delay added once per message and a bandwidth cap on each "
            "worker's egress (a token bucket 2 ms deep), emulated on 127.0.0.1",
            "atoll_shaping": f"{ENV_VAR} in each node's environment: protocol.p2p.shaper paces "
            "every Atoll RPC the node sends (all-reduce, repair, catch-up); hivemind's "
            "DHT traffic, matchmaking announcements included, is not shaped",
            "ddp_emulation": "DDP comm hook: each bucket's all-reduce completes no earlier "
            "than 2(n-1)/n * bytes * 8 / bandwidth + 2(n-1) * delay after the bucket was "
            "ready (a ring all-reduce on the link); the real gloo all-reduce runs unshaped "
            "on loopback underneath",
            "round_seconds": "Atoll: mean wall time between consecutive round ends per "
            "node (the round clock is 6 s); sync_seconds: a fragment sync from launch to "
            "applied, overlapped with training",
            "step_seconds": "DDP: training wall time / steps per rank",
            "utilization": "sum(busy) / sum(busy + idle) over workers, busy = compute",
            "bytes_sent_per_worker": "Atoll: all-reduce bytes from the nodes' status; "
            "DDP: steps * params * 4 * 2(n-1)/n (fp32 ring all-reduce)",
            "val_bpb_end": "Atoll: global parameters at the last round; DDP: rank 0 at the "
            "end; same wall time of training, not the same steps",
        },
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
    }
    if mode.netns:
        from benchmarks import _wan_netns

        report["mode"] = "netns"
        report["notes"].update(_wan_netns.NOTES)
    return report
