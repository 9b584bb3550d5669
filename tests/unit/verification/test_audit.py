"""Tests for verification.audit: the hash chain, tamper detection, queries, blame."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from verification.audit import GENESIS_HASH, AuditLog, AuditRow, open_database

PEER_A = "12D3KooWHgyZUJG4T1EYya9zZQ6VAoBD4Ws4Adut9bUpVmLMRXg2"
PEER_B = "12D3KooWKp4wDcx1te8zPS5J8UFKjE3wLHTYrmZQeDxFkkLkhJKQ"
ME = "12D3KooWThisNode"


def _row(round: int, sender: str, verdict: str, tokens: int = 100, part: int = 0) -> dict:
    return {
        "round": round,
        "fragment": round % 3,
        "part": part,
        "sender": sender,
        "digest": hashlib.sha256(f"{round}/{sender}/{part}".encode()).digest(),
        "tokens": tokens,
        "verdict": verdict,
        "reason": "" if verdict in ("accepted", "own") else "norm",
    }


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "data" / "atoll.db"


@pytest.fixture
def log(db: Path) -> Iterator[AuditLog]:
    """A log of 20 rows: rounds 0-4, four rows each."""
    audit = AuditLog(db)
    for round in range(5):
        audit.append_many(
            [
                _row(round, PEER_A, "accepted"),
                _row(round, PEER_B, "rejected" if round % 2 else "accepted", tokens=50),
                _row(round, ME, "own", tokens=70),
                _row(round, PEER_B, "owner_rejected", part=1),
            ]
        )
    yield audit
    audit.close()


def _tamper(db: Path, *statements: str) -> None:
    """Edit the file behind the log's back, as an attacker with file access would."""
    with sqlite3.connect(db) as conn:
        for statement in statements:
            conn.execute(statement)


def test_append_returns_chained_rows(db: Path) -> None:
    with AuditLog(db) as audit:
        common = {"round": 3, "fragment": 1, "part": 2}
        first = audit.append(
            **common, sender=PEER_A, digest=b"\x01\x02", tokens=9, verdict="accepted"
        )
        second = audit.append(
            **common, sender=PEER_B, digest="ABCD", tokens=0, verdict="rejected", reason="bad_sig"
        )
    assert isinstance(first, AuditRow)
    assert (first.id, second.id) == (1, 2)
    assert first.prev_hash == GENESIS_HASH
    assert second.prev_hash == first.hash
    assert first.digest == "0102" and second.digest == "abcd"  # hex, normalized
    # The documented hash: sha256(prev_hash hex || compact JSON of the fields).
    fields = [1, first.time, 3, 1, 2, PEER_A, "0102", 9, "accepted", ""]
    encoded = json.dumps(fields, separators=(",", ":")).encode()
    assert first.hash == hashlib.sha256(GENESIS_HASH.encode() + encoded).hexdigest()


def test_many_rows_verify(log: AuditLog) -> None:
    assert log.verify() == (True, None, "")
    assert log.head() == (20, log.rows()[-1].hash)
    assert [row.id for row in log.rows()] == list(range(1, 21))


def test_empty_log_verifies(db: Path) -> None:
    with AuditLog(db) as audit:
        assert audit.verify() == (True, None, "")
        assert audit.head() == (0, GENESIS_HASH)
        assert audit.append_many([]) == []


@pytest.mark.parametrize(
    "edit",
    [
        "UPDATE audit SET tokens = tokens + 1 WHERE id = 7",
        "UPDATE audit SET verdict = 'accepted' WHERE id = 7",
        "UPDATE audit SET tokens = 'many' WHERE id = 7",
        "UPDATE audit SET time = time + 1 WHERE id = 7",
    ],
)
def test_edited_middle_row_is_named(log: AuditLog, db: Path, edit: str) -> None:
    _tamper(db, edit)
    ok, bad_id, reason = log.verify()
    assert (ok, bad_id) == (False, 7)
    assert "hash" in reason


def test_edited_row_with_recomputed_hash_breaks_next_link(log: AuditLog, db: Path) -> None:
    # flip the first hex digit (whatever it is) so the stored hash always changes
    _tamper(
        db,
        "UPDATE audit SET hash = (CASE WHEN substr(hash, 1, 1) = 'f' THEN 'e' ELSE 'f' END)"
        " || substr(hash, 2) WHERE id = 7",
    )
    ok, bad_id, _ = log.verify()
    assert (ok, bad_id) == (False, 7)  # its own hash no longer matches its contents


def test_deleted_middle_row_names_next_id(log: AuditLog, db: Path) -> None:
    _tamper(db, "DELETE FROM audit WHERE id = 11")
    ok, bad_id, reason = log.verify()
    assert (ok, bad_id) == (False, 12)
    assert "gap" in reason


def test_deleted_last_row_is_detected(log: AuditLog, db: Path) -> None:
    _tamper(db, "DELETE FROM audit WHERE id = 20")
    ok, bad_id, reason = log.verify()
    assert (ok, bad_id) == (False, 20)
    assert "truncated" in reason


def test_deleted_last_row_and_patched_count_is_detected(log: AuditLog, db: Path) -> None:
    _tamper(db, "DELETE FROM audit WHERE id = 20", "UPDATE audit_head SET last_id = 19, count = 19")
    ok, bad_id, reason = log.verify()
    assert not ok and bad_id is None and "head" in reason  # last_hash still names row 20


def test_edited_or_missing_head_is_detected(log: AuditLog, db: Path) -> None:
    _tamper(db, "UPDATE audit_head SET last_hash = '00'")
    assert log.verify()[0] is False
    _tamper(db, "DELETE FROM audit_head")
    assert log.verify() == (False, None, "audit head missing")
    with pytest.raises(RuntimeError, match="head missing"):
        log.append(**_row(9, PEER_A, "accepted"))


