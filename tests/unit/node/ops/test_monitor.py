"""The metrics endpoint: Prometheus text and the state as JSON, from one snapshot."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from node.ops.monitor import Monitor

STATE = {
    "version": "0.1.0",
    "peer_id": "12D3KooWme",
    "run_id": "r",
    "round": 7,
    "step": 420,
    "tokens": 99_000,
    "throughput": 1234.5,
    "loss": 2.5,
    "val_bpb": 3.25,
    "bytes_sent": 1000,
    "bytes_received": 2000,
    "syncs": {"complete": 5, "partial": 1, "failed": 0},
    "refused": {"bad_signature": 2},
    "live_peers": 3,
    "control_peers": 2,
    "reputations": {"12D3KooWpeer": {"score": 0.25, "status": "quarantined"}},
    "sidecar_restarts": 1,
    "control_dropped": {"malformed": 4},
    "checkpoint_age_seconds": 12.5,
    "exchange_budget_seconds": 13.0,
    "alone_syncs": 2,
    "first_exchange_s": 14.25,
    "join_attempts": 3,
    "catch_ups": 1,
    "catch_up_bytes": 4096,
    "catch_up_seconds": 0.5,
    "host_bytes_per_param": 41.5,
    "device_bytes_per_param": None,
}


@pytest.fixture
def served():
    state = dict(STATE)
    monitor = Monitor("127.0.0.1", 0, lambda: state)
    monitor.start()
    try:
        yield monitor, state
    finally:
        monitor.close()


def _get(monitor: Monitor, path: str) -> tuple[str, bytes]:
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor.port}{path}", timeout=10) as r:
        return r.headers["Content-Type"], r.read()


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_follow_prometheus_conventions_and_the_snapshot(served) -> None:
    monitor, state = served
    kind, body = _get(monitor, "/metrics")
    assert kind.startswith("text/plain")
    got = _samples(body.decode())
    assert got[("atoll_round", ())] == 7
    assert got[("atoll_inner_steps_total", ())] == 420
    assert got[("atoll_tokens_per_second", ())] == 1234.5
    assert got[("atoll_val_bits_per_byte", ())] == 3.25
    assert got[("atoll_host_bytes_per_parameter", ())] == 41.5
    # on the CPU there is no device memory to report
    assert not any(name == "atoll_device_bytes_per_parameter" for name, _ in got)
    assert got[("atoll_sent_bytes_total", ())] == 1000
    assert got[("atoll_received_bytes_total", ())] == 2000
    assert got[("atoll_syncs_total", (("outcome", "partial"),))] == 1
    assert got[("atoll_refused_messages_total", (("reason", "bad_signature"),))] == 2
    assert got[("atoll_peers", (("source", "dht"),))] == 3
    assert got[("atoll_peer_reputation", (("peer", "12D3KooWpeer"),))] == 0.25
    assert (
        got[("atoll_peer_standing", (("peer", "12D3KooWpeer"), ("standing", "quarantined")))] == 1
    )
    assert got[("atoll_sidecar_restarts_total", ())] == 1
    assert got[("atoll_control_dropped_total", (("reason", "malformed"),))] == 4
    assert got[("atoll_checkpoint_age_seconds", ())] == 12.5
    assert got[("atoll_exchange_budget_seconds", ())] == 13.0
    assert got[("atoll_alone_syncs_total", ())] == 2
    assert got[("atoll_first_exchange_seconds", ())] == 14.25
    assert got[("atoll_join_attempts", ())] == 3
    assert got[("atoll_catch_ups_total", ())] == 1
    assert got[("atoll_catch_up_bytes_total", ())] == 4096
    assert got[("atoll_catch_up_seconds_total", ())] == 0.5
    info = (("peer_id", "12D3KooWme"), ("run_id", "r"), ("version", "0.1.0"))
    assert got[("atoll_info", info)] == 1
    # every scrape reads the node anew
    state["round"] = 8
    assert _samples(_get(monitor, "/metrics")[1].decode())[("atoll_round", ())] == 8


def test_values_the_node_does_not_have_yet_are_left_out(served) -> None:
    monitor, state = served
    state.clear()
    state.update(round=0)
    got = _samples(_get(monitor, "/metrics")[1].decode())
    assert got[("atoll_round", ())] == 0
    assert not any(name == "atoll_val_bits_per_byte" for name, _ in got)


def test_state_api_and_unknown_paths(served) -> None:
    monitor, _ = served
    kind, body = _get(monitor, "/api/v1/state")
    assert kind == "application/json" and json.loads(body)["round"] == 7
    with pytest.raises(urllib.error.HTTPError) as err:
        _get(monitor, "/nothing")
    assert err.value.code == 404


def test_a_snapshot_that_fails_is_a_500_and_the_server_keeps_serving() -> None:
    calls = []

    def state() -> dict:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return {"round": 1}

    monitor = Monitor("127.0.0.1", 0, state)
    monitor.start()
    try:
        with pytest.raises(urllib.error.HTTPError) as err:
            _get(monitor, "/api/v1/state")
        assert err.value.code == 500
        assert json.loads(_get(monitor, "/api/v1/state")[1]) == {"round": 1}
    finally:
        monitor.close()


def test_the_health_page_is_served_from_the_package(served) -> None:
    monitor, _ = served
    kind, body = _get(monitor, "/")
    assert kind.startswith("text/html")
    # no build step: one static page that reads the state API
    assert b"api/v1/state" in body and b'id="peers"' in body and b'id="plot"' in body


def test_recent_events_reads_whole_lines_from_the_end(tmp_path) -> None:
    from node.run.metrics import EventLog, recent_events

    with EventLog(tmp_path / "events.jsonl") as log:
        for r in range(2000):
            log.write("round", round=r, val_bpb=5.0 - r / 1000)
    tail = recent_events(tmp_path / "events.jsonl", max_bytes=4096)
    rounds = [e["round"] for e in tail]
    assert rounds == list(range(rounds[0], 2000)) and 0 < len(rounds) < 100
    assert recent_events(tmp_path / "missing.jsonl") == []
