"""The ``wan`` benchmark's namespace mode: each worker on its own host of a network lab.

Hosts are network namespaces on a private bridge (``tests.netlab``), each host's link
capped both ways at the link's bandwidth with tbf, so the bytes of both methods really
cross kernel-shaped links: Atoll's all-reduce, DHT and p2pd traffic, and gloo's ring
all-reduce. The one-way delay is not the kernel's (the kernels these run on lack
netem): Atoll's nodes add it in their in-process shaper (``ATOLL_LINK_SHAPE`` with
``delay_ms`` only, no rate), DDP with a comm hook that completes each all-reduce
``2(n-1) * delay`` after gloo's (``benchmarks._ddp_links._delay_allreduce_hook``).

Every process started here is ended, and every namespace deleted, also when a run
fails. A DDP rank is this module run as a script:
``python -m benchmarks._wan_netns RANK PORT PLAN_JSON REPORT_JSON``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from benchmarks._ddp import DdpRun, ddp_rank
from node.ops import swarm
from protocol.p2p.shaper import ENV_VAR, LinkShape

if TYPE_CHECKING:
    from tests.netlab import NetLab

__all__ = [
    "NOTES",
    "atoll_env",
    "available",
    "open_lab",
    "plot_bytes",
    "plan_from_json",
    "plan_to_json",
    "run_ddp",
    "run_nodes",
    "sources",
    "wire_bytes",
]

PORT = 29500
"""The nodes' and the gloo rendezvous' port: each host has its own network stack."""

_RANK_MODULE = "benchmarks._wan_netns"
_GRACE_S = 5.0

NOTES = {
    "link": "each worker is a network namespace on a private bridge; tbf caps each "
    "host's link at the bandwidth both ways (tests.netlab NetLab.shape, burst 4 ms); "
    "the one-way delay is added in-process (no netem in this kernel)",
    "atoll_shaping": f"{ENV_VAR}=delay_ms=D (no rate) in each node's environment: "
    "protocol.p2p.shaper delays every Atoll RPC the node sends; all of a node's traffic, "
    "DHT and p2pd included, crosses the tbf-capped link, but only Atoll RPCs are delayed",
    "ddp_emulation": "gloo's ring all-reduce crosses the tbf-capped links (ranks bound to "
    "eth0 with GLOO_SOCKET_IFNAME); a DDP comm hook completes each bucket's all-reduce "
    "2(n-1) * delay after gloo's (no hook at 0 ms); ring_model_allreduce_seconds is "
    "what the loopback mode's model charges, for comparison",
    "wire_bytes_sent_per_worker": "mean over hosts of eth0 tx_bytes (kernel counter; "
    "per host in wire_bytes_sent) over the method's whole run: start-up, DHT, rendezvous, "
    "warm-up steps and TCP/IP headers included",
    "sources": "per method: where its bandwidth, delay and byte figures come from",
}
"""The report's notes that differ from the loopback mode's (same keys, plus new ones)."""


def available() -> tuple[bool, str]:
    """Whether a lab can be built here: ``(True, "")``, or ``(False, why not)``."""
    from tests.netlab import netlab_available

    return netlab_available()


@contextlib.contextmanager
def open_lab(link: LinkShape, workers: int) -> Iterator[NetLab]:
    """A fresh lab of ``workers`` hosts ``w0``, ``w1``, ...; deleted with all it ran.

    Each host's link is capped at ``link``'s bandwidth (uncapped without one).
    """
    from tests.netlab import NetLab, cleanup_stale

    cleanup_stale()  # namespaces a crashed earlier run left behind
    rate = link.bandwidth_bps / 1e6 if link.bandwidth_bps is not None else None
    with NetLab() as lab:
        for i in range(workers):
            lab.add_host(f"w{i}", rate_mbit=rate)
        yield lab


def atoll_env(link: LinkShape) -> dict[str, str]:
    """The nodes' extra environment: the link's delay only (tbf is the bandwidth)."""
    return {ENV_VAR: LinkShape(link.delay_s).to_env()} if link.delay_s > 0 else {}


def sources(method: str, link: LinkShape) -> dict[str, str]:
    """Where a method's figures come from in this mode, for the report."""
    delay_ms = f"{link.delay_s * 1e3:g} ms"
    if method == "atoll":
        delay = f"in-process shaper ({ENV_VAR}={atoll_env(link).get(ENV_VAR)}), Atoll RPCs only"
        sent = "node status: what its all-reduce sent"
    else:
        delay = f"comm hook: each all-reduce completes 2(n-1) * {delay_ms} after gloo's"
        sent = "model: steps * params * 4 * 2(n-1)/n"
    return {
        "bandwidth": "tbf (kernel), each host's link both ways",
        "delay": delay if link.delay_s > 0 else "none (0 ms)",
        "bytes_sent_per_worker": sent,
        "wire_bytes_sent_per_worker": "eth0 tx_bytes (kernel counter)",
    }


def wire_bytes(lab: NetLab) -> list[int]:
    """Bytes each host has sent on its ``eth0`` since the lab was made."""
    path = "/sys/class/net/eth0/statistics/tx_bytes"  # netns exec mounts the host's /sys
    return [int(lab.run(host, ["cat", path]).stdout) for host in lab.hosts.values()]


# ---- Atoll ------------------------------------------------------------------------------


