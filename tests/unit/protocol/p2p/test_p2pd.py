"""A node's p2pd: a failed start in the operator's words, its pid, and a re-dial."""

from __future__ import annotations

import asyncio
import concurrent.futures
from types import SimpleNamespace

from hivemind.dht.protocol import ValidationError
from hivemind.p2p import P2PDaemonError

from protocol.p2p.p2pd import BootstrapUnreachable, NotDialable, pid_of, redial, startup_error

PEERS = ["/ip4/10.0.0.1/tcp/4001/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"]


def test_known_start_failures_become_the_operators_errors() -> None:
    unreachable = startup_error(P2PDaemonError("failed to connect to bootstrap peers"), PEERS)
    assert isinstance(unreachable, BootstrapUnreachable) and PEERS[0] in str(unreachable)
    not_yet = startup_error(RuntimeError("DHT bootstrap failed"), PEERS)
    assert isinstance(not_yet, BootstrapUnreachable) and "DHT answered yet" in str(not_yet)
    blocked = startup_error(ValidationError("peer id mismatch"), PEERS)
    assert isinstance(blocked, NotDialable) and "network.reachability" in str(blocked)
    for slow in (TimeoutError("p2pd"), concurrent.futures.TimeoutError()):
        mapped = startup_error(slow, PEERS)
        assert type(mapped) is RuntimeError and "failed to start" in str(mapped)
    assert startup_error(KeyError("anything else"), PEERS) is None


def test_the_daemon_pid_is_read_while_it_runs() -> None:
    assert pid_of(None) is None
    assert pid_of(SimpleNamespace(_child=SimpleNamespace(pid=4242))) == 4242
    assert pid_of(SimpleNamespace()) is None


def test_a_redial_counts_the_peers_that_answered() -> None:
    dialled: list[str] = []

    async def connect(peer, addrs) -> None:
        dialled.append(str(addrs[0]))
        if "10.0.0.2" in str(addrs[0]):
            raise ConnectionError("refused")

    p2p = SimpleNamespace(_client=SimpleNamespace(connect=connect))
    other = PEERS[0].replace("10.0.0.1", "10.0.0.2")
    joined = asyncio.run(redial(p2p, [PEERS[0], other, "not a multiaddr"], timeout=1))  # type: ignore[arg-type]
    assert joined == 1 and dialled == ["/ip4/10.0.0.1/tcp/4001", "/ip4/10.0.0.2/tcp/4001"]
