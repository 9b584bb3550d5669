"""The wan benchmark's namespace mode: shaper settings, the delay-only DDP hook, the CLI."""

from __future__ import annotations

import time

import pytest
import torch

from benchmarks import __main__ as bench_cli
from benchmarks import _wan_netns, wan
from benchmarks._common import free_port, gloo_group, run_ranks
from benchmarks._ddp import DdpRun
from benchmarks._ddp_links import _delay_allreduce_hook, _LinkHookState
from benchmarks._mode import Mode
from protocol.p2p.shaper import ENV_VAR, LinkShape, Shaper

_WORLD = 2
_DELAY_S = 0.1
_BACKWARDS = 3


def test_nodes_shape_only_the_delay_and_nothing_without_one():
    env = _wan_netns.atoll_env(LinkShape(0.070, 100e6))
    assert env == {ENV_VAR: "delay_ms=70"}
    shaper = Shaper.from_env(env)
    assert shaper is not None and shaper.shape == LinkShape(0.070, None)  # tbf is the rate
    assert _wan_netns.atoll_env(LinkShape(0.0, 100e6)) == {}


def test_sources_name_tbf_for_bandwidth_and_the_delay_mechanism_per_method():
    slow = LinkShape(0.070, 100e6)
    atoll, ddp = _wan_netns.sources("atoll", slow), _wan_netns.sources("ddp", slow)
    assert atoll["bandwidth"].startswith("tbf (kernel)") and ddp["bandwidth"] == atoll["bandwidth"]
    assert atoll["delay"].startswith("in-process shaper") and "delay_ms=70" in atoll["delay"]
    assert ddp["delay"].startswith("comm hook") and "70 ms" in ddp["delay"]
    assert _wan_netns.sources("ddp", LinkShape(0.0, 100e6))["delay"] == "none (0 ms)"


@pytest.mark.parametrize("link", [None, LinkShape(0.010, 1e9)])
def test_a_ddp_plan_survives_the_trip_to_a_rank_process(link):
    plan = DdpRun(
        ("a=1", "b='x'"),
        2,
        seconds=18.0,
        slowdowns=(1.0, 2.0),
        link=link,
        evaluate=True,
        delay_s=0.07,
        master_addr="10.77.3.11",
    )
    assert _wan_netns.plan_from_json(_wan_netns.plan_to_json(plan)) == plan


def test_link_bookings_queue_one_after_another():
    state = _LinkHookState(LinkShape(0.010), world=4)
    assert state.book(100.0, 0.06) == pytest.approx(100.06)
    assert state.book(100.01, 0.06) == pytest.approx(100.12)  # waits for the first
    assert state.book(200.0, 0.06) == pytest.approx(200.06)  # an idle link starts at once


def _timed_backward(rank: int, port: int, delay_s: float, results) -> None:
    """Spawned rank: DDP over gloo, with the delay hook when ``delay_s``; time backward."""
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    with gloo_group(port, rank, _WORLD, timeout_s=60):
        torch.manual_seed(rank)
        model = DistributedDataParallel(torch.nn.Linear(8, 1))
        if delay_s:
            model.register_comm_hook(
                _LinkHookState(LinkShape(delay_s), _WORLD), _delay_allreduce_hook
            )
        seconds = []
        for _ in range(_BACKWARDS):
            t0 = time.monotonic()
            model(torch.ones(2, 8)).sum().backward()
            seconds.append(time.monotonic() - t0)
        grad = model.module.weight.grad.clone()
        results.put({"rank": rank, "seconds": seconds, "grad": grad.tolist()})


def test_the_delay_hook_adds_the_ring_latency_after_the_real_allreduce():
    port = free_port()
    reports, exit_codes = run_ranks(
        _timed_backward, [(port, _DELAY_S)] * _WORLD, expected=_WORLD, timeout=120, grace=30
    )
    assert exit_codes == [0, 0]
    ring_latency = 2 * (_WORLD - 1) * _DELAY_S
    for r in reports:
        assert all(ring_latency <= s < ring_latency + 1.0 for s in r["seconds"]), r["seconds"]
    # Still a real all-reduce: both ranks hold the same averaged gradient.
    assert reports[0]["grad"] == reports[1]["grad"]


def test_cli_netns_applies_only_to_wan(capsys, tmp_path):
    assert bench_cli.main(["codec", "--netns", "--out", str(tmp_path)]) == 2
    assert "--netns applies to wan only" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_wan_netns_is_skipped_with_the_reason_where_no_lab_can_be_built(
    monkeypatch, capsys, tmp_path
):
    monkeypatch.setattr(_wan_netns, "available", lambda: (False, "needs root"))
    assert wan.run(Mode(quick=True, netns=True), tmp_path) == {
        "benchmark": "wan",
        "skipped": "--netns needs a network lab: needs root",
    }
    assert bench_cli.main(["wan", "--quick", "--netns", "--out", str(tmp_path)]) == 0
    assert "wan: skipped: --netns needs a network lab: needs root" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing ran, nothing written
