"""The dialer's step: the control plane sized and dialled to the live peers that can be
dialled, reachability asked once, and the new addresses told once circuits are claimed."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from node.swarm.dialer import Dialer


class _Transport:
    def __init__(self) -> None:
        self.reachability = SimpleNamespace(status="private")
        self.config = SimpleNamespace(relay_parts=True)
        self.maddrs = ["/ip4/1.2.3.4/tcp/1/p2p/R/p2p-circuit/p2p/me"]
        self.reached: list[dict] = []

    async def claim_relays(self):
        return SimpleNamespace(status="relayed")

    async def reach(self, wanted: dict) -> None:
        self.reached.append(wanted)


class _Control:
    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.dialled: list[dict] = []

    def resize(self, n: int) -> None:
        self.sizes.append(n)

    def dial(self, addrs: dict) -> None:
        self.dialled.append(addrs)


def test_a_step_sizes_dials_and_reaches_parts_through_relays() -> None:
    records = {
        "a": SimpleNamespace(
            peer="a", reachable=True, control=["ca"], maddrs=["/ip4/x/p2p/R/p2p-circuit/p2p/a"]
        ),
        "b": SimpleNamespace(peer="b", reachable=False, control=["cb"], maddrs=["/ip4/y"]),
    }
    transport, control, told = _Transport(), _Control(), []
    dialer = Dialer(transport, SimpleNamespace(records=records), control, told.append)  # type: ignore[arg-type]
    asyncio.run(dialer.dial({"a", "b"}))
    assert control.sizes == [3] and control.dialled == [{"a": ["ca"]}]
    assert transport.reached == [{"a": ["/ip4/x/p2p/R/p2p-circuit/p2p/a"]}]
    assert told == [transport.maddrs]
