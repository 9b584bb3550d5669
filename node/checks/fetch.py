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
from dataclasses import dataclass

import msgpack

from node.checks.replay import Unavailable
from node.checks.trace import REPLAY_RPC
from protocol.averaging.contributions import (
    CONTRIBUTION_RPC,
    CommittedDigests,
    Fetched,
    SentParts,
    open_contribution,
)
from protocol.averaging.parts import AllReduceSettings
from protocol.p2p.transport import Transport

__all__ = ["FetchSettings", "Fetcher"]

_CACHED = 16
"""Contributions kept after a fetch (a record's audit needs two, and their copies where
the group mixed, often fetched before)."""


@dataclass(frozen=True)
class FetchSettings:
    """What a fetch opens and how long it waits.

    Attributes:
        wire: the all-reduce's settings (codec, alignment, limits).
        numel: a fragment's size, by fragment.
        timeout: seconds one fetch may take (``trust.check_timeout``).
    """

    wire: AllReduceSettings
    numel: tuple[int, ...]
    timeout: float


class Fetcher:
    """Contributions of exchanges, from their members (or this node's own kept parts).

    Args:
        me: this node's PeerID.
        transport: the node's transport.
        settings: the wire, the fragments' sizes and the fetch's timeout.
        committed: the commitments' digests of a peer's parts in an exchange.
        sent: this node's own kept parts.
    """

    def __init__(
        self,
        me: str,
        transport: Transport,
        settings: FetchSettings,
        committed: CommittedDigests,
        sent: SentParts,
    ) -> None:
        self.me = me
        self.transport = transport
        self.wire = settings.wire
        self.committed = committed
        self.sent = sent
        self.numel = settings.numel
        self.timeout = settings.timeout
        self.bytes_fetched = 0
        self._cache: OrderedDict[tuple[str, int, int, str], Fetched] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, peer: str, round_: int, fragment: int, content: str = "update") -> Fetched:
        """``peer``'s checked contribution to exchange ``(round_, fragment)``: its
        pseudo-gradient, or with ``content="weights"`` the global copy it sent to mix.

        Raises:
            ProtocolError: it was not served, or is refused (the reason says why).
            TimeoutError: no answer within the timeout.
        """
        key = (peer, round_, fragment, content)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        if peer == self.me:
            kept = self.sent.get(round_, fragment, content) or []
            data = msgpack.packb(kept, use_bin_type=True)
        else:
            data = self.transport.run(
                self.transport.call(
                    peer,
                    CONTRIBUTION_RPC,
                    msgpack.packb([round_, fragment, content]),
                    timeout=self.timeout,
                    max_response_bytes=self.wire.max_message_bytes * 2,
                ),
                self.timeout + 5,
            )
            self.bytes_fetched += len(data)
        numel = self.numel[fragment]
        fetched = open_contribution(
            data, peer, (round_, fragment), numel, self.wire, self.committed, content
        )
        with self._lock:
            self._cache[key] = fetched
            while len(self._cache) > _CACHED:
                self._cache.popitem(last=False)
        return fetched

    def replay(self, peer: str, request: list) -> bytes:
        """``peer``'s answer to a :data:`node.checks.trace.REPLAY_RPC` request (a trace or a
        start state; empty where it keeps none).

        Raises:
            Unavailable: no answer (a timeout, a refused or broken stream).
        """
        try:
            data = self.transport.run(
                self.transport.call(
                    peer,
                    REPLAY_RPC,
                    msgpack.packb(request),
                    timeout=self.timeout,
                    max_response_bytes=self.wire.max_message_bytes,
                ),
                self.timeout + 5,
            )
        except Exception as exc:  # whatever the reason, nothing is known of the peer
            raise Unavailable(f"{type(exc).__name__}: {exc}") from None
        self.bytes_fetched += len(data)
        return data

    def forget(self, before: int) -> None:
        """Drop cached contributions of rounds before ``before``."""
        with self._lock:
            for key in [k for k in self._cache if k[1] < before]:
                del self._cache[key]
