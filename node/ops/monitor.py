"""A node's HTTP endpoint for operators: a health page, Prometheus metrics, its state.

``GET /`` serves the swarm health page (``node/web/index.html``: the node's progress,
the peers it hears with their reputation and standing, bits/byte per round, recent
violations; it reads the JSON below). ``GET /metrics`` serves the Prometheus text format (``prometheus_client``), built at
each scrape from one snapshot of the node (:meth:`node.ops.reporter.Reporter.monitor_state`);
``GET /api/v1/state`` serves the same snapshot as JSON. Names follow Prometheus'
conventions: an ``atoll_`` prefix, base units (seconds, bytes), ``_total`` on counters.
The server runs in its own daemon threads and only reads; a slow or broken scraper
cannot hold the node up.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["Monitor", "metrics_of"]

logger = logging.getLogger(__name__)

State = dict[str, Any]


@dataclass(frozen=True)
class _Family:
    """One metric family: its name, kind, help text and where a snapshot holds it.

    ``key`` names a number of the snapshot, or with ``label`` a ``{label: number}``
    table of it; a tuple of ``(label, key)`` gathers several numbers into one family.
    """

    name: str
    kind: str
    help: str
    key: str | tuple[tuple[str, str], ...] = ""
    label: str | None = None


_FAMILIES: tuple[_Family, ...] = (
    _Family("atoll_info", "info", "Always 1; labels name the node."),
    _Family("atoll_round", "gauge", "The outer round this node works on.", "round"),
    _Family("atoll_inner_steps", "counter", "Inner steps trained.", "step"),
    _Family("atoll_tokens", "counter", "Tokens trained on.", "tokens"),
    _Family(
        "atoll_tokens_per_second", "gauge", "Tokens per second of training time.", "throughput"
    ),
    _Family("atoll_train_loss", "gauge", "Loss of the last inner step.", "loss"),
    _Family(
        "atoll_val_bits_per_byte",
        "gauge",
        "Validation bits per byte of the global parameters at the last evaluated round.",
        "val_bpb",
    ),
    _Family(
        "atoll_alone_syncs",
        "counter",
        "Fragment syncs this node averaged alone while peers were live (cut off from them).",
        "alone_syncs",
    ),
    _Family(
        "atoll_alone_rounds",
        "gauge",
        "Rounds in a row this node ended without an exchange with any peer.",
        "alone_rounds",
    ),
    _Family(
        "atoll_first_exchange_seconds",
        "gauge",
        "Seconds from this node's launch to its first exchange with a peer.",
        "first_exchange_s",
    ),
    _Family(
        "atoll_join_attempts",
        "gauge",
        "Tries this node's start took to reach an initial peer (1: at once).",
        "join_attempts",
    ),
    _Family(
        "atoll_catch_ups",
        "counter",
        "Global states taken from peers (joining, or after a round that went wrong).",
        "catch_ups",
    ),
    _Family("atoll_catch_up_bytes", "counter", "Bytes of those states.", "catch_up_bytes"),
    _Family(
        "atoll_catch_up_seconds",
        "counter",
        "Seconds spent downloading and checking those states.",
        "catch_up_seconds",
    ),
    _Family(
        "atoll_host_bytes_per_parameter",
        "gauge",
        "Resident host memory of the node's process per model parameter, at the last round.",
        "host_bytes_per_param",
    ),
    _Family(
        "atoll_device_bytes_per_parameter",
        "gauge",
        "Peak device (GPU) memory allocated per model parameter, at the last round.",
        "device_bytes_per_param",
    ),
    _Family(
        "atoll_sent_bytes", "counter", "Bytes of parts, results and repairs sent.", "bytes_sent"
    ),
    _Family(
        "atoll_received_bytes",
        "counter",
        "Bytes of parts, results and repairs received.",
        "bytes_received",
    ),
    _Family(
        "atoll_syncs",
        "counter",
        "Fragment syncs by outcome (complete, partial: some parts kept local values, failed).",
        "syncs",
        label="outcome",
    ),
    _Family(
        "atoll_refused_messages",
        "counter",
        "Messages from peers refused, by reason.",
        "refused",
        label="reason",
    ),
    _Family(
        "atoll_peers",
        "gauge",
        "Peers this node knows, by source.",
        (("dht", "live_peers"), ("control", "control_peers")),
        label="source",
    ),
    _Family(
        "atoll_peer_reputation",
        "reputation",
        "Reputation of each peer judged, in [0, 1].",
        "reputations",
    ),
    _Family(
        "atoll_peer_standing",
        "standing",
        "1 for each peer's standing (ok, quarantined, banned).",
        "reputations",
    ),
    _Family(
        "atoll_sidecar_restarts",
        "counter",
        "Restarts of the control sidecar.",
        "sidecar_restarts",
    ),
    _Family(
        "atoll_control_dropped",
        "counter",
        "Control messages dropped, by reason.",
        "control_dropped",
        label="reason",
    ),
    _Family(
        "atoll_exchange_budget_seconds",
        "gauge",
        "Seconds the latest exchange was given (network.adaptive_deadlines: measured).",
        "exchange_budget_seconds",
    ),
    _Family(
        "atoll_checkpoint_age_seconds",
        "gauge",
        "Seconds since this node's last checkpoint.",
        "checkpoint_age_seconds",
    ),
)
"""Every family ``/metrics`` serves, in the order it serves them."""


def metrics_of(state: State) -> Iterator[Metric]:
    """The metric families of one snapshot of a node (absent values are left out)."""
    for family in _FAMILIES:
        yield from _BUILDERS[family.kind](family, state)


def _number(state: State, key: str) -> float | None:
    value = state.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _numbers(family: _Family, state: State) -> Iterator[Metric]:
    """A gauge or counter: one number, or one per label."""
    kind = GaugeMetricFamily if family.kind == "gauge" else CounterMetricFamily
    if family.label is None:
        value = _number(state, str(family.key))
        if value is not None:
            yield kind(family.name, family.help, value=value)
        return
    metric = kind(family.name, family.help, labels=[family.label])
    if isinstance(family.key, tuple):
        for label, key in family.key:
            value = _number(state, key)
            if value is not None:
                metric.add_metric([label], value)
    else:
        for label, value in sorted((state.get(family.key) or {}).items()):
            metric.add_metric([str(label)], float(value))
    yield metric


def _info(family: _Family, state: State) -> Iterator[Metric]:
    labels = ["version", "peer_id", "run_id"]
    metric = GaugeMetricFamily(family.name, family.help, labels=labels)
    metric.add_metric([str(state.get(label, "")) for label in labels], 1.0)
    yield metric


def _reputation(family: _Family, state: State) -> Iterator[Metric]:
    metric = GaugeMetricFamily(family.name, family.help, labels=["peer"])
    for peer, rep in sorted((state.get(str(family.key)) or {}).items()):
        metric.add_metric([peer], float(rep.get("score", 0.0)))
    yield metric


def _standing(family: _Family, state: State) -> Iterator[Metric]:
    metric = GaugeMetricFamily(family.name, family.help, labels=["peer", "standing"])
    for peer, rep in sorted((state.get(str(family.key)) or {}).items()):
        metric.add_metric([peer, str(rep.get("status", "ok"))], 1.0)
    yield metric


_BUILDERS: dict[str, Callable[[_Family, State], Iterator[Metric]]] = {
    "gauge": _numbers,
    "counter": _numbers,
    "info": _info,
    "reputation": _reputation,
    "standing": _standing,
}


def _page() -> bytes:
    """The swarm health page: static HTML and JavaScript shipped in the package, which
    reads ``/api/v1/state`` every two seconds (no build step)."""
    from importlib.resources import files

    return files("node").joinpath("web/index.html").read_bytes()


class _Collector(Collector):
    def __init__(self, state: Callable[[], State]) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        yield from metrics_of(self.state())


class Monitor:
    """Serves ``/metrics`` and ``/api/v1/state`` on ``host:port`` (0: a free port).

    Args:
        state: the node's snapshot, called once per request (from a server thread).
    """

    def __init__(self, host: str, port: int, state: Callable[[], State]) -> None:
        self.state = state
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(state))
        monitor = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the http.server API
                monitor._serve(self)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                logger.debug("monitor: " + format, *args)

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="atoll-monitor", daemon=True
        )

    def start(self) -> int:
        self._thread.start()
        return self.port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def _serve(self, request: BaseHTTPRequestHandler) -> None:
        path = request.path.split("?", 1)[0]
        try:
            if path in ("/", "/index.html"):
                body, kind = _page(), "text/html; charset=utf-8"
            elif path == "/metrics":
                body, kind = generate_latest(self.registry), "text/plain; version=0.0.4"
            elif path == "/api/v1/state":
                body, kind = json.dumps(self.state()).encode(), "application/json"
            else:
                request.send_error(404, "not here: try /, /metrics or /api/v1/state")
                return
        except Exception:  # a snapshot that fails must not take the server down
            logger.exception("monitor: %s failed", path)
            request.send_error(500, "the node could not report its state")
            return
        request.send_response(200)
        request.send_header("Content-Type", kind)
        request.send_header("Content-Length", str(len(body)))
        request.end_headers()
        request.wfile.write(body)
