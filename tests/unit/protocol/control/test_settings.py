"""The control plane's settings: the channel's message cap checked once, the plane's run
and cap taken from its channel."""

from __future__ import annotations

from pathlib import Path

import pytest

from protocol.control.frames import DEFAULT_MAX_CONTROL_BYTES, MAX_CONTROL_BYTES
from protocol.control.settings import ChannelSettings, ControlSettings


def test_the_channel_listens_on_loopback_by_default() -> None:
    channel = ChannelSettings(Path("identity.key"), "run-1")
    assert channel.listen_host == "127.0.0.1" and channel.port == 0 and channel.restart
    assert channel.max_bytes == DEFAULT_MAX_CONTROL_BYTES


@pytest.mark.parametrize("max_bytes", [1023, MAX_CONTROL_BYTES + 1])
def test_a_message_cap_outside_what_libp2p_carries_is_refused(max_bytes: int) -> None:
    with pytest.raises(ValueError, match="max_bytes must be in"):
        ChannelSettings("identity.key", "run-1", max_bytes=max_bytes)


def test_the_plane_takes_its_run_and_cap_from_its_channel() -> None:
    plane = ControlSettings(ChannelSettings("identity.key", "run-7", max_bytes=4096))
    assert plane.run_id == "run-7" and plane.max_bytes == 4096
    assert (plane.heartbeat_seconds, plane.commit_seconds) == (1.0, 2.0)
    assert plane.dial_peers == plane.base_rate_peers == 8 and plane.commit
