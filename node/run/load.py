"""What the swarm's plumbing costs one node: DHT and control-plane traffic and CPU.

The training loop's own work is measured elsewhere; this module answers the scaling
question "does the registry, matchmaking and the control plane cost a node more as
the swarm grows?" with cumulative counters that the node writes into each ``round``
event (``load``) and that ``atoll swarm`` turns into figures per round:

* ``dht``: operations and payload bytes this node handed to or got from its DHT
  (by kind: ``registry``, ``matchmaking``, ``digest``, ``clock``), and the CPU time
  and I/O bytes of its DHT process, which also serves other nodes' requests;
* ``control``: signed messages published and received through the GossipSub
  sidecar, their bytes, and the sidecar's CPU time and I/O bytes (its sockets, so
  forwarding and gossip for others included, and its pipe to the node);
* ``p2pd_cpu_s``: CPU of p2pd, which carries the DHT's and the tensors' streams alike;
* ``node_cpu_s``: this process (training included).

CPU and I/O are read from ``/proc`` through psutil and summed over every process that
held a role (a restarted sidecar adds to its predecessor's total).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import psutil

__all__ = ["LoadMeter", "memory_per_param", "per_round"]


class _Role:
    """One helper role's CPU and I/O, summed over the processes that held it."""

    def __init__(self) -> None:
        self._done = {"cpu_s": 0.0, "io_bytes": 0}  # of processes that are gone
        self._pid: int | None = None
        self._proc: psutil.Process | None = None
        self._last = {"cpu_s": 0.0, "io_bytes": 0}

    def sample(self, pid: int | None) -> dict[str, float]:
        if pid != self._pid:
            self._done = {k: self._done[k] + self._last[k] for k in self._done}
            self._last = {"cpu_s": 0.0, "io_bytes": 0}
            self._pid, self._proc = pid, None
            if pid is not None:
                with contextlib.suppress(psutil.Error):
                    self._proc = psutil.Process(pid)
        if self._proc is not None:
            with contextlib.suppress(psutil.Error):
                cpu = self._proc.cpu_times()
                self._last["cpu_s"] = cpu.user + cpu.system
            with contextlib.suppress(psutil.Error, AttributeError):
                io = self._proc.io_counters()
                self._last["io_bytes"] = io.read_chars + io.write_chars
        return {k: self._done[k] + self._last[k] for k in self._done}


class LoadMeter:
    """Cumulative DHT and control-plane counters of one node.

    Args:
        dht_usage: returns the transport's ``{kind: DhtUsage}``.
        control_traffic: returns the control channel's ``traffic`` counters (or ``{}``).
        pids: returns the current pids of ``p2pd``, ``dht`` and ``sidecar`` (None
            where there is none).
    """

    def __init__(
        self,
        dht_usage: Callable[[], dict[str, Any]],
        control_traffic: Callable[[], dict[str, int]],
        pids: Callable[[], dict[str, int | None]],
    ) -> None:
        self._dht_usage = dht_usage
        self._control_traffic = control_traffic
        self._pids = pids
        self._roles = {name: _Role() for name in ("p2pd", "dht", "sidecar")}
        self._me = psutil.Process(os.getpid())

    def sample(self) -> dict[str, Any]:
        """The counters now (JSON-ready; every number only grows)."""
        pids = self._pids()
        roles = {name: role.sample(pids.get(name)) for name, role in self._roles.items()}
        usage = self._dht_usage()
        by_kind = {
            k: {"ops": u.ops, "bytes": u.bytes_sent + u.bytes_received} for k, u in usage.items()
        }
        traffic = self._control_traffic()
        cpu = self._me.cpu_times()
        return {
            "dht": {
                "ops": sum(k["ops"] for k in by_kind.values()),
                "payload_bytes": sum(k["bytes"] for k in by_kind.values()),
                "by_kind": by_kind,
                "cpu_s": round(roles["dht"]["cpu_s"], 3),
                "io_bytes": int(roles["dht"]["io_bytes"]),
            },
            "control": {
                "published": traffic.get("published", 0),
                "received": traffic.get("received", 0),
                "payload_bytes": traffic.get("published_bytes", 0)
                + traffic.get("received_bytes", 0),
                "cpu_s": round(roles["sidecar"]["cpu_s"], 3),
                "io_bytes": int(roles["sidecar"]["io_bytes"]),
            },
            "p2pd_cpu_s": round(roles["p2pd"]["cpu_s"], 3),
            "node_cpu_s": round(cpu.user + cpu.system, 3),
        }


_FIGURES: dict[str, tuple[str, ...]] = {
    "dht_ops_per_round": ("dht", "ops"),
    "dht_payload_bytes_per_round": ("dht", "payload_bytes"),
    "dht_bytes_per_round": ("dht", "io_bytes"),
    "dht_cpu_s_per_round": ("dht", "cpu_s"),
    "control_messages_per_round": ("control", "messages"),
    "control_payload_bytes_per_round": ("control", "payload_bytes"),
    "control_bytes_per_round": ("control", "io_bytes"),
    "control_cpu_s_per_round": ("control", "cpu_s"),
    "p2pd_cpu_s_per_round": ("p2pd_cpu_s",),
    "node_cpu_s_per_round": ("node_cpu_s",),
}
"""Summary figure -> where its counter lives in a ``load`` sample."""


def _value(sample: dict[str, Any], path: tuple[str, ...]) -> float:
    if path == ("control", "messages"):
        c = sample.get("control", {})
        return float(c.get("published", 0) + c.get("received", 0))
    item: Any = sample
    for key in path:
        item = item.get(key, 0) if isinstance(item, dict) else 0
    return float(item or 0)


def per_round(samples: dict[int, dict[str, Any]]) -> dict[str, float] | None:
    """Figures per round from one node's ``{round: load sample}``.

    The rate between the first and the last sampled round, so start-up (joining,
    catching up, the clock) is left out; with a single round, its totals.
    """
    if not samples:
        return None
    first, last = min(samples), max(samples)
    rounds = last - first
    out = {}
    for name, path in _FIGURES.items():
        end = _value(samples[last], path)
        out[name] = (end - _value(samples[first], path)) / rounds if rounds else end / last
    return out


def memory_per_param(params: int, device: Any = None) -> dict[str, float | None]:
    """Memory per model parameter: this process's resident host memory now and at its
    peak, and the peak device memory torch allocated (None on the CPU).

    A float32 model with AdamW needs 16 bytes per parameter (weights, gradients, two
    moments); what a node holds beyond that is its outer state and buffers.
    """
    import resource

    params = max(1, params)
    rss = psutil.Process().memory_info().rss
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    out: dict[str, float | None] = {
        "host_bytes_per_param": round(rss / params, 2),
        "host_peak_bytes_per_param": round(peak / params, 2),
        "device_bytes_per_param": None,
    }
    if device is not None and getattr(device, "type", "cpu") == "cuda":
        import torch

        out["device_bytes_per_param"] = round(torch.cuda.max_memory_allocated(device) / params, 2)
    return out
