"""The network side's settings: every value checked once, naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from protocol.p2p.config import TransportConfig


def test_the_defaults_listen_on_loopback_over_p2pd() -> None:
    cfg = TransportConfig()
    assert cfg.host_maddr == "/ip4/127.0.0.1/tcp/0" and cfg.data_plane == "p2pd"
    pace = cfg.inbound_pace
    assert (pace.header_timeout, pace.min_bytes_per_second, pace.window) == (10.0, 16384, 10.0)


def test_an_ipv6_host_listens_on_an_ip6_multiaddr() -> None:
    assert TransportConfig(host="::1", port=4001).host_maddr == "/ip6/::1/tcp/4001"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"data_plane": "udp"}, "data_plane = 'udp'"),
        ({"data_plane": "tls"}, "give identity_path"),
        ({"data_port": 70000}, "data_port = 70000"),
        ({"reachability": "maybe"}, "reachability = 'maybe'"),
        ({"host": "localhost"}, "expected an IP address"),
        ({"port": -1}, "port = -1"),
        ({"request_timeout": 0}, "request_timeout = 0"),
        ({"max_inbound_per_peer": 0}, "max_inbound_per_peer = 0"),
        ({"min_inbound_bytes_per_second": -1}, "expected >= 0"),
        ({"relay_parts": True, "reachability": "public"}, "relay_parts needs relay = true"),
        ({"relay_parts": True, "relay": False}, "relay_parts needs relay = true"),
    ],
)
def test_bad_values_name_their_key(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        TransportConfig(**fields)


def test_a_direct_plane_with_a_node_key_is_accepted(tmp_path: Path) -> None:
    cfg = TransportConfig(data_plane="tls", identity_path=tmp_path / "identity.key")
    assert cfg.data_plane == "tls" and cfg.min_inbound_bytes_per_second > 0
