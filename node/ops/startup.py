"""A node's start and stop: its data directory, its transport (tried again while
the bootstrap node is not up yet), its metrics endpoint, the wait for peers, the run's
clock, and stopping what was started in order.

Start-up problems an operator can fix are raised as :class:`ValueError` with one line
that says what to do (``atoll`` prints it and exits with code 2).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from node.config import AtollConfig
from node.ops.monitor import Monitor
from node.run.metrics import EventLog, StatusWriter
from node.settings import clock_settings, transport_config
from node.train.clock import SecondsClock
from node.train.clock import agree as agree_clock
from protocol.p2p.transport import BootstrapUnreachable, NotDialable, Transport
from verification.identity import Identity

__all__ = [
    "Teardown",
    "install_signals",
    "open_logs",
    "run_clock",
    "start_monitor",
    "start_transport",
    "wait_for_peers",
]

logger = logging.getLogger(__name__)


def install_signals(stop: threading.Event) -> None:
    """SIGINT and SIGTERM set ``stop``; a second one, while the node finishes, raises
    ``KeyboardInterrupt`` (the node stops at once, its teardown still run). In the main
    thread only; elsewhere nothing is done."""
    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        if stop.is_set():
            raise KeyboardInterrupt(f"second {name}: stopping now")
        logger.info("received %s: finishing", name)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def open_logs(cfg: AtollConfig, data_dir: Path) -> tuple[StatusWriter, EventLog]:
    """The data directory, made if missing, with its status file and event log; and
    this process's share of the cores (``run.threads``)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    return StatusWriter(data_dir / "status.json"), EventLog(data_dir / "events.jsonl")


def start_transport(
    cfg: AtollConfig,
    key_file: Path,
    identity: Identity,
    initial_peers: tuple[str, ...],
    stop: threading.Event,
    status: StatusWriter,
) -> Transport:
    """Start the transport; keep trying initial peers that do not answer yet (the
    bootstrap node may come up after this one) for ``network.join_timeout``.

    Raises:
        BootstrapUnreachable: no initial peer answered in time.
        NotDialable: a peer could not dial this node back at its PeerID.
        ValueError: the port is in use, or the host is not this machine's.
    """
    net = cfg.network
    deadline = time.monotonic() + net.join_timeout
    wait = 1.0  # a bootstrap node starting beside this one answers within seconds
    attempts = 0
    while True:
        attempts += 1
        status.update(force=True, join_attempts=attempts)
        try:
            return Transport.start(transport_config(cfg, key_file, initial_peers))
        except BootstrapUnreachable as exc:
            left = deadline - time.monotonic()
            if left <= 0 or stop.is_set():
                raise BootstrapUnreachable(
                    f"{exc} (tried for {net.join_timeout:.0f} s); check the addresses and "
                    "that those nodes run, with the port they listen on open to this host"
                ) from exc
            logger.warning("%s; trying again in %.0f s", exc, min(wait, left))
            status.update(force=True, state="joining", join_error=str(exc))
            stop.wait(min(wait, left))
            wait = min(5.0, 2 * wait)
        except NotDialable as exc:
            raise NotDialable(
                f"a peer could not dial this node back at its PeerID "
                f"{identity.peer_id}: either another node is running with the identity "
                f"key {key_file} (a copied data directory; give this one its own, or run "
                "`atoll keygen --force` in it), or inbound connections to tcp port "
                f"{net.port} are blocked (then set network.reachability = 'private')"
            ) from exc
        except RuntimeError as exc:
            problem = _listen_problem(cfg, exc)
            if problem is None:
                raise
            raise problem from exc


def _listen_problem(cfg: AtollConfig, exc: RuntimeError) -> ValueError | None:
    """p2pd's own words (Go's strerror) for the two listen mistakes operators make."""
    net = cfg.network
    if "address already in use" in str(exc):
        return ValueError(
            f"tcp port {net.port} on {net.host} is in use; stop the other program "
            "or choose another network.port"
        )
    if "cannot assign requested address" in str(exc):
        return ValueError(
            f"network.host {net.host} is not an address of this machine; set it to "
            "one of its addresses, or 0.0.0.0 to listen on all of them"
        )
    return None


def start_monitor(
    cfg: AtollConfig, state: Callable[[], dict[str, Any]], status: StatusWriter
) -> Monitor | None:
    """The metrics endpoint, when ``[metrics] port`` is set."""
    m = cfg.metrics
    if m.port is None:
        return None
    try:
        monitor = Monitor(m.host, m.port, state)
    except OSError as exc:
        raise ValueError(
            f"metrics.port = {m.port} on {m.host}: {exc.strerror or exc}; choose another "
            "port (0: any free one)"
        ) from exc
    port = monitor.start()
    url = f"http://{m.host}:{port}"
    status.update(force=True, metrics_url=url)
    logger.info("metrics on %s/metrics, state on %s/api/v1/state", url, url)
    return monitor


def wait_for_peers(cfg: AtollConfig, live: Callable[[], set[str]], stop: threading.Event) -> None:
    """Until ``network.min_peers`` nodes (this one included) are live, at most
    ``network.min_peers_timeout`` seconds; then training starts anyway."""
    net = cfg.network
    deadline = time.monotonic() + net.min_peers_timeout
    while len(live()) + 1 < net.min_peers and not stop.is_set():
        if time.monotonic() > deadline:
            logger.warning(
                "only %d of %d peers after %.0fs; training anyway",
                len(live()) + 1,
                net.min_peers,
                net.min_peers_timeout,
            )
            return
        stop.wait(0.2)


def run_clock(
    cfg: AtollConfig,
    transport: Transport,
    identity: Identity,
    fragments: int,
    spec: tuple[str, tuple[str, ...], float | None],
) -> SecondsClock:
    """The run's round clock (:func:`node.train.clock.agree`).

    Args:
        spec: the spec's digest, the initial peers and the spec's ``t0`` (if any).
    """
    digest, initial_peers, t0 = spec
    settings = clock_settings(cfg, digest, fragments, initial_peers, t0)
    agreeing = agree_clock(transport, identity, settings)
    return transport.run(agreeing, settings.wait + 4 * cfg.network.request_timeout + 10)


_SLOW_STOP_SECONDS = 1.0
"""A teardown step that takes this long or longer is logged with its time."""


class Teardown:
    """Stop what was started, in order, each step on its own: one that fails is logged
    and the next still runs, so the error that ended the node (a read-only or full
    disk, say) is the one reported, not a second one.

    Args:
        quiet: the node is ending on an error: what fails here too is logged at debug
            level only.
    """

    def __init__(self, quiet: bool) -> None:
        self.level = logging.DEBUG if quiet else logging.WARNING

    def __call__(self, what: str, step: Callable[[], object]) -> None:
        started = time.monotonic()
        try:
            step()
        except Exception as exc:
            logger.log(self.level, "%s failed: %s", what, exc)
            logger.debug("%s failed", what, exc_info=True)
        finally:
            took = time.monotonic() - started
            if took >= _SLOW_STOP_SECONDS:
                logger.info("%s took %.1f s", what, took)
