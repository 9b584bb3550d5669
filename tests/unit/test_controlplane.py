"""A node's control plane without a network: commitments, equivocation, verdicts."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from node.config import ControlConfig
from protocol.control.commitments import _Commit
from protocol.control.frames import open_control, sign_control, topic_name
from protocol.control.heartbeats import SILENCE_GRACE_SECONDS
from protocol.control.plane import ControlPlane
from protocol.control.settings import ChannelSettings, ControlSettings
from protocol.control.verdicts import check_verdict, result_commit
from protocol.errors import ProtocolError
from verification.identity import Identity
from verification.policy import TrustPolicy
from verification.verifier import Verifier

RUN = "unit"
ME = Identity.from_seed(b"m" * 32)
CHEAT = Identity.from_seed(b"c" * 32)
OTHER = Identity.from_seed(b"o" * 32)
D1, D2 = b"\x01" * 32, b"\x02" * 32


def _signed(identity: Identity, topic: str, body: object, seq: int = 1) -> bytes:
    return sign_control(identity, RUN, topic_name(RUN, topic), seq, body)


def _commit(
    identity: Identity,
    digests: dict[int, bytes],
    round_: int = 3,
    seq: int = 1,
    content: str = "update",
) -> bytes:
    body = {
        "round": round_,
        "fragment": 0,
        "content": content,
        "digests": [[j, d] for j, d in digests.items()],
    }
    return _signed(identity, "commit", body, seq)


class _Transport:
    """What the plane asks of a transport: it sends each commitment through ``send``."""

    def __init__(self, send) -> None:
        self.send = send

    def add_handler(self, *args, **kwargs) -> None:
        pass

    async def call(self, peer: str, name: str, data: bytes, timeout: float) -> bytes:
        return await self.send(peer, data, timeout)


@pytest.fixture
def make_plane(tmp_path: Path):
    verifier = Verifier(TrustPolicy(), tmp_path / "atoll.db", ME.peer_id)

    def make(transport: _Transport | None = None) -> ControlPlane:
        channel = ChannelSettings(tmp_path / "identity.key", RUN, log_path=tmp_path / "sidecar.log")
        settings = ControlSettings(channel, commit_seconds=0.2)
        return ControlPlane(settings, ME, transport, verifier, None, lambda: {"round": 0}, "test")

    yield make
    verifier.close()


@pytest.fixture
def plane(make_plane) -> ControlPlane:
    return make_plane()


def _check(cp: ControlPlane, *args) -> str | None:
    return asyncio.run(cp.commitments.check(*args))


def _deliver(cp: ControlPlane, topic: str, wire: bytes) -> None:
    full = topic_name(RUN, topic)
    cp._on_message(full, open_control(wire, RUN, full))


def test_equivocation_evidence_checks_out() -> None:
    assert check_verdict(
        "equivocation",
        [_commit(CHEAT, {0: D1}), _commit(CHEAT, {0: D2}, seq=2)],
        CHEAT.peer_id,
        RUN,
    ) == (3, 0)


@pytest.mark.parametrize(
    ("evidence", "why"),
    [
        ([_commit(CHEAT, {0: D1}), _commit(CHEAT, {0: D1}, seq=2)], "agree"),
        ([_commit(CHEAT, {0: D1}), _commit(OTHER, {0: D2})], "not signed by the accused"),
        ([_commit(CHEAT, {0: D1}), _commit(CHEAT, {0: D2}, round_=4)], "different exchanges"),
        ([_commit(CHEAT, {0: D1})], "exactly two"),
        ([_commit(CHEAT, {0: D1}), b"\x93garbage"], "malformed"),
        ([_commit(CHEAT, {0: D1}), _signed(CHEAT, "heartbeat", {})], "wrong_topic"),
        ("not a list", "exactly two"),
    ],
)
def test_evidence_that_does_not_prove_equivocation_is_refused(evidence, why: str) -> None:
    with pytest.raises(ProtocolError, match=why) as info:
        check_verdict("equivocation", evidence, CHEAT.peer_id, RUN)
    assert info.value.reason == "bad_evidence"


def test_two_commitments_from_one_peer_ban_it(plane: ControlPlane) -> None:
    _deliver(plane, "commit", _commit(CHEAT, {0: D1}))
    assert plane.verifier.flagged(4) == {}
    _deliver(plane, "commit", _commit(CHEAT, {0: D2}, seq=2))
    assert plane.verifier.flagged(4) == {CHEAT.peer_id: "banned"}


def test_a_valid_verdict_bans_the_accused_and_a_forged_one_costs_nothing(
    plane: ControlPlane,
) -> None:
    forged = {
        "accused": OTHER.peer_id,
        "kind": "equivocation",
        "evidence": [_commit(CHEAT, {0: D1}), _commit(CHEAT, {0: D2}, seq=2)],
    }
    _deliver(plane, "verdict", _signed(CHEAT, "verdict", forged))
    assert plane.counters["forged_verdicts"] == 1
    assert plane.verifier.reputations() == {}  # the accused lost nothing
    real = dict(forged, accused=CHEAT.peer_id)
    _deliver(plane, "verdict", _signed(OTHER, "verdict", real, seq=5))
    assert plane.verifier.flagged(4) == {CHEAT.peer_id: "banned"}
    assert plane.counters["forged_verdicts"] == 1


def test_an_owner_takes_only_parts_committed_in_time(plane: ControlPlane) -> None:
    before = time.monotonic()
    _deliver(plane, "commit", _commit(OTHER, {0: D1, 1: D2}))
    closed = time.monotonic()
    assert _check(plane, OTHER.peer_id, 3, 0, 0, D1, closed) is None
    assert _check(plane, OTHER.peer_id, 3, 0, 1, D1, closed) == "commit_mismatch"
    assert _check(plane, OTHER.peer_id, 3, 0, 0, D1, before) == "late_commit"
    assert _check(plane, CHEAT.peer_id, 3, 0, 0, D1, closed) == "uncommitted"
    assert _check(plane, OTHER.peer_id, 4, 0, 0, D1, closed) == "uncommitted"


def test_the_commit_phase_waits_for_the_group_but_not_forever(plane: ControlPlane) -> None:
    group = [ME.peer_id, OTHER.peer_id]
    started = time.monotonic()
    asyncio.run(plane.commitments.commit(3, 0, group, {1: D1}))  # OTHER never commits: bounded wait
    assert 0.2 <= time.monotonic() - started < 2.0
    _deliver(plane, "commit", _commit(OTHER, {0: D2}, round_=5))
    started = time.monotonic()
    asyncio.run(plane.commitments.commit(5, 0, group, {1: D1}))
    assert time.monotonic() - started < 0.2  # everyone committed: no wait
    assert _check(plane, ME.peer_id, 5, 0, 1, D1, time.monotonic()) is None


def test_heartbeats_build_the_swarm_view(plane: ControlPlane) -> None:
    _deliver(plane, "heartbeat", _signed(OTHER, "heartbeat", {"version": "9", "round": 2}))
    _deliver(plane, "heartbeat", _signed(OTHER, "heartbeat", "not a map", seq=2))
    view = plane.swarm()
    assert set(view["peers"]) == {OTHER.peer_id}
    assert view["peers"][OTHER.peer_id]["round"] is None  # the latest beat said nothing


def test_malformed_commitments_are_counted_not_stored(plane: ControlPlane) -> None:
    _deliver(
        plane,
        "commit",
        _signed(OTHER, "commit", {"round": 1, "fragment": 0, "digests": [[0, b"x"]]}),
    )
    assert plane.counters["malformed"] == 1
    assert _check(plane, OTHER.peer_id, 1, 0, 0, b"x", time.monotonic()) == "uncommitted"


def test_a_part_that_overtakes_its_late_commitment_is_refused_as_late(
    plane: ControlPlane,
) -> None:
    import threading

    closed = time.monotonic()
    later = threading.Timer(0.2, _deliver, (plane, "commit", _commit(OTHER, {0: D1})))
    later.start()
    try:
        assert _check(plane, OTHER.peer_id, 3, 0, 0, D1, closed) == "late_commit"
    finally:
        later.join()


def _result(
    owner: Identity,
    contributors: list[str],
    digests: list[bytes],
    part: int = 1,
    content: str = "update",
    commits: list[bytes] | None = None,
) -> bytes:
    """The evidence of a signed result: its head and signature (the body is not needed)."""
    from protocol.wire.messages import Header
    from protocol.wire.partwire import open_part, seal_part

    meta = {
        "content": content,
        "contributors": contributors,
        "digests": digests,
        "weights": [1.0] * len(digests),
        **({"commits": commits} if commits is not None else {}),
    }
    header = Header("reduced", RUN, 3, 0, part, owner.peer_id)
    sealed = seal_part(owner, header, meta, bytes(4 * 1024)).to_bytes()
    return open_part(sealed, max_bytes=2**20).evidence()


def _own_commit(plane: ControlPlane, digests: dict[int, bytes]) -> bytes:
    """This node's commitment, signed and recorded as publish_commit would."""
    wire = _commit(ME, digests)
    plane.commitments._commits[(ME.peer_id, 3, 0, "update")] = _Commit(
        dict(digests), time.monotonic(), wire
    )
    return wire


