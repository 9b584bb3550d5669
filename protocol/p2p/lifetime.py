"""A transport's lifetime: its loop thread, open to work until shutdown, and the order
its parts stop in.

Synchronous code hands coroutines to the loop (the transport's ``submit``, which asks
:meth:`Lifetime.refuse_if_closed` first, and :meth:`Lifetime.run`) until
:meth:`Lifetime.close` is called once; that stops the
endpoints and the watchdog's supervision on the loop, then the DHT process (blocking,
off the loop), then p2pd and every task still in flight, then the loop itself, and
last ends whatever helper process ignored the polite stop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from protocol.p2p.daemons import Daemons
from protocol.p2p.endpoints import Endpoints
from protocol.p2p.loop import LoopThread

__all__ = ["Lifetime"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Lifetime:
    """The loop thread of one transport, and its shutdown.

    Args:
        name: the loop thread's name.
    """

    def __init__(self, name: str) -> None:
        self.loop = LoopThread(name, _log_loop_error)
        self._closed = False
        self._lock = threading.Lock()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (:meth:`LoopThread.run`)."""
        self.refuse_if_closed(coro)
        return self.loop.run(coro, timeout)

    def refuse_if_closed(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Close ``coro`` and refuse it once the transport is shut down.

        Raises:
            RuntimeError: the transport is shut down.
        """
        if self._closed:
            coro.close()
            raise RuntimeError("transport is shut down")

    def close(self) -> bool:
        """Refuse new work from now on; whether this call closed it (False the second
        time).

        Raises:
            RuntimeError: called from the loop's own thread (a handler cannot stop it).
        """
        if self.loop.on_loop():
            raise RuntimeError("Transport.shutdown() called on its own loop thread")
        with self._lock:
            closed, self._closed = self._closed, True
        return not closed

    def stop(self, daemons: Daemons | None, endpoints: Endpoints | None, timeout: float) -> None:
        """Once closed: stop ``endpoints``, then ``daemons``, then the loop, each stage
        within ``timeout`` seconds, and end whatever ignored the polite stop."""
        if self.loop.is_alive():
            try:
                self.loop.run(_stop_serving(daemons, endpoints), timeout)
                if daemons is not None:
                    daemons.stop_dht()
                self.loop.run(_stop_p2pd(daemons), timeout)
            except Exception:
                logger.warning(
                    "transport did not stop cleanly; ending its processes", exc_info=True
                )
            self.loop.stop(timeout)
        if daemons is not None:
            daemons.end()
        self.loop.close()


async def _stop_serving(daemons: Daemons | None, endpoints: Endpoints | None) -> None:
    if daemons is not None:
        daemons.stop_watching()
    if endpoints is not None:
        await endpoints.close()


async def _stop_p2pd(daemons: Daemons | None) -> None:
    if daemons is not None:
        await daemons.stop_p2pd()
    # in-flight handlers and calls end here rather than being dropped with the loop
    await LoopThread.cancel_others(timeout=2.0)


def _log_loop_error(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    logger.warning("transport loop: %s", context.get("message"), exc_info=context.get("exception"))
