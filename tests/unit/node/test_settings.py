"""Each component's settings object, built from a node's config."""

from __future__ import annotations

from pathlib import Path

import pytest

from node.config import load_config
from node.settings import (
    catchup_settings,
    check_settings,
    control_settings,
    peer_view_settings,
)

KEY = Path("/data/identity.key")
BOOT = "/ip4/10.0.0.2/tcp/1/p2p/boot"


def test_the_control_plane_and_its_channel_take_the_control_section() -> None:
    cfg = load_config(
        overrides=[
            "run.run_id=r1",
            "network.host=0.0.0.0",
            "control.port=4001",
            "control.max_message_kb=64",
            "control.commit_seconds=3",
            "control.dial_peers=5",
            'control.announce_maddrs=["/ip4/203.0.113.5/tcp/4001"]',
        ]
    )
    settings = control_settings(cfg, KEY, Path("/data"))
    channel = settings.channel
    assert (channel.key_file, channel.run, channel.listen_host, channel.port) == (
        KEY,
        "r1",
        "0.0.0.0",
        4001,
    )
    assert channel.max_bytes == settings.max_bytes == 64 * 1024
    assert channel.announce_maddrs == ("/ip4/203.0.113.5/tcp/4001",)
    assert channel.log_path == Path("/data/sidecar.log")
    assert (settings.run_id, settings.commit_seconds, settings.dial_peers) == ("r1", 3.0, 5)
    assert (settings.heartbeat_seconds, settings.base_rate_peers, settings.commit) == (1.0, 8, True)


def test_a_control_message_cap_under_one_kib_is_refused() -> None:
    cfg = load_config(overrides=["control.max_message_kb=0.5"])
    with pytest.raises(ValueError, match="max_bytes"):
        control_settings(cfg, KEY, Path("/data"))


def test_the_registry_view_takes_the_network_section() -> None:
    cfg = load_config(
        overrides=[
            "run.run_id=r2",
            "network.request_timeout=7",
            "network.registry_seconds=0.5",
            "network.base_rate_peers=16",
            "network.registry_shards=4",
        ]
    )
    settings = peer_view_settings(cfg, KEY, "s" * 64, (BOOT,))
    assert settings.run_id == "r2" and settings.spec == "s" * 64 and settings.key_file == KEY
    assert settings.initial_peers == (BOOT,)
    assert (settings.request_timeout, settings.registry_seconds) == (7.0, 0.5)
    assert (settings.base_rate_peers, settings.registry_shards) == (16, 4)


def test_catch_up_takes_the_request_deadline_and_message_cap() -> None:
    cfg = load_config(
        overrides=["run.run_id=r3", "network.request_timeout=9", "network.max_message_mb=2"]
    )
    settings = catchup_settings(cfg)
    assert (settings.run_id, settings.timeout, settings.max_bytes) == ("r3", 9.0, 2 * 2**20)


@pytest.mark.parametrize(
    ("replay_steps", "codec", "charge"),
    [
        (8, "int8", False),
        (8, "none", False),
        (8, "bf16", False),
        (8, "int4", True),  # the sent check allows nearly a whole contribution
        (8, "topk", True),  # no sent check
        (0, "int8", True),  # no replay checks
    ],
)
def test_check_records_charge_only_where_replay_and_sent_checks_do_not_both_run(
    replay_steps: int, codec: str, charge: bool
) -> None:
    cfg = load_config(
        overrides=[
            "trust.checkers=2",
            f"trust.replay_steps={replay_steps}",
            f"sync.codec='{codec}'",
        ]
    )
    assert check_settings(cfg).records_charge is charge
