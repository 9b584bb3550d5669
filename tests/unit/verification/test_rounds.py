"""The round clock: started rounds never go back; a finished round is where the node's
state stands, which a resume or a rebase may put behind the newest round started."""

from __future__ import annotations

from verification.rounds import RoundClock


def test_a_round_started_moves_the_clock_on_and_an_older_one_leaves_it() -> None:
    clock = RoundClock()
    assert (clock.ended, clock.current) == (0, 0)
    clock.start(3)
    clock.start(2)
    assert (clock.ended, clock.current) == (0, 3)


def test_a_finished_round_is_the_state_and_never_puts_current_back() -> None:
    clock = RoundClock()
    clock.finish(4)
    assert (clock.ended, clock.current) == (4, 4)
    clock.start(6)
    clock.finish(5)  # a state taken from peers, older than the round started
    assert (clock.ended, clock.current) == (5, 6)
    assert repr(clock) == "RoundClock(ended=5, current=6)"
