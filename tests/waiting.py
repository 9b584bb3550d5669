"""Bounded waits on a condition, for tests that wait for something to happen elsewhere
(a mesh to form, a process to start, a background task to run) instead of sleeping a
fixed time and hoping it did."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

__all__ = ["eventually", "wait_until"]


def wait_until(predicate: Callable[[], object], timeout: float, interval: float = 0.2) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` seconds pass.

    Bounded in time and in the number of polls, so a condition that never holds fails
    the test instead of hanging it.

    Args:
        predicate: the condition; truthy when the wait is over.
        timeout: longest wait in seconds.
        interval: seconds between polls.

    Returns:
        Whether ``predicate`` held (it is asked once more at the deadline).
    """
    deadline = time.monotonic() + timeout
    for _ in range(int(timeout / interval) + 1):
        if predicate():
            return True
        if time.monotonic() > deadline:
            break
        time.sleep(interval)
    return bool(predicate())


async def eventually(
    predicate: Callable[[], object], timeout: float, interval: float = 0.001
) -> bool:
    """:func:`wait_until` inside an event loop: yields to the loop between polls, so the
    tasks the condition waits for can run.

    Returns:
        Whether ``predicate`` held within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return bool(predicate())
        await asyncio.sleep(interval)
    return True
