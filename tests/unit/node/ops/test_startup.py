"""A node's start and stop: its data directory, the listen mistakes p2pd
reports, the metrics port, the wait for peers, and a teardown that never raises."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time

import pytest

from node.config import load_config
from node.ops.startup import (
    Teardown,
    _listen_problem,
    install_signals,
    open_logs,
    start_monitor,
    wait_for_peers,
)
from node.run.metrics import StatusWriter


def test_the_data_directory_is_made_with_its_status_and_events(tmp_path) -> None:
    cfg = load_config(None, [])
    status, events = open_logs(cfg, tmp_path / "a" / "b")
    status.update(force=True, state="starting")
    events.write("start")
    events.close()
    assert (tmp_path / "a" / "b" / "status.json").exists()
    assert "start" in (tmp_path / "a" / "b" / "events.jsonl").read_text()


def test_p2pds_listen_errors_become_what_to_change() -> None:
    cfg = load_config(None, ["network.port=4711", "network.host='10.9.9.9'"])
    in_use = _listen_problem(cfg, RuntimeError("listen tcp: address already in use"))
    assert in_use is not None and "tcp port 4711" in str(in_use)
    foreign = _listen_problem(cfg, RuntimeError("bind: cannot assign requested address"))
    assert foreign is not None and "network.host 10.9.9.9" in str(foreign)
    assert _listen_problem(cfg, RuntimeError("something else")) is None


def test_a_metrics_port_in_use_is_a_config_error_and_none_is_no_endpoint(tmp_path) -> None:
    status = StatusWriter(tmp_path / "status.json")
    assert start_monitor(load_config(None, []), dict, status) is None
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = load_config(None, [f"metrics.port={port}", "metrics.host='127.0.0.1'"])
        with pytest.raises(ValueError, match=f"metrics.port = {port}.*choose another"):
            start_monitor(cfg, dict, status)
    cfg = load_config(None, ["metrics.port=0", "metrics.host='127.0.0.1'"])
    monitor = start_monitor(cfg, dict, status)
    assert monitor is not None
    try:
        assert status.current["metrics_url"].startswith("http://127.0.0.1:")
    finally:
        monitor.close()


def test_the_wait_for_peers_ends_when_they_come_or_at_its_timeout(caplog) -> None:
    cfg = load_config(None, ["network.min_peers=3", "network.min_peers_timeout=0.5"])
    live: set[str] = set()
    threading.Timer(0.1, lambda: live.update({"a", "b"})).start()
    started = time.monotonic()
    wait_for_peers(cfg, lambda: live, threading.Event())
    assert time.monotonic() - started < 0.45 and not caplog.records
    with caplog.at_level(logging.WARNING):
        wait_for_peers(cfg, set, threading.Event())
    assert "only 1 of 3 peers" in caplog.text


def test_teardown_logs_each_failure_and_goes_on(caplog) -> None:
    ran: list[str] = []

    def fail() -> None:
        raise OSError("disk full")

    with caplog.at_level(logging.DEBUG):
        attempt = Teardown(quiet=True)
        attempt("first", fail)
        attempt("second", lambda: ran.append("second"))
    assert ran == ["second"]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    Teardown(quiet=False)("third", fail)
    assert any(
        r.levelno == logging.WARNING and "third failed" in r.getMessage() for r in caplog.records
    )


def test_a_slow_teardown_step_is_logged_with_its_time(caplog, monkeypatch) -> None:
    monkeypatch.setattr("node.ops.startup._SLOW_STOP_SECONDS", 0.05)
    with caplog.at_level(logging.INFO, logger="node.ops.startup"):
        attempt = Teardown(quiet=False)
        attempt("quick", lambda: None)
        attempt("slow", lambda: time.sleep(0.1))
    timed = [r.getMessage() for r in caplog.records if "took" in r.getMessage()]
    assert len(timed) == 1 and timed[0].startswith("slow took 0.1"), timed


def test_a_signal_asks_the_node_to_finish_and_a_second_stops_it_at_once() -> None:
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    stop = threading.Event()
    try:
        install_signals(stop)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.wait(5)
        with pytest.raises(KeyboardInterrupt, match="second SIGINT"):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler runs between bytecodes, well before this ends
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
