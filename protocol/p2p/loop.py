"""A private asyncio loop on a thread of its own, driven from synchronous code.

The training code is synchronous and the network side is asyncio: :class:`LoopThread`
runs one event loop on a daemon thread and hands coroutines to it, as a future
(:meth:`LoopThread.submit`) or waiting for the result (:meth:`LoopThread.run`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread"]

T = TypeVar("T")


class LoopThread:
    """An event loop running on its own daemon thread.

    Args:
        name: the thread's name.
        on_error: the loop's exception handler (errors no task retrieved).
    """

    def __init__(
        self,
        name: str,
        on_error: Callable[[asyncio.AbstractEventLoop, dict[str, Any]], None],
    ) -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(on_error)
        self.thread = threading.Thread(target=self.loop.run_forever, name=name)
        self.thread.daemon = True  # its owner stops it; never block interpreter exit

    def start(self) -> None:
        """Start running the loop."""
        self.thread.start()

    def on_loop(self) -> bool:
        """Whether the caller runs on the loop's own thread."""
        return threading.current_thread() is self.thread

    def is_alive(self) -> bool:
        """Whether the loop's thread still runs."""
        return self.thread.is_alive()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop and return a future for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        """Run ``coro`` on the loop and wait for its result.

        Raises:
            TimeoutError: ``coro`` did not finish within ``timeout`` seconds (it is cancelled).
            RuntimeError: called from the loop's own thread (await the coroutine instead).
        """
        if self.on_loop():
            coro.close()
            raise RuntimeError("Transport.run() called on its own loop; await the coroutine")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            if future.done():
                raise
            future.cancel()
            raise TimeoutError(f"transport task did not finish within {timeout}s") from None

    @staticmethod
    async def cancel_others(timeout: float) -> None:
        """On the loop: cancel every task but the current one, and wait up to ``timeout``
        seconds for them to end."""
        current = asyncio.current_task()
        pending = [t for t in asyncio.all_tasks() if t is not current]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=timeout)

    def stop(self, timeout: float) -> None:
        """Stop the loop and wait up to ``timeout`` seconds for its thread to end."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout)

    def close(self) -> None:
        """Close the loop, once its thread has ended."""
        if not self.thread.is_alive():
            self.loop.close()
