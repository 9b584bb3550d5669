"""RPC ``atoll.spec`` between two real p2pd on 127.0.0.1, neither with a DHT (as a
volunteer's fetch runs): the spec for the run asked, a refusal for any other."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from protocol.errors import ProtocolError
from protocol.p2p.config import TransportConfig
from protocol.p2p.transport import Transport
from protocol.runspec import MAX_SPEC_BYTES, RPC_NAME, SpecServer, fetch_spec_bytes

TEXT = b'[spec]\nrun_id = "demo"\n'


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Transport, Transport, SpecServer]]:
    server = Transport.start(TransportConfig(dht=False, reachability="private"))
    client = None
    try:
        spec = SpecServer(server, "demo", TEXT)
        spec.register()
        client = Transport.start(TransportConfig(initial_peers=(server.maddrs[0],), dht=False))
        yield server, client, spec
    finally:
        if client is not None:
            client.shutdown()
        server.shutdown()


def test_a_transport_without_a_dht_calls_the_peer_it_was_given(pair) -> None:
    server, client, _ = pair
    assert client.dht_pid is None and server.dht_pid is None
    assert client.reachability.status == "private" and client.reachability.forced


def test_the_spec_of_the_run_asked_comes_back_as_served(pair) -> None:
    server, client, spec = pair
    before = spec.served
    got = client.run(fetch_spec_bytes(client, server.peer_id, "demo", 10.0), 20.0)
    assert got == TEXT and spec.served == before + 1


@pytest.mark.parametrize(("run_id", "said"), [("other", "wrong_run"), ("é" * 64, "wrong_run")])
def test_another_run_is_refused_with_the_run_served(pair, run_id: str, said: str) -> None:
    server, client, spec = pair
    before = spec.served
    with pytest.raises(ProtocolError) as raised:
        client.run(fetch_spec_bytes(client, server.peer_id, run_id, 10.0), 20.0)
    assert raised.value.reason == "remote_error" and said in str(raised.value)
    assert "'demo'" in str(raised.value) and spec.served == before


def test_malformed_requests_are_refused_before_anything_is_served(pair) -> None:
    server, client, spec = pair
    with pytest.raises(ProtocolError, match="not UTF-8"):
        client.run(client.call(server.peer_id, RPC_NAME, b"\xff\xfe", timeout=10.0), 20.0)
    with pytest.raises(ProtocolError) as raised:  # longer than any run id: not read
        client.run(client.call(server.peer_id, RPC_NAME, b"x" * 300, timeout=10.0), 20.0)
    assert raised.value.reason in ("remote_error", "oversized", "connection_lost")
    with pytest.raises(ProtocolError, match="run id of 320 bytes"):  # refused before sending
        client.run(fetch_spec_bytes(client, server.peer_id, "é" * 160, 10.0), 20.0)


def test_a_peer_that_serves_no_spec_says_so(pair) -> None:
    server, client, _ = pair
    with pytest.raises(ProtocolError) as raised:  # the client itself serves none
        server.run(fetch_spec_bytes(server, client.peer_id, "demo", 10.0), 20.0)
    assert raised.value.reason in ("no_handler", "remote_error")


def test_a_spec_too_large_to_serve_is_refused_at_once() -> None:
    with pytest.raises(ValueError, match="at most"):
        SpecServer(None, "demo", b"x" * (MAX_SPEC_BYTES + 1))  # type: ignore[arg-type]
