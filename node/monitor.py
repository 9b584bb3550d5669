"""A node's HTTP endpoint for operators: a health page, Prometheus metrics, its state.

``GET /`` serves the swarm health page (``node/web/index.html``: the node's progress,
the peers it hears with their reputation and standing, bits/byte per round, recent
violations; it reads the JSON below). ``GET /metrics`` serves the Prometheus text format (``prometheus_client``), built at
each scrape from one snapshot of the node (:meth:`node.daemon.Node.monitor_state`);
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
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["Monitor", "metrics_of"]

logger = logging.getLogger(__name__)

State = dict[str, Any]


def _number(state: State, key: str) -> float | None:
    value = state.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _gauge(name: str, doc: str, value: float | None) -> Iterator[Metric]:
    if value is not None:
        yield GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float | None) -> Iterator[Metric]:
    if value is not None:
        yield CounterMetricFamily(name, doc, value=value)


def _labelled(kind: type, name: str, doc: str, label: str, values: dict) -> Iterator[Metric]:
    family = kind(name, doc, labels=[label])
    for key, value in sorted(values.items()):
        family.add_metric([str(key)], float(value))
    yield family


def metrics_of(state: State) -> Iterator[Metric]:
    """The metric families of one snapshot of a node (absent values are left out)."""
    info = GaugeMetricFamily(
        "atoll_info", "Always 1; labels name the node.", labels=["version", "peer_id", "run_id"]
    )
    info.add_metric(
        [
            str(state.get("version", "")),
            str(state.get("peer_id", "")),
            str(state.get("run_id", "")),
        ],
        1.0,
    )
    yield info
    yield from _gauge("atoll_round", "The outer round this node works on.", _number(state, "round"))
    yield from _counter("atoll_inner_steps", "Inner steps trained.", _number(state, "step"))
    yield from _counter("atoll_tokens", "Tokens trained on.", _number(state, "tokens"))
    yield from _gauge(
        "atoll_tokens_per_second",
        "Tokens per second of training time.",
        _number(state, "throughput"),
    )
    yield from _gauge("atoll_train_loss", "Loss of the last inner step.", _number(state, "loss"))
    yield from _gauge(
        "atoll_val_bits_per_byte",
        "Validation bits per byte of the global parameters at the last evaluated round.",
        _number(state, "val_bpb"),
    )
    yield from _counter(
        "atoll_alone_syncs",
        "Fragment syncs this node averaged alone while peers were live (cut off from them).",
        _number(state, "alone_syncs"),
    )
    yield from _gauge(
        "atoll_host_bytes_per_parameter",
        "Resident host memory of the node's process per model parameter, at the last round.",
        _number(state, "host_bytes_per_param"),
    )
    yield from _gauge(
        "atoll_device_bytes_per_parameter",
        "Peak device (GPU) memory allocated per model parameter, at the last round.",
        _number(state, "device_bytes_per_param"),
    )
    yield from _counter(
        "atoll_sent_bytes",
        "Bytes of parts, results and repairs sent.",
        _number(state, "bytes_sent"),
    )
    yield from _counter(
        "atoll_received_bytes",
        "Bytes of parts, results and repairs received.",
        _number(state, "bytes_received"),
    )
    yield from _labelled(
        CounterMetricFamily,
        "atoll_syncs",
        "Fragment syncs by outcome (complete, partial: some parts kept local values, failed).",
        "outcome",
        state.get("syncs") or {},
    )
    yield from _labelled(
        CounterMetricFamily,
        "atoll_refused_messages",
        "Messages from peers refused, by reason.",
        "reason",
        state.get("refused") or {},
    )
    peers = GaugeMetricFamily("atoll_peers", "Peers this node knows, by source.", labels=["source"])
    for source, key in (("dht", "live_peers"), ("control", "control_peers")):
        value = _number(state, key)
        if value is not None:
            peers.add_metric([source], value)
    yield peers
    reputations = state.get("reputations") or {}
    score = GaugeMetricFamily(
        "atoll_peer_reputation", "Reputation of each peer judged, in [0, 1].", labels=["peer"]
    )
    standing = GaugeMetricFamily(
        "atoll_peer_standing",
        "1 for each peer's standing (ok, quarantined, banned).",
        labels=["peer", "standing"],
    )
    for peer, rep in sorted(reputations.items()):
        score.add_metric([peer], float(rep.get("score", 0.0)))
        standing.add_metric([peer, str(rep.get("status", "ok"))], 1.0)
    yield score
    yield standing
    yield from _counter(
        "atoll_sidecar_restarts",
        "Restarts of the control sidecar.",
        _number(state, "sidecar_restarts"),
    )
    yield from _labelled(
        CounterMetricFamily,
        "atoll_control_dropped",
        "Control messages dropped, by reason.",
        "reason",
        state.get("control_dropped") or {},
    )
    yield from _gauge(
        "atoll_checkpoint_age_seconds",
        "Seconds since this node's last checkpoint.",
        _number(state, "checkpoint_age_seconds"),
    )


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
