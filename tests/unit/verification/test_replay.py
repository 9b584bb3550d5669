"""Replay checks' rules: sketches the same on every node, traces and replay records that
authenticate and refuse what is malformed, oversized or forged, windows that must tile
a claim, the distance of a replay from its record, and how failed replays flag a peer."""

from __future__ import annotations

import math

import msgpack
import pytest
import torch

from verification.identity import Identity
from verification.replay import (
    ReplayRecord,
    agreement,
    drawn_window,
    is_replay_record,
    open_replay_record,
)
from verification.sketch import SKETCH_SIZE, Sketcher
from verification.traces import (
    MAX_REPLAY_BYTES,
    ReplayError,
    Trace,
    TraceWindow,
    covers,
    open_trace,
)
from verification.workscores import Scores

A, B, C, D = (Identity.from_seed(bytes([k]) * 32) for k in (11, 12, 13, 14))


def _window(stream: int = 3, start: int = 0, steps: int = 2, change: float = 1.0) -> TraceWindow:
    return TraceWindow(
        stream,
        start,
        steps,
        1,
        10 + start,
        f"{start:064x}",
        (2.0,) * steps,
        (change,) * SKETCH_SIZE,
    )


def _trace(windows=None, spans=((3, 0, 4),), who: Identity = A) -> Trace:
    windows = windows if windows is not None else (_window(), _window(start=2))
    return Trace(who.peer_id, "run", 3, 1, tuple(windows), spans, (1, 0, 1, 8)).signed(who)


def test_a_sketch_is_linear_and_the_same_for_the_same_run() -> None:
    torch.manual_seed(0)
    x = [torch.randn(5, 7), torch.randn(300)]
    y = [torch.randn(5, 7), torch.randn(300)]
    one, two = Sketcher("run"), Sketcher("run")
    assert torch.equal(one.sketch(x), two.sketch(x))
    both = one.sketch([a + b for a, b in zip(x, y)])
    assert torch.allclose(both, one.sketch(x) + one.sketch(y), atol=1e-5)  # x + y in fp32
    assert not torch.allclose(Sketcher("other").sketch(x), one.sketch(x))
    # norms are kept on average (a CountSketch): a change's size shows
    assert 0.5 < float(one.sketch(y).norm() / torch.cat([t.reshape(-1) for t in y]).norm()) < 2


def test_a_trace_round_trips_and_refuses_what_is_forged_or_malformed() -> None:
    trace = _trace()
    opened = open_trace(trace.to_bytes(), "run", A.peer_id)
    assert opened == trace and opened.digest == trace.digest
    with pytest.raises(ReplayError, match="wrong_run"):
        open_trace(trace.to_bytes(), "other")
    with pytest.raises(ReplayError, match="wrong_peer"):
        open_trace(trace.to_bytes(), "run", B.peer_id)
    with pytest.raises(ValueError, match="signed by its member"):
        Trace(A.peer_id, "run", 3, 1, ()).signed(B)  # B cannot sign as A
    body, signature = msgpack.unpackb(trace.to_bytes(), raw=False)
    tampered = msgpack.packb([body.replace(b"run", b"run", 1), B.sign(b"x" * 32)])
    with pytest.raises(ReplayError, match="bad_signature"):
        open_trace(tampered, "run")
    for bad in (b"\x00", msgpack.packb([1, 2]), msgpack.packb([msgpack.packb({"v": 1}), b""])):
        with pytest.raises(ReplayError, match="malformed"):
            open_trace(bad, "run")
    with pytest.raises(ReplayError, match="oversized"):
        open_trace(b"\x00" * (MAX_REPLAY_BYTES + 1), "run")
    nan = TraceWindow(3, 0, 1, 1, 0, "a" * 64, (math.nan,), (0.0,) * SKETCH_SIZE)
    with pytest.raises(ReplayError, match="finite"):
        open_trace(_trace((nan,), ((3, 0, 1),)).to_bytes(), "run")
    short = TraceWindow(3, 0, 1, 1, 0, "a" * 64, (1.0,), (0.0,) * 3)
    with pytest.raises(ReplayError, match="full sketch"):
        open_trace(_trace((short,), ((3, 0, 1),)).to_bytes(), "run")


