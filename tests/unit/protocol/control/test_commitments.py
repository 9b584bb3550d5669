"""Round commitments: equivocation, parts taken only when committed in time, direct sends."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from protocol.control.frames import open_control, sign_control, topic_name
from protocol.control.plane import ControlPlane
from protocol.control.verdicts import check_verdict
from protocol.errors import ProtocolError
from tests.unit.protocol.control._plane import (
    CHEAT,
    D1,
    D2,
    ME,
    OTHER,
    RUN,
    DirectTransport,
    check_part,
    commitment,
    deliver,
    own_commitment,
    result_evidence,
    signed_message,
)
from tests.waiting import eventually


def test_two_commitments_from_one_peer_ban_it(plane: ControlPlane) -> None:
    deliver(plane, "commit", commitment(CHEAT, {0: D1}))
    assert plane.verifier.flagged(4) == {}
    deliver(plane, "commit", commitment(CHEAT, {0: D2}, seq=2))
    assert plane.verifier.flagged(4) == {CHEAT.peer_id: "banned"}


def test_an_owner_takes_only_parts_committed_in_time(plane: ControlPlane) -> None:
    before = time.monotonic()
    deliver(plane, "commit", commitment(OTHER, {0: D1, 1: D2}))
    closed = time.monotonic()
    assert check_part(plane, OTHER.peer_id, 3, 0, 0, D1, closed) is None
    assert check_part(plane, OTHER.peer_id, 3, 0, 1, D1, closed) == "commit_mismatch"
    assert check_part(plane, OTHER.peer_id, 3, 0, 0, D1, before) == "late_commit"
    assert check_part(plane, CHEAT.peer_id, 3, 0, 0, D1, closed) == "uncommitted"
    assert check_part(plane, OTHER.peer_id, 4, 0, 0, D1, closed) == "uncommitted"


def test_the_commit_phase_waits_for_the_group_but_not_forever(plane: ControlPlane) -> None:
    group = [ME.peer_id, OTHER.peer_id]
    started = time.monotonic()
    asyncio.run(plane.commitments.commit(3, 0, group, {1: D1}))  # OTHER never commits: bounded wait
    assert 0.2 <= time.monotonic() - started < 2.0
    deliver(plane, "commit", commitment(OTHER, {0: D2}, round_=5))
    started = time.monotonic()
    asyncio.run(plane.commitments.commit(5, 0, group, {1: D1}))
    assert time.monotonic() - started < 0.2  # everyone committed: no wait
    assert check_part(plane, ME.peer_id, 5, 0, 1, D1, time.monotonic()) is None


def test_malformed_commitments_are_counted_not_stored(plane: ControlPlane) -> None:
    deliver(
        plane,
        "commit",
        signed_message(OTHER, "commit", {"round": 1, "fragment": 0, "digests": [[0, b"x"]]}),
    )
    assert plane.counters["malformed"] == 1
    assert check_part(plane, OTHER.peer_id, 1, 0, 0, b"x", time.monotonic()) == "uncommitted"


def test_a_part_that_overtakes_its_late_commitment_is_refused_as_late(
    plane: ControlPlane,
) -> None:

    closed = time.monotonic()
    later = threading.Timer(0.2, deliver, (plane, "commit", commitment(OTHER, {0: D1})))
    later.start()
    try:
        assert check_part(plane, OTHER.peer_id, 3, 0, 0, D1, closed) == "late_commit"
    finally:
        later.join()


def test_an_owner_that_misstates_this_nodes_input_is_proven_bad(plane: ControlPlane) -> None:
    wire = own_commitment(plane, {1: D1})
    honest = result_evidence(CHEAT, [CHEAT.peer_id, ME.peer_id], [D2, D1])
    assert (
        plane.commitments.check_result(
            CHEAT.peer_id, 3, 0, 1, honest, [CHEAT.peer_id, ME.peer_id], [D2, D1]
        )
        is None
    )
    lying = result_evidence(CHEAT, [CHEAT.peer_id, ME.peer_id], [D2, D2])
    assert (
        plane.commitments.check_result(
            CHEAT.peer_id, 3, 0, 1, lying, [CHEAT.peer_id, ME.peer_id], [D2, D2]
        )
        == "bad_owner"
    )
    assert plane.verifier.flagged(4) == {}  # checking convicts nobody: its caller does
    plane.commitments.convict_owner(CHEAT.peer_id, 3, 0, lying)
    assert plane.verifier.flagged(4) == {CHEAT.peer_id: "banned"}
    # and the evidence convinces anyone
    assert check_verdict("bad_owner", {"reduced": lying, "commit": wire}, CHEAT.peer_id, RUN) == (
        3,
        0,
    )


def test_commitments_are_gossiped_only_in_a_small_swarm(plane: ControlPlane) -> None:
    published: list[str] = []

    class Channel:
        def sign(self, topic: str, body: object) -> bytes:
            return sign_control(ME, RUN, topic, 1, body)

        def publish_signed(self, topic: str, wire: bytes) -> bool:
            published.append(topic)
            return True

    plane.channel = Channel()  # type: ignore[assignment]
    try:
        plane.resize(plane.settings.base_rate_peers)
        assert plane.pace.gossips_commitments
        assert asyncio.run(plane.commitments.publish_commit(3, 0, {0: D1}))
        assert published == [topic_name(RUN, "commit")]
        plane.resize(plane.settings.base_rate_peers + 1)
        assert not plane.pace.gossips_commitments
        wire = asyncio.run(plane.commitments.publish_commit(4, 0, {0: D1}))
        assert published == [topic_name(RUN, "commit")]  # not gossiped this time
        # still signed and held: sent to the group and named in results
        assert wire and plane.commitments.evidence(ME.peer_id, 4, 0) == wire
    finally:
        plane.channel = None


def test_without_gossip_a_failed_direct_commitment_is_sent_again(make_plane) -> None:
    calls: list[str] = []

    async def flaky(peer: str, wire: bytes, timeout: float) -> bytes:
        calls.append(peer)
        if len(calls) == 1:
            raise ConnectionError("stream reset")
        return b""

    plane = make_plane(DirectTransport(flaky))
    plane.resize(4 * plane.settings.base_rate_peers)
    asyncio.run(plane.commitments._send_one(OTHER.peer_id, b"wire"))
    assert calls == [OTHER.peer_id, OTHER.peer_id]
    calls.clear()
    plane.resize(1)  # with gossip, the gossip copy is the fallback: one try
    asyncio.run(plane.commitments._send_one(OTHER.peer_id, b"wire"))
    assert calls == [OTHER.peer_id]


def test_the_two_exchanges_of_a_fragment_are_committed_apart(plane: ControlPlane) -> None:
    # a member commits to its update parts and to its global-copy parts of one fragment:
    # two commitments, no equivocation, and each part is checked against its own
    deliver(plane, "commit", commitment(OTHER, {0: D1}))
    deliver(plane, "commit", commitment(OTHER, {0: D2}, seq=2, content="weights"))
    assert plane.verifier.flagged(4) == {}
    closed = time.monotonic() + 10
    assert check_part(plane, OTHER.peer_id, 3, 0, 0, D1, closed, "update") is None
    assert check_part(plane, OTHER.peer_id, 3, 0, 0, D2, closed, "weights") is None
    assert check_part(plane, OTHER.peer_id, 3, 0, 0, D2, closed, "update") == "commit_mismatch"
    assert plane.commitments.committed(OTHER.peer_id, 3, 0, "weights")
    assert not plane.commitments.committed(CHEAT.peer_id, 3, 0, "weights")
    with pytest.raises(ProtocolError, match="different exchanges"):
        check_verdict(
            "equivocation",
            [commitment(OTHER, {0: D1}), commitment(OTHER, {0: D2}, seq=2, content="weights")],
            OTHER.peer_id,
            RUN,
        )


@pytest.mark.parametrize("content", [None, "gradients", 1])
def test_a_commitment_must_say_what_it_commits_to(plane: ControlPlane, content) -> None:
    body = {"round": 3, "fragment": 0, "digests": [[0, D1]]}
    if content is not None:
        body["content"] = content
    deliver(plane, "commit", signed_message(OTHER, "commit", body))
    assert plane.counters["malformed"] == 1
    assert not plane.commitments.committed(OTHER.peer_id, 3, 0)


def test_a_commitment_sent_directly_counts_and_its_gossip_copy_is_no_equivocation(
    plane: ControlPlane,
) -> None:
    wire = commitment(OTHER, {0: D1})
    asyncio.run(plane.commitments.receive_commit(OTHER.peer_id, wire))
    assert plane.commitments.committed(OTHER.peer_id, 3, 0)
    deliver(plane, "commit", wire)  # the same message, later, by gossip
    assert plane.verifier.flagged(4) == {}
    assert check_part(plane, OTHER.peer_id, 3, 0, 0, D1, time.monotonic() + 1) is None


def test_a_commitment_sent_directly_must_be_signed_by_the_caller(plane: ControlPlane) -> None:
    with pytest.raises(ProtocolError, match="sender_mismatch"):
        asyncio.run(plane.commitments.receive_commit(CHEAT.peer_id, commitment(OTHER, {0: D1})))
    assert not plane.commitments.committed(OTHER.peer_id, 3, 0)
    with pytest.raises(ProtocolError):
        asyncio.run(plane.commitments.receive_commit(OTHER.peer_id, b"\x93garbage"))


def test_commit_sends_the_signed_commitment_to_every_other_member(make_plane) -> None:
    class Channel:
        def sign(self, topic: str, body: object) -> bytes:
            return sign_control(ME, RUN, topic, 1, body)

        def publish_signed(self, topic: str, wire: bytes) -> bool:
            return True

    sent: list[tuple[str, bytes]] = []

    async def send(peer: str, wire: bytes, timeout: float) -> bytes:
        sent.append((peer, wire))
        return b""

    plane = make_plane(DirectTransport(send))
    plane.channel = Channel()  # type: ignore[assignment]

    async def commit() -> None:
        await plane.commitments.commit(3, 0, [ME.peer_id, OTHER.peer_id, CHEAT.peer_id], {0: D1})
        assert await eventually(lambda: len(sent) == 2, 5)  # the sends run in the background

    asyncio.run(commit())
    plane.channel = None
    assert sorted(p for p, _ in sent) == sorted([OTHER.peer_id, CHEAT.peer_id])
    msg = open_control(sent[0][1], RUN, topic_name(RUN, "commit"))
    assert msg.sender == ME.peer_id and msg.body["digests"] == [[0, D1]]


def test_a_commitment_for_a_round_far_ahead_cannot_wipe_the_stored_ones(
    plane: ControlPlane,
) -> None:
    """A member's signed commitment for round 10**6 once advanced the store's newest round
    and dropped every commitment of the rounds being exchanged, so that honest parts
    looked uncommitted; past this node's own newest round by more than the rounds kept,
    it is ignored."""
    asyncio.run(plane.commitments.publish_commit(3, 0, {1: D1}))
    deliver(plane, "commit", commitment(OTHER, {0: D1}))
    closed = time.monotonic()
    deliver(plane, "commit", commitment(CHEAT, {0: D2}, round_=10**6))
    assert check_part(plane, OTHER.peer_id, 3, 0, 0, D1, closed) is None
    assert check_part(plane, CHEAT.peer_id, 10**6, 0, 0, D2, time.monotonic()) == "uncommitted"
    # a peer a round or two ahead is still heard
    deliver(plane, "commit", commitment(CHEAT, {0: D2}, round_=5))
    assert check_part(plane, CHEAT.peer_id, 5, 0, 0, D2, time.monotonic()) is None


def test_commitments_of_rounds_long_before_the_clock_are_forgotten(plane: ControlPlane) -> None:
    deliver(plane, "commit", commitment(OTHER, {0: D1}))
    closed = time.monotonic()
    assert check_part(plane, OTHER.peer_id, 3, 0, 0, D1, closed) is None
    plane.verifier.clock.start(5)  # within the rounds kept: still known
    deliver(plane, "commit", commitment(CHEAT, {0: D2}, round_=5))
    assert check_part(plane, OTHER.peer_id, 3, 0, 0, D1, closed) is None
    plane.verifier.clock.start(20)
    deliver(plane, "commit", commitment(CHEAT, {0: D2}, round_=20))
    assert check_part(plane, OTHER.peer_id, 3, 0, 0, D1, closed) == "uncommitted"
    assert check_part(plane, CHEAT.peer_id, 20, 0, 0, D2, time.monotonic()) is None


def test_the_commit_phase_ends_when_the_last_commitment_arrives_from_another_thread(
    plane: ControlPlane,
) -> None:
    plane.resize(50 * plane.settings.base_rate_peers)  # a window of seconds
    assert plane.commit_window >= 5.0
    group = [ME.peer_id, OTHER.peer_id]
    later = threading.Timer(0.1, deliver, (plane, "commit", commitment(OTHER, {0: D2})))
    started = time.monotonic()
    later.start()
    try:
        asyncio.run(plane.commitments.commit(3, 0, group, {1: D1}))
    finally:
        later.join()
    assert 0.1 <= time.monotonic() - started < 2.0  # woken by the arrival, not the window