def test_an_owner_that_misstates_this_nodes_input_is_proven_bad(plane: ControlPlane) -> None:
    wire = _own_commit(plane, {1: D1})
    honest = _result(CHEAT, [CHEAT.peer_id, ME.peer_id], [D2, D1])
    assert (
        plane.commitments.check_result(
            CHEAT.peer_id, 3, 0, 1, honest, [CHEAT.peer_id, ME.peer_id], [D2, D1]
        )
        is None
    )
    lying = _result(CHEAT, [CHEAT.peer_id, ME.peer_id], [D2, D2])
    assert (
        plane.commitments.check_result(
            CHEAT.peer_id, 3, 0, 1, lying, [CHEAT.peer_id, ME.peer_id], [D2, D2]
        )
        == "bad_owner"
    )
    assert plane.verifier.flagged(4) == {CHEAT.peer_id: "banned"}
    # and the evidence convinces anyone
    assert check_verdict("bad_owner", {"reduced": lying, "commit": wire}, CHEAT.peer_id, RUN) == (
        3,
        0,
    )


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (
            lambda w: {
                "reduced": _result(CHEAT, [CHEAT.peer_id, ME.peer_id], [D2, D1]),
                "commit": w,
            },
            "matches",
        ),
        (
            lambda w: {
                "reduced": _result(OTHER, [OTHER.peer_id, ME.peer_id], [D2, D2]),
                "commit": w,
            },
            "sender_mismatch",
        ),
        (
            lambda w: {"reduced": _result(CHEAT, [CHEAT.peer_id], [D2]), "commit": w},
            "does not name",
        ),
        (
            lambda w: {
                "reduced": _result(CHEAT, [CHEAT.peer_id, ME.peer_id], [D2, D2], part=2),
                "commit": w,
            },
            "another exchange or part",
        ),
        (lambda w: {"reduced": b"junk", "commit": w}, "malformed"),
        (lambda w: [w], "is a map"),
    ],
)
def test_bad_owner_evidence_that_does_not_check_out_is_refused(plane, make, why: str) -> None:
    wire = _own_commit(plane, {1: D1})
    with pytest.raises(ProtocolError, match=why) as info:
        check_verdict("bad_owner", make(wire), CHEAT.peer_id, RUN)
    assert info.value.reason == "bad_evidence"


