"""An in-memory network for all-reduce services: a member's call runs the owner's real
part reader and handler on the bytes it would send, and its answer goes through the
member's real receiver, as a stream would carry them."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Sequence
from typing import Any

import torch

from protocol.averaging.allreduce import RESULT_RPC, RPC_NAME, AllReduceService
from protocol.averaging.hooks import Hooks
from protocol.averaging.parts import AllReduceSettings
from protocol.errors import ProtocolError
from protocol.p2p._frames import StreamedResponse
from verification.identity import Identity

__all__ = ["Network", "mean_of"]


class Network:
    """The services that answer calls, and the peers that are down."""

    def __init__(self) -> None:
        self.services: dict[str, AllReduceService] = {}
        self.down: set[str] = set()
        self.calls: list[tuple[str, str, str]] = []
        """``(caller, callee, rpc)`` of every call made."""

    def service(
        self, identity: Identity, settings: AllReduceSettings, **kwargs
    ) -> AllReduceService:
        transport = _Transport(self, identity.peer_id)
        service = AllReduceService(transport, identity, settings, Hooks(**kwargs))  # type: ignore[arg-type]
        self.services[identity.peer_id] = service
        return service


class _Transport:
    """What the all-reduce uses of a Transport to call an owner: ``call_into``."""

    def __init__(self, network: Network, me: str) -> None:
        self.network = network
        self.me = me

    @property
    def caller(self) -> _Transport:
        """Calls go out through the transport's caller; here, this stand-in itself."""
        return self

    async def call_into(
        self,
        peer: str,
        name: str,
        data: Sequence[bytes | memoryview] | bytes,
        *,
        timeout: float,
        receive: Any = None,
        max_response_bytes: int | None = None,
    ) -> Any:
        self.network.calls.append((self.me, peer, name))
        service = self.network.services.get(peer)
        if service is None or peer in self.network.down:
            raise ProtocolError("unreachable", "no route to the peer", peer)
        try:
            return await asyncio.wait_for(self._exchange(service, name, data, receive), timeout)
        except asyncio.TimeoutError:
            raise ProtocolError("timeout", f"{name} took over {timeout:.1f}s", peer) from None

    async def _exchange(self, service: AllReduceService, name: str, data, receive) -> Any:
        request = data if isinstance(data, bytes) else b"".join(bytes(b) for b in data)
        try:
            if name == RESULT_RPC:
                answer = await service.handle_result(self.me, request)
            else:
                assert name == RPC_NAME, name
                reader = asyncio.StreamReader()
                reader.feed_data(request)
                reader.feed_eof()
                lease = await service.read_part(reader.read, len(request), self.me)
                try:
                    answer = await service.handle_part(self.me, lease.data)
                finally:
                    lease.release()
        except ProtocolError as exc:  # what the callee's refusal looks like to the caller
            raise ProtocolError(
                "remote_error", f"{exc.reason}: {exc.detail}", service.identity.peer_id
            ) from None
        return await _deliver(answer, receive)


async def _deliver(answer: Any, receive: Any) -> Any:
    """The owner's answer through the member's receiver, framed as on a stream."""
    reader = asyncio.StreamReader()
    if not isinstance(answer, StreamedResponse):
        body = b"".join(bytes(b) for b in answer)
        reader.feed_data(body)
        reader.feed_eof()
        return await receive(reader, len(body))
    reading = asyncio.ensure_future(receive(reader, answer.size))
    async for piece in answer.body():
        reader.feed_data(bytes(piece))
    trailer = await answer.trailer()
    reader.feed_data(struct.pack(">BQ", 0, len(trailer)) + trailer)
    reader.feed_eof()
    return await reading


def mean_of(vectors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """The weighted mean every member should end with, in float64 then float32."""
    total = sum(weights)
    return (sum(v.double() * (w / total) for v, w in zip(vectors, weights))).float()
