"""Useful-work records: the assignment seed, who checks whom, which batches, signed
records and their forgeries, reproduction within the tolerance, and per-peer scores."""

from __future__ import annotations

import dataclasses
import hashlib

import msgpack
import pytest
import torch

from verification.identity import Identity
from verification.usefulness import (
    LOSS_RTOL,
    CheckRecord,
    RecordError,
    Scores,
    assignment_seed,
    batch_plan,
    checkers_for,
    contribution_digest,
    open_record,
    passes,
    reproduces,
    wilson_upper,
)

CHECKER = Identity.from_seed(b"c" * 32)
PEERS = [f"peer{i}" for i in range(6)]


def _record(**changes) -> CheckRecord:
    fields = dict(
        checker=CHECKER.peer_id,
        peer="peer1",
        run="run",
        round=4,
        fragment=0,
        contribution="ab" * 32,
        global_digest="cd" * 32,
        seed="ef" * 32,
        claimed=12,
        assigned=(3.0, 2.5),
        validation=(3.1, 2.9),
    )
    fields.update(changes)
    return CheckRecord(**fields)


def _digest(values: torch.Tensor) -> str:
    return hashlib.sha256(values.numpy().tobytes()).hexdigest()


def test_the_seed_follows_the_committed_parts_and_every_node_computes_the_same() -> None:
    """The seed hashes the global the round's reduction produced: it exists only once
    every committed part was reduced, and a part changed after the commit phase (a
    different reduction) gives another seed. Members compute it alike, in any order."""
    parts = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, -1.0]), torch.tensor([0.5, 0.5])]
    reduced = torch.stack(parts).mean(0)
    seed = assignment_seed("run", 3, 0, _digest(reduced), PEERS[:3])
    assert seed == assignment_seed("run", 3, 0, _digest(reduced), list(reversed(PEERS[:3])))
    changed = [parts[0], torch.tensor([3.0, -0.9]), parts[2]]  # one part swapped afterwards
    other = assignment_seed("run", 3, 0, _digest(torch.stack(changed).mean(0)), PEERS[:3])
    assert other != seed
    assert assignment_seed("run", 4, 0, _digest(reduced), PEERS[:3]) != seed
    assert assignment_seed("run", 3, 0, _digest(reduced), PEERS[:2]) != seed


def test_checkers_are_others_drawn_by_the_seed() -> None:
    seed = assignment_seed("run", 1, 0, "00", PEERS)
    drawn = checkers_for(seed, "peer2", PEERS, 2)
    assert len(drawn) == 2 and "peer2" not in drawn and set(drawn) <= set(PEERS)
    assert checkers_for(seed, "peer2", list(reversed(PEERS)), 2) == drawn
    assert checkers_for(seed, "peer0", ["peer0", "peer1"], 3) == ["peer1"]
    seeds = [assignment_seed("run", r, 0, "00", PEERS) for r in range(40)]
    assert len({tuple(checkers_for(s, "peer2", PEERS, 2)) for s in seeds}) > 3


def test_batch_plans_are_distinct_in_range_and_reproducible() -> None:
    seed = assignment_seed("run", 2, 1, "11", PEERS)
    assigned, val = batch_plan(seed, "peer3", "peer1", claimed=40, count=3, val_batches=4)
    assert assigned == sorted(set(assigned)) and len(assigned) == 3
    assert all(0 <= i < 40 for i in assigned) and all(0 <= i < 4 for i in val)
    assert (assigned, val) == batch_plan(seed, "peer3", "peer1", 40, 3, 4)
    # another checker draws its own sample
    assert batch_plan(seed, "peer3", "peer2", 40, 3, 4)[0] != assigned
    assert batch_plan(seed, "peer3", "peer1", claimed=1, count=3, val_batches=2) == ([0], [0, 1])