def test_an_equivocator_cannot_frame_an_honest_owner(plane: ControlPlane) -> None:
    # the cheat committed D2 (what the owner saw and used) and D1 (shown as "evidence")
    _deliver(plane, "commit", _commit(CHEAT, {1: D2}))
    owner = OTHER
    result = _result(owner, [owner.peer_id, CHEAT.peer_id], [D1, D2])
    framing = {
        "accused": owner.peer_id,
        "kind": "bad_owner",
        "evidence": {"reduced": result, "commit": _commit(CHEAT, {1: D1}, seq=2)},
    }
    _deliver(plane, "verdict", _signed(CHEAT, "verdict", framing, seq=3))
    assert plane.verifier.flagged(4) == {CHEAT.peer_id: "banned"}  # the framer, not the owner


def test_an_owner_result_holding_the_commitment_it_used_defeats_a_framer(
    plane: ControlPlane,
) -> None:
    # A large swarm: commitments are not gossiped, so this node never saw the cheat's
    # commitment; the owner's result holds the one it relied on (D2).
    plane.resize(4 * plane.settings.base_rate_peers)
    used = _commit(CHEAT, {1: D2})
    owner = OTHER
    result = _result(owner, [owner.peer_id, CHEAT.peer_id], [D1, D2], commits=[b"", used])
    framing = {
        "accused": owner.peer_id,
        "kind": "bad_owner",
        "evidence": {"reduced": result, "commit": _commit(CHEAT, {1: D1}, seq=2)},
    }
    # on its face the evidence holds (the result names D2, the commitment shown says D1)
    assert check_verdict("bad_owner", framing["evidence"], owner.peer_id, RUN) == (3, 0)
    _deliver(plane, "verdict", _signed(CHEAT, "verdict", framing, seq=3))
    assert plane.verifier.flagged(4) == {CHEAT.peer_id: "banned"}  # the framer, not the owner


