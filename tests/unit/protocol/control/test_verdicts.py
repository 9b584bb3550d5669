"""Verdicts: evidence of equivocation and of a bad owner, checked as every receiver checks it."""

from __future__ import annotations

import pytest
import torch

from node.config import ControlConfig
from protocol.control.frames import open_control, topic_name
from protocol.control.plane import ControlPlane
from protocol.control.verdicts import check_verdict, result_commit
from protocol.errors import ProtocolError
from protocol.wire.messages import Header
from protocol.wire.partwire import (
    Part,
    chunk_hashes,
    open_part,
    seal_part,
    seal_stream_head,
    seal_trailer,
)
from tests.unit.protocol.control._plane import (
    CHEAT,
    D1,
    D2,
    ME,
    OTHER,
    RUN,
    commitment,
    deliver,
    own_commitment,
    result_evidence,
    signed_message,
)


def test_equivocation_evidence_checks_out() -> None:
    assert check_verdict(
        "equivocation",
        [commitment(CHEAT, {0: D1}), commitment(CHEAT, {0: D2}, seq=2)],
        CHEAT.peer_id,
        RUN,
    ) == (3, 0)


@pytest.mark.parametrize(
    ("evidence", "why"),
    [
        ([commitment(CHEAT, {0: D1}), commitment(CHEAT, {0: D1}, seq=2)], "agree"),
        ([commitment(CHEAT, {0: D1}), commitment(OTHER, {0: D2})], "not signed by the accused"),
        ([commitment(CHEAT, {0: D1}), commitment(CHEAT, {0: D2}, round_=4)], "different exchanges"),
        ([commitment(CHEAT, {0: D1})], "exactly two"),
        ([commitment(CHEAT, {0: D1}), b"\x93garbage"], "malformed"),
        ([commitment(CHEAT, {0: D1}), signed_message(CHEAT, "heartbeat", {})], "wrong_topic"),
        ("not a list", "exactly two"),
    ],
)
def test_evidence_that_does_not_prove_equivocation_is_refused(evidence, why: str) -> None:
    with pytest.raises(ProtocolError, match=why) as info:
        check_verdict("equivocation", evidence, CHEAT.peer_id, RUN)
    assert info.value.reason == "bad_evidence"


def test_a_valid_verdict_bans_the_accused_and_a_forged_one_costs_nothing(
    plane: ControlPlane,
) -> None:
    forged = {
        "accused": OTHER.peer_id,
        "kind": "equivocation",
        "evidence": [commitment(CHEAT, {0: D1}), commitment(CHEAT, {0: D2}, seq=2)],
    }
    deliver(plane, "verdict", signed_message(CHEAT, "verdict", forged))
    assert plane.counters["forged_verdicts"] == 1
    assert plane.verifier.reputations() == {}  # the accused lost nothing
    real = dict(forged, accused=CHEAT.peer_id)
    deliver(plane, "verdict", signed_message(OTHER, "verdict", real, seq=5))
    assert plane.verifier.flagged(4) == {CHEAT.peer_id: "banned"}
    assert plane.counters["forged_verdicts"] == 1


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (
            lambda w: {
                "reduced": result_evidence(CHEAT, [CHEAT.peer_id, ME.peer_id], [D2, D1]),
                "commit": w,
            },
            "matches",
        ),
        (
            lambda w: {
                "reduced": result_evidence(OTHER, [OTHER.peer_id, ME.peer_id], [D2, D2]),
                "commit": w,
            },
            "sender_mismatch",
        ),
        (
            lambda w: {"reduced": result_evidence(CHEAT, [CHEAT.peer_id], [D2]), "commit": w},
            "does not name",
        ),
        (
            lambda w: {
                "reduced": result_evidence(CHEAT, [CHEAT.peer_id, ME.peer_id], [D2, D2], part=2),
                "commit": w,
            },
            "another exchange or part",
        ),
        (lambda w: {"reduced": b"junk", "commit": w}, "malformed"),
        (lambda w: [w], "is a map"),
    ],
)
def test_bad_owner_evidence_that_does_not_check_out_is_refused(plane, make, why: str) -> None:
    wire = own_commitment(plane, {1: D1})
    with pytest.raises(ProtocolError, match=why) as info:
        check_verdict("bad_owner", make(wire), CHEAT.peer_id, RUN)
    assert info.value.reason == "bad_evidence"