def test_a_signed_record_opens_and_every_forgery_is_refused() -> None:
    record = _record().signed(CHECKER)
    assert open_record(record.to_bytes(), "run") == record
    with pytest.raises(RecordError, match="wrong_run"):
        open_record(record.to_bytes(), "other")
    # losses edited after signing
    body = msgpack.unpackb(record.body())
    body["validation"] = [3.1, 1.0]
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
        b"\x00" * 5000,
        b"not msgpack",
        msgpack.packb([b"x", b"y"]),
        msgpack.packb([msgpack.packb({"v": 2}), b"s"]),
    ],
)
def test_malformed_records_are_refused(data: bytes) -> None:
    with pytest.raises(RecordError):
        open_record(data, "run")


@pytest.mark.parametrize(
    "change",
    [
        {"validation": [float("nan"), 1.0]},
        {"assigned": [1.0]},
        {"round": -1},
        {"checker": "x" * 200},
        {"extra": 1},
    ],
)
def test_records_with_bad_fields_are_refused(change: dict) -> None:
    body = msgpack.unpackb(_record().body())
    body.update(change)
    packed = msgpack.packb(body)
    data = msgpack.packb(
        [packed, CHECKER.sign(b"atoll/check/v1\0" + hashlib.sha256(packed).digest())]
    )
    with pytest.raises(RecordError, match="malformed"):
        open_record(data, "run")


def test_reproduction_holds_within_the_tolerance_and_not_beyond() -> None:
    record = _record()
    near = _record(validation=(3.1 * (1 + LOSS_RTOL / 10), 2.9))
    far = _record(validation=(3.1, 2.9 * (1 + 10 * LOSS_RTOL)))
    assert reproduces(record, near) and not reproduces(record, far)
    assert not reproduces(record, _record(seed="00" * 32))
    assert not reproduces(record, _record(contribution="00" * 32))
    assert not reproduces(record, _record(assigned=None))


def test_a_record_passes_when_the_assigned_gain_beats_validation_and_is_positive() -> None:
    assert passes(_record(assigned=(3.0, 2.5), validation=(3.1, 2.9)))[0]
    # late honest update: validation a hair worse, assigned still better
    assert passes(_record(assigned=(2.0, 1.98), validation=(2.0, 2.001)))[0]
    zero = passes(_record(assigned=(3.0, 3.0), validation=(3.1, 3.1)))
    assert not zero[0] and "+0.0000" in zero[1]
    assert not passes(_record(assigned=(3.0, 2.9), validation=(3.1, 2.9)))[0]  # copied
    assert not passes(_record(assigned=(3.0, 5.0), validation=(3.1, 5.0)))[0]  # garbage
    assert passes(_record(assigned=None, validation=(3.1, 3.0)))[0]
    assert not passes(_record(assigned=None, validation=(3.1, 3.2)))[0]


def test_wilson_upper_bound_hand_values() -> None:
    # p = 0: z^2 / (n + z^2) with z = 1.645
    assert wilson_upper(0, 4) == pytest.approx(1.645**2 / (4 + 1.645**2))
    assert wilson_upper(0, 0) == 1.0 and wilson_upper(5, 5) == pytest.approx(1.0)
    assert wilson_upper(2, 4) > 0.5 > wilson_upper(0, 4)


def test_scores_flag_a_peer_whose_records_keep_failing_and_count_each_record_once() -> None:
    scores = Scores(min_records=4, pass_rate=0.5)
    bad = dict(assigned=(3.0, 3.0), validation=(3.1, 3.1))
    for r in range(3):
        scores.add(_record(round=r, **bad))
    assert not scores.score("peer1")["flagged"]  # three records are not enough
    scores.add(_record(round=2, **bad))  # the same record again counts once
    assert scores.score("peer1")["records"] == 3
    scores.add(_record(round=3, **bad))
    assert scores.flagged() == {"peer1"}
    assert "assigned data" in scores.score("peer1")["last_failure"]
    # an honest peer that failed its first two checks is not flagged
    for r in range(6):
        ok = r >= 2
        scores.add(_record(peer="peer2", round=r, **({} if ok else bad)))
    assert not scores.score("peer2")["flagged"]


def test_contribution_digest_follows_every_part_in_order() -> None:
    a, b = b"a" * 32, b"b" * 32
    assert contribution_digest([a, b]) != contribution_digest([b, a])
    assert contribution_digest([a, b]) == contribution_digest([a, b])