def test_an_owner_whose_own_result_contradicts_the_commitment_it_holds_is_convicted(
    plane: ControlPlane,
) -> None:
    plane.resize(4 * plane.settings.base_rate_peers)
    committed = _commit(ME, {1: D1})
    # the owner holds ME's commitment to D1 and still names D2 for ME
    lying = _result(CHEAT, [CHEAT.peer_id, ME.peer_id], [D2, D2], commits=[b"", committed])
    verdict = {
        "accused": CHEAT.peer_id,
        "kind": "bad_owner",
        "evidence": {"reduced": lying, "commit": committed},
    }
    _deliver(plane, "verdict", _signed(OTHER, "verdict", verdict, seq=4))
    assert plane.verifier.flagged(4) == {CHEAT.peer_id: "banned"}


def test_embedded_commitments_are_read_only_from_a_well_formed_result() -> None:
    used = _commit(CHEAT, {1: D2})
    two = [OTHER.peer_id, CHEAT.peer_id]
    assert result_commit(_result(OTHER, two, [D1, D2], commits=[b"", used]), CHEAT.peer_id) == (
        used
    )
    assert result_commit(_result(OTHER, two, [D1, D2]), CHEAT.peer_id) is None  # none held
    assert result_commit(_result(OTHER, two, [D1, D2], commits=[used]), CHEAT.peer_id) is None
    assert result_commit(_result(OTHER, two, [D1, D2], commits=[b"", b""]), CHEAT.peer_id) is None
    assert result_commit(b"junk", CHEAT.peer_id) is None


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

    plane = make_plane(_Transport(flaky))
    plane.resize(4 * plane.settings.base_rate_peers)
    asyncio.run(plane.commitments._send_one(OTHER.peer_id, b"wire"))
    assert calls == [OTHER.peer_id, OTHER.peer_id]
    calls.clear()
    plane.resize(1)  # with gossip, the gossip copy is the fallback: one try
    asyncio.run(plane.commitments._send_one(OTHER.peer_id, b"wire"))
    assert calls == [OTHER.peer_id]


def test_silence_warns_only_after_the_grace_period_and_stops_when_heard(plane) -> None:
    live = {OTHER.peer_id}
    assert plane.silence(set(), now=0.0) is None  # nobody to hear
    assert plane.silence(live, now=100.0) is None  # quiet, but only just
    text = plane.silence(live, now=100.0 + SILENCE_GRACE_SECONDS + 1)
    assert text is not None and "hears none of the 1 live peers" in text
    assert "uncommitted" in text and "control.port" in text
    _deliver(plane, "heartbeat", _signed(OTHER, "heartbeat", {"round": 1, "step": 2}))
    assert plane.silence(live, now=200.0) is None  # heard: no warning, and the clock resets
    assert plane.silence({CHEAT.peer_id}, now=201.0) is None  # a new silence starts again
    assert plane.silence({CHEAT.peer_id}, now=201.0 + SILENCE_GRACE_SECONDS + 1) is not None


