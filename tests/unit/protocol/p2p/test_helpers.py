"""The node's helper processes as its watchdog knows them: reported, supervised, ended."""

from __future__ import annotations

import asyncio

import pytest

from protocol.p2p import helpers
from protocol.p2p.helpers import Helpers


class _Watchdog:
    def __init__(self) -> None:
        self.tracked: list[tuple[int, float]] = []
        self.alive = True
        self.closed = False

    def track(self, pids: list[int]) -> None:
        self.tracked = [(pid, 0.0) for pid in pids]

    def is_alive(self) -> bool:
        return self.alive

    def close(self) -> None:
        self.closed = True


class _Dht:
    def __init__(self) -> None:
        self.alive = True
        self.exitcode = None

    def is_alive(self) -> bool:
        return self.alive


def test_only_known_pids_are_tracked() -> None:
    watchdog = _Watchdog()
    helpers_ = Helpers(watchdog)  # type: ignore[arg-type]
    helpers_.track(101, None, 202)
    assert helpers_.pids == [101, 202]


@pytest.mark.parametrize("dies", ["dht", "watchdog"])
def test_supervision_reports_the_pids_and_returns_once_a_helper_died(monkeypatch, dies) -> None:
    monkeypatch.setattr(helpers, "_WATCH_SECONDS", 0.01)
    watchdog, dht = _Watchdog(), _Dht()
    helpers_ = Helpers(watchdog)  # type: ignore[arg-type]
    rounds = iter(range(100))

    def roots() -> tuple[int | None, ...]:
        n = next(rounds)
        if n == 2:
            (dht if dies == "dht" else watchdog).alive = False
        return (10 + n, None)

    asyncio.run(asyncio.wait_for(helpers_.supervise(roots, dht), 5))  # type: ignore[arg-type]
    assert helpers_.pids == [12]  # the last report before it returned


def test_end_lets_the_watchdog_exit() -> None:
    watchdog = _Watchdog()
    Helpers(watchdog).end()  # type: ignore[arg-type]
    assert watchdog.closed
