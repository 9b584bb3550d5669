"""Useful-work records: the round's base and the exchange's seed, who checks whom on which
fragment and windows, signed records and their forgeries, and reproduction within the
tolerance."""

from __future__ import annotations

import dataclasses
import hashlib

import msgpack
import pytest
import torch

from verification.identity import Identity
from verification.usefulness import (
    LOSS_RTOL,
    MAX_RECORD_BYTES,
    CheckRecord,
    RecordError,
    assignment_seed,
    checkers_for,
    contribution_digest,
    fragment_digest,
    fragments_checked,
    open_record,
    reproduces,
    round_base_digest,
    window_plan,
)

CHECKER = Identity.from_seed(b"c" * 32)
PEERS = [f"peer{i}" for i in range(6)]


def _record(**changes) -> CheckRecord:
    fields = dict(
        checker=CHECKER.peer_id,
        peer="peer1",
        run="run",
        round=4,
        fragment=1,
        contribution="ab" * 32,
        reference="ba" * 32,
        base="cd" * 32,
        result="dc" * 32,
        seed="ef" * 32,
        claimed=24,
        reference_claimed=20,
        assigned=((3.0, 2.5), (3.2, 2.6)),
        reference_assigned=((2.9, 2.4),),
        control=((3.1, 2.9, 3.1, 2.95), (3.3, 3.2, 3.3, 3.1)),
    )
    fields.update(changes)
    return CheckRecord(**fields)


def _signed_body(body: dict) -> bytes:
    packed = msgpack.packb(body)
    signature = CHECKER.sign(b"atoll/check/v2\0" + hashlib.sha256(packed).digest())
    return msgpack.packb([packed, signature])


def test_the_round_base_and_the_seed_follow_every_shared_value_in_any_order() -> None:
    """The seed hashes the round's base and the exchange's reduced result: no one knows
    it before the commit phase closed and the parts were reduced, every member computes
    the same one after, whatever order it lists the contributors in."""
    values = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, -1.0])]
    digests = [fragment_digest(v) for v in values]
    base = round_base_digest(digests)
    assert fragment_digest(values[0].clone()) == digests[0]
    assert fragment_digest(torch.tensor([1.0, 2.0000002])) != digests[0]
    assert round_base_digest(list(reversed(digests))) != base
    seed = assignment_seed("run", 3, 0, base, "r1", PEERS[:3])
    assert seed == assignment_seed("run", 3, 0, base, "r1", list(reversed(PEERS[:3])))
    for other in (
        assignment_seed("run", 3, 0, base, "r2", PEERS[:3]),  # another reduction
        assignment_seed("run", 3, 0, "00" * 32, "r1", PEERS[:3]),  # another base
        assignment_seed("run", 4, 0, base, "r1", PEERS[:3]),
        assignment_seed("run", 3, 1, base, "r1", PEERS[:3]),
        assignment_seed("run", 3, 0, base, "r1", PEERS[:2]),
        assignment_seed("other", 3, 0, base, "r1", PEERS[:3]),
    ):
        assert other != seed


def test_checkers_are_others_drawn_by_the_seed() -> None:
    seed = assignment_seed("run", 1, 0, "00", "r", PEERS)
    drawn = checkers_for(seed, "peer2", PEERS, 2)
    assert len(drawn) == 2 and "peer2" not in drawn and set(drawn) <= set(PEERS)
    assert checkers_for(seed, "peer2", list(reversed(PEERS)), 2) == drawn
    assert checkers_for(seed, "peer0", ["peer0", "peer1"], 3) == ["peer1"]
    seeds = [assignment_seed("run", r, 0, "00", "r", PEERS) for r in range(40)]
    assert len({tuple(checkers_for(s, "peer2", PEERS, 2)) for s in seeds}) > 3


def test_the_fragments_checked_are_drawn_from_the_round_base_per_peer() -> None:
    assert fragments_checked("b", 3, "peer1", 4, 4) == {0, 1, 2, 3}
    assert fragments_checked("b", 3, "peer1", 2, 7) == {0, 1}
    one = fragments_checked("b", 3, "peer1", 4, 1)
    assert len(one) == 1 and one == fragments_checked("b", 3, "peer1", 4, 1)
    assert len(fragments_checked("b", 3, "peer1", 4, 2)) == 2
    drawn = {frozenset(fragments_checked(f"b{k}", 3, "peer1", 4, 1)) for k in range(40)}
    assert len(drawn) == 4  # every fragment is checked some round
    peers = {frozenset(fragments_checked("b", 3, p, 4, 1)) for p in PEERS}
    assert len(peers) > 1


