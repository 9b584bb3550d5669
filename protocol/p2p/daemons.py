"""The processes a transport runs beside it: p2pd, the DHT process and their watchdog.

They start in order on the transport's loop (the watchdog first, so that it can end
whatever comes up after it: :meth:`Daemons.start_p2pd`, then
:meth:`Daemons.start_dht`) and stop in order (:meth:`Daemons.stop_dht`,
:meth:`Daemons.stop_p2pd`, and :meth:`Daemons.end` for whatever ignored the polite
stop). Each one's pid is reported to the watchdog as it starts
(:mod:`protocol.p2p.helpers`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

from hivemind.p2p import P2P

from protocol.p2p import addrs, p2pd
from protocol.p2p.config import TransportConfig
from protocol.p2p.dht import Dht
from protocol.p2p.helpers import Helpers

__all__ = ["Daemons"]


class Daemons:
    """p2pd and the DHT process of one transport, watched by its watchdog.

    Args:
        helpers: the watchdog's view of the helper processes.
    """

    def __init__(self, helpers: Helpers) -> None:
        self.helpers = helpers
        self.p2p: P2P | None = None
        self.dht: Dht | None = None
        self._watch: asyncio.Task | None = None

    @property
    def p2pd_pid(self) -> int | None:
        """The pid of p2pd, while it runs."""
        return p2pd.pid_of(self.p2p)

    @property
    def dht_pid(self) -> int | None:
        """The pid of the DHT process, while it runs."""
        return self.dht.pid if self.dht is not None else None

    def _roots(self) -> tuple[int | None, ...]:
        return self.p2pd_pid, self.dht_pid

    async def start_p2pd(self, cfg: TransportConfig) -> P2P:
        """Start p2pd as ``cfg`` says (:func:`protocol.p2p.p2pd.start`)."""
        self.p2p = await p2pd.start(cfg)
        self.helpers.track(*self._roots())
        return self.p2p

    async def start_dht(self, cfg: TransportConfig, client_mode: bool) -> Dht:
        """Start the DHT process on p2pd (on the loop's thread, which lives until
        shutdown, so that the fork comes from it) and supervise it once it is ready."""
        assert self.p2p is not None, "p2pd not started"
        self.dht = Dht.spawn(self.p2p, cfg.initial_peers, client_mode, cfg.request_timeout)
        self.helpers.track(*self._roots())
        await self.dht.wait_ready(cfg.startup_timeout)
        self._watch = asyncio.ensure_future(self.helpers.supervise(self._roots, self.dht))
        return self.dht

    async def rejoin(self, maddrs: Sequence[str], timeout: float) -> int:
        """Dial ``maddrs`` again and re-enter the DHT through them; how many answered."""
        assert self.p2p is not None and self.dht is not None, "transport not started"
        joined = await p2pd.redial(self.p2p, maddrs, timeout)
        if joined:
            with contextlib.suppress(Exception):
                await self.dht.ping(addrs.peer_ids(maddrs), timeout)
        return joined

    def stop_watching(self) -> None:
        """Stop re-reporting pids to the watchdog (on the loop)."""
        if self._watch is not None:
            self._watch.cancel()

    def stop_dht(self) -> None:
        """Stop the DHT process, off the loop. Blocking: it asks the process to stop,
        joins it and SIGTERMs it after 3 s; called in the caller's thread, not in an
        executor, which is gone during interpreter exit."""
        if self.dht is not None and self.dht.pid is not None:
            self.dht.shutdown()

    async def stop_p2pd(self) -> None:
        """Stop p2pd and remove its socket (:func:`protocol.p2p.p2pd.stop`)."""
        if self.p2p is not None:
            await p2pd.stop(self.p2p)

    def end(self) -> None:
        """End whatever ignored a polite stop, then let the watchdog exit."""
        self.helpers.end()
