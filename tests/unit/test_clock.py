"""The wall-clock round schedule, by hand."""

from __future__ import annotations

import time

from node.clock import SecondsClock


def test_sync_times_spread_fragments_evenly_over_each_round() -> None:
    clock = SecondsClock(t0=1000.0, round_seconds=20.0, fragments=4)
    assert [clock.sync_time(1, f) for f in range(4)] == [1005.0, 1010.0, 1015.0, 1020.0]
    assert clock.sync_time(3, 0) == 1045.0


def test_round_at() -> None:
    clock = SecondsClock(t0=1000.0, round_seconds=20.0, fragments=2)
    assert clock.round_at(999.9) == 0
    assert clock.round_at(1000.0) == 1
    assert clock.round_at(1019.99) == 1
    assert clock.round_at(1020.0) == 2


def test_due_lists_every_passed_sync_after_the_last_one_in_order() -> None:
    clock = SecondsClock(t0=1000.0, round_seconds=20.0, fragments=2)
    assert clock.due(1009.0, (0, 1)) == []
    assert clock.due(1010.0, (0, 1)) == [(1, 0)]
    assert clock.due(1031.0, (1, 0)) == [(1, 1), (2, 0)]
    assert clock.due(1031.0, (2, 0)) == []


def test_next_boundary_wraps_to_the_next_round() -> None:
    clock = SecondsClock(t0=0.0, round_seconds=10.0, fragments=3)
    assert clock.next_boundary((1, 0)) == (1, 1)
    assert clock.next_boundary((1, 2)) == (2, 0)


def test_start_time_is_a_whole_second_at_least_the_lead_ahead() -> None:
    now = time.time()
    t0 = SecondsClock.start_time(20.0, lead=5.0)
    assert t0 == int(t0) and now + 5.0 <= t0 <= time.time() + 6.0
