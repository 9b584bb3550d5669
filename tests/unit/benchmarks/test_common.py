"""The benchmarks' shared parts: the link cost model, gloo ranks in spawned processes, digests."""

from __future__ import annotations

import os
import time

import pytest
import torch

from benchmarks._common import free_port, gloo_group, params_digest, run_ranks
from benchmarks._ddp_links import ring_allreduce_seconds
from protocol.p2p.shaper import LinkShape

_WORLD = 2


def _sum_rank(rank: int, port: int, results) -> None:
    """Spawned rank: all-reduce its rank + 1 over gloo and report the sum."""
    torch.set_num_threads(1)
    with gloo_group(port, rank, _WORLD, timeout_s=60) as dist:
        x = torch.tensor([float(rank + 1)])
        dist.all_reduce(x)
        results.put({"rank": rank, "sum": x.item(), "initialized": dist.is_initialized()})


def _die_or_wait(rank: int, seconds: float, results) -> None:
    """Spawned rank: rank 0 exits with an error at once, the others sleep."""
    if rank == 0:
        os._exit(3)
    time.sleep(seconds)
    results.put({"rank": rank})


def test_ring_allreduce_seconds_follows_the_ring_formula():
    link = LinkShape(delay_s=0.010, bandwidth_bps=100e6)
    nbytes, world = 4_000_000, 4
    expected = (2 * 3 / 4) * nbytes * 8 / 100e6 + 2 * 3 * 0.010
    assert ring_allreduce_seconds(nbytes, world, link) == pytest.approx(expected, rel=1e-3)
    assert ring_allreduce_seconds(nbytes, 1, link) == 0.0


def test_run_ranks_collects_every_rank_report_through_a_real_gloo_group():
    port = free_port()
    reports, exit_codes = run_ranks(
        _sum_rank, [(port,)] * _WORLD, expected=_WORLD, timeout=120, grace=30
    )
    assert exit_codes == [0, 0]
    assert sorted(r["rank"] for r in reports) == [0, 1]
    assert all(r["sum"] == 3.0 and r["initialized"] for r in reports)


def test_run_ranks_stops_waiting_when_a_rank_dies():
    started = time.monotonic()
    reports, exit_codes = run_ranks(
        _die_or_wait, [(60.0,)] * _WORLD, expected=_WORLD, timeout=120, grace=1
    )
    assert time.monotonic() - started < 50  # not the 60 s sleep, not the 120 s timeout
    assert exit_codes[0] == 3
    assert exit_codes[1] is not None  # the sleeper was ended, not left running
    assert reports == []


def test_params_digest_changes_with_any_parameter():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    assert params_digest(a) == params_digest(b)
    with torch.no_grad():
        b.bias[1] += 1e-6
    assert params_digest(a) != params_digest(b)
