"""Deadlines that follow measured exchange times: the configured budget until enough
exchanges completed, then a bounded multiple of their 90th percentile, doubled after
one that ran out."""

from __future__ import annotations

import pytest

from node.train.deadlines import FACTOR, MIN_SAMPLES, SLACK_SECONDS, WINDOW, Deadlines

CEILING, FLOOR = 63.0, 3.0


def _measured(seconds: list[float], adaptive: bool = True) -> Deadlines:
    d = Deadlines(adaptive)
    for s in seconds:
        d.finished(s, CEILING, complete=True)
    return d


def test_the_configured_budget_until_enough_exchanges_completed() -> None:
    d = _measured([1.0] * (MIN_SAMPLES - 1))
    assert d.budget(CEILING, FLOOR) == CEILING
    assert d.summary()["measured_p90"] is None
    d.finished(1.0, CEILING, complete=True)
    assert d.budget(CEILING, FLOOR) < CEILING


def test_a_budget_is_a_multiple_of_the_90th_percentile_within_floor_and_ceiling() -> None:
    # ten exchanges of 4 s and one of 5 s: the 90th percentile is 4 s
    d = _measured([4.0] * 10 + [5.0])
    assert d.budget(CEILING, FLOOR) == pytest.approx(FACTOR * 4.0)
    # fast exchanges never bring it under the matchmaking wait and commit window + slack
    fast = _measured([0.1] * 8)
    assert fast.budget(CEILING, FLOOR) == pytest.approx(FLOOR + SLACK_SECONDS)
    # slow ones never take it past the configured budget
    slow = _measured([40.0] * 8)
    assert slow.budget(CEILING, FLOOR) == CEILING
    assert slow.summary() == {
        "adaptive": True,
        "exchange_seconds": CEILING,
        "measured_p90": 40.0,
        "backoff": 1,
    }


def test_only_the_latest_window_of_exchanges_counts() -> None:
    d = _measured([40.0] * WINDOW)
    assert d.budget(CEILING, FLOOR) == CEILING
    for _ in range(WINDOW):
        d.finished(2.0, CEILING, complete=True)
    assert d.budget(CEILING, FLOOR) == pytest.approx(FLOOR + SLACK_SECONDS)


def test_an_exchange_that_ran_out_doubles_the_next_budget_until_one_completes() -> None:
    d = _measured([4.0] * 8)
    budget = d.budget(CEILING, FLOOR)
    assert budget == pytest.approx(16.0)
    d.finished(budget, budget, complete=False)  # ran out of its budget
    assert d.budget(CEILING, FLOOR) == pytest.approx(32.0)
    d.finished(32.0, 32.0, complete=False)
    assert d.budget(CEILING, FLOOR) == CEILING  # 64 s, held to the configured budget
    assert d.summary()["backoff"] == 4
    d.finished(4.0, CEILING, complete=True)
    assert d.budget(CEILING, FLOOR) == pytest.approx(16.0)


def test_a_failure_before_the_deadline_is_no_sign_of_slowness() -> None:
    d = _measured([4.0] * 8)
    budget = d.budget(CEILING, FLOOR)
    d.finished(1.0, budget, complete=False)  # refused, no group: not a wait that ran out
    assert d.budget(CEILING, FLOOR) == pytest.approx(budget)
    for bad in (float("nan"), float("inf"), -1.0):
        d.finished(bad, budget, complete=True)
    assert d.budget(CEILING, FLOOR) == pytest.approx(budget)


def test_off_keeps_the_configured_budgets() -> None:
    d = _measured([0.5] * 10, adaptive=False)
    assert d.budget(CEILING, FLOOR) == CEILING
    assert d.state_wait(60.0) == 60.0
    assert d.summary()["measured_p90"] is None


def test_the_wait_for_signed_states_follows_the_exchange_budget() -> None:
    d = Deadlines()
    assert d.state_wait(60.0) == 60.0  # nothing measured yet
    for _ in range(8):
        d.finished(1.0, CEILING, complete=True)
    budget = d.budget(CEILING, FLOOR)
    assert d.state_wait(60.0) == pytest.approx(budget) and budget < 60.0
    assert d.state_wait(2.0) == 5.0  # never under 5 s, even where configured so
