"""The node's network side: one p2pd shared by hivemind's DHT and Atoll's own RPCs.

Layout (hivemind 1.1.12 allows two; both were measured, this one was kept):

* this process starts p2pd with ``hivemind.p2p.P2P.create`` on a private asyncio
  loop in a background thread; Atoll's handlers and calls use that P2P directly;
* hivemind's DHT runs in its forked child process and reaches the same p2pd
  through ``DHT(p2p=...)``, which connects a replica to the daemon's socket;
* a watchdog process (:mod:`protocol.p2p.watchdog`) holds the pids of p2pd and the DHT
  process and ends them if this process dies without :meth:`Transport.shutdown`.

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
import functools
import ipaddress
import logging
import os
import re
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from hivemind.dht import DHT
from hivemind.dht.protocol import ValidationError as DHTValidationError
from hivemind.p2p import P2P, P2PDaemonError, PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.multiaddr import Multiaddr

from protocol.errors import ProtocolError
from protocol.p2p import _framing, addrs, direct, reachability
from protocol.p2p.reachability import Reachability
from protocol.p2p.watchdog import Watchdog, set_parent_death_signal, terminate_processes

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
]

logger = logging.getLogger(__name__)

T = TypeVar("T")
BufferPool = _framing.BufferPool
Lease = _framing.Lease
Read = _framing.Read
Receiver = _framing.Receiver
RequestReader = _framing.RequestReader
StreamRead = _framing.StreamRead
StreamedResponse = _framing.StreamedResponse
read_frame = _framing.read_frame

Handler = Callable[[str, bytes], Awaitable[_framing.Payload | _framing.StreamedResponse]]
"""An RPC handler: ``(authenticated caller PeerID, request bytes) -> response``; the
response is bytes, a sequence of buffers written one after the other, or a
:class:`StreamedResponse` written as it is produced."""

_PROTOCOL_PREFIX = "/atoll/rpc/"
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_WATCH_SECONDS = 5.0  # how often the set of helper pids is rechecked for the watchdog
_P2PD_ONLY = frozenset({reachability.RPC_NAME, direct.RPC_NAME})  # about p2pd itself
_ROUTE_SECONDS = 600.0  # a peer's data port is asked again after this long...
_NO_ROUTE_SECONDS = 60.0  # ...and a peer without one (or unreachable on it) after this
_ROUTE_TIMEOUT = 5.0
_MADDR_HOST = re.compile(r"/(ip4|ip6)/([^/]+)/tcp/\d+")


@dataclass(frozen=True)
class TransportConfig:
    """Settings of the network side.

    Attributes:
        host: IP address p2pd listens on.
        port: TCP port p2pd listens on; 0 picks a free one.
        initial_peers: multiaddrs of peers to join through (empty starts a new swarm).
        identity_path: libp2p private-key file; None lets p2pd make a throwaway key.
        announce_maddrs: multiaddrs other peers should dial, when they differ from the listen ones.
        request_timeout: default deadline, in seconds, of a call, a handler and a DHT operation.
        max_message_bytes: largest request or response this node sends or accepts.
        dht_client_mode: join the DHT without serving it (for nodes others cannot dial).
            A node that finds itself unreachable at start joins as a client anyway.
        startup_timeout: deadline, in seconds, for p2pd and the DHT to come up.
        reachability: ``auto`` asks the initial peers to dial this node back at start
            (:mod:`protocol.p2p.reachability`); ``public`` or ``private`` skips the check and
            is also passed to p2pd's AutoNAT as its forced reachability.
        relay: let p2pd use circuit relays (reach peers behind NAT through others).
        auto_relay: behind NAT, reserve a slot on a relay and announce the relayed
            address, so this node becomes dialable through it.
        trusted_relays: relays ``auto_relay`` uses (p2pd's default: the initial peers).
        nat_port_map: ask the home router for a port mapping (UPnP / NAT-PMP).
        auto_nat: run p2pd's AutoNAT service (tells peers whether they are reachable).
        max_inbound_streams: RPC streams this node serves at once, from everyone; one more
            is answered ``busy`` without being read. An owner serves about
            ``2 * fragments * (group_size - 1)`` part streams when every fragment syncs at
            once (240 for 8 fragments in groups of 16), hence the margin.
        max_inbound_per_peer: RPC streams served at once from one PeerID. A peer sends
            about two per fragment in flight (its part and its mixing part) plus repairs,
            state downloads and probes.
        inbound_header_timeout: seconds a caller has, from opening a stream, to send its
            8-byte request header; a silent stream is then dropped as ``too_slow``. A
            caller writes it at once; the margin covers a header queued behind other
            streams on a saturated slow link.
        min_inbound_bytes_per_second: least rate of a request body, over every sliding
            ``inbound_rate_window``; a slower stream is dropped as ``too_slow``, freeing
            its slot. The default (16 KiB/s, 128 kbit/s) lets a 1 Mbit/s link carry seven
            requests at once and still pass. 0 turns the check off.
        inbound_rate_window: seconds ``min_inbound_bytes_per_second`` is averaged over; a
            stream that sends nothing is dropped after this long.
        data_plane: ``p2pd`` carries every RPC through p2pd; ``tcp`` also listens on
            ``data_port`` and calls peers that listen too over direct TCP connections,
            opened with a handshake signed by both node keys (:mod:`protocol.p2p.direct`;
            not encrypted), falling back to p2pd for a peer whose port cannot be reached;
            ``tls`` is ``tcp`` encrypted with TLS 1.3 (bound to the signed handshake), and
            calls a peer whose port is not encrypted through p2pd. Needs
            ``identity_path``.
        data_port: TCP port of the direct data plane on ``host``; 0 picks a free one.
    """

    host: str = "127.0.0.1"
    port: int = 0
    initial_peers: tuple[str, ...] = ()
    identity_path: Path | None = None
    announce_maddrs: tuple[str, ...] = ()
    request_timeout: float = 30.0
    max_message_bytes: int = 256 * 2**20
    dht_client_mode: bool = False
    startup_timeout: float = 30.0
    reachability: Literal["auto", "public", "private"] = "auto"
    relay: bool = True
    auto_relay: bool = False
    trusted_relays: tuple[str, ...] = ()
    nat_port_map: bool = False
    auto_nat: bool = True
    max_inbound_streams: int = 256
    max_inbound_per_peer: int = 32
    inbound_header_timeout: float = 10.0
    min_inbound_bytes_per_second: float = 16 * 1024
    inbound_rate_window: float = 10.0
    data_plane: Literal["p2pd", "tcp", "tls"] = "p2pd"
    data_port: int = 0

    def __post_init__(self) -> None:
        if self.data_plane not in ("p2pd", "tcp", "tls"):
            raise ValueError(
                f"transport.data_plane = {self.data_plane!r}: expected p2pd, tcp or tls"
            )
        if self.data_plane != "p2pd" and self.identity_path is None:
            raise ValueError(
                f"transport.data_plane = {self.data_plane!r} signs its handshake with the "
                "node key: give identity_path"
            )
        if not 0 <= self.data_port <= 65535:
            raise ValueError(f"transport.data_port = {self.data_port}: expected 0..65535")
        if self.reachability not in ("auto", "public", "private"):
            raise ValueError(
                f"transport.reachability = {self.reachability!r}: expected auto, public or private"
            )
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            raise ValueError(f"transport.host = {self.host!r}: expected an IP address") from None
        if not 0 <= self.port <= 65535:
            raise ValueError(f"transport.port = {self.port}: expected 0..65535")
        for key in (
            "request_timeout",
            "startup_timeout",
            "max_message_bytes",
            "max_inbound_streams",
            "max_inbound_per_peer",
            "inbound_header_timeout",
            "inbound_rate_window",
        ):
            if not getattr(self, key) > 0:
                raise ValueError(f"transport.{key} = {getattr(self, key)}: expected > 0")
        if not self.min_inbound_bytes_per_second >= 0:
            raise ValueError(
                f"transport.min_inbound_bytes_per_second = {self.min_inbound_bytes_per_second}: "
                "expected >= 0"
            )

    @property
    def host_maddr(self) -> str:
        """The multiaddr p2pd listens on."""
        family = "ip4" if ipaddress.ip_address(self.host).version == 4 else "ip6"
        return f"/{family}/{self.host}/tcp/{self.port}"


_GET_BEAM = 8
"""Nodes a DHT lookup keeps in its beam. hivemind's default (its bucket size, 20) makes
every ``latest`` lookup in a swarm of up to 20 ask every node, and a node that holds
(or caches) the key answers with all of its subkeys: one record per node of the swarm.
Eight covers the five nodes a key is stored on, and every node of a swarm of up to
nine."""


@dataclass
class DhtUsage:
    """DHT operations of one kind and their payload bytes (keys and values, as this
    node hands them to or gets them from its DHT process)."""

    ops: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0

    def count(self, sent: int = 0, received: int = 0, op: bool = True) -> None:
        self.ops += int(op)
        self.bytes_sent += sent
        self.bytes_received += received


class BootstrapUnreachable(RuntimeError):
    """None of the initial peers could be reached (p2pd refuses to start then)."""


def startup_error(exc: BaseException, initial_peers: Sequence[str]) -> Exception | None:
    """What a failed :meth:`Transport.start` raises for ``exc``: a known failure in the
    operator's words, or None to raise ``exc`` as it is."""
    peers = ", ".join(initial_peers)
    if isinstance(exc, P2PDaemonError) and "bootstrap peers" in str(exc):
        return BootstrapUnreachable(f"none of the initial peers answered: {peers}")
    if isinstance(exc, RuntimeError) and "bootstrap failed" in str(exc):
        # their p2pd answered, their DHT not yet (a bootstrap node still starting)
        return BootstrapUnreachable(f"none of the initial peers' DHT answered yet: {peers}")
    if isinstance(exc, DHTValidationError):
        return NotDialable(
            f"{exc}: another running node may use this node's identity key (a copied "
            "data directory; give each node its own), or inbound connections are "
            "blocked (set network.reachability = 'private')"
        )
    if isinstance(exc, (P2PDaemonError, TimeoutError, concurrent.futures.TimeoutError)):
        return RuntimeError(f"transport failed to start: {exc!r}")
    return None


class NotDialable(RuntimeError):
    """A DHT peer could not reach this node back at its peer id while it joined."""


class _SupervisedDHT(DHT):
    """hivemind's DHT process, which also dies with the thread that forked it (Linux)."""

    def run(self) -> None:
        # The fork happens on the transport's loop thread, which outlives the DHT in a clean
        # shutdown; if the whole node is killed this is a second belt next to the watchdog.
        set_parent_death_signal(signal.SIGTERM)
        if os.getppid() != self._parent_pid:
            os._exit(1)  # the node died before the signal was armed
        super().run()


class Transport:
    """One node's p2pd, DHT and RPC endpoints behind a synchronous facade.

    Create it with :meth:`start`; end it with :meth:`shutdown` (also on exit).
    """

    def __init__(self, config: TransportConfig) -> None:
        self.config = config
        self._loop = asyncio.new_event_loop()
        self._loop.set_exception_handler(self._log_loop_error)
        self._thread = threading.Thread(target=self._loop.run_forever, name="atoll-transport")
        self._thread.daemon = True  # shutdown() or atexit stops it; never block interpreter exit
        self._p2p: P2P | None = None
        self._dht: DHT | None = None
        self._watchdog: Watchdog | None = None
        self._watch_task: asyncio.Task | None = None
        self._handlers: dict[str, str] = {}
        self._peer_id = ""
        self._maddrs: list[str] = []
        self._listen_maddrs: list[str] = []
        self._reachability = Reachability("unknown")
        self._inbound_gate = _framing.StreamGate(
            config.max_inbound_streams, config.max_inbound_per_peer
        )
        self._closed = False
        self._lock = threading.Lock()
        self._direct_server: direct.DirectServer | None = None
        self._direct_client: direct.DirectClient | None = None
        self._direct_rpcs: dict[str, direct.ServedRpc] = {}
        self._routes: dict[str, tuple[direct.Route | None, float]] = {}
        self._route_locks: dict[str, asyncio.Lock] = {}
        self.calls_by_plane = {"p2pd": 0, "tcp": 0, "tls": 0}
        """Calls made so far over each data plane."""
        self.dht_usage: dict[str, DhtUsage] = {}
        """DHT operations this node made so far, by the ``kind`` its callers gave."""

    @classmethod
    def start(cls, config: TransportConfig | None = None) -> Transport:
        """Start p2pd, the DHT process and the watchdog, and join the swarm.

        Raises:
            BootstrapUnreachable: none of ``initial_peers`` answered.
            NotDialable: a peer could not dial this node back at its peer id.
            RuntimeError: p2pd or the DHT did not come up within ``startup_timeout``.
        """
        self = cls(config or TransportConfig())
        self._thread.start()
        atexit.register(self.shutdown)
        started = time.perf_counter()
        try:
            self._run(self._start(), self.config.startup_timeout * 2)
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
        self._watchdog = Watchdog.spawn()
        self._p2p = await P2P.create(
            initial_peers=list(cfg.initial_peers) or None,
            host_maddrs=[cfg.host_maddr],
            announce_maddrs=list(cfg.announce_maddrs) or None,
            identity_path=str(cfg.identity_path) if cfg.identity_path is not None else None,
            # hivemind's identity check cannot read Ed25519 keys and costs a second daemon
            check_if_identity_free=False,
            dht_mode="client" if cfg.dht_client_mode else "server",
            startup_timeout=cfg.startup_timeout,
            force_reachability=None if cfg.reachability == "auto" else cfg.reachability,
            use_relay=cfg.relay,
            use_auto_relay=cfg.auto_relay,
            trusted_relays=list(cfg.trusted_relays) or None,
            nat_port_map=cfg.nat_port_map,
            auto_nat=cfg.auto_nat,
        )
        self._update_watchdog()
        self._peer_id = self._p2p.peer_id.to_base58()
        if cfg.data_plane != "p2pd":
            await self._start_direct()
        await self._add_handler(
            reachability.RPC_NAME,
            reachability.DialbackServer(_framing.REMOTE_ADDR.get).handle,
            reachability.MAX_REQUEST_BYTES,
            cfg.request_timeout,
        )
        maddrs = await asyncio.wait_for(self._p2p.get_visible_maddrs(), cfg.request_timeout)
        self._listen_maddrs = [str(m) for m in maddrs]
        self._maddrs = addrs.publishable(self._listen_maddrs, cfg.host)
        # Before the DHT starts: a node nobody can dial must join it as a client, or
        # every peer that adds it to its routing table would time out storing to it.
        if cfg.reachability != "auto":
            self._reachability = Reachability.forced_to(cfg.reachability)
        else:
            self._reachability = await self._probe(_peer_ids(cfg.initial_peers))
        if self._reachability.status != "unknown":
            logger.info("%s", self._reachability.summary())
        # Created on the loop thread, so the DHT fork comes from a thread that lives until shutdown.
        client_mode = cfg.dht_client_mode or not self._reachability.reachable
        self._dht = _SupervisedDHT(
            initial_peers=list(cfg.initial_peers),
            start=True,
            p2p=self._p2p,
            client_mode=client_mode,
            await_ready=False,
        )
        self._update_watchdog()
        wait_ready = functools.partial(self._dht.wait_until_ready, cfg.startup_timeout)
        await self._loop.run_in_executor(None, wait_ready)
        self._watch_task = asyncio.ensure_future(self._watch_helpers())

    async def _start_direct(self) -> None:
        cfg = self.config
        assert cfg.identity_path is not None  # checked by the config
        from verification.identity import Identity

        identity = Identity.load(cfg.identity_path)
        if identity.peer_id != self._peer_id:
            raise RuntimeError("the identity file does not hold p2pd's key")
        self._direct_server = direct.DirectServer(
            identity,
            self._direct_rpcs.get,
            self._inbound_gate,
            self._pace(),
            cfg.inbound_header_timeout,
            cfg.max_inbound_streams,
            tls=cfg.data_plane == "tls",
        )
        port = await self._direct_server.start(cfg.host, cfg.data_port)
        self._direct_client = direct.DirectClient(identity, require_tls=cfg.data_plane == "tls")
        answer = direct.encode_port(port, tls=cfg.data_plane == "tls")

        async def tell_port(peer: str, request: bytes) -> bytes:
            return answer

        await self._add_handler(direct.RPC_NAME, tell_port, 64, cfg.request_timeout)
        logger.info("direct data plane (%s) on %s:%d", cfg.data_plane, cfg.host, port)

    @property
    def data_port(self) -> int | None:
        """The direct data plane's port, when it runs."""
        return self._direct_server.port if self._direct_server is not None else None

    def _pace(self) -> _framing.Pace:
        cfg = self.config
        return _framing.Pace(
            cfg.inbound_header_timeout, cfg.min_inbound_bytes_per_second, cfg.inbound_rate_window
        )

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
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the transport's loop and wait for its result.

        Raises:
            TimeoutError: ``coro`` did not finish within ``timeout`` seconds (it is cancelled).
            RuntimeError: called from the loop thread itself (use ``await``) or after shutdown.
        """
        if self._closed:
            coro.close()
            raise RuntimeError("transport is shut down")
        return self._run(coro, timeout)

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("Transport.run() called on its own loop; await the coroutine")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            if future.done():
                raise
            future.cancel()
            raise TimeoutError(f"transport task did not finish within {timeout}s") from None

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
    def listen_maddrs(self) -> list[str]:
        """Every address p2pd listens on, loopback included (for local use only)."""
        return list(self._listen_maddrs)

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
        if found.status != "unknown":
            self._reachability = found
        return self._reachability

    async def connected_peers(self) -> list[str]:
        """PeerIDs this node's p2pd holds a connection to now."""
        assert self._p2p is not None, "transport not started"
        return [p.peer_id.to_base58() for p in await self._p2p.list_peers()]

    async def rejoin(self, maddrs: list[str], timeout: float) -> int:
        """Dial ``maddrs`` again and re-enter the DHT through them (after losing every
        peer); returns how many answered."""
        assert self._p2p is not None and self._dht is not None, "transport not started"
        joined = 0
        for maddr in maddrs:
            try:
                where, peer = maddr.rsplit("/p2p/", 1)
                connect = self._p2p._client.connect(PeerID.from_base58(peer), [Multiaddr(where)])
                await asyncio.wait_for(connect, timeout)
                joined += 1
            except Exception as exc:  # unreachable, bad address, daemon error: try the next
                logger.info("re-dial of %s failed: %r", maddr, exc)
        if joined:
            ping = functools.partial(_dht_ping, peers=_peer_ids(maddrs))
            with contextlib.suppress(Exception):
                await self._await_dht(
                    self._dht.run_coroutine(ping, return_future=True), "rejoin", timeout
                )
        return joined

    @property
    def helper_pids(self) -> list[int]:
        """Pids of p2pd and the DHT process, as last reported to the watchdog."""
        return [pid for pid, _ in self._watchdog.tracked] if self._watchdog else []

    @property
    def p2pd_pid(self) -> int | None:
        """The pid of this node's p2pd, while it runs."""
        child = getattr(self._p2p, "_child", None)  # hivemind keeps the process private
        return getattr(child, "pid", None)

    @property
    def dht_pid(self) -> int | None:
        """The pid of this node's DHT process, while it runs."""
        return self._dht.pid if self._dht is not None else None

    # ---- RPCs ------------------------------------------------------------------------

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

        The caller's PeerID comes from the authenticated stream, never from the payload.
        A handler that raises is logged and answered with an error; it never ends the node.

        Args:
            name: RPC name (letters, digits, ``_.-``; at most 64).
            handler: coroutine function serving one request.
            max_request_bytes: longer requests are refused before their body is read.
            timeout: deadline for one whole exchange; defaults to ``config.request_timeout``.
            receive: reads each request as it arrives (into a pooled buffer, say
                ``BufferPool.read_request``, or checking a signed head before any body
                byte); the handler gets the ``data`` of the lease it returns, valid until
                the handler returns (a view or tensor it keeps holds a pooled buffer out
                of the pool until dropped). Default: the request as bytes.
        """
        if not 0 < max_request_bytes <= self.config.max_message_bytes:
            raise ValueError(
                f"max_request_bytes = {max_request_bytes}: expected 1..{self.config.max_message_bytes}"
            )
        self._protocol(name)
        if name in self._handlers:
            raise ValueError(f"a handler for {name!r} is already registered")
        timeout = timeout or self.config.request_timeout
        self.run(self._add_handler(name, handler, max_request_bytes, timeout, receive), timeout)

    async def _add_handler(
        self,
        name: str,
        handler: Handler,
        max_request_bytes: int,
        timeout: float,
        receive: _framing.RequestReader | None = None,
    ) -> None:
        protocol = self._protocol(name)
        gate = self._inbound_gate  # one count for all of this transport's handlers
        pace = self._pace()

        async def serve(*stream: Any) -> None:
            await _framing.serve(
                stream,
                handler,
                max_request_bytes,
                name,
                timeout,
                gate=gate,
                pace=pace,
                receive=receive,
            )

        assert self._p2p is not None, "transport not started"
        await self._p2p.add_binary_stream_handler(protocol, serve)
        self._handlers[name] = protocol
        if name not in _P2PD_ONLY:
            self._direct_rpcs[name] = direct.ServedRpc(handler, max_request_bytes, timeout, receive)

    def remove_handler(self, name: str) -> None:
        """Stop serving RPC ``name``."""
        protocol = self._handlers.pop(name)
        self._direct_rpcs.pop(name, None)
        assert self._p2p is not None, "transport not started"
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
        """Send ``data`` to RPC ``name`` of ``peer_id`` and return the response.

        Args:
            peer_id: the callee's base58 PeerID.
            name: the RPC name the callee registered with :meth:`add_handler`.
            data: the request: bytes, or buffers sent one after the other.
            timeout: deadline, in seconds, for the whole exchange.
            max_response_bytes: refuse longer responses; defaults to ``config.max_message_bytes``.

        Raises:
            ProtocolError: with ``reason`` timeout, unreachable, no_handler, connection_lost,
                oversized, remote_error or malformed. A callee at its stream caps answers
                remote_error with a detail starting ``busy:``; one that found this request
                too slow, ``too_slow:``.
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
        """:meth:`call`, with the response read by ``receive(reader, length)`` (checked
        as it arrives, into a buffer of the caller's); returns what it returns (by
        default a :class:`Lease` of bytes: release it when done).
        """
        protocol = self._protocol(name)
        size = _framing.payload_size(data)
        if size > self.config.max_message_bytes:
            raise ProtocolError(
                "oversized", f"request of {size} bytes exceeds max_message_bytes", peer_id
            )
        limit = max_response_bytes or self.config.max_message_bytes
        try:
            exchange = self._exchange(peer_id, name, protocol, data, limit, receive)
            return await asyncio.wait_for(exchange, timeout)
        except asyncio.TimeoutError:
            raise ProtocolError("timeout", f"{name} took over {timeout:.1f}s", peer_id) from None

    async def _exchange(
        self,
        peer_id: str,
        name: str,
        protocol: str,
        data: _framing.Payload,
        limit: int,
        receive: _framing.Receiver | None,
    ) -> Any:
        """Over the direct data plane when it runs on both sides, else through p2pd."""
        assert self._p2p is not None, "transport not started"
        client = self._direct_client
        if client is not None and name not in _P2PD_ONLY:
            route = await self._route(peer_id)
            if route is not None:
                try:
                    lease = await client.call(peer_id, route, name, data, limit, receive)
                    self.calls_by_plane["tls" if route.tls else "tcp"] += 1
                    return lease
                except direct.DirectUnavailable as e:
                    logger.info("direct to %s failed, using p2pd: %s", peer_id[:16], e)
                    self._routes[peer_id] = (None, time.monotonic() + _NO_ROUTE_SECONDS)
        self.calls_by_plane["p2pd"] += 1
        return await _framing.exchange(self._p2p, peer_id, protocol, data, limit, receive)

    async def _route(self, peer_id: str) -> direct.Route | None:
        """Where ``peer_id``'s data port is, asked once through p2pd and kept a while."""
        known = self._routes.get(peer_id)
        if known is not None and time.monotonic() < known[1]:
            return known[0]
        lock = self._route_locks.setdefault(peer_id, asyncio.Lock())
        async with lock:
            known = self._routes.get(peer_id)
            if known is not None and time.monotonic() < known[1]:
                return known[0]
            route = None
            try:
                answer = await asyncio.wait_for(
                    _framing.exchange(
                        self._p2p,
                        peer_id,
                        self._protocol(direct.RPC_NAME),
                        b"",
                        64,  # type: ignore[arg-type]
                    ),
                    _ROUTE_TIMEOUT,
                )
                port, tls = direct.decode_port(answer.data)  # type: ignore[arg-type]
                host = await self._connected_host(peer_id)
                if host is not None:
                    route = direct.Route(host, port, tls)
            except (ProtocolError, asyncio.TimeoutError) as e:
                logger.debug("no direct route to %s: %s", peer_id[:16], e)
            expires = _ROUTE_SECONDS if route is not None else _NO_ROUTE_SECONDS
            self._routes[peer_id] = (route, time.monotonic() + expires)
            return route

    async def _connected_host(self, peer_id: str) -> str | None:
        """The IP address of this node's p2pd connection to ``peer_id`` (not a relay)."""
        assert self._p2p is not None
        for info in await self._p2p.list_peers():
            if info.peer_id.to_base58() != peer_id:
                continue
            for maddr in info.addrs:
                text = str(maddr)
                found = _MADDR_HOST.match(text)
                if found and "p2p-circuit" not in text:
                    return found.group(2)
        return None

    @staticmethod
    def _protocol(name: str) -> str:
        if not _NAME.fullmatch(name):
            raise ValueError(f"RPC name {name!r}: expected 1-64 of letters, digits and _.-")
        return f"{_PROTOCOL_PREFIX}{name}/1"

    # ---- DHT -------------------------------------------------------------------------

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
        """Store ``value`` under ``key`` (and ``subkey``) for ``expiration_seconds``.

        ``kind`` names what the record is for in :attr:`dht_usage` (``registry``, say).

        Returns:
            Whether at least one DHT peer accepted the record.

        Raises:
            ProtocolError: ``timeout``.
        """
        assert self._dht is not None, "transport not started"
        expiration = get_dht_time() + expiration_seconds
        self._usage(kind).count(sent=len(key) + len(subkey or "") + len(value))
        future = self._dht.store(key, value, expiration, subkey=subkey, return_future=True)
        return bool(await self._await_dht(future, f"store {key!r}", timeout))

    async def dht_get(
        self, key: str, *, latest: bool = True, timeout: float | None = None, kind: str = "other"
    ) -> dict[str, bytes] | bytes | None:
        """Look ``key`` up in the DHT.

        Args:
            key: the key given to :meth:`dht_store`.
            latest: search until the newest record is found, rather than take the first one.
            timeout: deadline in seconds; defaults to ``config.request_timeout``.
            kind: what the key is for, counted in :attr:`dht_usage`.

        Returns:
            ``{subkey: value}`` for a key stored with subkeys, the value for a plain key, or
            None when nothing is found. Entries whose types another peer got wrong are dropped.

        Raises:
            ProtocolError: ``timeout``.
        """
        assert self._dht is not None, "transport not started"
        usage = self._usage(kind)
        usage.count(sent=len(key))
        future = self._dht.get(key, latest=latest, return_future=True, beam_size=_GET_BEAM)
        found = await self._await_dht(future, f"get {key!r}", timeout)
        if found is None:
            return None
        if isinstance(found.value, bytes):
            usage.count(received=len(found.value), op=False)
            return found.value
        if isinstance(found.value, dict):
            items = {
                sub: item.value
                for sub, item in found.value.items()
                if isinstance(sub, str) and isinstance(getattr(item, "value", None), bytes)
            }
            usage.count(received=sum(len(k) + len(v) for k, v in items.items()), op=False)
            return items
        logger.info("dht key %r holds a %s, not bytes; ignored", key, type(found.value).__name__)
        return None

    def _usage(self, kind: str) -> DhtUsage:
        usage = self.dht_usage.get(kind)
        if usage is None:
            usage = self.dht_usage[kind] = DhtUsage()
        return usage

    async def _await_dht(self, future: Awaitable[Any], what: str, timeout: float | None) -> Any:
        timeout = timeout or self.config.request_timeout
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise ProtocolError("timeout", f"dht {what} took over {timeout:.1f}s") from None

    # ---- helper processes and shutdown ---------------------------------------------------

    def _update_watchdog(self) -> None:
        child = getattr(self._p2p, "_child", None)  # hivemind keeps the p2pd process private
        roots = [p.pid for p in (child, self._dht) if p is not None and p.pid is not None]
        if self._watchdog is not None:
            self._watchdog.track(roots)

    async def _watch_helpers(self) -> None:
        while True:
            await asyncio.sleep(_WATCH_SECONDS)
            self._update_watchdog()
            if self._dht is not None and not self._dht.is_alive():
                logger.error("the DHT process exited unexpectedly (code %s)", self._dht.exitcode)
                return
            if self._watchdog is not None and not self._watchdog.is_alive():
                logger.error("the watchdog exited; helper processes may outlive this node")
                return

    def shutdown(self, timeout: float = 15.0) -> None:
        """Stop handlers, the DHT process, p2pd, the watchdog and the loop thread (idempotent).

        Raises:
            RuntimeError: called from the transport's own loop (a handler cannot stop it).
        """
        if threading.current_thread() is self._thread:
            raise RuntimeError("Transport.shutdown() called on its own loop thread")
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.shutdown)
        if self._thread.is_alive():
            try:
                self._run(self._stop_handlers(), timeout)
                if self._dht is not None and self._dht.pid is not None:
                    # blocking: asks the DHT process to stop, joins it, SIGTERMs it after 3 s;
                    # called here, not in an executor, which is gone during interpreter exit
                    self._dht.shutdown()
                self._run(self._stop_p2p(), timeout)
            except Exception:
                logger.warning(
                    "transport did not stop cleanly; ending its processes", exc_info=True
                )
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
        if self._watchdog is not None:
            # whatever ignored a polite shutdown (a hung DHT process) ends here
            survivors = terminate_processes(self._watchdog.tracked, grace=2.0)
            if survivors:
                logger.error("could not end helper processes %s", survivors)
            self._watchdog.close()
        if not self._thread.is_alive():
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
        if self._p2p is not None:
            for protocol in list(self._handlers.values()):
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._p2p.remove_binary_stream_handler(protocol), 2.0)
        self._handlers.clear()

    async def _stop_p2p(self) -> None:
        if self._p2p is not None:
            try:
                await asyncio.wait_for(self._p2p.shutdown(), 5.0)
            except asyncio.TimeoutError:
                logger.warning("p2pd did not exit within 5 s of SIGTERM; it gets SIGKILL")
        # in-flight handlers and calls end here rather than being dropped with the loop
        current = asyncio.current_task()
        pending = [t for t in asyncio.all_tasks() if t is not current]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=2.0)

    def _log_loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        logger.warning(
            "transport loop: %s", context.get("message"), exc_info=context.get("exception")
        )

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


def _peer_ids(maddrs: tuple[str, ...] | list[str]) -> list[str]:
    """The PeerIDs named by ``/p2p/<id>`` multiaddrs (others are skipped)."""
    return list(dict.fromkeys(m.rsplit("/p2p/", 1)[1] for m in maddrs if "/p2p/" in m))


async def _dht_ping(_dht: DHT, node: Any, peers: list[str]) -> None:
    """Runs in the DHT process: ping ``peers`` into the routing table, look up neighbours."""
    for peer in peers:
        with contextlib.suppress(Exception):
            await node.protocol.call_ping(PeerID.from_base58(peer), validate=False, strict=False)
    await node.find_nearest_nodes([node.node_id])
