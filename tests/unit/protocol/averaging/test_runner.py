"""One all-reduce on one node: an owned part that wakes once every expected part is in,
the split of the time left, and the table of runners that forgets rounds long past."""

from __future__ import annotations

import asyncio
import time

import torch

from protocol.averaging.context import AllReduceContext
from protocol.averaging.early import EarlyReduction
from protocol.averaging.hooks import Hooks, Judge
from protocol.averaging.owner import OwnedPart
from protocol.averaging.parts import AllReduceSettings, Contribution, PartPlan
from protocol.averaging.runner import ExchangeRunner, RunnerTable
from verification.identity import Identity
from verification.rounds import RoundClock

ME, P, Q = "me", "p", "q"


def _own() -> Contribution:
    return Contribution(ME, torch.zeros(4), 1.0, b"d" * 32)


def _context(**settings) -> AllReduceContext:
    identity = Identity.from_seed(b"m" * 32)
    settings = AllReduceSettings(run_id="r", **settings)
    return AllReduceContext(None, identity, settings, Hooks(judge=Judge()))  # type: ignore[arg-type]


def _runner(group: list[str], numel: int, seconds: float) -> ExchangeRunner:
    runner = ExchangeRunner((1, 0, "update"), _context())
    runner.join(PartPlan.of(ME, group, None, numel, 1), time.monotonic() + seconds)
    return runner


def test_an_owned_part_is_full_once_every_expected_part_is_in_or_refused() -> None:
    async def main() -> list[bool]:
        part = OwnedPart(_runner([ME, P, Q], 12, 5), {ME, P, Q}, _own(), None)
        seen = []
        part.note_in()
        seen.append(part.full.is_set())
        part.contributions[P] = Contribution(P, torch.ones(4), 1.0, b"p" * 32)
        part.note_in()
        seen.append(part.full.is_set())
        part.refused[Q] = "late"
        part.note_in()
        seen.append(part.full.is_set())
        return seen

    assert asyncio.run(main()) == [False, False, True]


def test_without_a_streamed_reduction_there_is_no_progress_to_send() -> None:
    async def main() -> tuple:
        runner = _runner([ME, P], 8, 5)
        part = OwnedPart(runner, {ME}, _own(), None)
        early = EarlyReduction(runner, {ME, P}, _own(), part.answerable, lambda *a: None)
        early.arrived(P, 100)  # P's body is not followed: ignored
        progress = early.progress()
        await early.stop()
        early.drop()
        part.drop_reply()
        return part.early, progress, early.progress(), part.reply, part.answerable.is_set()

    assert asyncio.run(main()) == (None, (None, 0), (None, 0), None, False)


def test_the_time_left_is_split_between_parts_answers_and_repair() -> None:
    async def main() -> ExchangeRunner:
        runner = _runner([ME, P], 8, 4.0)
        runner.schedule()
        return runner

    session = asyncio.run(main())
    now = time.monotonic()
    assert abs(session.parts_by - (now + 2.0)) < 0.2  # half for the parts
    assert abs(session.replies_by - (now + 3.0)) < 0.2  # three quarters for the answers
    assert session.parts_by < session.replies_by < session.done_by
    assert session.content == "update" and session.header("part").part == 0


def test_when_every_other_owner_sees_another_group_the_owned_part_stops_waiting() -> None:
    async def main() -> list[bool]:
        session = _runner([ME, P, Q], 9, 5)
        session.owned = OwnedPart(session, {ME, P, Q}, _own(), None)
        session.note_mismatch()
        first = session.owned.full.is_set()
        session.note_mismatch()
        return [first, session.owned.full.is_set()]

    assert asyncio.run(main()) == [False, True]


def test_the_table_forgets_rounds_long_past_and_bounds_what_a_peer_can_open() -> None:
    context = _context(fragments=1, round_window=1)
    table = RunnerTable(context)
    context.tally((1, 0, "update"), sent=10)
    first = table.open((1, 0, "update"))
    assert table.open((1, 0, "update")) is first
    context.clock.start(10)
    table.open((10, 0, "update"))
    assert table.get((1, 0, "update")) is None and context.traffic((1, 0, "update")) == (0, 0)
    context.clock = RoundClock()  # at round 0: nothing is old enough to drop
    rounds = 0
    while table.has_room((100 + rounds, 0, "update")):
        table.open((100 + rounds, 0, "update"))
        rounds += 1
    assert rounds < 20  # a peer cannot make this node hold runners without bound
    assert table.has_room((100, 0, "update"))  # one that is open always has room