def test_swapped_rows_are_detected(log: AuditLog, db: Path) -> None:
    columns = (
        "time, round, fragment, part, sender, digest, tokens, verdict, reason, prev_hash, hash"
    )
    # Swap every column of rows 5 and 9, hashes included: each row is self-consistent,
    # but the chain of prev_hash links no longer runs in id order.
    _tamper(
        db,
        f"CREATE TABLE tmp AS SELECT id, {columns} FROM audit WHERE id IN (5, 9)",
        "DELETE FROM audit WHERE id IN (5, 9)",
        f"INSERT INTO audit (id, {columns}) SELECT 14 - id, {columns} FROM tmp",
    )
    ok, bad_id, reason = log.verify()
    assert (ok, bad_id) == (False, 5)
    assert "prev_hash" in reason


def test_swapped_contents_only_are_detected(log: AuditLog, db: Path) -> None:
    # Swap the fields but keep each id's hashes: the hash check catches it.
    _tamper(
        db,
        "CREATE TABLE tmp AS SELECT id, sender, tokens, verdict FROM audit WHERE id IN (2, 3)",
        "UPDATE audit SET sender = (SELECT sender FROM tmp WHERE id = 5 - audit.id),"
        " tokens = (SELECT tokens FROM tmp WHERE id = 5 - audit.id),"
        " verdict = (SELECT verdict FROM tmp WHERE id = 5 - audit.id) WHERE id IN (2, 3)",
    )
    assert log.verify()[:2] == (False, 2)


def test_bad_input_is_refused_and_nothing_written(log: AuditLog) -> None:
    with pytest.raises(ValueError, match="verdict"):
        log.append(**{**_row(9, PEER_A, "accepted"), "verdict": "maybe"})
    with pytest.raises(ValueError, match="tokens"):
        log.append(**{**_row(9, PEER_A, "accepted"), "tokens": -1})
    with pytest.raises(ValueError, match="round"):
        log.append(**{**_row(9, PEER_A, "accepted"), "round": True})
    with pytest.raises(ValueError, match="digest"):
        log.append(**{**_row(9, PEER_A, "accepted"), "digest": "xyz"})
    with pytest.raises(ValueError, match="row 1: unknown fields"):
        log.append_many([_row(9, PEER_A, "accepted"), {**_row(9, PEER_A, "own"), "extra": 1}])
    assert log.head()[0] == 20  # the good first row of the failed batch was not written
    assert log.verify()[0]


def test_rows_filters(log: AuditLog) -> None:
    round_two = log.rows(round=2)
    assert [row.id for row in round_two] == [9, 10, 11, 12]
    from_b = log.rows(peer=PEER_B)
    assert len(from_b) == 10 and {row.sender for row in from_b} == {PEER_B}
    assert [row.verdict for row in log.rows(round=1, peer=PEER_B)] == ["rejected", "owner_rejected"]
    assert [row.id for row in log.rows(peer=PEER_A, limit=2)] == [1, 5]
    assert log.rows(round=99) == []


def test_blame_hand_case(log: AuditLog) -> None:
    # Round 1: A accepted (100 tokens); B's contribution rejected and its reduced
    # part refused; this node's own 70 tokens are in the model.
    assert log.blame(1) == {
        PEER_A: {"accepted": 1, "rejected": 0, "tokens": 100},
        PEER_B: {"accepted": 0, "rejected": 2, "tokens": 0},
        ME: {"accepted": 1, "rejected": 0, "tokens": 70},
    }
    # Round 2: B's contribution (50 tokens) is accepted, its reduced part is not.
    assert log.blame(2)[PEER_B] == {"accepted": 1, "rejected": 1, "tokens": 50}
    assert log.blame(99) == {}


def test_reopen_continues_the_chain(log: AuditLog, db: Path) -> None:
    last = log.rows()[-1]
    log.close()
    with AuditLog(db) as again:
        row = again.append(**_row(5, PEER_A, "accepted"))
        assert (row.id, row.prev_hash) == (21, last.hash)
        assert again.verify() == (True, None, "")
        assert again.head() == (21, row.hash)


def test_two_connections_share_one_linear_chain(db: Path) -> None:
    first, second = AuditLog(db), AuditLog(db)
    try:

        def write(audit: AuditLog, sender: str) -> None:
            for round in range(25):
                audit.append(**_row(round, sender, "accepted"))

        threads = [
            threading.Thread(target=write, args=(first, PEER_A)),
            threading.Thread(target=write, args=(second, PEER_B)),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert first.verify() == (True, None, "")
        assert second.head()[0] == 50
        with sqlite3.connect(db) as conn:
            assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        first.close()
        second.close()


def test_commits_skip_fsync_but_survive_a_killed_process(db: Path) -> None:
    conn = open_database(db)
    try:
        # WAL with synchronous = NORMAL (1): no fsync per commit, see open_database
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA synchronous").fetchone()[0] == 1
    finally:
        conn.close()
    # A process that dies without closing its log loses none of its commits.
    script = (
        "import os, sys\n"
        "from verification.audit import AuditLog\n"
        "log = AuditLog(sys.argv[1])\n"
        "for round in range(30):\n"
        f"    log.append(round=round, fragment=0, part=0, sender={PEER_A!r},"
        " digest=b'd' * 32, tokens=1, verdict='accepted')\n"
        "os._exit(0)\n"
    )
    subprocess.run([sys.executable, "-c", script, str(db)], check=True, timeout=60)
    with AuditLog(db) as log:
        assert log.verify() == (True, None, "")
        assert log.head()[0] == 30
