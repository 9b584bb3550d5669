"""The node's network side: one p2pd shared by hivemind's DHT and Atoll's own RPCs.

Layout (hivemind 1.1.12 allows two; both were measured, this one was kept):

* this process starts p2pd with ``hivemind.p2p.P2P.create`` on a private asyncio
  loop in a background thread; Atoll's handlers and calls use that P2P directly;
* hivemind's DHT runs in its forked child process and reaches the same p2pd
  through ``DHT(p2p=...)``, which connects a replica to the daemon's socket;
* a watchdog process (:mod:`protocol.p2p.watchdog`) holds the pids of p2pd and the DHT
  process and ends them if this process dies without :meth:`Transport.shutdown`.

:class:`Transport` is the facade over the rooms of :mod:`protocol.p2p`: p2pd
(:mod:`~protocol.p2p.p2pd`), the DHT (:mod:`~protocol.p2p.dht`), the watchdog's
helpers (:mod:`~protocol.p2p.helpers`), the RPC endpoints
(:mod:`~protocol.p2p.endpoints`: handlers, calls, the direct data plane) and where
other nodes find this one (:mod:`~protocol.p2p.presence`: addresses, reachability).

The training code is synchronous: it hands coroutines to the loop with
:meth:`Transport.run` or :meth:`Transport.submit`. Every failure of
:meth:`Transport.call` is a :class:`~protocol.errors.ProtocolError` whose reason is
one of ``timeout``, ``unreachable``, ``no_handler``, ``connection_lost``,
``oversized``, ``remote_error`` or ``malformed``.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from protocol.p2p import _framing, reachability, relays
from protocol.p2p._framing import (  # re-exported: the names callers import from here
    BufferPool,
    Lease,
    Read,
    Receiver,
    RequestReader,
    StreamedResponse,
    StreamRead,
    read_frame,
)
from protocol.p2p.calls import PLANES, Caller
from protocol.p2p.config import TransportConfig
from protocol.p2p.daemons import Daemons
from protocol.p2p.dht import Dht, DhtUsage
from protocol.p2p.endpoints import Endpoints
from protocol.p2p.handlers import Handler
from protocol.p2p.helpers import Helpers
from protocol.p2p.lifetime import Lifetime
from protocol.p2p.p2pd import BootstrapUnreachable, NotDialable, startup_error
from protocol.p2p.presence import Presence
from protocol.p2p.reachability import Reachability

__all__ = [
    "BootstrapUnreachable",
    "BufferPool",
    "DhtUsage",
    "Handler",
    "Lease",
    "NotDialable",
    "Read",
    "Receiver",
    "RequestReader",
    "StreamRead",
    "StreamedResponse",
    "Transport",
    "TransportConfig",
    "read_frame",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Transport:
    """One node's p2pd, DHT and RPC endpoints behind a synchronous facade.

    Create it with :meth:`start`; end it with :meth:`shutdown` (also on exit).
    """

    def __init__(self, config: TransportConfig) -> None:
        self.config = config
        self._life = Lifetime("atoll-transport")
        self._daemons: Daemons | None = None
        self._endpoints: Endpoints | None = None
        self._peer_id = ""
        self._presence = Presence(config)

    @classmethod
    def start(cls, config: TransportConfig | None = None) -> Transport:
        """Start p2pd, the DHT process and the watchdog, and join the swarm.

        Raises:
            BootstrapUnreachable: none of ``initial_peers`` answered.
            NotDialable: a peer could not dial this node back at its peer id.
            RuntimeError: p2pd or the DHT did not come up within ``startup_timeout``.
        """
        self = cls(config or TransportConfig())
        self._life.loop.start()
        atexit.register(self.shutdown)
        started = time.perf_counter()
        try:
            self._life.run(self._start(), self.config.startup_timeout * 2)
        except BaseException as e:
            self.shutdown()
            mapped = startup_error(e, self.config.initial_peers)
            if mapped is None:
                raise
            raise mapped from e
        logger.info(
            "transport up in %.2fs: peer %s at %s",
            time.perf_counter() - started,
            self._peer_id,
            ", ".join(self.maddrs),
        )
        return self

    async def _start(self) -> None:
        cfg = self.config
        self._daemons = Daemons(Helpers.spawn())
        p2p = await self._daemons.start_p2pd(cfg)
        self._peer_id = p2p.peer_id.to_base58()
        self._endpoints = await Endpoints.create(p2p, cfg, self._peer_id)
        maddrs = await asyncio.wait_for(p2p.get_visible_maddrs(), cfg.request_timeout)
        self._presence.listen_on([str(m) for m in maddrs])
        if not cfg.dht:
            self._presence.reachability = Reachability.forced_to("private")
            return
        # Before the DHT starts: a node nobody can dial must join it as a client, or
        # every peer that adds it to its routing table would time out storing to it.
        found = await self._presence.settle(self._dial)
        await self._daemons.start_dht(cfg, cfg.dht_client_mode or not found.reachable)

    async def _dial(self, peer: str, request: bytes, timeout: float) -> bytes:
        return await self.call(peer, reachability.RPC_NAME, request, timeout=timeout)

    # ---- synchronous facade -------------------------------------------------------------

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the transport's loop and return a future for its result.

        Raises:
            RuntimeError: after shutdown (``coro`` is closed, never run).
        """
        self._life.refuse_if_closed(coro)
        return asyncio.run_coroutine_threadsafe(coro, self._life.loop.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the transport's loop and wait for its result.

        Raises:
            TimeoutError: ``coro`` did not finish within ``timeout`` seconds (it is cancelled).
            RuntimeError: called from the loop thread itself (use ``await``) or after shutdown.
        """
        return self._life.run(coro, timeout)

    # ---- what the node is (protocol.p2p.presence) ---------------------------------------

    @property
    def peer_id(self) -> str:
        """This node's PeerID, base58 (``12D3KooW…`` for an Ed25519 identity)."""
        return self._peer_id

    @property
    def maddrs(self) -> list[str]:
        """Multiaddrs, ending in ``/p2p/<peer id>``, that other nodes can join through.

        Loopback addresses are left out unless the node listens on loopback itself
        (:func:`protocol.p2p.addrs.publishable`)."""
        return list(self._presence.maddrs)

    @property
    def data_port(self) -> int | None:
        """The direct data plane's port, when it runs."""
        return self._endpoints.data_port if self._endpoints is not None else None

    @property
    def calls_by_plane(self) -> dict[str, int]:
        """Calls made so far over each data plane."""
        if self._endpoints is None:
            return dict.fromkeys(PLANES, 0)
        return self._endpoints.caller.calls_by_plane

    @property
    def dht_usage(self) -> dict[str, DhtUsage]:
        """DHT operations this node made so far, by the ``kind`` its callers gave."""
        dht = self._daemons.dht if self._daemons is not None else None
        return dht.usage if dht is not None else {}

    @property
    def reachability(self) -> Reachability:
        """Whether peers on other hosts can dial this node (see :mod:`protocol.p2p.reachability`)."""
        return self._presence.reachability

    @property
    def relayed(self) -> bool:
        return self._presence.relayed

    async def check_reachability(
        self, peers: list[str], extra_ports: tuple[int, ...] = ()
    ) -> Reachability:
        """Ask ``peers`` to dial this node back (p2pd's port and ``extra_ports``)
        (:meth:`protocol.p2p.presence.Presence.check`)."""
        return await self._presence.check(self._dial, peers, extra_ports)

    async def claim_relays(self) -> Reachability:
        """With ``relay_parts``: claim this node's circuit addresses once it holds a
        relay's slot (:meth:`protocol.p2p.presence.Presence.claim_relays`); they join
        :attr:`maddrs`."""
        assert self._daemons is not None and self._daemons.p2p is not None
        return await self._presence.claim_relays(self._daemons.p2p, self._peer_id)

    async def reach(self, wanted: dict[str, list[str]]) -> None:
        """Connect to each peer of ``wanted`` through its circuit addresses among its
        multiaddrs, unless connected already (:func:`protocol.p2p.relays.connect`)."""
        assert self._daemons is not None and self._daemons.p2p is not None
        await relays.reach(self._daemons.p2p, wanted, self.config.request_timeout)

    async def rejoin(self, maddrs: list[str], timeout: float) -> int:
        """Dial ``maddrs`` again and re-enter the DHT through them (after losing every
        peer); returns how many answered."""
        assert self._daemons is not None, "transport not started"
        return await self._daemons.rejoin(maddrs, timeout)

    # ---- RPCs (protocol.p2p.endpoints) --------------------------------------------------

    def add_handler(
        self,
        name: str,
        handler: Handler,
        *,
        max_request_bytes: int,
        timeout: float | None = None,
        receive: _framing.RequestReader | None = None,
    ) -> None:
        """Serve RPC ``name``: ``handler(caller_peer_id, request) -> response``.

        The arguments are :meth:`protocol.p2p.handlers.Handlers.add`'s; ``timeout``
        defaults to ``config.request_timeout``.

        Raises:
            ValueError: a bad name or ``max_request_bytes``, or a name already served.
        """
        assert self._endpoints is not None, "transport not started"
        handlers = self._endpoints.handlers
        handlers.check(name, max_request_bytes)
        timeout = timeout or self.config.request_timeout
        self.run(handlers.add(name, handler, max_request_bytes, timeout, receive), timeout)

    def remove_handler(self, name: str) -> None:
        """Stop serving RPC ``name``."""
        assert self._endpoints is not None, "transport not started"
        self.run(self._endpoints.handlers.remove(name), self.config.request_timeout)

    async def call(
        self,
        peer_id: str,
        name: str,
        data: _framing.Payload,
        *,
        timeout: float,
        max_response_bytes: int | None = None,
    ) -> bytes:
        """Send ``data`` to RPC ``name`` of ``peer_id`` and return the response (the
        arguments are :meth:`protocol.p2p.calls.Caller.call_into`'s).

        Raises:
            ProtocolError: with ``reason`` timeout, unreachable, no_handler, connection_lost,
                oversized, remote_error or malformed.
        """
        lease = await self.caller.call_into(
            peer_id, name, data, timeout=timeout, max_response_bytes=max_response_bytes
        )
        return lease.data  # type: ignore[return-value]  # no pool: always bytes

    @property
    def caller(self) -> Caller:
        """What calls peers' RPCs (:class:`protocol.p2p.calls.Caller`): the all-reduce
        sends its parts through it directly."""
        assert self._endpoints is not None, "transport not started"
        return self._endpoints.caller

    # ---- DHT (protocol.p2p.dht) ---------------------------------------------------------

    @property
    def dht(self) -> Dht:
        """The DHT (:class:`protocol.p2p.dht.Dht`): matchmaking stores and reads its
        announcements there directly."""
        assert self._daemons is not None and self._daemons.dht is not None, "not started"
        return self._daemons.dht

    async def dht_store(
        self,
        key: str,
        subkey: str | None,
        value: bytes,
        expiration_seconds: float,
        *,
        timeout: float | None = None,
        kind: str = "other",
    ) -> bool:
        """Store ``value`` under ``key`` (and ``subkey``) for ``expiration_seconds``;
        whether a DHT peer accepted it (:meth:`protocol.p2p.dht.Dht.store`).

        Raises:
            ProtocolError: ``timeout``.
        """
        assert self._daemons is not None and self._daemons.dht is not None, "not started"
        return await self._daemons.dht.store(
            key, subkey, value, expiration_seconds, timeout=timeout, kind=kind
        )

    async def dht_get(
        self, key: str, *, latest: bool = True, timeout: float | None = None, kind: str = "other"
    ) -> dict[str, bytes] | bytes | None:
        """Look ``key`` up in the DHT: ``{subkey: value}``, a plain value, or None
        (:meth:`protocol.p2p.dht.Dht.get`).

        Raises:
            ProtocolError: ``timeout``.
        """
        assert self._daemons is not None and self._daemons.dht is not None, "not started"
        return await self._daemons.dht.get(key, latest=latest, timeout=timeout, kind=kind)

    # ---- helper processes and shutdown ---------------------------------------------------

    @property
    def helper_pids(self) -> list[int]:
        """Pids of p2pd and the DHT process, as last reported to the watchdog."""
        return self._daemons.helpers.pids if self._daemons is not None else []

    @property
    def p2pd_pid(self) -> int | None:
        """The pid of this node's p2pd, while it runs."""
        return self._daemons.p2pd_pid if self._daemons is not None else None

    @property
    def dht_pid(self) -> int | None:
        """The pid of this node's DHT process, while it runs."""
        return self._daemons.dht_pid if self._daemons is not None else None

    def shutdown(self, timeout: float = 15.0) -> None:
        """Stop handlers, the DHT process, p2pd, the watchdog and the loop thread (idempotent;
        :meth:`protocol.p2p.lifetime.Lifetime.stop`).

        Raises:
            RuntimeError: called from the transport's own loop (a handler cannot stop it).
        """
        if not self._life.close():
            return
        atexit.unregister(self.shutdown)
        self._life.stop(self._daemons, self._endpoints, timeout)
        logger.info("transport %s shut down", self._peer_id or "(not started)")

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
