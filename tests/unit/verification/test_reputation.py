"""Tests for verification.reputation: scores, quarantines, bans, persistence."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from verification.audit import AuditLog
from verification.reputation import ReputationStore, Standing

A = "12D3KooWHgyZUJG4T1EYya9zZQ6VAoBD4Ws4Adut9bUpVmLMRXg2"
B = "12D3KooWKp4wDcx1te8zPS5J8UFKjE3wLHTYrmZQeDxFkkLkhJKQ"
C = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "atoll.db"


@pytest.fixture
def store(db: Path) -> Iterator[ReputationStore]:
    with ReputationStore(db) as reputation:
        yield reputation


def test_unknown_peer_has_initial_standing(store: ReputationStore) -> None:
    assert store.standing(A, 0) == Standing(A, 0.5, "ok", 0, 0, "")
    assert store.all() == []  # reading does not create a row
    assert store.excluded(0) == set()


def test_score_arithmetic(store: ReputationStore) -> None:
    for _ in range(3):
        store.record(A, 1, ok=True)
    assert store.standing(A, 1).score == pytest.approx(0.56)  # 0.5 + 3 * 0.02
    after = store.record(A, 2, ok=False, reason="norm")
    assert after.score == pytest.approx(0.36)  # 0.56 - 0.2
    assert (after.violations, after.reason, after.status) == (1, "norm", "ok")
    custom = store.record(A, 3, ok=False, reason="cosine", penalty=0.3)
    assert custom.score == pytest.approx(0.06)
    assert store.record(A, 4, ok=True, reward=0.1).score == pytest.approx(0.16)
    standing = store.standing(A, 4)
    assert (standing.violations, standing.reason) == (2, "cosine")  # a good round keeps both


def test_score_is_clamped_to_unit_interval(store: ReputationStore) -> None:
    for _ in range(5):
        store.record(A, 0, ok=False, reason="nan")
    assert store.standing(A, 0).score == 0.0
    assert store.standing(A, 0).violations == 5
    for _ in range(60):
        store.record(B, 0, ok=True)
    assert store.standing(B, 0).score == 1.0


def test_initial_score_applies_to_new_peers(db: Path) -> None:
    with ReputationStore(db, initial=0.9) as high:
        assert high.standing(A, 0).score == 0.9
        assert high.record(A, 0, ok=False).score == pytest.approx(0.7)
    with pytest.raises(ValueError, match="initial"):
        ReputationStore(db, initial=1.5)


def test_bad_arguments_are_refused(store: ReputationStore) -> None:
    with pytest.raises(ValueError, match="penalty"):
        store.record(A, 0, ok=False, penalty=-0.1)
    with pytest.raises(ValueError, match="round"):
        store.record(A, -1, ok=True)
    with pytest.raises(ValueError, match="rounds"):
        store.quarantine(A, 0, 0, "norm")
    with pytest.raises(ValueError, match="peer"):
        store.standing("", 0)


def test_quarantine_expires(store: ReputationStore) -> None:
    standing = store.quarantine(A, 10, 5, "norm")
    assert (standing.status, standing.until_round, standing.reason) == ("quarantined", 15, "norm")
    for round in range(10, 15):
        assert store.standing(A, round).status == "quarantined"
        assert store.excluded(round) == {A}
    assert store.standing(A, 15) == Standing(A, 0.5, "ok", 0, 0, "norm")
    assert store.excluded(15) == set()
    # A later record persists the lifted quarantine.
    store.record(A, 16, ok=True)
    assert store.all()[0].status == "ok"


def test_quarantine_keeps_the_later_end(store: ReputationStore) -> None:
    store.quarantine(A, 10, 10, "norm")
    assert store.quarantine(A, 12, 2, "cosine").until_round == 20
    assert store.quarantine(A, 12, 30, "cosine").until_round == 42


def test_ban_is_permanent(store: ReputationStore) -> None:
    banned = store.ban(A, "forged tokens")
    assert (banned.status, banned.reason) == ("banned", "forged tokens")
    for round in (0, 10, 10**6):
        assert store.standing(A, round).status == "banned"
        assert A in store.excluded(round)
    # Neither a quarantine nor good behaviour lifts a ban.
    assert store.quarantine(A, 5, 1, "norm").status == "banned"
    assert store.record(A, 7, ok=True).status == "banned"
    assert store.pardon(A, "operator review").status == "ok"
    assert store.excluded(10**6) == set()


def test_excluded_mixes_bans_and_active_quarantines(store: ReputationStore) -> None:
    store.quarantine(A, 0, 3, "norm")
    store.ban(B, "sign flip")
    store.record(C, 0, ok=False, reason="norm")  # a violation alone excludes nobody
    assert store.excluded(0) == {A, B}
    assert store.excluded(3) == {B}


def test_persists_across_reopen(db: Path) -> None:
    with ReputationStore(db) as store:
        store.record(A, 0, ok=False, reason="norm")
        store.quarantine(A, 0, 4, "norm")
        store.ban(B, "sign flip")
        store.record(C, 0, ok=True)
    with ReputationStore(db) as again:
        assert again.standing(A, 1) == Standing(A, pytest.approx(0.3), "quarantined", 4, 1, "norm")
        assert again.standing(B, 99).status == "banned"
        assert [s.peer for s in again.all()] == sorted([A, B, C])
        assert again.excluded(2) == {A, B}


def test_shares_the_file_with_the_audit_log(db: Path) -> None:
    with AuditLog(db) as audit, ReputationStore(db) as store:
        audit.append(
            round=0, fragment=0, part=0, sender=A, digest=b"x", tokens=1, verdict="rejected"
        )
        store.record(A, 0, ok=False, reason="norm")
        assert audit.verify() == (True, None, "")
    with sqlite3.connect(db) as conn:
        tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master")}
    assert {"audit", "audit_head", "reputation"} <= tables
