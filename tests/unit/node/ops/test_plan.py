"""``atoll plan`` against hand-computed cases."""

from __future__ import annotations

import json

import pytest

from node.cli import main
from node.ops.plan import PlanInput, parse_count, plan


def test_a_1t_bf16_model_is_2_tb_per_full_sync_and_20_s_at_800_gbit() -> None:
    two_sites = PlanInput(
        params=10**12, codec="bf16", bandwidth_gbit=800, step_seconds=1.0, group_size=2
    )
    out = plan(two_sites)
    assert out["full_sync_bytes"] == 2 * 10**12
    assert out["sent_bytes_per_sync"] == 2 * 10**12  # two sites: each sends the whole fragment
    assert out["transfer_seconds"] == pytest.approx(20.0)
    assert out["sync_seconds"] == pytest.approx(20.0)  # 0 km, no fixed overhead


def test_distance_adds_5_us_per_km_each_way() -> None:
    base = dict(params=10**6, codec="none", bandwidth_gbit=1.0, step_seconds=0.1)
    near = plan(PlanInput(**base, distance_km=100))
    far = plan(PlanInput(**base, distance_km=14_000))
    assert 2 * near["one_way_seconds"] == pytest.approx(1e-3)  # 1 ms round trip at 100 km
    assert 2 * far["one_way_seconds"] == pytest.approx(0.14)  # 140 ms at 14,000 km
    # two round trips per sync by default
    assert far["sync_seconds"] - far["transfer_seconds"] == pytest.approx(0.28)


def test_steps_mode_utilization_and_the_smallest_h_by_hand() -> None:
    # int8, 4M values in 4 fragments: 1M values + 3907 scales of 4 bytes = 1,015,628 B;
    # a group of 4 sends 1.5x that = 1,523,442 B = 12.187536 Mbit; at 0.1 Gbit/s 0.12187536 s
    inp = PlanInput(
        params=4_000_000,
        codec="int8",
        fragments=4,
        group_size=4,
        bandwidth_gbit=0.1,
        step_seconds=0.05,
        inner_steps=100,
        tau=1,
        overhead_seconds=0.5,
    )
    out = plan(inp)
    assert out["fragment_bytes"] == 1_000_000 + 4 * 3907
    assert out["sent_bytes_per_sync"] == pytest.approx(1.5 * 1_015_628)
    sync = 1.5 * 1_015_628 * 8 / 1e8 + 0.5
    assert out["sync_seconds"] == pytest.approx(sync)
    wait = sync - 0.05  # tau = 1 step hides 0.05 s
    assert out["utilization"] == pytest.approx(5.0 / (5.0 + 4 * wait))
    # 0.95 = H s / (H s + 4 wait)  =>  H = 0.95 * 4 * wait / (0.05 * 0.05)
    assert out["smallest_inner_steps"] == int(-(-0.95 * 4 * wait // (0.05 * 0.05)))
    bigger = plan(PlanInput(**{**inp.__dict__, "inner_steps": out["smallest_inner_steps"]}))
    assert bigger["utilization"] >= 0.95


def test_seconds_mode_fits_or_says_it_does_not() -> None:
    base = dict(params=10**9, codec="int8", bandwidth_gbit=1.0, step_seconds=0.5)
    slow = plan(PlanInput(**base, trigger="seconds", round_seconds=5.0))
    assert slow["sync_seconds"] > 5.0 and not slow["fits"] and slow["utilization"] == 0.0
    ok = plan(PlanInput(**base, trigger="seconds", round_seconds=slow["smallest_round_seconds"]))
    assert ok["fits"] and ok["utilization"] == 1.0


def test_counts_and_bad_input() -> None:
    assert parse_count("1T") == 10**12 and parse_count("7B") == 7 * 10**9
    assert parse_count("480k") == 480_000 and parse_count("1.5e3") == 1500
    for bad in ("", "many", "-5", "0"):
        with pytest.raises(ValueError):
            parse_count(bad)
    with pytest.raises(ValueError, match="at least 2 members"):
        PlanInput(params=1, bandwidth_gbit=1, step_seconds=1, group_size=1)
    with pytest.raises(ValueError):
        plan(PlanInput(params=1, bandwidth_gbit=1, step_seconds=1, codec="zip"))


def test_the_command_prints_json_and_reads_the_config(capsys) -> None:
    args = ["plan", "--step-seconds", "0.2", "--bandwidth-gbit", "1", "--json"]
    assert main([*args, "--config", "configs/islands.toml"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["input"]["params"] == 478_720 and out["input"]["codec"] == "int4"
    assert out["input"]["fragments"] == 5 and out["input"]["tau"] == 5
    assert (
        main(
            [
                "plan",
                "--params",
                "1T",
                "--codec",
                "bf16",
                "--step-seconds",
                "1",
                "--bandwidth-gbit",
                "800",
                "--group-size",
                "2",
                "--trigger",
                "steps",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "2 TB a full sync" in text and "a sync takes 20 s" in text


def test_topk_sends_parts_and_union_results_by_hand() -> None:
    # 40,960 values in chunks of 4096 keeping 41 in 2 bits: 10 chunks of 6 bytes of scale
    # and count; 410 offsets of 12 bits, two in three bytes: 615; the 410 codes packed
    # four a byte: 103
    inp = PlanInput(
        params=40_960,
        codec="topk",
        block_size=4096,
        topk_k=41,
        topk_bits=2,
        bandwidth_gbit=1.0,
        step_seconds=0.1,
        group_size=4,
    )
    out = plan(inp)
    assert out["fragment_bytes"] == 10 * 6 + 615 + 103
    # a result keeps at most 4 * 41 values of a chunk, 8 bits each: 1,640 offsets in
    # 2,460 bytes and 1,640 codes
    result = 10 * 6 + 2460 + 1640
    assert out["sent_bytes_per_sync"] == pytest.approx(3 / 4 * (out["fragment_bytes"] + result))
