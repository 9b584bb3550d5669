"""A node's SQLite file: WAL mode, and transactions that commit whole or not at all."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from verification.database import open_database, transaction


def _table(path: Path):
    conn = open_database(path)
    conn.execute("CREATE TABLE IF NOT EXISTS t (x INTEGER)")
    return conn


def test_the_file_and_its_folder_are_created_in_wal_mode(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "atoll.db"
    conn = open_database(path)
    try:
        assert path.exists()
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA busy_timeout").fetchone()[0] >= 1000
    finally:
        conn.close()


def test_a_transaction_commits_when_its_block_returns(tmp_path: Path) -> None:
    conn = _table(tmp_path / "atoll.db")
    with transaction(conn) as same:
        assert same is conn
        conn.execute("INSERT INTO t VALUES (1)")
    other = open_database(tmp_path / "atoll.db")
    assert other.execute("SELECT x FROM t").fetchall() == [(1,)]
    conn.close()
    other.close()


def test_a_block_that_raises_leaves_nothing_behind(tmp_path: Path) -> None:
    conn = _table(tmp_path / "atoll.db")
    with pytest.raises(RuntimeError), transaction(conn):
        conn.execute("INSERT INTO t VALUES (2)")
        raise RuntimeError("half done")
    assert conn.execute("SELECT count(*) FROM t").fetchone()[0] == 0
    assert not conn.in_transaction
    conn.close()


def test_the_connection_serves_other_threads(tmp_path: Path) -> None:
    conn = _table(tmp_path / "atoll.db")
    errors: list[BaseException] = []

    def insert() -> None:
        try:
            with transaction(conn):
                conn.execute("INSERT INTO t VALUES (3)")
        except BaseException as exc:  # reported below, on the test's thread
            errors.append(exc)

    thread = threading.Thread(target=insert)
    thread.start()
    thread.join(10)
    assert errors == [] and conn.execute("SELECT x FROM t").fetchall() == [(3,)]
    conn.close()
