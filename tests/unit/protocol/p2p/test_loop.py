"""A private event loop on its own thread, driven from synchronous code."""

from __future__ import annotations

import asyncio

import pytest

from protocol.p2p.loop import LoopThread


@pytest.fixture
def loop():
    errors: list[dict] = []
    thread = LoopThread("atoll-test-loop", lambda loop, context: errors.append(context))
    thread.start()
    yield thread
    thread.stop(5)
    thread.close()
    assert not thread.is_alive() and thread.loop.is_closed()


def test_run_waits_for_the_result_and_submit_returns_a_future(loop: LoopThread) -> None:
    async def add(a: int, b: int) -> int:
        await asyncio.sleep(0)
        return a + b

    assert loop.run(add(2, 3), timeout=5) == 5
    assert loop.submit(add(1, 1)).result(5) == 2
    assert not loop.on_loop() and loop.run(_on_loop(loop), timeout=5)


async def _on_loop(loop: LoopThread) -> bool:
    return loop.on_loop()


def test_a_coroutine_past_its_deadline_is_cancelled(loop: LoopThread) -> None:
    cancelled = asyncio.Event()

    async def hang() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(TimeoutError, match="within 0.1s"):
        loop.run(hang(), timeout=0.1)
    assert loop.run(asyncio.wait_for(cancelled.wait(), 5), timeout=5) is True


def test_run_from_the_loops_own_thread_is_refused(loop: LoopThread) -> None:
    async def nested() -> str:
        async def inner() -> None:
            pass

        try:
            loop.run(inner(), timeout=1)
        except RuntimeError as exc:
            return str(exc)
        return "ran"

    assert "await the coroutine" in loop.run(nested(), timeout=5)


def test_cancel_others_ends_every_other_task(loop: LoopThread) -> None:
    async def start_and_cancel() -> bool:
        task = asyncio.ensure_future(asyncio.sleep(60))
        await asyncio.sleep(0)
        await LoopThread.cancel_others(timeout=2)
        return task.cancelled()

    assert loop.run(start_and_cancel(), timeout=5)
