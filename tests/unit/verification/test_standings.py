"""Peers' standing: the operator's lists, the cost of violations, and when a flag counts."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from verification.identity import Identity
from verification.policy import TrustPolicy
from verification.reputation import ReputationStore
from verification.rounds import RoundClock
from verification.standings import Standings

ME, PEER, DENIED = (Identity.from_seed(bytes([i]) * 32).peer_id for i in (1, 2, 3))


class _Events:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict]] = []

    def write(self, event: str, **fields: object) -> None:
        self.lines.append((event, fields))


@pytest.fixture
def make(tmp_path: Path):
    stores: list[ReputationStore] = []

    def build(**policy) -> tuple[Standings, _Events]:
        store = ReputationStore(tmp_path / f"atoll{len(stores)}.db")
        stores.append(store)
        events = _Events()
        return Standings(
            TrustPolicy(**policy), ME, store, threading.RLock(), events, RoundClock()
        ), events

    yield build
    for store in stores:
        store.close()


def test_the_operators_lists_refuse_and_block_but_never_this_node(make) -> None:
    standings, _ = make(deny=(DENIED,))
    assert standings.refusal(DENIED, 1) == "denied" and standings.blocks(DENIED, 1) == "denied"
    assert standings.refusal(PEER, 1) is None and standings.blocks(PEER, 1) is None
    assert standings.refusal(ME, 1) is None
    assert standings.excluded([DENIED, PEER], 1) == set()  # a list gets no vote


def test_a_violation_quarantines_from_the_next_round_and_reports_it(make) -> None:
    standings, events = make(on_violation="quarantine", quarantine_rounds=3)
    standings.clock.start(4)
    standings.violation(PEER, 4, 0, "norm", "norm 9 > 3")
    assert standings.flagged(4) == {PEER: "quarantined"}
    # flagged during round 4: taken in round 4 as the others may still take it
    assert standings.refusal(PEER, 4) is None and standings.excluded([PEER], 4) == set()
    assert standings.refusal(PEER, 5) == "quarantined" and standings.excluded([PEER], 5) == {PEER}
    assert standings.blocks(PEER, 5) is None  # a quarantine refuses parts, it does not block
    assert [(e, f["reason"], f["status"]) for e, f in events.lines] == [
        ("violation", "norm", "quarantined")
    ]


def test_proof_bans_at_once_and_a_pardon_lifts_it(make) -> None:
    standings, _ = make(on_proof="ban")
    standings.convict(PEER, 2, 0, "equivocation")
    assert standings.flagged(3) == {PEER: "banned"} and standings.blocks(PEER, 3) == "banned"
    standing = standings.pardon(PEER, "operator")
    assert standing.status == "ok" and standings.refusal(PEER, 3) is None
    assert standings.reputations()[PEER]["violations"] == 1  # the record stays


def test_an_operator_ban_counts_from_the_current_round(make) -> None:
    standings, _ = make()
    standings.clock.start(7)
    assert standings.ban(PEER, "flooding").status == "banned"
    assert standings.blocks(PEER, 7) is None  # this round's groups are formed
    assert standings.blocks(PEER, 8) == "banned"


def test_an_outlier_counts_once_repeated_in_another_round_within_the_window(make) -> None:
    standings, events = make(outlier_rounds=2, outlier_window=3)
    # two fragments of one round are one outlier round
    assert not standings.outlier(PEER, 2, 0, "norm", "norm 9 > 3")
    assert not standings.outlier(PEER, 2, 1, "norm", "norm 9 > 3")
    # round 5 is out of round 2's window (rounds 3-5)
    assert not standings.outlier(PEER, 5, 0, "direction", "cosine -0.5")
    assert standings.flagged(6) == {}
    assert standings.outlier(PEER, 6, 0, "norm", "norm 9 > 3")
    assert standings.flagged(7) == {PEER: "quarantined"}
    assert [(e, f["round"], f["reason"]) for e, f in events.lines] == [
        ("outlier", 2, "norm"),
        ("outlier", 2, "norm"),
        ("outlier", 5, "direction"),
        ("violation", 6, "norm"),
    ]
    # the count starts again after a violation
    assert not standings.outlier(PEER, 7, 0, "norm", "norm 9 > 3")
