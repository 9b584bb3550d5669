"""A serving transport against an outsider's silent streams, on real p2pd daemons.

Three transports share this pytest process: the server, an attacker that opens raw
streams announcing the largest request and then sends nothing, and a bystander whose
ordinary call must still be answered during the attack. Memory is the RSS of this
process, which holds the server's side of every stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import struct
import time

import psutil
import pytest
from hivemind.p2p import PeerID

from protocol.p2p import _framing
from protocol.p2p.transport import Transport, TransportConfig
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

MiB = 1 << 20
ATTACK_STREAMS = 50
HEADER_TIMEOUT = 2.0
WINDOW = 5.0  # the server's slow-stream window, short for the test


async def _open_silent(p2p, peer: str, protocol: str, count: int, announced: int) -> list:
    """Open ``count`` streams, each sending only a header that announces ``announced`` bytes."""
    streams = []
    for _ in range(count):
        call = p2p.call_binary_stream_handler(PeerID.from_base58(peer), protocol)
        _, reader, writer = await asyncio.wait_for(call, 5)
        # a stream over the caps may be answered and closed before its header is through
        with contextlib.suppress(ConnectionError):
            writer.write(struct.pack(">Q", announced))
            await asyncio.wait_for(writer.drain(), 5)
        streams.append((time.monotonic(), reader, writer))
    return streams


async def _ending(reader: asyncio.StreamReader, limit_s: float) -> tuple[str, float]:
    """How the server ended one stream (its error reason, ``closed`` or ``open``) and when."""
    try:
        data = await asyncio.wait_for(reader.read(), limit_s)  # to EOF; it never sends a body
    except asyncio.TimeoutError:
        return "open", time.monotonic()
    except ConnectionError:
        return "reset", time.monotonic()
    ended = time.monotonic()
    if len(data) < 9:
        return "closed", ended
    status, length = struct.unpack(">BQ", data[:9])
    assert status == _framing.STATUS_ERROR, data
    if len(data) != 9 + length:  # p2pd's reset overtook part of the frame
        return "cut", ended
    return _framing.decode_error(data[9:])[0], ended


async def _endings(streams: list, limit_s: float) -> list[tuple[str, float]]:
    return await asyncio.gather(*(_ending(reader, limit_s) for _, reader, _ in streams))


async def _close_all(streams: list) -> None:
    for _, _, writer in streams:
        writer.close()


def _rss_mib() -> float:
    gc.collect()
    return psutil.Process().memory_info().rss / MiB


@pytest.mark.timeout(120)
def test_silent_streams_cost_no_memory_and_are_dropped() -> None:
    started: list[Transport] = []
    streams: list = []
    attacker = None
    try:
        config = TransportConfig(
            request_timeout=30.0,  # the handler deadline is not what ends the attack
            inbound_header_timeout=HEADER_TIMEOUT,
            inbound_rate_window=WINDOW,
        )
        server = Transport.start(config)
        started.append(server)
        peers = tuple(server.maddrs)
        attacker = Transport.start(TransportConfig(initial_peers=peers))
        started.append(attacker)
        bystander = Transport.start(TransportConfig(initial_peers=peers))
        started.append(bystander)

        async def echo(peer: str, data: bytes) -> bytes:
            return data

        limit = config.max_message_bytes
        server.add_handler("echo", echo, max_request_bytes=limit)
        assert bystander.run(bystander.call(server.peer_id, "echo", b"warm", timeout=10), 15)
        gate = server._endpoints.gate
        held = config.max_inbound_per_peer  # one identity gets this many; the rest are busy

        before = _rss_mib()
        attack = _open_silent(attacker._daemons.p2p, server.peer_id, "/atoll/rpc/echo/1", 50, limit)
        streams = attacker.run(attack, 30)
        assert wait_until(lambda: gate.open == held, 2, 0.05), gate.open
        answer = bystander.run(bystander.call(server.peer_id, "echo", b"hello", timeout=10), 15)
        # the attack was still on while the bystander was answered (whose own stream the
        # server may count for a moment after the answer went out)
        assert wait_until(lambda: gate.open == held, 2, 0.05), gate.open
        during = _rss_mib()
        print(f"server-process RSS: {before:.0f} MiB before, {during:.0f} MiB with 50 streams")
        assert answer == b"hello"
        assert during - before < 64, (before, during)

        limit_s = HEADER_TIMEOUT + WINDOW + 5.0
        endings = attacker.run(_endings(streams, limit_s), limit_s + 5)
        reasons = [reason for reason, _ in endings]
        lifetimes = [ended - opened for (opened, _, _), (_, ended) in zip(streams, endings)]
        print(f"attack streams ended: {dict((r, reasons.count(r)) for r in set(reasons))}")
        assert "open" not in reasons, reasons
        # the held ones were dropped by the server within the slow-stream window
        slow = [life for reason, life in zip(reasons, lifetimes) if reason == "too_slow"]
        assert len(slow) >= held, reasons
        assert max(slow) < WINDOW + 2.0, slow
        assert min(slow) > WINDOW - 0.5, slow
        # the others were refused at once (a refusal can lose a race to p2pd's reset)
        refused = [r for r in reasons if r != "too_slow"]
        assert refused.count("busy") >= 1 and set(refused) <= {"busy", "closed", "reset", "cut"}
        assert wait_until(lambda: gate.open == 0, 2, 0.05), gate.open
        after = _rss_mib()
        print(f"server-process RSS after the attack: {after:.0f} MiB")
        assert after - before < 64
    finally:
        if attacker is not None and streams:
            with contextlib.suppress(Exception):  # the transport may already be gone
                attacker.run(_close_all(streams), 5)
        for transport in reversed(started):
            transport.shutdown()
