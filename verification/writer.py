"""One background writer for a node's SQLite file: audit rows and reputations off the
critical path.

An owner judges a part while its group waits for the result; a SQLite commit there
costs milliseconds each time. Instead the stores hand the writer small write
functions, and the writer's thread runs everything queued within ``delay`` seconds
(about one round's rows) in one transaction on its own connection. Writes run in the
order they were queued, so the audit chain is extended link after link as before.

What is lost when: :meth:`Writer.flush` returns once everything queued before it is
committed (a node flushes before each checkpoint, and :meth:`Writer.close` flushes on
shutdown, so a SIGTERM loses nothing); a SIGKILL loses what was queued in the last
``delay`` seconds, never part of a transaction, so the chain and its head still agree
and :meth:`~verification.audit.AuditLog.verify` passes on what remains.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path

from verification.database import open_database, transaction

__all__ = ["Writer"]

logger = logging.getLogger(__name__)

Write = Callable[[sqlite3.Connection], None]
"""A write: runs inside the writer's open transaction, on its connection."""


class Writer:
    """Runs queued writes in batches, one transaction per batch, from one thread.

    Args:
        path: the database file.
        delay: seconds a write may wait for others to join its transaction.
    """

    def __init__(self, path: Path, delay: float = 0.5) -> None:
        self.path = Path(path)
        self.delay = delay
        self._conn = open_database(self.path)
        self._cond = threading.Condition()
        self._queue: list[Write] = []
        self._queued = 0
        self._done = 0
        self._urgent = False
        self._closing = False
        self.batches = 0
        """Transactions committed so far."""
        self.failures = 0
        """Batches that failed (their writes are lost; logged)."""
        self._thread = threading.Thread(target=self._run, name="atoll-db-writer", daemon=True)
        self._thread.start()

    def submit(self, write: Write) -> None:
        """Queue ``write``; it runs within ``delay`` seconds.

        Raises:
            RuntimeError: the writer is closed.
        """
        with self._cond:
            if self._closing:
                raise RuntimeError(f"the writer of {self.path} is closed")
            self._queue.append(write)
            self._queued += 1
            self._cond.notify_all()

    def flush(self, timeout: float = 30.0) -> bool:
        """Commit everything queued so far now; whether it was done within ``timeout``."""
        with self._cond:
            target = self._queued
            if self._done >= target:
                return True
            self._urgent = True
            self._cond.notify_all()
            return self._cond.wait_for(lambda: self._done >= target, timeout)

    @property
    def pending(self) -> int:
        """Writes queued and not yet committed."""
        with self._cond:
            return self._queued - self._done

    def close(self, timeout: float = 30.0) -> None:
        """Flush, stop the thread and close the connection (idempotent)."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._urgent = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("the writer of %s did not finish within %.0fs", self.path, timeout)
            return
        self._conn.close()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return  # closing and nothing left
                if not self._urgent:  # let the rest of the round's writes join
                    self._cond.wait_for(lambda: self._urgent, self.delay)
                batch, self._queue = self._queue, []
                self._urgent = False
            self._commit(batch)
            with self._cond:
                self._done += len(batch)
                self._cond.notify_all()

    def _commit(self, batch: list[Write]) -> None:
        try:
            with transaction(self._conn) as conn:
                for write in batch:
                    write(conn)
            self.batches += 1
        except sqlite3.DatabaseError as e:  # a full disk, a locked or damaged file
            self.failures += 1
            logger.error("%d writes to %s lost: %s", len(batch), self.path, e)
        except Exception:  # a failed batch must not stop later ones
            self.failures += 1
            logger.exception("%d writes to %s lost", len(batch), self.path)
