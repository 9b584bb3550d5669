"""In-memory stand-ins for the transport's DHT and connections, for unit tests of the
code above it (registry, matchmaking, exchange). Records go through the real signing
and checking code; only the network is replaced."""

from __future__ import annotations

from typing import Any

from protocol.p2p.reachability import Reachability


class FakeDHT:
    """One shared key-value store with subkeys, as hivemind's DHT presents it."""

    def __init__(self) -> None:
        self.data: dict[str, dict[str, bytes]] = {}

    async def store(
        self, key: str, subkey: str | None, value: bytes, expiration: float, **_: Any
    ) -> bool:
        self.data.setdefault(key, {})[subkey or ""] = value
        return True

    async def get(self, key: str, **_: Any) -> dict[str, bytes] | None:
        found = self.data.get(key)
        return dict(found) if found else None


class FakeTransport:
    """What node.swarm.peers, protocol.averaging.matchmaking and protocol.averaging.exchange use of a Transport."""

    def __init__(
        self,
        dht: FakeDHT,
        peer_id: str,
        maddrs: tuple[str, ...] = (),
        reachability: Reachability | None = None,
    ) -> None:
        self.dht = dht
        self.peer_id = peer_id
        self.maddrs = list(maddrs) or [f"/ip4/10.0.0.1/tcp/1/p2p/{peer_id}"]
        self.reachability = reachability or Reachability("public")
        self.rejoins: list[list[str]] = []
        self.rejoin_answers = 1

    async def dht_store(
        self, key: str, subkey: str | None, value: bytes, expiration: float, **_: Any
    ) -> bool:
        return await self.dht.store(key, subkey, value, expiration)

    async def dht_get(self, key: str, **_: Any) -> dict[str, bytes] | None:
        return await self.dht.get(key)

    async def rejoin(self, maddrs: list[str], timeout: float) -> int:
        self.rejoins.append(list(maddrs))
        return self.rejoin_answers