def test_an_equivocator_cannot_frame_an_honest_owner(plane: ControlPlane) -> None:
    # the cheat committed D2 (what the owner saw and used) and D1 (shown as "evidence")
    deliver(plane, "commit", commitment(CHEAT, {1: D2}))
    owner = OTHER
    result = result_evidence(owner, [owner.peer_id, CHEAT.peer_id], [D1, D2])
    framing = {
        "accused": owner.peer_id,
        "kind": "bad_owner",
        "evidence": {"reduced": result, "commit": commitment(CHEAT, {1: D1}, seq=2)},
    }
    deliver(plane, "verdict", signed_message(CHEAT, "verdict", framing, seq=3))
    assert plane.verifier.flagged(4) == {CHEAT.peer_id: "banned"}  # the framer, not the owner


def test_an_owner_result_holding_the_commitment_it_used_defeats_a_framer(
    plane: ControlPlane,
) -> None:
    # A large swarm: commitments are not gossiped, so this node never saw the cheat's
    # commitment; the owner's result holds the one it relied on (D2).
    plane.resize(4 * plane.settings.base_rate_peers)
    used = commitment(CHEAT, {1: D2})
    owner = OTHER
    result = result_evidence(owner, [owner.peer_id, CHEAT.peer_id], [D1, D2], commits=[b"", used])
    framing = {
        "accused": owner.peer_id,
        "kind": "bad_owner",
        "evidence": {"reduced": result, "commit": commitment(CHEAT, {1: D1}, seq=2)},
    }
    # on its face the evidence holds (the result names D2, the commitment shown says D1)
    assert check_verdict("bad_owner", framing["evidence"], owner.peer_id, RUN) == (3, 0)
    deliver(plane, "verdict", signed_message(CHEAT, "verdict", framing, seq=3))
    assert plane.verifier.flagged(4) == {CHEAT.peer_id: "banned"}  # the framer, not the owner


def test_an_owner_whose_own_result_contradicts_the_commitment_it_holds_is_convicted(
    plane: ControlPlane,
) -> None:
    plane.resize(4 * plane.settings.base_rate_peers)
    committed = commitment(ME, {1: D1})
    # the owner holds ME's commitment to D1 and still names D2 for ME
    lying = result_evidence(CHEAT, [CHEAT.peer_id, ME.peer_id], [D2, D2], commits=[b"", committed])
    verdict = {
        "accused": CHEAT.peer_id,
        "kind": "bad_owner",
        "evidence": {"reduced": lying, "commit": committed},
    }
    deliver(plane, "verdict", signed_message(OTHER, "verdict", verdict, seq=4))
    assert plane.verifier.flagged(4) == {CHEAT.peer_id: "banned"}


def test_embedded_commitments_are_read_only_from_a_well_formed_result() -> None:
    used = commitment(CHEAT, {1: D2})
    two = [OTHER.peer_id, CHEAT.peer_id]
    assert result_commit(
        result_evidence(OTHER, two, [D1, D2], commits=[b"", used]), CHEAT.peer_id
    ) == (used)
    assert result_commit(result_evidence(OTHER, two, [D1, D2]), CHEAT.peer_id) is None  # none held
    assert (
        result_commit(result_evidence(OTHER, two, [D1, D2], commits=[used]), CHEAT.peer_id) is None
    )
    assert (
        result_commit(result_evidence(OTHER, two, [D1, D2], commits=[b"", b""]), CHEAT.peer_id)
        is None
    )
    assert result_commit(b"junk", CHEAT.peer_id) is None


def test_a_bad_owner_verdict_for_a_part_of_ten_million_values_fits_one_control_message(
    plane: ControlPlane,
) -> None:
    # the verdict carries the owner's signed head (a hash per MiB of body), never the
    # body: 40 MB of float32 values make about 1.5 KB of evidence

    wire = own_commitment(plane, {1: D1})
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
    verdict = signed_message(
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

    wire = own_commitment(plane, {1: D1})
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


def test_bad_owner_evidence_must_be_about_the_committed_content(plane: ControlPlane) -> None:
    wire = own_commitment(plane, {1: D1})  # an update commitment
    weights = result_evidence(CHEAT, [CHEAT.peer_id, ME.peer_id], [D2, D2], content="weights")
    with pytest.raises(ProtocolError, match="another exchange"):
        check_verdict("bad_owner", {"reduced": weights, "commit": wire}, CHEAT.peer_id, RUN)
