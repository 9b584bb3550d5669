"""The control channel with real sidecars on 127.0.0.1 (its wire format: test_frames.py)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import psutil
import pytest

from protocol.control.channel import ChannelSettings, ControlChannel, ControlChannelError
from protocol.control.frames import ControlMessage, read_frame, sign_control, write_frame
from tests.waiting import wait_until
from verification.identity import Identity

ROOT = Path(__file__).resolve().parents[4]
ALICE = Identity.from_seed(b"a" * 32)
RUN = "run-1"
TOPIC = "atoll/run-1/heartbeat"
DEADLINE_S = 10.0

pytestmark = pytest.mark.timeout(90)


# -- real sidecars ----------------------------------------------------------------


class Inbox:
    """Collects one channel's messages for the test thread."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, ControlMessage]] = []
        self._cond = threading.Condition()

    def __call__(self, topic: str, message: ControlMessage) -> None:
        with self._cond:
            self.messages.append((topic, message))
            self._cond.notify_all()

    def wait_for(
        self, predicate: Callable[[list[ControlMessage]], bool], timeout: float = DEADLINE_S
    ) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: predicate([m for _, m in self.messages]), timeout)

    def bodies_from(self, sender: str) -> list[Any]:
        with self._cond:
            return [m.body for _, m in self.messages if m.sender == sender]


Node = tuple[Identity, ControlChannel, Inbox]


@pytest.fixture
def start_node(tmp_path: Path) -> Iterator[Callable[[], Node]]:
    """Starts ControlChannels; closes them all and checks no sidecar is left."""
    channels: list[ControlChannel] = []
    pids: set[int] = set()

    def start() -> Node:
        identity = Identity.generate()
        key_file = tmp_path / f"key-{len(channels)}"
        identity.save(key_file)
        inbox = Inbox()
        channel = ControlChannel.start(
            ChannelSettings(key_file, RUN), [TOPIC], inbox, identity=identity
        )
        channels.append(channel)
        pids.add(channel.sidecar_pid)  # type: ignore[arg-type]
        return identity, channel, inbox

    yield start
    for channel in channels:
        pid = channel.sidecar_pid
        if pid is not None:
            pids.add(pid)
        channel.close()
    assert not [pid for pid in pids if _alive(pid)], "a sidecar outlived close()"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait(condition: Callable[[], bool], timeout: float = DEADLINE_S) -> bool:
    return wait_until(condition, timeout, interval=0.1)


def _mesh(nodes: list[Node]) -> None:
    """Connect every node to the ones before it; wait until all see each other subscribed."""
    for i, (_, channel, _) in enumerate(nodes):
        channel.connect([a for _, other, _ in nodes[:i] for a in other.addrs])

    def subscribed() -> bool:
        for _, channel, _ in nodes:
            seen = channel.stats(refresh=True).get("topic_peers", {}).get(TOPIC, [])
            if len(seen) < len(nodes) - 1:
                return False
        return True

    assert _wait(subscribed), [c.stats() for _, c, _ in nodes]


@pytest.mark.integration
def test_three_nodes_exchange_messages(start_node: Callable[[], Node]) -> None:
    nodes = [start_node() for _ in range(3)]
    for identity, channel, _ in nodes:
        assert channel.peer_id == identity.peer_id
        assert channel.addrs and all(a.endswith(f"/p2p/{identity.peer_id}") for a in channel.addrs)
    _mesh(nodes)

    for i, (_, channel, _) in enumerate(nodes):
        assert channel.publish(TOPIC, {"hello": i})
    for i, (identity, _, inbox) in enumerate(nodes):
        others = {n[0].peer_id for j, n in enumerate(nodes) if j != i}
        assert inbox.wait_for(lambda ms, others=others: {m.sender for m in ms} >= others)
        assert identity.peer_id not in {m.sender for _, m in inbox.messages}
        for j, (other, _, _) in enumerate(nodes):
            if j != i:
                assert inbox.bodies_from(other.peer_id) == [{"hello": j}]

    # A burst far past py-libp2p's defaults (10 msg/s per forwarder, 32-RPC
    # queues) arrives whole, with nothing dropped anywhere. Order is not kept:
    # py-libp2p handles each received message in its own trio task.
    burst = 120
    for k in range(burst):
        assert nodes[0][1].publish(TOPIC, {"burst": k})
    for _, _, inbox in nodes[1:]:
        assert inbox.wait_for(lambda ms: sum("burst" in m.body for m in ms) == burst, 30.0)
        got = [b["burst"] for b in inbox.bodies_from(nodes[0][0].peer_id) if "burst" in b]
        assert sorted(got) == list(range(burst))
    for _, channel, _ in nodes:
        stats = channel.stats(refresh=True)
        assert stats["dropped"] == {} and stats["client_dropped"] == {}

    with pytest.raises(ValueError, match="byte cap"):
        nodes[0][1].publish(TOPIC, b"x" * 300_000)
    with pytest.raises(ValueError, match="not joined"):
        nodes[0][1].publish("elsewhere", {})


