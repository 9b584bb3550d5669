"""This node's DHT: hivemind's DHT process on the shared p2pd, driven from the transport's loop.

hivemind's DHT runs in a child process forked from the transport's loop thread and
reaches the node's p2pd through ``DHT(p2p=...)``. :class:`Dht` is the transport's
handle on it: it stores and looks up records, each under a deadline, counts them by
the kind its callers name (:class:`DhtUsage`), and re-enters the DHT after the node
lost every peer.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any

from hivemind.dht import DHT
from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_dht_time

from protocol.errors import ProtocolError
from protocol.p2p.watchdog import set_parent_death_signal

__all__ = ["Dht", "DhtUsage"]

logger = logging.getLogger(__name__)

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


class _SupervisedDHT(DHT):
    """hivemind's DHT process, which also dies with the thread that forked it (Linux)."""

    def run(self) -> None:
        # The fork happens on the transport's loop thread, which outlives the DHT in a clean
        # shutdown; if the whole node is killed this is a second belt next to the watchdog.
        set_parent_death_signal(signal.SIGTERM)
        if os.getppid() != self._parent_pid:
            os._exit(1)  # the node died before the signal was armed
        super().run()


class Dht:
    """The transport's handle on its DHT process.

    Create it with :meth:`spawn` on the transport's loop thread; its coroutines run
    on that loop.

    Args:
        process: the running DHT process.
        request_timeout: default deadline, in seconds, of one operation.
    """

    def __init__(self, process: DHT, request_timeout: float) -> None:
        self.process = process
        self.request_timeout = request_timeout
        self.usage: dict[str, DhtUsage] = {}
        """DHT operations made so far, by the ``kind`` their callers gave."""

    @classmethod
    def spawn(
        cls, p2p: P2P, initial_peers: Sequence[str], client_mode: bool, request_timeout: float
    ) -> Dht:
        """Fork the DHT process on ``p2p`` without waiting for it (:meth:`wait_ready`).

        Call it on the transport's loop thread: the process dies with the thread that
        forked it, and that thread lives until the transport shuts down.
        """
        process = _SupervisedDHT(
            initial_peers=list(initial_peers),
            start=True,
            p2p=p2p,
            client_mode=client_mode,
            await_ready=False,
        )
        return cls(process, request_timeout)

    async def wait_ready(self, timeout: float) -> None:
        """Wait, off the loop, until the DHT process has joined the swarm."""
        wait = functools.partial(self.process.wait_until_ready, timeout)
        await asyncio.get_running_loop().run_in_executor(None, wait)

    @property
    def pid(self) -> int | None:
        """The DHT process's pid, once it started."""
        return self.process.pid

    @property
    def exitcode(self) -> int | None:
        """The DHT process's exit code, once it exited."""
        return self.process.exitcode

    def is_alive(self) -> bool:
        """Whether the DHT process is still running."""
        return self.process.is_alive()

    def shutdown(self) -> None:
        """Stop the DHT process (blocking: asks it to stop, joins it, SIGTERMs it after 3 s)."""
        self.process.shutdown()

    async def store(
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

        ``kind`` names what the record is for in :attr:`usage` (``registry``, say).

        Returns:
            Whether at least one DHT peer accepted the record.

        Raises:
            ProtocolError: ``timeout``.
        """
        expiration = get_dht_time() + expiration_seconds
        self._usage(kind).count(sent=len(key) + len(subkey or "") + len(value))
        future = self.process.store(key, value, expiration, subkey=subkey, return_future=True)
        return bool(await self._await(future, f"store {key!r}", timeout))

    async def get(
        self, key: str, *, latest: bool = True, timeout: float | None = None, kind: str = "other"
    ) -> dict[str, bytes] | bytes | None:
        """Look ``key`` up in the DHT.

        Args:
            key: the key given to :meth:`store`.
            latest: search until the newest record is found, rather than take the first one.
            timeout: deadline in seconds; defaults to ``request_timeout``.
            kind: what the key is for, counted in :attr:`usage`.

        Returns:
            ``{subkey: value}`` for a key stored with subkeys, the value for a plain key, or
            None when nothing is found. Entries whose types another peer got wrong are dropped.

        Raises:
            ProtocolError: ``timeout``.
        """
        usage = self._usage(kind)
        usage.count(sent=len(key))
        future = self.process.get(key, latest=latest, return_future=True, beam_size=_GET_BEAM)
        found = await self._await(future, f"get {key!r}", timeout)
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

    async def ping(self, peers: list[str], timeout: float) -> None:
        """Ping ``peers`` into the routing table and look up this node's neighbours
        (re-entering the DHT once p2pd has dialled them again).

        Raises:
            ProtocolError: ``timeout``.
        """
        ping = functools.partial(_dht_ping, peers=peers)
        await self._await(self.process.run_coroutine(ping, return_future=True), "rejoin", timeout)

    def _usage(self, kind: str) -> DhtUsage:
        usage = self.usage.get(kind)
        if usage is None:
            usage = self.usage[kind] = DhtUsage()
        return usage

    async def _await(self, future: Awaitable[Any], what: str, timeout: float | None) -> Any:
        timeout = timeout or self.request_timeout
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            raise ProtocolError("timeout", f"dht {what} took over {timeout:.1f}s") from None


async def _dht_ping(_dht: DHT, node: Any, peers: list[str]) -> None:
    """Runs in the DHT process: ping ``peers`` into the routing table, look up neighbours."""
    for peer in peers:
        with contextlib.suppress(Exception):
            await node.protocol.call_ping(PeerID.from_base58(peer), validate=False, strict=False)
    await node.find_nearest_nodes([node.node_id])
