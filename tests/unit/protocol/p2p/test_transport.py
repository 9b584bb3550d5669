"""The transport's facade without a network: what it says before it started, and a start
that fails raised in the operator's words with nothing left running."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from protocol.p2p.config import TransportConfig
from protocol.p2p.transport import BootstrapUnreachable, Transport
from tests.waiting import wait_until

PEER = "/ip4/10.0.0.1/tcp/4001/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


def _transport_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "atoll-transport" and t.is_alive()]


def test_before_it_starts_a_transport_has_no_address_and_made_no_call() -> None:
    transport = Transport(TransportConfig())
    assert transport.peer_id == "" and transport.maddrs == [] and transport.data_port is None
    assert transport.calls_by_plane == {"p2pd": 0, "tcp": 0, "tls": 0}
    assert transport.dht_usage == {} and transport.helper_pids == []
    assert transport.reachability.status == "unknown" and transport.p2pd_pid is None
    transport.shutdown()
    transport.shutdown()  # idempotent


def test_a_failed_start_is_the_operators_error_and_leaves_nothing_running(monkeypatch) -> None:
    async def fail(self) -> None:
        raise RuntimeError("DHT bootstrap failed: no peer answered")

    monkeypatch.setattr(Transport, "_start", fail)
    before = len(_transport_threads())
    with pytest.raises(BootstrapUnreachable, match="DHT answered yet") as info:
        Transport.start(TransportConfig(initial_peers=(PEER,), startup_timeout=2))
    assert PEER in str(info.value)
    assert len(_transport_threads()) == before


def test_the_facade_runs_coroutines_on_its_own_loop(monkeypatch) -> None:
    async def started(self) -> None:
        self._peer_id = "12D3KooWtest"

    monkeypatch.setattr(Transport, "_start", started)
    before = len(_transport_threads())
    with Transport.start(TransportConfig(startup_timeout=2)) as transport:
        assert transport.peer_id == "12D3KooWtest"

        async def answer() -> int:
            return 42

        assert transport.run(answer(), timeout=5) == 42
        assert transport.submit(answer()).result(5) == 42
    assert len(_transport_threads()) == before  # its loop thread ended with it


def test_a_transport_whose_p2pd_died_leaves_no_socket_behind() -> None:
    """hivemind removes p2pd's socket only when it stops a p2pd still running; one that
    died first (killed, or crashed) left its socket in /tmp, one per node start."""
    transport = Transport.start(TransportConfig(dht=False, reachability="private"))
    path = transport._daemons.p2p._daemon_listen_maddr.value_for_protocol("unix")
    assert os.path.exists(path)
    os.kill(transport._daemons.p2p._child.pid, signal.SIGKILL)
    assert wait_until(lambda: transport._daemons.p2p._child.returncode is not None, 10)
    transport.shutdown()
    assert not os.path.exists(path)
