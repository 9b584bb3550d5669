"""The direct data plane's handshake and connections, on real TCP sockets on 127.0.0.1
(no p2pd: the server and client are driven directly)."""

from __future__ import annotations

import asyncio
import os
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
import pytest

from protocol.errors import ProtocolError
from protocol.p2p import _framing, _handshake, direct
from protocol.p2p.directserver import DirectServer, DirectServerSettings, ServedRpc
from verification.identity import Identity

SERVER = Identity.from_seed(b"s" * 32)
CLIENT = Identity.from_seed(b"c" * 32)
OTHER = Identity.from_seed(b"o" * 32)
PACE = _framing.Pace(header_timeout=2.0, min_bytes_per_second=0, window=1.0)


async def _echo(peer: str, data: bytes) -> bytes:
    return peer.encode() + b":" + bytes(data)


def _server(
    handler: Callable[[str, bytes], Awaitable[Any]] = _echo,
    *,
    limit: int = 1 << 20,
    header_timeout: float = 2.0,
    tls: bool = False,
) -> DirectServer:
    rpcs = {"echo": ServedRpc(handler, limit, 5.0, None)}
    gate = _framing.StreamGate(16, 4)
    settings = DirectServerSettings(PACE, header_timeout, 8, tls=tls)
    return settings.build(SERVER, rpcs.get, gate)


async def _with_server(server: DirectServer, body: Callable[[int], Awaitable[Any]]) -> Any:
    port = await server.start("127.0.0.1", 0)
    try:
        return await asyncio.wait_for(body(port), 10)
    finally:
        await server.close()


def test_calls_reuse_one_authenticated_connection() -> None:
    server = _server()
    client = direct.DirectClient(CLIENT)

    async def body(port: int) -> list[bytes]:
        route = direct.Route("127.0.0.1", port)
        answers = []
        for i in range(3):
            lease = await client.call(SERVER.peer_id, route, "echo", b"x%d" % i, 1 << 20, None)
            answers.append(bytes(lease.data))
            lease.release()
        client.close()
        return answers

    answers = asyncio.run(_with_server(server, body))
    # the server names the caller by the key it proved, not by anything it was told
    assert answers == [CLIENT.peer_id.encode() + b":x%d" % i for i in range(3)]
    assert client.opened == 1
    assert server.refused == {}


def test_a_port_held_by_another_key_is_refused_before_anything_is_sent() -> None:
    calls: list[str] = []

    async def handler(peer: str, data: bytes) -> bytes:
        calls.append(peer)
        return b"ok"

    server = _server(handler)
    client = direct.DirectClient(CLIENT)

    async def body(port: int) -> None:
        # the caller means OTHER; the port answers as SERVER
        with pytest.raises(direct.DirectUnavailable):
            await client.call(
                OTHER.peer_id, direct.Route("127.0.0.1", port), "echo", b"x", 64, None
            )

    asyncio.run(_with_server(server, body))
    assert calls == []
    assert server.refused == {"wrong_peer": 1}


async def _hello(writer: asyncio.StreamWriter, fields: list) -> None:
    data = msgpack.packb(fields, use_bin_type=True)
    writer.write(struct.pack(">H", len(data)) + data)
    await writer.drain()


async def _read_hello(reader: asyncio.StreamReader) -> list:
    (length,) = struct.unpack(">H", await reader.readexactly(2))
    return msgpack.unpackb(await reader.readexactly(length), raw=False)


