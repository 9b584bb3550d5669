"""The sync, network, control and metrics sections: each refuses what cannot work, naming
the key."""

from __future__ import annotations

import pytest

from node.config_network import ControlConfig, MetricsConfig, NetworkConfig, SyncConfig

PEER = "/ip4/203.0.113.5/tcp/31337/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


def test_the_defaults_make_a_local_node_with_commitments() -> None:
    sync, network, control = SyncConfig(), NetworkConfig(), ControlConfig()
    assert sync.trigger == "seconds" and sync.mix_codec == "fp16"
    assert network.host == "127.0.0.1" and network.initial_peers == ()
    assert control.enabled and control.commit
    assert MetricsConfig().port is None  # no endpoint unless asked for


def test_stochastic_rounding_needs_an_integer_codec() -> None:
    assert SyncConfig(codec="int4", stochastic_rounding=True).stochastic_rounding
    with pytest.raises(ValueError, match="stochastic_rounding needs codec int8, int4 or topk"):
        SyncConfig(codec="fp16", stochastic_rounding=True)


def test_peers_are_multiaddrs_with_their_peer_id_and_announced_ones_need_none() -> None:
    assert NetworkConfig(initial_peers=(PEER,)).initial_peers == (PEER,)
    assert NetworkConfig(announce_maddrs=("/ip4/203.0.113.5/tcp/31337",)).announce_maddrs
    with pytest.raises(ValueError, match="is not a multiaddr"):
        NetworkConfig(initial_peers=("203.0.113.5:31337",))
    with pytest.raises(ValueError, match="needs its peer id"):
        NetworkConfig(trusted_relays=("/ip4/203.0.113.5/tcp/1",))


def test_a_client_cannot_say_it_is_publicly_reachable() -> None:
    with pytest.raises(ValueError, match="client_mode = true"):
        NetworkConfig(client_mode=True, reachability="public")


def test_commitments_need_the_control_channel_and_limits_are_bounded() -> None:
    assert not ControlConfig(enabled=False, commit=False).enabled
    with pytest.raises(ValueError, match="control.commit needs control.enabled"):
        ControlConfig(enabled=False)
    with pytest.raises(ValueError):
        ControlConfig(max_message_kb=2048)  # py-libp2p refuses more than 1 MiB
    with pytest.raises(ValueError):
        MetricsConfig(port=70000)


def test_unknown_keys_are_refused() -> None:
    with pytest.raises(ValueError):
        SyncConfig(codecs="int8")  # type: ignore[call-arg]


def test_topk_arguments_and_what_cannot_go_with_it() -> None:
    sync = SyncConfig(codec="topk", topk_chunk=4096, topk_density=0.01, topk_bits=4)
    assert sync.codec_args() == {"block_size": 4096, "k": 41, "bits": 4}
    assert sync.chunk == 4096
    assert SyncConfig(codec="topk", topk_chunk=100, topk_density=0.001).codec_args()["k"] == 1
    assert SyncConfig(codec="int8", block_size=128).codec_args() == {"block_size": 128}
    assert SyncConfig(codec="topk", stochastic_rounding=True).stochastic_rounding
    with pytest.raises(ValueError, match="mix_codec = 'topk'"):
        SyncConfig(mix_codec="topk")
    with pytest.raises(ValueError, match="feedback_decay < 1 needs sync.error_feedback"):
        SyncConfig(codec="topk", feedback_decay=0.9, error_feedback=False)
    with pytest.raises(ValueError):
        SyncConfig(codec="topk", topk_chunk=70_000)
    with pytest.raises(ValueError):
        SyncConfig(codec="topk", topk_bits=3)  # type: ignore[arg-type]


def test_a_gather_is_shared_reaches_the_all_reduce_and_refuses_a_streamed_reduce() -> None:
    from node.config import load_config
    from node.settings import allreduce_settings
    from node.shared_settings import settings_digest

    cfg = load_config(None, ["sync.codec='topk'", "sync.exchange='gather'"])
    assert allreduce_settings(cfg, 4).gather
    assert not allreduce_settings(load_config(None, []), 4).gather
    # nodes on the other exchange are on other settings: they never form a group
    reduce = load_config(None, ["sync.codec='topk'"])
    assert settings_digest(cfg) != settings_digest(reduce)
    with pytest.raises(ValueError, match="sync.exchange = 'gather' with network.stream_reduce"):
        load_config(None, ["sync.exchange='gather'", "network.stream_reduce=true"])
    with pytest.raises(ValueError, match="sync.exchange = 'gather' needs control.commit"):
        load_config(None, ["sync.exchange='gather'", "control.commit=false"])
    with pytest.raises(ValueError):
        SyncConfig(exchange="allgather")  # type: ignore[arg-type]