@pytest.mark.integration
def test_forged_messages_are_dropped_and_counted(
    start_node: Callable[[], Node], tmp_path: Path
) -> None:
    nodes = [start_node() for _ in range(2)]
    _mesh(nodes)
    forger = Identity.generate()
    forger.save(tmp_path / "forger-key")
    proc = subprocess.Popen(
        [sys.executable, "-m", "protocol.control.sidecar"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=ROOT,
    )
    try:
        pipe_in, pipe_out = proc.stdin, proc.stdout
        assert pipe_in is not None and pipe_out is not None
        write_frame(
            pipe_in,
            {
                "op": "start",
                "key_file": str(tmp_path / "forger-key"),
                "listen_host": "127.0.0.1",
                "port": 0,
                "run": RUN,
                "topics": [TOPIC],
                "max_bytes": 256 * 1024,
            },
        )
        ready = read_frame(pipe_out)
        assert ready["ev"] == "ready" and ready["peer_id"] == forger.peer_id
        write_frame(pipe_in, {"op": "connect", "addrs": [a for n in nodes for a in n[1].addrs]})
        assert _wait(lambda: all(len(n[1].stats(refresh=True)["peers"]) == 2 for n in nodes))

        victim = nodes[0][0]
        bad_sig = msgpack.unpackb(sign_control(forger, RUN, TOPIC, 2, {"forged": "sig"}))
        bad_sig[2] = victim.sign(b"anything")
        forgeries = [
            sign_control(victim, RUN, TOPIC, 1, {"forged": "sender"}),  # signed, wrong source
            msgpack.packb(bad_sig, use_bin_type=True),
            sign_control(forger, "run-2", TOPIC, 3, {"forged": "run"}),
        ]
        for data in [*forgeries, sign_control(forger, RUN, TOPIC, 4, {"honest": True})]:
            write_frame(pipe_in, {"op": "publish", "topic": TOPIC, "data": data})

        reasons = ("sender_mismatch", "bad_signature", "wrong_run")
        for _, channel, inbox in nodes:
            assert inbox.wait_for(lambda ms: any(m.sender == forger.peer_id for m in ms))
            assert _wait(
                lambda c=channel: all(c.stats(refresh=True)["dropped"].get(r) for r in reasons)
            ), channel.stats()
            assert [m.body for _, m in inbox.messages] == [{"honest": True}]
            assert channel.stats()["client_dropped"] == {}
        pipe_in.close()  # end of file alone stops a sidecar
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for f in (proc.stdin, proc.stdout):
            if f is not None:
                f.close()


@pytest.mark.integration
def test_killed_sidecar_is_restarted_and_traffic_resumes(
    start_node: Callable[[], Node],
) -> None:
    nodes = [start_node() for _ in range(3)]
    _mesh(nodes)
    (alice, channel, inbox), (bob, bob_channel, _) = nodes[0], nodes[1]
    old_pid = channel.sidecar_pid
    assert old_pid is not None
    os.kill(old_pid, signal.SIGKILL)
    assert _wait(
        lambda: channel.restarts == 1 and channel.sidecar_pid not in (None, old_pid), timeout=30.0
    )
    assert channel.peer_id == alice.peer_id
    assert all(a.endswith(f"/p2p/{alice.peer_id}") for a in channel.addrs)

    def flowing() -> bool:
        channel.publish(TOPIC, {"after": "restart"})
        bob_channel.publish(TOPIC, {"after": "restart"})
        return all(
            {"after": "restart"} in node_inbox.bodies_from(alice.peer_id)
            for _, _, node_inbox in nodes[1:]
        ) and {"after": "restart"} in inbox.bodies_from(bob.peer_id)

    assert _wait(flowing, timeout=30.0), [c.stats() for _, c, _ in nodes]
    assert _alive(old_pid) is False


ATTACKER_SCRIPT = textwrap.dedent(
    """
    import hashlib, sys
    import multiaddr, trio
    from libp2p import new_host
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from libp2p.pubsub.gossipsub import PROTOCOL_ID_V12
    from libp2p.pubsub.pb import rpc_pb2
    from libp2p.utils import encode_varint_prefixed

    async def main():
        host = new_host()
        async with host.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
            target = info_from_p2p_addr(multiaddr.Multiaddr(sys.argv[1]))
            await host.connect(target)
            # An RPC that is not protobuf at all.
            stream = await host.new_stream(target.peer_id, [PROTOCOL_ID_V12])
            await stream.write(encode_varint_prefixed(b"\\xff\\xff not protobuf"))
            # A message whose libp2p key cannot be parsed.
            stream = await host.new_stream(target.peer_id, [PROTOCOL_ID_V12])
            bad = rpc_pb2.Message(
                data=b"x", topicIDs=[sys.argv[2]], seqno=b"\\0" * 8, signature=b"s" * 64,
                from_id=bytes([0x12, 0x20]) + hashlib.sha256(b"x").digest(), key=b"junk",
            )
            subscribe = rpc_pb2.RPC.SubOpts(subscribe=True, topicid=sys.argv[2])
            rpc = rpc_pb2.RPC(subscriptions=[subscribe], publish=[bad])
            await stream.write(encode_varint_prefixed(rpc.SerializeToString()))
            await trio.sleep(1.0)

    trio.run(main)
    """
)


@pytest.mark.integration
def test_malformed_libp2p_input_does_not_take_the_sidecar_down(
    start_node: Callable[[], Node],
) -> None:
    nodes = [start_node() for _ in range(2)]
    _mesh(nodes)
    (_, victim, _), (sender, sender_channel, _) = nodes
    attack = subprocess.run(
        [sys.executable, "-c", ATTACKER_SCRIPT, victim.addrs[0], TOPIC],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert attack.returncode == 0, attack.stderr
    reasons = ("bad_rpc", "bad_libp2p_message")
    assert _wait(lambda: all(victim.stats(refresh=True)["dropped"].get(r) for r in reasons))
    assert victim.restarts == 0
    assert sender_channel.publish(TOPIC, {"still": "alive"})
    assert nodes[0][2].wait_for(lambda ms: any(m.sender == sender.peer_id for m in ms))


PARENT_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from protocol.control.channel import ChannelSettings, ControlChannel
    settings = ChannelSettings(sys.argv[1], "run-1")
    channel = ControlChannel.start(settings, ["t"], lambda topic, message: None)
    print(channel.sidecar_pid, flush=True)
    time.sleep(120)
    """
)


@pytest.mark.integration
def test_sidecar_dies_with_a_killed_node(tmp_path: Path) -> None:
    Identity.generate().save(tmp_path / "key")
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT_SCRIPT, str(tmp_path / "key")],
        stdout=subprocess.PIPE,
        cwd=ROOT,
        text=True,
    )
    sidecar_pid = None
    try:
        assert parent.stdout is not None
        ready, _, _ = select.select([parent.stdout], [], [], 40.0)
        assert ready, "the node did not report its sidecar"
        sidecar_pid = int(parent.stdout.readline())
        assert _alive(sidecar_pid)
        parent.kill()
        parent.wait()
        assert _wait(lambda: not _alive(sidecar_pid), timeout=5.0)
    finally:
        parent.kill()
        parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()
        if sidecar_pid is not None and _alive(sidecar_pid):
            os.kill(sidecar_pid, signal.SIGKILL)


@pytest.mark.integration
def test_start_failure_is_reported(tmp_path: Path) -> None:
    identity = Identity.generate()
    identity.save(tmp_path / "key")
    with pytest.raises(ValueError, match="holds"):
        ControlChannel.start(
            ChannelSettings(tmp_path / "key", RUN), [TOPIC], Inbox(), identity=ALICE
        )
    with pytest.raises(ControlChannelError, match="listen_host"):
        settings = ChannelSettings(tmp_path / "key", RUN, listen_host="not-an-ip")
        ControlChannel.start(settings, [TOPIC], Inbox())
