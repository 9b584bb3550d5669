"""Which multiaddrs a node tells other hosts about."""

from __future__ import annotations

import pytest

from protocol.p2p import addrs

PEER = "12D3KooWExample"


@pytest.mark.parametrize(
    ("maddr", "host", "port"),
    [
        ("/ip4/10.0.0.1/tcp/31337", "10.0.0.1", 31337),
        ("/ip4/10.0.0.1/tcp/31337/p2p/X", "10.0.0.1", 31337),
        ("/ip6/::1/tcp/5", "::1", 5),
        ("/dns/example.org/tcp/80", None, 80),
        ("/ip4/10.0.0.1/udp/9/quic", "10.0.0.1", None),
        ("/p2p/X/p2p-circuit", None, None),
    ],
)
def test_parts_of_a_maddr(maddr: str, host: str | None, port: int | None) -> None:
    assert addrs.host_of(maddr) == host
    assert addrs.tcp_port(maddr) == port


def test_loopback_is_published_only_by_a_node_on_loopback() -> None:
    seen = [
        "/ip4/127.0.0.1/tcp/1/p2p/X",
        "/ip4/10.1.2.3/tcp/1/p2p/X",
        "/ip6/::1/tcp/1/p2p/X",
        "/ip4/0.0.0.0/tcp/1/p2p/X",
        "/ip4/10.1.2.3/tcp/1/p2p/X",
    ]
    assert addrs.publishable(seen, "0.0.0.0") == ["/ip4/10.1.2.3/tcp/1/p2p/X"]
    assert addrs.publishable(seen, "10.1.2.3") == ["/ip4/10.1.2.3/tcp/1/p2p/X"]
    assert addrs.publishable(seen, "127.0.0.1") == [
        "/ip4/127.0.0.1/tcp/1/p2p/X",
        "/ip4/10.1.2.3/tcp/1/p2p/X",
        "/ip6/::1/tcp/1/p2p/X",
    ]


def test_wildcard_expands_to_interfaces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        addrs,
        "interface_addresses",
        lambda include_loopback=False, ipv6=False: ["10.9.9.9", "127.0.0.1"],
    )
    out = addrs.expand_wildcard(["/ip4/0.0.0.0/tcp/7", "/ip4/10.0.0.5/tcp/8"])
    assert out == ["/ip4/10.9.9.9/tcp/7", "/ip4/127.0.0.1/tcp/7", "/ip4/10.0.0.5/tcp/8"]


def test_interface_addresses_has_loopback_only_when_asked() -> None:
    assert "127.0.0.1" not in addrs.interface_addresses()
    assert "127.0.0.1" in addrs.interface_addresses(include_loopback=True)


def test_small_helpers() -> None:
    assert addrs.is_wildcard("0.0.0.0") and addrs.is_wildcard("::")
    assert not addrs.is_wildcard("10.0.0.1") and not addrs.is_wildcard("example.org")
    assert addrs.tcp_maddr("10.0.0.1", 5) == "/ip4/10.0.0.1/tcp/5"
    assert addrs.tcp_maddr("::1", 5) == "/ip6/::1/tcp/5"
    assert addrs.with_peer_id("/ip4/1.2.3.4/tcp/5", PEER) == f"/ip4/1.2.3.4/tcp/5/p2p/{PEER}"
    assert addrs.with_peer_id(f"/ip4/1.2.3.4/tcp/5/p2p/{PEER}", "other").endswith(PEER)
    assert addrs.is_loopback("/ip4/127.0.0.2/tcp/1") and not addrs.is_loopback("/dns/x/tcp/1")
