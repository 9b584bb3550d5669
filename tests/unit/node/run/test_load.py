"""What the DHT and control plane cost a node: counters and the figures per round."""

from __future__ import annotations

import os

import pytest

from node.run.load import LoadMeter, per_round
from protocol.p2p.transport import DhtUsage


def _sample(dht_ops: int, dht_io: int, published: int, received: int, cpu: float) -> dict:
    return {
        "dht": {"ops": dht_ops, "payload_bytes": 10 * dht_ops, "cpu_s": cpu, "io_bytes": dht_io},
        "control": {
            "published": published,
            "received": received,
            "payload_bytes": 300 * (published + received),
            "cpu_s": 2 * cpu,
            "io_bytes": 0,
        },
        "p2pd_cpu_s": cpu,
        "node_cpu_s": 10 * cpu,
    }


def test_figures_per_round_leave_out_the_first_round() -> None:
    samples = {
        1: _sample(40, 5_000, 3, 10, 1.0),  # start-up: joining, the clock, catching up
        2: _sample(46, 6_000, 5, 20, 1.5),
        4: _sample(58, 8_000, 9, 40, 2.5),
    }
    figures = per_round(samples)
    assert figures is not None
    # three rounds from the end of round 1 to the end of round 4, hand-computed
    assert figures["dht_ops_per_round"] == pytest.approx(18 / 3)
    assert figures["dht_payload_bytes_per_round"] == pytest.approx(180 / 3)
    assert figures["dht_bytes_per_round"] == pytest.approx(3_000 / 3)
    assert figures["dht_cpu_s_per_round"] == pytest.approx(0.5)
    assert figures["control_messages_per_round"] == pytest.approx((6 + 30) / 3)
    assert figures["control_payload_bytes_per_round"] == pytest.approx(300 * 36 / 3)
    assert figures["control_cpu_s_per_round"] == pytest.approx(1.0)
    assert figures["p2pd_cpu_s_per_round"] == pytest.approx(0.5)
    assert figures["node_cpu_s_per_round"] == pytest.approx(5.0)


def test_one_round_gives_its_totals_and_none_gives_nothing() -> None:
    figures = per_round({2: _sample(40, 5_000, 3, 10, 1.0)})
    assert figures is not None and figures["dht_ops_per_round"] == 20
    assert per_round({}) is None


def test_the_meter_counts_dht_kinds_control_traffic_and_helper_cpu() -> None:
    usage = {"registry": DhtUsage(), "matchmaking": DhtUsage()}
    usage["registry"].count(sent=100)
    usage["registry"].count(sent=20, received=900, op=False)
    usage["matchmaking"].count(sent=50)
    traffic = {"published": 2, "published_bytes": 600, "received": 5, "received_bytes": 1500}
    pids: dict[str, int | None] = {"p2pd": None, "dht": os.getpid(), "sidecar": None}
    meter = LoadMeter(lambda: usage, lambda: traffic, lambda: pids)
    first = meter.sample()
    assert first["dht"]["ops"] == 2 and first["dht"]["payload_bytes"] == 1070
    assert first["dht"]["by_kind"]["registry"] == {"ops": 1, "bytes": 1020}
    assert first["control"]["published"] == 2 and first["control"]["received"] == 5
    assert first["control"]["payload_bytes"] == 2100
    assert first["dht"]["cpu_s"] > 0 and first["control"]["cpu_s"] == 0
    # the role's process is replaced (a restart): its totals are kept, not lost
    pids["dht"] = None
    assert meter.sample()["dht"]["cpu_s"] >= first["dht"]["cpu_s"]


def test_memory_per_parameter_reports_this_process_and_no_device_on_the_cpu() -> None:
    import psutil
    import torch

    from node.run.load import memory_per_param

    rss = psutil.Process().memory_info().rss
    got = memory_per_param(1000, torch.device("cpu"))
    assert got["device_bytes_per_param"] is None
    assert 0.5 * rss / 1000 < got["host_bytes_per_param"] < 2 * rss / 1000
    assert got["host_peak_bytes_per_param"] >= got["host_bytes_per_param"] * 0.9
    assert memory_per_param(0)["host_bytes_per_param"] > 1e6  # no division by zero
