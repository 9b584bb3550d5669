"""The node's helper processes (p2pd, the DHT process) as its watchdog knows them.

The transport reports the helpers' pids to the watchdog (:mod:`protocol.p2p.watchdog`)
as each one starts, and again every few seconds (their children come and go), so the
watchdog can end them all if the node dies. On a clean shutdown :meth:`Helpers.end`
ends whatever ignored the polite stop, then lets the watchdog exit.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from protocol.p2p.dht import Dht
from protocol.p2p.watchdog import Watchdog, terminate_processes

__all__ = ["Helpers"]

logger = logging.getLogger(__name__)

_WATCH_SECONDS = 5.0  # how often the set of helper pids is rechecked for the watchdog
_END_GRACE_SECONDS = 2.0


class Helpers:
    """The helpers' pids, reported to the node's watchdog.

    Args:
        watchdog: the watchdog of this process.
    """

    def __init__(self, watchdog: Watchdog) -> None:
        self._watchdog = watchdog

    @classmethod
    def spawn(cls) -> Helpers:
        """Start the watchdog of this process, watching nothing yet."""
        return cls(Watchdog.spawn())

    @property
    def pids(self) -> list[int]:
        """Pids of the helpers and their children, as last reported to the watchdog."""
        return [pid for pid, _ in self._watchdog.tracked]

    def track(self, *roots: int | None) -> None:
        """Make ``roots`` (the pids known yet) and their children the set to end."""
        self._watchdog.track([pid for pid in roots if pid is not None])

    async def supervise(self, roots: Callable[[], tuple[int | None, ...]], dht: Dht) -> None:
        """Report ``roots()`` again every few seconds; return, saying why, once the DHT
        process or the watchdog has exited."""
        while True:
            await asyncio.sleep(_WATCH_SECONDS)
            self.track(*roots())
            if not dht.is_alive():
                logger.error("the DHT process exited unexpectedly (code %s)", dht.exitcode)
                return
            if not self._watchdog.is_alive():
                logger.error("the watchdog exited; helper processes may outlive this node")
                return

    def end(self) -> None:
        """End the helpers that ignored a polite shutdown (a hung DHT process), then let
        the watchdog exit."""
        survivors = terminate_processes(self._watchdog.tracked, grace=_END_GRACE_SECONDS)
        if survivors:
            logger.error("could not end helper processes %s", survivors)
        self._watchdog.close()