def run_nodes(
    lab: NetLab, spec: swarm.SwarmSpec, timeout: float
) -> tuple[list[swarm.SwarmProcess], bool]:
    """One node per host, listening on the host's address, until all exit or ``timeout``.

    Like ``swarm.run_to_end``: the first node starts, the others join through its
    multiaddrs; every node is always stopped (the lab then ends what they left).

    Returns:
        The nodes and whether all of them finished on their own.
    """
    nodes: list[swarm.SwarmProcess] = []
    finished = False
    peers: list[str] = []
    try:
        for index, host in enumerate(lab.hosts.values()):
            own = [f"network.host='{host.ip}'", f"network.port={PORT}"]
            node_spec = dataclasses.replace(spec, overrides=[*spec.overrides, *own])
            popen = functools.partial(lab.popen, host)
            nodes.append(swarm.start_node(node_spec, index, peers, popen=popen))
            if index == 0:
                peers = swarm.wait_for_maddrs(nodes[0])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(n.proc.poll() is not None for n in nodes):
                finished = True
                break
            time.sleep(0.5)
    finally:
        swarm.stop_all(nodes, grace=20)
    return nodes, finished


# ---- figure -----------------------------------------------------------------------------


def plot_bytes(ax: Any, links: list[dict[str, Any]], xs: list[int]) -> None:
    """The figure's bytes panel: per link, what each method counts and what its eth0 sent."""
    series = (
        (-0.3, "atoll", "bytes_sent_per_worker", "Atoll all-reduce (node status)", "tab:blue"),
        (-0.1, "atoll", "wire_bytes_sent_per_worker", "Atoll on the wire (eth0)", "tab:cyan"),
        (0.1, "ddp", "bytes_sent_per_worker", "DDP fp32 ring (model)", "tab:orange"),
        (0.3, "ddp", "wire_bytes_sent_per_worker", "DDP on the wire (eth0)", "tab:red"),
    )
    for offset, method, key, label, color in series:
        sent = [r[method].get(key) or 0 for r in links]
        ax.bar([x + offset for x in xs], sent, 0.2, label=label, color=color, hatch="//")
        for x, v in zip(xs, sent):
            ax.annotate(f"{v / 1e6:.3g}M", (x + offset, v), ha="center", va="bottom", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("bytes sent per worker (log)")
    ax.set_title("bytes sent per worker", fontsize=10)


# ---- DDP --------------------------------------------------------------------------------


def plan_to_json(plan: DdpRun) -> str:
    """``plan`` as JSON, for a rank process (:func:`plan_from_json` reads it back)."""
    return json.dumps(dataclasses.asdict(plan))


def plan_from_json(text: str) -> DdpRun:
    """The plan :func:`plan_to_json` wrote."""
    fields = json.loads(text)
    for name in ("overrides", "slowdowns", "eval_at"):
        fields[name] = tuple(fields[name])
    if fields["link"] is not None:
        fields["link"] = LinkShape(**fields["link"])
    return DdpRun(**fields)


def run_ddp(lab: NetLab, plan: DdpRun, directory: pathlib.Path, timeout: float) -> dict[str, Any]:
    """One DDP rank per host, gloo bound to the host's ``eth0``; always ended.

    Returns:
        What ``benchmarks._ddp.run_timed_ddp`` returns: ``{"ranks": [...],
        "exit_codes": [...]}``, or ``{"error": ...}`` when a rank reported nothing.
    """
    directory.mkdir(parents=True, exist_ok=True)
    plan_path = directory / "plan.json"
    plan_path.write_text(plan_to_json(plan))
    # Without it gloo binds to the address the hostname resolves to, 127.0.0.1 here,
    # and the ranks cannot connect to each other.
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen] = []
    with contextlib.ExitStack() as logs:
        try:
            for rank, host in enumerate(lab.hosts.values()):
                log = logs.enter_context(open(directory / f"rank{rank}.log", "wb"))
                argv = [sys.executable, "-m", _RANK_MODULE, str(rank), str(PORT)]
                argv += [str(plan_path), str(directory / f"rank{rank}.json")]
                procs.append(lab.popen(host, argv, stdout=log, stderr=subprocess.STDOUT, env=env))
            _wait(procs, timeout)
        finally:
            _end(procs)
    exit_codes = [p.returncode for p in procs]
    reports = [_read_json(directory / f"rank{rank}.json") for rank in range(len(lab.hosts))]
    missing = [rank for rank, r in enumerate(reports) if r is None]
    if missing:
        last = _last_line(directory / f"rank{missing[0]}.log")
        return {"error": f"ranks {missing} reported nothing; exit codes {exit_codes}; {last}"}
    return {"ranks": reports, "exit_codes": exit_codes}


def _wait(procs: list[subprocess.Popen], timeout: float) -> None:
    """Until every rank exits, one fails (the others would wait for it), or ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
            return
        time.sleep(0.5)


def _end(procs: list[subprocess.Popen]) -> None:
    """SIGTERM the live ranks' process groups, wait, then SIGKILL them; reap all."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + _GRACE_S
    for p in live:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=_GRACE_S)


def _read_json(path: pathlib.Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def _last_line(path: pathlib.Path) -> str:
    lines = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
    return f"{path.name}: {lines[-1] if lines else 'empty'}"


class _ReportFile:
    """What a rank's ``results.put(report)`` writes: the report as JSON, whole or not at all."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path

    def put(self, report: dict[str, Any]) -> None:
        partial = self.path.with_suffix(".partial")
        partial.write_text(json.dumps(report))
        partial.replace(self.path)


def _rank_main(argv: list[str]) -> int:
    """``RANK PORT PLAN_JSON REPORT_JSON``: train one DDP rank, write its report."""
    rank, port, plan_path, report_path = argv
    plan = plan_from_json(pathlib.Path(plan_path).read_text())
    ddp_rank(int(rank), int(port), plan, _ReportFile(pathlib.Path(report_path)))
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main(sys.argv[1:]))
