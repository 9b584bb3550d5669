"""Heartbeats: the swarm view, the silence warning, the pace in a large swarm, the peers dialled."""

from __future__ import annotations

from protocol.control.heartbeats import SILENCE_GRACE_SECONDS
from protocol.control.plane import ControlPlane
from tests.unit.protocol.control._plane import (
    CHEAT,
    OTHER,
    deliver,
    signed_message,
)


def test_heartbeats_build_the_swarm_view(plane: ControlPlane) -> None:
    deliver(plane, "heartbeat", signed_message(OTHER, "heartbeat", {"version": "9", "round": 2}))
    deliver(plane, "heartbeat", signed_message(OTHER, "heartbeat", "not a map", seq=2))
    view = plane.swarm()
    assert set(view["peers"]) == {OTHER.peer_id}
    assert view["peers"][OTHER.peer_id]["round"] is None  # the latest beat said nothing


def test_silence_warns_only_after_the_grace_period_and_stops_when_heard(plane) -> None:
    live = {OTHER.peer_id}
    assert plane.silence(set(), now=0.0) is None  # nobody to hear
    assert plane.silence(live, now=100.0) is None  # quiet, but only just
    text = plane.silence(live, now=100.0 + SILENCE_GRACE_SECONDS + 1)
    assert text is not None and "hears none of the 1 live peers" in text
    assert "uncommitted" in text and "control.port" in text
    deliver(plane, "heartbeat", signed_message(OTHER, "heartbeat", {"round": 1, "step": 2}))
    assert plane.silence(live, now=200.0) is None  # heard: no warning, and the clock resets
    assert plane.silence({CHEAT.peer_id}, now=201.0) is None  # a new silence starts again
    assert plane.silence({CHEAT.peer_id}, now=201.0 + SILENCE_GRACE_SECONDS + 1) is not None


def test_heartbeats_carry_reachability_and_spec(plane) -> None:
    body = {"round": 1, "step": 2, "reachable": False, "spec": "ab" * 32}
    deliver(plane, "heartbeat", signed_message(OTHER, "heartbeat", body))
    seen = plane.swarm()["peers"][OTHER.peer_id]
    assert seen["reachable"] is False and seen["spec"] == "ab" * 32


def test_heartbeats_and_the_commit_phase_stretch_in_a_large_swarm(plane: ControlPlane) -> None:
    cfg = plane.settings
    for nodes in (1, 4, cfg.base_rate_peers):  # small swarms: exactly the base pace
        plane.resize(nodes)
        assert plane.pace.heartbeat_interval == cfg.heartbeat_seconds
        assert plane.commit_window == cfg.commit_seconds
    plane.resize(4 * cfg.base_rate_peers)
    assert plane.pace.heartbeat_interval == 4 * cfg.heartbeat_seconds
    assert plane.commit_window == 4 * cfg.commit_seconds


def test_a_node_dials_a_bounded_set_of_peers_and_keeps_it(plane: ControlPlane) -> None:
    dialled: list[str] = []

    class Channel:
        def connect(self, addrs: list[str]) -> None:
            dialled.extend(addrs)

    plane.channel = Channel()  # type: ignore[assignment]
    addr = lambda i: f"/ip4/10.0.0.{i}/tcp/1/p2p/peer{i}"  # noqa: E731
    few = {f"peer{i}": [addr(i)] for i in range(5)}
    plane.dial(few)
    assert sorted(dialled) == sorted(addr(i) for i in range(5))  # all of a small swarm
    many = {f"peer{i}": [addr(i)] for i in range(40)}
    plane.dial(many)
    plane.dial(many)
    assert len(dialled) == plane.settings.dial_peers  # at most dial_peers, once each
    assert {addr(i) for i in range(5)} <= set(dialled)  # the ones dialled stay chosen
    plane.channel = None