def test_heartbeats_carry_reachability_and_spec(plane) -> None:
    body = {"round": 1, "step": 2, "reachable": False, "spec": "ab" * 32}
    _deliver(plane, "heartbeat", _signed(OTHER, "heartbeat", body))
    seen = plane.swarm()["peers"][OTHER.peer_id]
    assert seen["reachable"] is False and seen["spec"] == "ab" * 32


def test_a_bad_owner_verdict_for_a_part_of_ten_million_values_fits_one_control_message(
    plane: ControlPlane,
) -> None:
    # the verdict carries the owner's signed head (a hash per MiB of body), never the
    # body: 40 MB of float32 values make about 1.5 KB of evidence
    import torch

    from protocol.wire.messages import Header
    from protocol.wire.partwire import open_part, seal_part

    wire = _own_commit(plane, {1: D1})
    body = torch.zeros(10_000_000).numpy().view("uint8")
    meta = {
        "content": "update",
        "contributors": [CHEAT.peer_id, ME.peer_id],
        "digests": [D2, D2],
        "weights": [1.0, 1.0],
    }
    sealed = seal_part(CHEAT, Header("reduced", RUN, 3, 0, 1, CHEAT.peer_id), meta, body)
    evidence = open_part(
        sealed.buffers()[0] + sealed.head + sealed.signature + body.tobytes(), max_bytes=2**27
    ).evidence()
    verdict = _signed(
        ME,
        "verdict",
        {
            "accused": CHEAT.peer_id,
            "kind": "bad_owner",
            "evidence": {"reduced": evidence, "commit": wire},
        },
    )
    assert len(evidence) < 4096
    assert len(verdict) < ControlConfig().max_message_kb * 1024
    # and whoever receives it can check it
    received = open_control(verdict, RUN, topic_name(RUN, "verdict")).body["evidence"]
    assert check_verdict("bad_owner", received, CHEAT.peer_id, RUN) == (3, 0)
    assert check_verdict(
        "bad_owner", {"reduced": evidence, "commit": wire}, CHEAT.peer_id, RUN
    ) == (3, 0)


def test_a_bad_owner_verdict_works_alike_for_a_result_streamed_back(plane: ControlPlane) -> None:
    # a result streamed back names its contributors in its signed trailer: head, signature
    # and trailer are the evidence, kilobytes for 10M values
    import torch

    from protocol.wire.messages import Header
    from protocol.wire.partwire import Part, chunk_hashes, seal_stream_head, seal_trailer

    wire = _own_commit(plane, {1: D1})
    body = torch.zeros(10_000_000).numpy().view("uint8")
    header = Header("reduced", RUN, 3, 0, 1, CHEAT.peer_id)
    head = seal_stream_head(CHEAT, header, {"content": "update"}, body.nbytes)
    signed = {"contributors": [CHEAT.peer_id, ME.peer_id], "digests": [D2, D2], "weights": [1, 1]}
    trailer = seal_trailer(CHEAT, head, signed, chunk_hashes(body))
    part = Part(header, {}, memoryview(body), head.head, head.signature, head.digest, trailer)
    evidence = part.evidence()
    assert len(evidence) < 4096
    assert check_verdict(
        "bad_owner", {"reduced": evidence, "commit": wire}, CHEAT.peer_id, RUN
    ) == (3, 0)
    # the same trailer behind another head, or one byte of it changed, proves nothing
    flipped = bytearray(evidence)
    flipped[-10] ^= 0x01
    with pytest.raises(ProtocolError, match="bad_evidence"):
        check_verdict("bad_owner", {"reduced": bytes(flipped), "commit": wire}, CHEAT.peer_id, RUN)


