"""Fetching contributions for useful-work checks.

A member keeps the signed parts it sent for a few rounds and serves them on
:data:`~protocol.averaging.contributions.CONTRIBUTION_RPC`; :class:`Fetcher` asks for
them on the transport's loop and waits on the calling thread (the checks' worker, never
the training thread), then authenticates them against the commitments
(:func:`~protocol.averaging.contributions.open_contribution`). This node's own
contribution comes from its kept parts, with the same checks.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import msgpack

from protocol.averaging.contributions import (
    CONTRIBUTION_RPC,
    CommittedDigests,
    Fetched,
    SentParts,
    open_contribution,
)
from protocol.averaging.parts import AllReduceSettings
from protocol.p2p.transport import Transport

__all__ = ["Fetcher"]

_CACHED = 8
"""Contributions kept after a fetch (a record's audit needs two, often fetched before)."""


class Fetcher:
    """Contributions of exchanges, from their members (or this node's own kept parts).

    Args:
        me: this node's PeerID.
        transport: the node's transport.
        wire: the all-reduce's settings (codec, alignment, limits).
        committed: the commitments' digests of a peer's parts in an exchange.
        sent: this node's own kept parts.
        numel: a fragment's size, by fragment.
        timeout: seconds one fetch may take.
    """

    def __init__(
        self,
        me: str,
        transport: Transport,
        wire: AllReduceSettings,
        committed: CommittedDigests,
        sent: SentParts,
        numel: list[int],
        timeout: float,
    ) -> None:
        self.me = me
        self.transport = transport
        self.wire = wire
        self.committed = committed
        self.sent = sent
        self.numel = numel
        self.timeout = timeout
        self.bytes_fetched = 0
        self._cache: OrderedDict[tuple[str, int, int], Fetched] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, peer: str, round_: int, fragment: int) -> Fetched:
        """``peer``'s checked contribution to exchange ``(round_, fragment)``.

        Raises:
            ProtocolError: it was not served, or is refused (the reason says why).
            TimeoutError: no answer within the timeout.
        """
        key = (peer, round_, fragment)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        if peer == self.me:
            data = msgpack.packb(self.sent.get(round_, fragment) or [], use_bin_type=True)
        else:
            data = self.transport.run(
                self.transport.call(
                    peer,
                    CONTRIBUTION_RPC,
                    msgpack.packb([round_, fragment]),
                    timeout=self.timeout,
                    max_response_bytes=self.wire.max_message_bytes * 2,
                ),
                self.timeout + 5,
            )
            self.bytes_fetched += len(data)
        fetched = open_contribution(
            data, peer, (round_, fragment), self.numel[fragment], self.wire, self.committed
        )
        with self._lock:
            self._cache[key] = fetched
            while len(self._cache) > _CACHED:
                self._cache.popitem(last=False)
        return fetched

    def forget(self, before: int) -> None:
        """Drop cached contributions of rounds before ``before``."""
        with self._lock:
            for key in [k for k in self._cache if k[1] < before]:
                del self._cache[key]
