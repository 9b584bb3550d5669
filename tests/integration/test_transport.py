"""Transport on real p2pd daemons and DHT processes on 127.0.0.1.

Two transports share this pytest process (hivemind allows several P2P instances in one
interpreter); process hygiene is checked on a transport in a child interpreter, which is
SIGKILLed or shut down.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from types import SimpleNamespace

import psutil
import pytest
from hivemind.p2p import P2P, PeerID

from protocol.errors import ProtocolError
from protocol.p2p.transport import Transport, TransportConfig
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

MiB = 1 << 20

_CHILD = """
import json, sys, time
import psutil
from protocol.p2p.transport import Transport, TransportConfig

transport = Transport.start(TransportConfig())
me = psutil.Process()
report = {
    "helpers": transport.helper_pids,
    "watchdog": [c.pid for c in me.children() if "watchdog.py" in " ".join(c.cmdline())][0],
    "children": [c.pid for c in me.children(recursive=True)],
}
if sys.argv[1] == "shutdown":
    transport.shutdown()
    report["after"] = [[c.pid, c.name()] for c in me.children(recursive=True)]
print(json.dumps(report), flush=True)
time.sleep(120)
"""


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_all_gone(pids: list[int], timeout: float) -> list[int]:
    wait_until(lambda: not any(_running(p) for p in pids), timeout, 0.1)
    return [p for p in pids if _running(p)]


def _start_child(mode: str) -> tuple[subprocess.Popen, dict]:
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, mode], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line, f"child transport failed to start (exit code {child.poll()})"
    return child, json.loads(line)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    identity = tmp_path_factory.mktemp("identity") / "a.key"
    P2P.generate_identity(str(identity))  # hivemind's own key writer; p2pd reads it
    seen: list[str] = []

    async def echo(peer: str, data: bytes) -> bytes:
        seen.append(peer)
        return data

    async def boom(peer: str, data: bytes) -> bytes:
        raise RuntimeError("kaboom")

    started: list[Transport] = []
    try:
        config = TransportConfig(identity_path=identity, request_timeout=10.0)
        a = Transport.start(config)
        started.append(a)
        b = Transport.start(TransportConfig(initial_peers=tuple(a.maddrs), request_timeout=10.0))
        started.append(b)
        a.add_handler("echo", echo, max_request_bytes=64 * MiB)
        a.add_handler("small", echo, max_request_bytes=MiB)
        a.add_handler("boom", boom, max_request_bytes=MiB)
        yield SimpleNamespace(a=a, b=b, seen=seen, identity=identity)
    finally:
        for transport in reversed(started):
            transport.shutdown()


@pytest.mark.timeout(20)
def test_identity_and_maddrs(swarm: SimpleNamespace) -> None:
    expected = PeerID.from_identity(swarm.identity.read_bytes()).to_base58()
    assert swarm.a.peer_id == expected
    assert swarm.a.maddrs and all(m.endswith(f"/p2p/{expected}") for m in swarm.a.maddrs)
    assert swarm.b.peer_id != swarm.a.peer_id


@pytest.mark.timeout(30)
def test_call_round_trip_10mib(swarm: SimpleNamespace) -> None:
    payload = os.urandom(10 * MiB)
    response = swarm.b.run(swarm.b.call(swarm.a.peer_id, "echo", payload, timeout=20), 25)
    assert response == payload
    assert swarm.seen[-1] == swarm.b.peer_id  # the authenticated caller, not a claim


@pytest.mark.timeout(30)
def test_oversized_request_rejected_and_server_survives(swarm: SimpleNamespace) -> None:
    b, a = swarm.b, swarm.a
    started = time.monotonic()
    with pytest.raises(ProtocolError) as info:
        b.run(b.call(a.peer_id, "small", os.urandom(8 * MiB), timeout=10), 15)
    assert info.value.reason == "oversized"
    assert info.value.peer == a.peer_id
    assert time.monotonic() - started < 5
    assert b.run(b.call(a.peer_id, "small", b"still here", timeout=10), 15) == b"still here"


@pytest.mark.timeout(30)
def test_handler_exception_is_remote_error(swarm: SimpleNamespace) -> None:
    b, a = swarm.b, swarm.a
    with pytest.raises(ProtocolError) as info:
        b.run(b.call(a.peer_id, "boom", b"x", timeout=10), 15)
    assert info.value.reason == "remote_error"
    assert "kaboom" in info.value.detail
    with pytest.raises(ProtocolError) as info:
        b.run(b.call(a.peer_id, "nothing_here", b"x", timeout=10), 15)
    assert info.value.reason == "no_handler"
    assert b.run(b.call(a.peer_id, "echo", b"ok", timeout=10), 15) == b"ok"


@pytest.mark.timeout(30)
def test_dht_store_and_get(swarm: SimpleNamespace) -> None:
    a, b = swarm.a, swarm.b
    assert b.run(b.dht_store("peers", "b", b"from-b", 60), 15)
    assert a.run(a.dht_store("peers", "a", b"from-a", 60), 15)
    assert a.run(a.dht_store("manifest", None, b"plain", 60), 15)
    assert b.run(b.dht_get("peers"), 15) == {"a": b"from-a", "b": b"from-b"}
    assert b.run(b.dht_get("manifest"), 15) == b"plain"
    assert a.run(a.dht_get("no-such-key"), 15) is None


@pytest.mark.timeout(30)
def test_call_to_dead_peer_fails_within_timeout(swarm: SimpleNamespace) -> None:
    c = Transport.start(TransportConfig(initial_peers=tuple(swarm.a.maddrs)))
    try:

        async def pong(peer: str, data: bytes) -> bytes:
            return b"pong"

        c.add_handler("ping", pong, max_request_bytes=1024)
        b = swarm.b
        assert b.run(b.call(c.peer_id, "ping", b"", timeout=10), 15) == b"pong"
        helpers = c.helper_pids
        assert len(helpers) == 2  # p2pd and the DHT process
    finally:
        c.shutdown()
    c.shutdown()  # idempotent
    assert _wait_all_gone(helpers, 5) == []
    started = time.monotonic()
    with pytest.raises(ProtocolError) as info:
        b.run(b.call(c.peer_id, "ping", b"", timeout=3), 10)
    assert info.value.reason in {"unreachable", "timeout", "connection_lost"}
    assert time.monotonic() - started < 4


@pytest.mark.timeout(20)
def test_run_and_submit(swarm: SimpleNamespace) -> None:
    b = swarm.b
    with pytest.raises(TimeoutError):
        b.run(asyncio.sleep(5), timeout=0.2)
    assert b.submit(asyncio.sleep(0, result=7)).result(5) == 7


@pytest.mark.timeout(40)
def test_sigkilled_node_leaves_no_helpers() -> None:
    child, report = _start_child("sleep")
    try:
        ours = [*report["helpers"], report["watchdog"]]
        assert len(report["helpers"]) == 2  # p2pd and the DHT process
        assert set(ours) <= set(report["children"])
        os.kill(child.pid, signal.SIGKILL)
        child.wait(5)
        survivors = _wait_all_gone(ours, 10)
        assert survivors == [], f"processes outlived the SIGKILLed node: {survivors}"
    finally:
        child.kill()
        child.wait()
        # torch_shm_manager (torch's, started by hivemind's MPFuture) leaves on its own
        # within seconds once its clients are gone; anything else still here is reaped
        for pid in _wait_all_gone(report["children"], 5):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(40)
def test_shutdown_leaves_no_helpers() -> None:
    child, report = _start_child("shutdown")
    try:
        left = {pid: name for pid, name in report["after"]}
        # torch_shm_manager belongs to torch (hivemind's MPFuture starts it) and serves the
        # whole interpreter; it exits once its clients are gone
        left = {pid: name for pid, name in left.items() if name != "torch_shm_manager"}
        assert left == {}, f"children left after shutdown(): {left}"
        assert not any(_running(pid) for pid in [*report["helpers"], report["watchdog"]])
    finally:
        child.kill()
        child.wait()