def test_the_two_exchanges_of_a_fragment_are_committed_apart(plane: ControlPlane) -> None:
    # a member commits to its update parts and to its global-copy parts of one fragment:
    # two commitments, no equivocation, and each part is checked against its own
    _deliver(plane, "commit", _commit(OTHER, {0: D1}))
    _deliver(plane, "commit", _commit(OTHER, {0: D2}, seq=2, content="weights"))
    assert plane.verifier.flagged(4) == {}
    closed = time.monotonic() + 10
    assert _check(plane, OTHER.peer_id, 3, 0, 0, D1, closed, "update") is None
    assert _check(plane, OTHER.peer_id, 3, 0, 0, D2, closed, "weights") is None
    assert _check(plane, OTHER.peer_id, 3, 0, 0, D2, closed, "update") == "commit_mismatch"
    assert plane.commitments.committed(OTHER.peer_id, 3, 0, "weights")
    assert not plane.commitments.committed(CHEAT.peer_id, 3, 0, "weights")
    with pytest.raises(ProtocolError, match="different exchanges"):
        check_verdict(
            "equivocation",
            [_commit(OTHER, {0: D1}), _commit(OTHER, {0: D2}, seq=2, content="weights")],
            OTHER.peer_id,
            RUN,
        )


@pytest.mark.parametrize("content", [None, "gradients", 1])
def test_a_commitment_must_say_what_it_commits_to(plane: ControlPlane, content) -> None:
    body = {"round": 3, "fragment": 0, "digests": [[0, D1]]}
    if content is not None:
        body["content"] = content
    _deliver(plane, "commit", _signed(OTHER, "commit", body))
    assert plane.counters["malformed"] == 1
    assert not plane.commitments.committed(OTHER.peer_id, 3, 0)


def test_bad_owner_evidence_must_be_about_the_committed_content(plane: ControlPlane) -> None:
    wire = _own_commit(plane, {1: D1})  # an update commitment
    weights = _result(CHEAT, [CHEAT.peer_id, ME.peer_id], [D2, D2], content="weights")
    with pytest.raises(ProtocolError, match="another exchange"):
        check_verdict("bad_owner", {"reduced": weights, "commit": wire}, CHEAT.peer_id, RUN)


def test_heartbeats_and_the_commit_phase_stretch_in_a_large_swarm(plane: ControlPlane) -> None:
    cfg = plane.settings
    for nodes in (1, 4, cfg.base_rate_peers):  # small swarms: exactly the base pace
        plane.resize(nodes)
        assert plane.pace.heartbeat_interval == cfg.heartbeat_seconds
        assert plane.commit_window == cfg.commit_seconds
    plane.resize(4 * cfg.base_rate_peers)
    assert plane.pace.heartbeat_interval == 4 * cfg.heartbeat_seconds
    assert plane.commit_window == 4 * cfg.commit_seconds


def test_a_commitment_sent_directly_counts_and_its_gossip_copy_is_no_equivocation(
    plane: ControlPlane,
) -> None:
    wire = _commit(OTHER, {0: D1})
    asyncio.run(plane.commitments.receive_commit(OTHER.peer_id, wire))
    assert plane.commitments.committed(OTHER.peer_id, 3, 0)
    _deliver(plane, "commit", wire)  # the same message, later, by gossip
    assert plane.verifier.flagged(4) == {}
    assert _check(plane, OTHER.peer_id, 3, 0, 0, D1, time.monotonic() + 1) is None


def test_a_commitment_sent_directly_must_be_signed_by_the_caller(plane: ControlPlane) -> None:
    with pytest.raises(ProtocolError, match="sender_mismatch"):
        asyncio.run(plane.commitments.receive_commit(CHEAT.peer_id, _commit(OTHER, {0: D1})))
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

    plane = make_plane(_Transport(send))
    plane.channel = Channel()  # type: ignore[assignment]

    async def commit() -> None:
        await plane.commitments.commit(3, 0, [ME.peer_id, OTHER.peer_id, CHEAT.peer_id], {0: D1})
        await asyncio.sleep(0)  # the sends run in the background

    asyncio.run(commit())
    plane.channel = None
    assert sorted(p for p, _ in sent) == sorted([OTHER.peer_id, CHEAT.peer_id])
    msg = open_control(sent[0][1], RUN, topic_name(RUN, "commit"))
    assert msg.sender == ME.peer_id and msg.body["digests"] == [[0, D1]]


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
