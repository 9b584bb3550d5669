"""The two sync triggers behind one interface: when syncs start, when results are
taken, where a joining node comes in, and the books both keep."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

from node.train.clock import SecondsClock
from node.train.schedule import StepSchedule, SyncBook, WallSchedule


def _pending(step: int, done: bool = True) -> SimpleNamespace:
    future: Future = Future()
    if done:
        future.set_result(None)
    return SimpleNamespace(step=step, future=future)


def test_steps_stagger_fragments_over_the_round_and_take_every_result_at_its_end() -> None:
    schedule = StepSchedule(inner_steps=6, fragments=3, tau=1, round_=4)
    due = [schedule.due(0.0) for _ in range(6)]
    assert due == [[], [(5, 0)], [], [(5, 1)], [], [(5, 2)]]
    # mid-round a result waits tau steps; at the round's last step every result is taken
    fresh = StepSchedule(inner_steps=6, fragments=3, tau=3, round_=0)
    fresh.due(0.0)
    fresh.due(0.0)
    assert not fresh.ready(_pending(step=2), steps=3)
    assert fresh.ready(_pending(step=2), steps=5)
    for _ in range(4):
        fresh.due(0.0)
    assert fresh.ready(_pending(step=6), steps=6)
    schedule.ended(5)
    assert [schedule.due(0.0) for _ in range(2)] == [[], [(6, 0)]]
    assert not schedule.skips(6)


def test_the_wall_clock_hands_out_each_sync_once_and_takes_arrived_results_after_tau() -> None:
    clock = SecondsClock(t0=1000.0, round_seconds=10.0, fragments=2)
    schedule = WallSchedule(clock, tau=2, now=lambda: 1000.0)
    assert schedule.due(1004.9) == []
    assert schedule.due(1005.0) == [(1, 0)]
    assert schedule.due(1006.0) == []
    assert schedule.due(1021.0) == [(1, 1), (2, 0), (2, 1)]
    assert schedule.ready(_pending(step=10), steps=12)
    assert not schedule.ready(_pending(step=11), steps=12)  # tau steps not yet
    assert not schedule.ready(_pending(step=1, done=False), steps=12)  # not arrived


def test_a_node_behind_the_clock_sits_out_the_round_in_progress() -> None:
    clock = SecondsClock(t0=1000.0, round_seconds=10.0, fragments=2)
    schedule = WallSchedule(clock, tau=0, now=lambda: 1052.0)  # round 6 in progress
    placed = schedule.place(round_=2, lead=3.0)
    assert (placed.round_, placed.joins, placed.contributes_from) == (5, 6, 7)
    assert placed.state_round == 2 and placed.skipped == []
    assert schedule.skips(6) and not schedule.skips(7)
    assert schedule.due(1055.0) == [(6, 0)]  # handed out, for the loop to skip
    assert schedule.behind(2) == 4 and schedule.behind(4) == 0


def test_a_current_node_joining_mid_round_skips_the_syncs_already_under_way() -> None:
    clock = SecondsClock(t0=1000.0, round_seconds=10.0, fragments=4)
    # round 3 began at 1020; fragment f syncs at 1022.5 + 2.5 f, matchmaking 3 s before:
    # at 1021 fragment 0's matchmaking has begun, fragment 1's has not
    schedule = WallSchedule(clock, tau=0, now=lambda: 1021.0)
    placed = schedule.place(round_=2, lead=3.0)
    assert (placed.round_, placed.joins, placed.from_fragment) == (2, 3, 1)
    assert placed.skipped == [0]
    assert schedule.due(1025.0) == [(3, 1)]
    # at a round's very start nothing is skipped
    assert WallSchedule(clock, 0, now=lambda: 1016.0).place(2, lead=3.0).joins is None


def test_the_books_count_tokens_and_close_rounds_that_went_wrong() -> None:
    book = SyncBook.of(2)
    book.trained(100)
    book.launched(0, "p0")
    book.trained(50)
    assert book.tokens_since == [50, 150]
    book.finished(3, 0, ok=True)
    assert not book.complete(3, 2)
    book.finished(3, 1, ok=False)
    assert book.complete(3, 2)
    assert book.close(3) is True and book.close(3) is False
    assert book.clear() == ["p0"] and book.pending == {}
