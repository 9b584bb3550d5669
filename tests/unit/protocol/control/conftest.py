"""Fixtures of the control plane's tests: a plane on a temporary data directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from protocol.control.heartbeats import SelfReport
from protocol.control.plane import ControlPlane
from protocol.control.settings import ChannelSettings, ControlSettings
from tests.unit.protocol.control._plane import ME, RUN, DirectTransport
from verification.policy import TrustPolicy
from verification.verifier import Verifier


@pytest.fixture
def make_plane(tmp_path: Path):
    verifier = Verifier(TrustPolicy(), tmp_path / "atoll.db", ME.peer_id)

    def make(transport: DirectTransport | None = None) -> ControlPlane:
        channel = ChannelSettings(tmp_path / "identity.key", RUN, log_path=tmp_path / "sidecar.log")
        settings = ControlSettings(channel, commit_seconds=0.2)
        report = SelfReport(lambda: {"round": 0}, "test")
        return ControlPlane(settings, ME, transport, verifier, None, report)

    yield make
    verifier.close()


@pytest.fixture
def plane(make_plane) -> ControlPlane:
    return make_plane()