async def _forged_caller(port: int, claim: str, key: Identity, replay: bytes | None) -> bytes:
    """A caller claiming ``claim`` while holding ``key`` (or replaying a signature); then
    sends a request and returns what comes back (b"" when the server hung up)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    nonce = os.urandom(32)
    await _hello(writer, [1, claim, SERVER.peer_id, nonce])
    nonce_callee, _ = await _read_hello(reader)
    transcript = nonce + nonce_callee + claim.encode() + b"\0" + SERVER.peer_id.encode() + b"\0"
    signature = replay or key.sign(direct.DOMAIN_CALLER + transcript)
    await _hello(writer, [signature])
    writer.write(b"\x04echo" + struct.pack(">Q", 1) + b"x")
    await writer.drain()
    answer = await reader.read()
    writer.close()
    return answer


@pytest.mark.parametrize("case", ["other_key", "replayed_signature"])
def test_a_caller_that_cannot_prove_its_peer_id_is_refused(case: str) -> None:
    calls: list[str] = []

    async def handler(peer: str, data: bytes) -> bytes:
        calls.append(peer)
        return b"ok"

    server = _server(handler)

    async def body(port: int) -> bytes:
        if case == "other_key":
            return await _forged_caller(port, CLIENT.peer_id, OTHER, None)
        # a signature from an earlier connection does not sign this one's fresh nonce
        stale = CLIENT.sign(direct.DOMAIN_CALLER + b"\0" * 64 + CLIENT.peer_id.encode())
        return await _forged_caller(port, CLIENT.peer_id, CLIENT, stale)

    assert asyncio.run(_with_server(server, body)) == b""
    assert calls == []
    assert server.refused == {"bad_signature": 1}


@pytest.mark.parametrize(
    "first_bytes, reason",
    [
        (struct.pack(">H", 60000) + b"x" * 10, "malformed"),  # a frame far over 1 KiB
        (struct.pack(">H", 3) + b"\xc1\xc1\xc1", "malformed"),  # not msgpack
        (struct.pack(">H", 2) + msgpack.packb([9]), "malformed"),  # wrong shape
        (b"", "too_slow"),  # says nothing
    ],
    ids=["huge", "garbage", "shape", "silent"],
)
def test_bad_handshakes_are_refused_and_the_server_keeps_serving(
    first_bytes: bytes, reason: str
) -> None:
    server = _server(header_timeout=0.5)
    client = direct.DirectClient(CLIENT)

    async def body(port: int) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(first_bytes)
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed on us
        writer.close()
        lease = await client.call(
            SERVER.peer_id, direct.Route("127.0.0.1", port), "echo", b"y", 64, None
        )
        client.close()
        return bytes(lease.data)

    assert asyncio.run(_with_server(server, body)).endswith(b":y")
    assert server.refused == {reason: 1}


def test_unknown_rpc_and_oversized_request_get_their_reasons() -> None:
    server = _server(limit=100)
    client = direct.DirectClient(CLIENT)

    async def body(port: int) -> list[str]:
        route = direct.Route("127.0.0.1", port)
        reasons = []
        for name, data in (("nothing", b"x"), ("echo", b"x" * 1000)):
            with pytest.raises(ProtocolError) as info:
                await client.call(SERVER.peer_id, route, name, data, 1 << 20, None)
            reasons.append(f"{info.value.reason}:{info.value.detail.split(':')[0]}")
        lease = await client.call(SERVER.peer_id, route, "echo", b"fine", 1 << 20, None)
        assert bytes(lease.data).endswith(b":fine")
        client.close()
        return reasons

    assert asyncio.run(_with_server(server, body)) == [
        "no_handler:no handler for 'nothing'",
        "oversized:request of 1000 bytes exceeds the 100-byte limit of echo",
    ]


def test_port_answer_is_checked() -> None:
    assert direct.decode_port(direct.encode_port(4242)) == (4242, False)
    assert direct.decode_port(direct.encode_port(4242, tls=True)) == (4242, True)
    assert direct.decode_port(msgpack.packb({"port": 80})) == (80, False)
    for bad in (
        b"\xc1",
        msgpack.packb({"port": 0}),
        msgpack.packb({"port": "80"}),
        msgpack.packb({"port": 80, "tls": 1}),
        msgpack.packb([1]),
    ):
        with pytest.raises(ProtocolError, match="malformed"):
            direct.decode_port(bad)


# ---- encryption (data_plane = "tls") ----------------------------------------------------


class _Relay:
    """A TCP relay between caller and callee that keeps a copy of every byte it passes
    (what a machine on the path sees). With ``intercept`` it is a machine in the middle
    of TLS: it ends the caller's TLS with a certificate of its own and opens its own TLS
    connection to the callee."""

    def __init__(self, target: int, intercept: bool = False) -> None:
        self.target = target
        self.intercept = intercept
        self.seen = bytearray()
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> int:
        context = _handshake.server_tls()[0] if self.intercept else None
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0, ssl=context)
        return self._server.sockets[0].getsockname()[1]

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tls = {"ssl": _handshake.client_tls(), "server_hostname": ""} if self.intercept else {}
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target, **tls)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while data := await src.read(65536):
                self.seen += data
                dst.write(data)
                await dst.drain()
            dst.close()

        await asyncio.gather(
            pipe(reader, up_writer), pipe(up_reader, writer), return_exceptions=True
        )

    def close(self) -> None:
        assert self._server is not None
        self._server.close()


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
def test_tls_hides_the_bytes_that_plain_tcp_shows(tls: bool) -> None:
    server = _server(tls=tls)
    client = direct.DirectClient(CLIENT)
    secret = b"pseudo-gradient bytes " * 64

    async def body(port: int) -> tuple[bytes, bytes]:
        tap = _Relay(port)
        route = direct.Route("127.0.0.1", await tap.start(), tls)
        try:
            lease = await client.call(SERVER.peer_id, route, "echo", secret, 1 << 20, None)
            answer = bytes(lease.data)
            lease.release()
            client.close()
            await asyncio.sleep(0.05)
            return answer, bytes(tap.seen)
        finally:
            tap.close()

    answer, seen = asyncio.run(_with_server(server, body))
    assert answer == CLIENT.peer_id.encode() + b":" + secret
    assert len(seen) > len(secret)  # everything went through the tap
    assert (secret in seen) is not tls
    assert server.refused == {}


def test_a_machine_in_the_middle_of_tls_cannot_pass_the_handshake() -> None:
    calls: list[str] = []

    async def handler(peer: str, data: bytes) -> bytes:
        calls.append(peer)
        return b"ok"

    server = _server(handler, tls=True)
    client = direct.DirectClient(CLIENT)

    async def body(port: int) -> None:
        middle = _Relay(port, intercept=True)
        route = direct.Route("127.0.0.1", await middle.start(), True)
        try:
            # the callee signed its own certificate's hash, the caller was shown another
            with pytest.raises(direct.DirectUnavailable, match="bad_signature"):
                await client.call(SERVER.peer_id, route, "echo", b"x", 64, None)
        finally:
            middle.close()

    asyncio.run(_with_server(server, body))
    assert calls == []


def test_a_node_that_requires_tls_never_sends_in_the_clear() -> None:
    calls: list[str] = []

    async def handler(peer: str, data: bytes) -> bytes:
        calls.append(peer)
        return b"ok"

    server = _server(handler, tls=False)
    client = direct.DirectClient(CLIENT, require_tls=True)

    async def body(port: int) -> None:
        with pytest.raises(direct.DirectUnavailable, match="not encrypted"):
            await client.call(
                SERVER.peer_id, direct.Route("127.0.0.1", port), "echo", b"x", 64, None
            )

    asyncio.run(_with_server(server, body))
    assert calls == [] and client.opened == 0


def test_a_plain_caller_of_a_tls_port_speaks_tls() -> None:
    server = _server(tls=True)
    client = direct.DirectClient(CLIENT)

    async def body(port: int) -> bytes:
        # a route that says plain TCP to a TLS port: the handshake cannot even start
        with pytest.raises(direct.DirectUnavailable):
            await client.call(
                SERVER.peer_id, direct.Route("127.0.0.1", port), "echo", b"x", 64, None
            )
        lease = await client.call(
            SERVER.peer_id, direct.Route("127.0.0.1", port, True), "echo", b"y", 64, None
        )
        client.close()
        return bytes(lease.data)

    assert asyncio.run(_with_server(server, body)).endswith(b":y")