def test_windows_must_tile_the_claimed_batches_exactly() -> None:
    w = [_window(start=0), _window(start=2)]
    assert covers(w, [(3, 0, 4)])
    assert covers(w, [(3, 0, 2), (3, 2, 2)])
    assert not covers(w, [(3, 0, 5)])  # a claimed batch no window trained
    assert not covers(w[:1], [(3, 0, 4)])
    assert not covers([*w, _window(start=1)], [(3, 0, 4)])  # overlapping windows
    assert not covers(w, [(4, 0, 4)])  # another round's stream
    assert covers([_window(stream=2, start=6), _window(stream=3)], [(2, 6, 2), (3, 0, 2)])


def test_the_window_drawn_depends_on_the_seed_and_the_checker() -> None:
    drawn = {drawn_window(bytes([s]) * 32, A.peer_id, 10) for s in range(40)}
    assert len(drawn) > 5 and drawn <= set(range(10))
    assert drawn_window(b"s" * 32, A.peer_id, 10) == drawn_window(b"s" * 32, A.peer_id, 10)


def test_agreement_is_relative_to_the_recorded_change() -> None:
    w = _window(change=1.0)
    assert agreement(w, [1.0] * SKETCH_SIZE, [2.0, 2.0]) == (0.0, 0.0)
    distance, loss = agreement(w, [1.01] * SKETCH_SIZE, [2.0, 2.02])
    assert distance == pytest.approx(0.01) and loss == pytest.approx(0.01)
    # a window recorded as no change at all, where training moves: infinitely far
    still = _window(change=0.0)
    assert agreement(still, [0.1] * SKETCH_SIZE, [2.0, 2.0])[0] == math.inf
    assert agreement(still, [0.0] * SKETCH_SIZE, [2.0, 2.0])[0] == 0.0


def test_a_replay_record_carries_its_evidence_and_is_told_from_a_check_record() -> None:
    trace = _trace()
    record = ReplayRecord(
        B.peer_id, A.peer_id, 3, 1, trace.to_bytes(), 1, False, math.inf, 0.5, "skipped"
    ).signed(B)
    data = record.to_bytes()
    assert is_replay_record(data) and not is_replay_record(msgpack.packb([b"body", b"sig"]))
    opened = open_replay_record(data, "run")
    assert opened.proof and opened.distance == math.inf and opened.opened == trace
    assert (opened.checker, opened.peer, opened.round, opened.fragment) == (
        B.peer_id,
        A.peer_id,
        3,
        1,
    )
    word = ReplayRecord(B.peer_id, A.peer_id, 3, 1, b"", 0, False, why="no trace").signed(B)
    assert not open_replay_record(word.to_bytes(), "run").proof
    with pytest.raises(ValueError):
        record.signed(C)  # only its checker signs it
    # a record about another exchange than its trace's, or a window it does not hold
    other = ReplayRecord(B.peer_id, A.peer_id, 4, 1, trace.to_bytes(), 0, False).signed(B)
    with pytest.raises(ReplayError, match="another exchange"):
        open_replay_record(other.to_bytes(), "run")
    beyond = ReplayRecord(B.peer_id, A.peer_id, 3, 1, trace.to_bytes(), 2, False).signed(B)
    with pytest.raises(ReplayError, match="window 2"):
        open_replay_record(beyond.to_bytes(), "run")
    tag, body, signature = msgpack.unpackb(data, raw=False)
    with pytest.raises(ReplayError, match="bad_signature"):
        open_replay_record(msgpack.packb([tag, body, C.sign(b"x")]), "run")
    with pytest.raises(ReplayError, match="malformed"):
        open_replay_record(msgpack.packb(["replay", b"\x00", b""]), "run")


def test_a_proven_failure_flags_at_once_and_word_needs_two_checkers() -> None:
    scores = Scores(4, 0.5, 0.7, rounds=3)
    assert not scores.replay_failed(A.peer_id, B.peer_id, 3, proven=False)
    assert A.peer_id not in scores.flagged() and scores.factor(A.peer_id) == 1.0
    assert scores.replay_failed(A.peer_id, C.peer_id, 3, proven=False)  # a second checker
    assert A.peer_id in scores.flagged() and scores.factor(A.peer_id) == 0.0
    assert scores.score(A.peer_id)["flagged"] and scores.score(A.peer_id)["replays_failed"] == 2
    # words far apart in rounds do not add up
    assert not scores.replay_failed(B.peer_id, C.peer_id, 3, proven=False)
    assert not scores.replay_failed(B.peer_id, D.peer_id, 9, proven=False)
    assert not scores.proven(D.peer_id)
    assert scores.replay_failed(D.peer_id, B.peer_id, 5, proven=True)
    assert scores.proven(D.peer_id) and D.peer_id in scores.all()
