"""The direct plane's handshake on real sockets: each side proves its node key, a caller
that means another node or claims another's PeerID is refused."""

from __future__ import annotations

import asyncio
import ssl

import pytest

from protocol.errors import ProtocolError
from protocol.p2p import _handshake
from verification.identity import Identity

CALLER = Identity.from_seed(b"c" * 32)
CALLEE = Identity.from_seed(b"e" * 32)
OTHER = Identity.from_seed(b"o" * 32)


class _Impostor:
    """Claims ``claimed``'s PeerID but holds another key."""

    def __init__(self, claimed: Identity, key: Identity) -> None:
        self.peer_id = claimed.peer_id
        self._key = key

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)


def _handshake_over_tcp(caller, meant: str) -> tuple[object, object]:
    """Run both sides; returns what each side returned or raised."""

    async def main() -> tuple[object, object]:
        answered: asyncio.Future = asyncio.get_running_loop().create_future()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                answered.set_result(await _handshake.answer_hello(CALLEE, reader, writer))
            except Exception as exc:
                answered.set_result(exc)
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            await _handshake.open_hello(caller, meant, reader, writer)
            opened: object = None
        except Exception as exc:
            opened = exc
        callee_saw = await asyncio.wait_for(answered, 5)
        writer.close()
        server.close()
        await server.wait_closed()
        return opened, callee_saw

    return asyncio.run(asyncio.wait_for(main(), 10))


def test_both_sides_prove_their_keys() -> None:
    opened, callee_saw = _handshake_over_tcp(CALLER, CALLEE.peer_id)
    assert opened is None and callee_saw == CALLER.peer_id


def test_a_caller_that_means_another_node_is_refused() -> None:
    _, callee_saw = _handshake_over_tcp(CALLER, OTHER.peer_id)
    assert isinstance(callee_saw, ProtocolError) and callee_saw.reason == "wrong_peer"


def test_a_caller_claiming_another_peer_id_is_refused() -> None:
    _, callee_saw = _handshake_over_tcp(_Impostor(OTHER, CALLER), CALLEE.peer_id)
    assert isinstance(callee_saw, ProtocolError) and callee_saw.reason == "bad_signature"


def test_tls_contexts_speak_tls13_and_the_certificate_hash_is_sha256() -> None:
    server, certificate_hash = _handshake.server_tls()
    assert server.minimum_version == ssl.TLSVersion.TLSv1_3 and len(certificate_hash) == 32
    client = _handshake.client_tls()
    assert client.minimum_version == ssl.TLSVersion.TLSv1_3
    assert client.verify_mode == ssl.CERT_NONE and not client.check_hostname
    assert _handshake.server_tls()[1] != certificate_hash  # a fresh certificate each start


def test_the_two_signatures_have_their_own_domains() -> None:
    assert _handshake.DOMAIN_CALLER != _handshake.DOMAIN_CALLEE
    with pytest.raises(ProtocolError, match="nonce"):
        _handshake._bytes_field(b"short", 32, "nonce")
