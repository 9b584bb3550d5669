"""The node's network side: one p2pd shared by hivemind's DHT and Atoll's own RPCs.

Layout (hivemind 1.1.12 allows two; both were measured, this one was kept):

* this process starts p2pd with ``hivemind.p2p.P2P.create`` on a private asyncio
  loop in a background thread; Atoll's handlers and calls use that P2P directly;
* hivemind's DHT runs in its forked child process and reaches the same p2pd
  through ``DHT(p2p=...)``, which connects a replica to the daemon's socket;
* a watchdog process (:mod:`protocol.p2p.watchdog`) holds the pids of p2pd and the DHT
  process and ends them if this process dies without :meth:`Transport.shutdown`.

:class:`Transport` is the facade over the rooms of :mod:`protocol.p2p`: the DHT
(:mod:`~protocol.p2p.dht`), the handlers served (:mod:`~protocol.p2p.handlers`), the
calls made (:mod:`~protocol.p2p.calls`), the direct data plane
(:mod:`~protocol.p2p.direct`) and reachability (:mod:`~protocol.p2p.reachability`).

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
import contextlib
import logging
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from hivemind.p2p import P2P

from protocol.p2p import _framing, addrs, direct, p2pd, reachability, relays
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
from protocol.p2p.dht import Dht, DhtUsage
from protocol.p2p.handlers import Handler, Handlers
from protocol.p2p.helpers import Helpers
from protocol.p2p.loop import LoopThread
from protocol.p2p.p2pd import BootstrapUnreachable, NotDialable, startup_error
from protocol.p2p.reachability import Reachability
from protocol.p2p.watchdog import remove_sockets

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
        self._loop = LoopThread("atoll-transport", self._log_loop_error)
        self._p2p: P2P | None = None
        self._dht: Dht | None = None
        self._handlers: Handlers | None = None
        self._caller: Caller | None = None
        self._helpers: Helpers | None = None
        self._watch_task: asyncio.Task | None = None
        self._peer_id = ""
        self._maddrs: list[str] = []
        self._listen_maddrs: list[str] = []
        self._reachability = Reachability("unknown")
        self._started_at = time.monotonic()
        self._inbound_gate = _framing.StreamGate(
            config.max_inbound_streams, config.max_inbound_per_peer
        )
        self._closed = False
        self._lock = threading.Lock()
        self._direct_server: direct.DirectServer | None = None
        self._direct_client: direct.DirectClient | None = None

    @classmethod
    def start(cls, config: TransportConfig | None = None) -> Transport:
        """Start p2pd, the DHT process and the watchdog, and join the swarm.

        Raises:
            BootstrapUnreachable: none of ``initial_peers`` answered.
            NotDialable: a peer could not dial this node back at its peer id.
            RuntimeError: p2pd or the DHT did not come up within ``startup_timeout``.
        """
        self = cls(config or TransportConfig())
        self._loop.start()
        atexit.register(self.shutdown)
        started = time.perf_counter()
        try:
            self._loop.run(self._start(), self.config.startup_timeout * 2)
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
            ", ".join(self._maddrs),
        )
        return self

    async def _start(self) -> None:
        cfg = self.config
        self._helpers = Helpers.spawn()
        self._p2p = await p2pd.start(cfg)
        self._update_watchdog()
        self._peer_id = self._p2p.peer_id.to_base58()
        self._handlers = Handlers(
            self._p2p, self._inbound_gate, cfg.inbound_pace, cfg.max_message_bytes
        )
        if cfg.data_plane != "p2pd":
            handlers, gate = self._handlers, self._inbound_gate
            started = await direct.start(cfg, self._peer_id, handlers.served, gate, handlers.add)
            self._direct_server, self._direct_client = started
        self._caller = Caller(self._p2p, self._direct_client, cfg.max_message_bytes)
        await self._handlers.add(
            reachability.RPC_NAME,
            reachability.DialbackServer(_framing.REMOTE_ADDR.get).handle,
            reachability.MAX_REQUEST_BYTES,
            cfg.request_timeout,
        )
        maddrs = await asyncio.wait_for(self._p2p.get_visible_maddrs(), cfg.request_timeout)
        self._listen_maddrs = [str(m) for m in maddrs]
        self._maddrs = addrs.publishable(self._listen_maddrs, cfg.host)
        if cfg.dht:
            await self._start_dht()
        else:
            self._reachability = Reachability.forced_to("private")

    async def _start_dht(self) -> None:
        cfg = self.config
        # Before the DHT starts: a node nobody can dial must join it as a client, or
        # every peer that adds it to its routing table would time out storing to it.
        if cfg.relay_parts:  # behind NAT: a client until it holds a relay's slot
            self._reachability = Reachability("private")
            self._started_at = time.monotonic()
        elif cfg.reachability != "auto":
            self._reachability = Reachability.forced_to(cfg.reachability)
        else:
            self._reachability = await self._probe(addrs.peer_ids(cfg.initial_peers))
        if self._reachability.status != "unknown":
            logger.info("%s", self._reachability.summary())
        # Created on the loop thread, so the DHT fork comes from a thread that lives until shutdown.
        client_mode = cfg.dht_client_mode or not self._reachability.reachable
        assert self._p2p is not None
        self._dht = Dht.spawn(self._p2p, cfg.initial_peers, client_mode, cfg.request_timeout)
        self._update_watchdog()
        await self._dht.wait_ready(cfg.startup_timeout)
        assert self._helpers is not None
        self._watch_task = asyncio.ensure_future(self._helpers.supervise(self._roots, self._dht))

    async def _probe(self, peers: list[str], extra_ports: tuple[int, ...] = ()) -> Reachability:
        ports = [addrs.tcp_port(m) for m in (self.config.announce_maddrs or self._listen_maddrs)]
        wanted = [p for p in dict.fromkeys(ports) if p] + list(extra_ports)

        async def call(peer: str, request: bytes, timeout: float) -> bytes:
            return await self.call(peer, reachability.RPC_NAME, request, timeout=timeout)

        return await reachability.probe(call, peers, wanted, self.config.request_timeout)

    # ---- synchronous facade -------------------------------------------------------------

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the transport's loop and return a future for its result."""
        if self._closed:
            coro.close()
            raise RuntimeError("transport is shut down")
        return self._loop.submit(coro)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the transport's loop and wait for its result.

        Raises:
            TimeoutError: ``coro`` did not finish within ``timeout`` seconds (it is cancelled).
            RuntimeError: called from the loop thread itself (use ``await``) or after shutdown.
        """
        if self._closed:
            coro.close()
            raise RuntimeError("transport is shut down")
        return self._loop.run(coro, timeout)

    # ---- what the node is ---------------------------------------------------------------

    @property
    def peer_id(self) -> str:
        """This node's PeerID, base58 (``12D3KooW…`` for an Ed25519 identity)."""
        return self._peer_id

    @property
    def maddrs(self) -> list[str]:
        """Multiaddrs, ending in ``/p2p/<peer id>``, that other nodes can join through.

        Loopback addresses are left out unless the node listens on loopback itself
        (:func:`protocol.p2p.addrs.publishable`)."""
        return list(self._maddrs)

    @property
    def data_port(self) -> int | None:
        """The direct data plane's port, when it runs."""
        return self._direct_server.port if self._direct_server is not None else None

    @property
    def calls_by_plane(self) -> dict[str, int]:
        """Calls made so far over each data plane."""
        return self._caller.calls_by_plane if self._caller else dict.fromkeys(PLANES, 0)

    @property
    def dht_usage(self) -> dict[str, DhtUsage]:
        """DHT operations this node made so far, by the ``kind`` its callers gave."""
        return self._dht.usage if self._dht is not None else {}

    @property
    def reachability(self) -> Reachability:
        """Whether peers on other hosts can dial this node (see :mod:`protocol.p2p.reachability`)."""
        return self._reachability

    async def check_reachability(
        self, peers: list[str], extra_ports: tuple[int, ...] = ()
    ) -> Reachability:
        """Ask ``peers`` to dial this node back (p2pd's port and ``extra_ports``).

        A forced reachability is kept as it is; an answer from nobody keeps what was
        known before.
        """
        if self._reachability.forced:
            return self._reachability
        found = await self._probe(peers, extra_ports)
        if found.status != "unknown" and not (found.status == "private" and self.relayed):
            self._reachability = found  # a relayed node stays relayed
        return self._reachability

    @property
    def relayed(self) -> bool:
        return self._reachability.status == "relayed"

    async def claim_relays(self) -> Reachability:
        """With ``relay_parts``: claim this node's circuit addresses once it holds a
        relay's slot (:func:`protocol.p2p.relays.claim`); they join :attr:`maddrs`."""
        assert self._p2p is not None
        found = await relays.claim(self._p2p, self.config, self._peer_id, self._started_at)
        if found and self._reachability.status == "private":
            self._reachability = self._reachability.through(found)
            self._maddrs = [*self._maddrs, *found]
            logger.info("%s", self._reachability.summary())
        return self._reachability

    async def reach(self, wanted: dict[str, list[str]]) -> None:
        """Connect to each peer of ``wanted`` through its circuit addresses among its
        multiaddrs, unless connected already (:func:`protocol.p2p.relays.connect`)."""
        assert self._p2p is not None
        if not wanted or (peers := await relays.connected(self._p2p)) is None:
            return
        for peer, maddrs in wanted.items():
            await relays.connect(self._p2p, peer, maddrs, self.config.request_timeout, peers)

    async def rejoin(self, maddrs: list[str], timeout: float) -> int:
        """Dial ``maddrs`` again and re-enter the DHT through them (after losing every
        peer); returns how many answered."""
        assert self._p2p is not None and self._dht is not None, "transport not started"
        joined = await p2pd.redial(self._p2p, maddrs, timeout)
        if joined:
            with contextlib.suppress(Exception):
                await self._dht.ping(addrs.peer_ids(maddrs), timeout)
        return joined

    # ---- RPCs (protocol.p2p.handlers, protocol.p2p.calls) -------------------------------

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
        assert self._handlers is not None, "transport not started"
        self._handlers.check(name, max_request_bytes)
        timeout = timeout or self.config.request_timeout
        added = self._handlers.add(name, handler, max_request_bytes, timeout, receive)
        self.run(added, timeout)

    def remove_handler(self, name: str) -> None:
        """Stop serving RPC ``name``."""
        assert self._handlers is not None and self._p2p is not None, "transport not started"
        protocol = self._handlers.forget(name)
        self.run(self._p2p.remove_binary_stream_handler(protocol), self.config.request_timeout)

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
        lease = await self.call_into(
            peer_id, name, data, timeout=timeout, max_response_bytes=max_response_bytes
        )
        return lease.data  # type: ignore[return-value]  # no pool: always bytes

    async def call_into(
        self,
        peer_id: str,
        name: str,
        data: _framing.Payload,
        *,
        timeout: float,
        receive: _framing.Receiver | None = None,
        max_response_bytes: int | None = None,
    ) -> Any:
        """:meth:`call`, with the response read by ``receive(reader, length)``
        (:meth:`protocol.p2p.calls.Caller.call_into`); by default a :class:`Lease`."""
        assert self._caller is not None, "transport not started"
        return await self._caller.call_into(
            peer_id,
            name,
            data,
            timeout=timeout,
            receive=receive,
            max_response_bytes=max_response_bytes,
        )

    # ---- DHT (protocol.p2p.dht) ---------------------------------------------------------

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
        assert self._dht is not None, "transport not started"
        return await self._dht.store(
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
        assert self._dht is not None, "transport not started"
        return await self._dht.get(key, latest=latest, timeout=timeout, kind=kind)

    # ---- helper processes and shutdown ---------------------------------------------------

    @property
    def helper_pids(self) -> list[int]:
        """Pids of p2pd and the DHT process, as last reported to the watchdog."""
        return self._helpers.pids if self._helpers is not None else []

    @property
    def p2pd_pid(self) -> int | None:
        """The pid of this node's p2pd, while it runs."""
        return p2pd.pid_of(self._p2p)

    @property
    def dht_pid(self) -> int | None:
        """The pid of this node's DHT process, while it runs."""
        return self._dht.pid if self._dht is not None else None

    def _roots(self) -> tuple[int | None, ...]:
        return self.p2pd_pid, self.dht_pid

    def _update_watchdog(self) -> None:
        if self._helpers is not None:
            self._helpers.track(*self._roots())

    def shutdown(self, timeout: float = 15.0) -> None:
        """Stop handlers, the DHT process, p2pd, the watchdog and the loop thread (idempotent).

        Raises:
            RuntimeError: called from the transport's own loop (a handler cannot stop it).
        """
        if self._loop.on_loop():
            raise RuntimeError("Transport.shutdown() called on its own loop thread")
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.shutdown)
        if self._loop.is_alive():
            try:
                self._loop.run(self._stop_handlers(), timeout)
                if self._dht is not None and self._dht.pid is not None:
                    # blocking: asks the DHT process to stop, joins it, SIGTERMs it after 3 s;
                    # called here, not in an executor, which is gone during interpreter exit
                    self._dht.shutdown()
                self._loop.run(self._stop_p2p(), timeout)
            except Exception:
                logger.warning(
                    "transport did not stop cleanly; ending its processes", exc_info=True
                )
            self._loop.stop(timeout)
        if self._helpers is not None:
            self._helpers.end()  # whatever ignored a polite shutdown ends here
        self._loop.close()
        logger.info("transport %s shut down", self._peer_id or "(not started)")

    async def _stop_handlers(self) -> None:
        if self._watch_task is not None:
            self._watch_task.cancel()
        if self._direct_client is not None:
            self._direct_client.close()
        if self._direct_server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._direct_server.close(), 3.0)
        if self._handlers is not None:
            await self._handlers.close()

    async def _stop_p2p(self) -> None:
        if self._p2p is not None:
            try:
                await asyncio.wait_for(self._p2p.shutdown(), 5.0)
            except asyncio.TimeoutError:
                logger.warning("p2pd did not exit within 5 s of SIGTERM; it gets SIGKILL")
            # hivemind removes p2pd's socket only when p2pd was still running
            listen = getattr(self._p2p, "_daemon_listen_maddr", None)
            with contextlib.suppress(Exception):
                remove_sockets([listen.value_for_protocol("unix")])
        # in-flight handlers and calls end here rather than being dropped with the loop
        await LoopThread.cancel_others(timeout=2.0)

    def _log_loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        logger.warning(
            "transport loop: %s", context.get("message"), exc_info=context.get("exception")
        )

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