def test_window_plans_take_one_window_of_distinct_batches_reproducibly() -> None:
    seed = assignment_seed("run", 2, 1, "11", "r", PEERS)
    plan = window_plan(seed, "peer3", "peer1", claimed=40, batch=8, count=6)
    batches = [b for b, _ in plan]
    assert len(plan) == 6 and batches == sorted(set(batches))
    assert all(0 <= b < 40 and 0 <= w < 8 for b, w in plan)
    assert plan == window_plan(seed, "peer3", "peer1", 40, 8, 6)
    assert window_plan(seed, "peer3", "peer2", 40, 8, 6) != plan  # each checker its own
    assert [b for b, _ in window_plan(seed, "peer3", "peer1", 3, 8, 6)] == [0, 1, 2]
    assert window_plan(seed, "peer3", "peer1", 0, 8, 6) == []


def test_a_signed_record_opens_and_every_forgery_is_refused() -> None:
    record = _record().signed(CHECKER)
    assert open_record(record.to_bytes(), "run") == record
    with pytest.raises(RecordError, match="wrong_run"):
        open_record(record.to_bytes(), "other")
    # losses edited after signing
    body = msgpack.unpackb(record.body())
    body["control"][0] = [3.1, 1.0, 3.1, 2.95]
    forged = msgpack.packb([msgpack.packb(body), record.signature])
    with pytest.raises(RecordError, match="bad_signature"):
        open_record(forged, "run")
    # signed by someone else under the checker's name
    other = Identity.from_seed(b"o" * 32)
    stolen = dataclasses.replace(record, signature=other.sign(b"x"))
    with pytest.raises(RecordError, match="bad_signature"):
        open_record(stolen.to_bytes(), "run")
    with pytest.raises(ValueError):
        _record().signed(other)


@pytest.mark.parametrize(
    "data",
    [
        b"\x00" * (MAX_RECORD_BYTES + 1),
        b"not msgpack",
        msgpack.packb([b"x", b"y"]),
        msgpack.packb([msgpack.packb({"v": 1}), b"s"]),  # the version before
    ],
)
def test_malformed_records_are_refused(data: bytes) -> None:
    with pytest.raises(RecordError):
        open_record(data, "run")


@pytest.mark.parametrize(
    "change",
    [
        {"control": [[float("nan"), 1.0, 1.0, 1.0]]},
        {"control": [[1.0, 1.0, 1.0]]},  # not four losses
        {"control": []},  # no control window
        {"assigned": [[1.0, 2.0, 3.0]]},
        {"reference_assigned": [[True, 1.0]]},
        {"assigned": [[1.0, 1.0]] * 129},
        {"round": -1},
        {"claimed": True},
        {"checker": "x" * 200},
        {"extra": 1},
    ],
)
def test_records_with_bad_fields_are_refused(change: dict) -> None:
    body = msgpack.unpackb(_record().body())
    body.update(change)
    with pytest.raises(RecordError, match="malformed"):
        open_record(_signed_body(body), "run")


def test_reproduction_holds_within_the_tolerance_and_not_beyond() -> None:
    record = _record()
    near = _record(control=((3.1 * (1 + LOSS_RTOL / 10), 2.9, 3.1, 2.95), (3.3, 3.2, 3.3, 3.1)))
    far = _record(control=((3.1, 2.9 * (1 + 10 * LOSS_RTOL), 3.1, 2.95), (3.3, 3.2, 3.3, 3.1)))
    assert reproduces(record, near) and not reproduces(record, far)
    for changes in (
        {"seed": "00" * 32},
        {"contribution": "00" * 32},
        {"reference": "00" * 32},
        {"base": "00" * 32},
        {"claimed": 25},
        {"assigned": ()},
        {"reference_assigned": ((2.9, 2.5),)},
    ):
        assert not reproduces(record, _record(**changes)), changes


def test_contribution_digest_follows_every_part_in_order() -> None:
    a, b = b"a" * 32, b"b" * 32
    assert contribution_digest([a, b]) != contribution_digest([b, a])
    assert contribution_digest([a, b]) == contribution_digest([a, b])
