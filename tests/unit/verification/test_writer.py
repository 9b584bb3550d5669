"""The background writer of a node's SQLite file: batched, ordered, flushed, and
consistent after a SIGKILL."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from verification.audit import AuditLog
from verification.reputation import ReputationStore
from verification.writer import Writer


def _rows(round_: int, n: int) -> list[dict]:
    return [
        dict(
            round=round_,
            fragment=0,
            part=i,
            sender=f"peer{i}",
            digest=bytes([i]) * 32,
            tokens=10,
            verdict="accepted",
        )
        for i in range(n)
    ]


def test_queued_rows_land_in_one_transaction_on_flush(tmp_path: Path) -> None:
    db = tmp_path / "atoll.db"
    writer = Writer(db, delay=60.0)  # nothing is written before a flush
    log = AuditLog(db, writer=writer)
    outside = AuditLog(db)  # another reader of the file (an operator's `atoll audit`)
    for round_ in (1, 2, 3):
        log.append_later(_rows(round_, 4))
    assert outside.head()[0] == 0 and writer.pending == 3
    assert writer.flush()
    assert outside.head()[0] == 12 and writer.batches == 1
    assert outside.verify() == (True, None, "")
    assert [r.round for r in outside.rows()] == [1] * 4 + [2] * 4 + [3] * 4  # in order
    writer.close()
    log.close()
    outside.close()


def test_reads_through_the_store_see_what_is_queued(tmp_path: Path) -> None:
    db = tmp_path / "atoll.db"
    writer = Writer(db, delay=60.0)
    log = AuditLog(db, writer=writer)
    reputation = ReputationStore(db, writer=writer)
    log.append_later(_rows(1, 2))
    reputation.record("peer0", 1, ok=False, reason="norm")
    reputation.quarantine("peer0", 1, 3, "norm")
    # the node reads its own writes at once: standings from memory, rows after a flush
    assert reputation.standing("peer0", 2).status == "quarantined"
    assert reputation.excluded(2) == {"peer0"}
    assert ReputationStore(db).all() == []  # not on disk yet
    assert len(log.rows()) == 2  # a read flushes first
    assert ReputationStore(db).standing("peer0", 2).status == "quarantined"
    writer.close()
    # a restarted node loads its standings from the file
    again = ReputationStore(db, writer=Writer(db))
    assert again.standing("peer0", 2).violations == 1
    again.writer.close()


def test_close_writes_everything_and_a_failed_write_loses_only_its_batch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db = tmp_path / "atoll.db"
    writer = Writer(db, delay=60.0)
    log = AuditLog(db, writer=writer)
    log.append_later(_rows(1, 2))

    def broken(conn: object) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    writer.submit(broken)
    writer.flush()
    assert writer.failures == 1  # the batch with the broken write is rolled back whole
    # one line for the operator, no traceback (a full disk is not a bug)
    lost = [r for r in caplog.records if "writes to" in r.getMessage()]
    assert len(lost) == 1 and lost[0].exc_info is None and "disk is full" in lost[0].getMessage()
    log.append_later(_rows(2, 3))
    writer.close()
    plain = AuditLog(db)
    assert [r.round for r in plain.rows()] == [2, 2, 2]
    assert plain.verify()[0]


_KILLED = """
import os, signal, sys
from pathlib import Path
from verification.audit import AuditLog
from verification.writer import Writer
from tests.unit.verification.test_writer import _rows

db = Path(sys.argv[1])
writer = Writer(db, delay=60.0)
log = AuditLog(db, writer=writer)
log.append_later(_rows(1, 5))
writer.flush()                 # round 1 is checkpointed
log.append_later(_rows(2, 5))  # round 2 is still queued
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_sigkill_loses_at_most_the_queued_round_and_the_chain_holds(tmp_path: Path) -> None:
    db = tmp_path / "atoll.db"
    root = Path(__file__).resolve().parents[3]
    child = subprocess.run(
        [sys.executable, "-c", _KILLED, str(db)], cwd=root, timeout=60, env=dict(os.environ)
    )
    assert child.returncode == -signal.SIGKILL
    log = AuditLog(db)
    assert log.verify() == (True, None, "")
    assert [r.round for r in log.rows()] == [1] * 5
