"""The control plane routes each topic to its handler, ignores its own messages, and tells
the swarm of the verdicts it finds itself."""

from __future__ import annotations

import asyncio
from typing import Any

from protocol.control.frames import topic_name
from protocol.control.plane import COMMIT_RPC, TOPICS, ControlPlane
from tests.unit.protocol.control._plane import (
    CHEAT,
    D1,
    D2,
    ME,
    OTHER,
    RUN,
    DirectTransport,
    commitment,
    deliver,
    signed_message,
)


class _Channel:
    """What the plane asks of a channel to publish a verdict: ``publish``."""

    def __init__(self) -> None:
        self.published: list[tuple[str, Any]] = []

    def publish(self, topic: str, body: Any) -> bool:
        self.published.append((topic, body))
        return True


def test_the_four_topics_are_heartbeat_commit_verdict_and_check() -> None:
    assert TOPICS == ("heartbeat", "commit", "verdict", "check")
    assert COMMIT_RPC == "atoll.commit"


def test_before_it_starts_the_plane_has_no_sidecar_and_counts_nothing(plane: ControlPlane) -> None:
    assert plane.addrs == [] and plane.sidecar_pid is None
    view = plane.swarm()
    assert view["peers"] == {} and view["sidecar_restarts"] == 0 and view["dropped"] == {}
    assert view["malformed"] == 0 and view["verdicts"] == 0 and view["forged_verdicts"] == 0


def test_this_nodes_own_messages_are_ignored(plane: ControlPlane) -> None:
    deliver(plane, "heartbeat", signed_message(ME, "heartbeat", {"round": 1}))
    deliver(plane, "commit", commitment(ME, {0: D1}))
    deliver(plane, "commit", commitment(ME, {0: D2}, seq=2))
    assert plane.swarm()["peers"] == {}
    assert plane.verifier.flagged(4) == {}  # never convicts itself
    assert not plane.commitments.committed(ME.peer_id, 3, 0)


def test_each_topic_goes_to_its_own_handler(plane: ControlPlane) -> None:
    deliver(plane, "heartbeat", signed_message(OTHER, "heartbeat", {"round": 2}))
    assert set(plane.heard()) == {OTHER.peer_id}
    assert not plane.commitments.committed(OTHER.peer_id, 3, 0)
    deliver(plane, "commit", commitment(OTHER, {0: D1}))
    assert plane.commitments.committed(OTHER.peer_id, 3, 0)
    deliver(plane, "verdict", signed_message(OTHER, "verdict", {"kind": "nonsense"}))
    assert plane.counters["verdicts"] == 1 and plane.counters["forged_verdicts"] == 1
    deliver(plane, "elsewhere", signed_message(OTHER, "elsewhere", {"round": 9}))
    assert plane.counters["malformed"] == 0 and plane.counters["verdicts"] == 1


def test_a_verdict_this_node_proves_goes_out_on_the_runs_verdict_topic(
    plane: ControlPlane,
) -> None:
    channel = _Channel()
    plane.channel = channel  # type: ignore[assignment]
    try:
        deliver(plane, "commit", commitment(CHEAT, {0: D1}))
        deliver(plane, "commit", commitment(CHEAT, {0: D2}, seq=2))
    finally:
        plane.channel = None
    assert [topic for topic, _ in channel.published] == [topic_name(RUN, "verdict")]
    body = channel.published[0][1]
    assert body["accused"] == CHEAT.peer_id and body["kind"] == "equivocation"
    assert len(body["evidence"]) == 2


def test_a_pardoned_peer_is_convicted_again_by_new_proof(plane: ControlPlane) -> None:
    deliver(plane, "commit", commitment(CHEAT, {0: D1}))
    deliver(plane, "commit", commitment(CHEAT, {0: D2}, seq=2))
    assert plane.verifier.flagged(4) == {CHEAT.peer_id: "banned"}
    plane.verifier.operator("pardon", CHEAT.peer_id, "operator")
    plane.pardoned(CHEAT.peer_id)
    assert plane.verifier.flagged(5) == {}
    deliver(plane, "commit", commitment(CHEAT, {0: D1}, round_=5, seq=3))
    deliver(plane, "commit", commitment(CHEAT, {0: D2}, round_=5, seq=4))
    assert plane.verifier.flagged(6) == {CHEAT.peer_id: "banned"}


def test_commitments_go_to_peers_through_the_commit_rpc(make_plane) -> None:
    names: list[str] = []

    class _Recording(DirectTransport):
        async def call(self, peer: str, name: str, data: bytes, timeout: float) -> bytes:
            names.append(name)
            return b""

    plane = make_plane(_Recording(None))
    plane.resize(4 * plane.settings.base_rate_peers)  # no gossip: direct sends only
    asyncio.run(plane.commitments._send_one(OTHER.peer_id, b"wire"))
    assert names == [COMMIT_RPC]
