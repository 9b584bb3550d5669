"""Opening a node's SQLite file, and transactions on it.

The audit log, the reputation store and the background writer all use the same file
(``DATA_DIR/atoll.db``) through connections opened here.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["open_database", "transaction"]

_BUSY_TIMEOUT_MS = 10_000


def open_database(path: Path) -> sqlite3.Connection:
    """Open (creating if needed) a node's SQLite file, in WAL mode with a busy timeout.

    The connection is in autocommit mode: callers open their own transactions with
    ``BEGIN``/``BEGIN IMMEDIATE``, so a read of the chain head and the write that
    extends it happen under one write lock.

    Commits are not synced to disk (``synchronous = NORMAL``; WAL is synced at each
    checkpoint): an fsync per commit cost more than screening and aggregation
    together. A node that crashes or is killed loses nothing; a power loss or an OS
    crash may roll back the last commits, each one whole, so the chain and its head
    still agree and :meth:`AuditLog.verify` passes on what remains. A head published
    before such a loss names rows the log no longer holds.

    Args:
        path: the database file, usually ``DATA_DIR/atoll.db``.

    Returns:
        A connection usable from any thread (callers serialize access themselves).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(
        str(path), timeout=_BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=False
    )
    # busy_timeout first: switching to WAL itself needs the lock another process may hold.
    conn.execute(f"PRAGMA busy_timeout = {_BUSY_TIMEOUT_MS}")
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = NORMAL")
    return conn


@contextmanager
def transaction(
    conn: sqlite3.Connection, *, immediate: bool = True
) -> Iterator[sqlite3.Connection]:
    """Run a block as one transaction on an autocommit connection from :func:`open_database`.

    Args:
        conn: the connection.
        immediate: take the write lock at ``BEGIN`` (needed when a block reads and
            then writes, so no other connection writes in between); ``False`` opens a
            read transaction, which gives a consistent snapshot under WAL.

    Yields:
        The same connection. The transaction commits when the block returns and
        rolls back when it raises.
    """
    conn.execute("BEGIN IMMEDIATE" if immediate else "BEGIN")
    try:
        yield conn
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
