"""Append-only, hash-chained audit log of every contribution a node judged.

Each node keeps one SQLite file, ``DATA_DIR/atoll.db``; this module owns its
``audit`` and ``audit_head`` tables (reputations live in the same file, in tables of
their own). Every row records one contribution to one part of one fragment in one
round: who sent it, the digest of what was sent, the tokens it claimed, and the
verdict. Rows are chained: each row's hash covers the previous row's hash and the
row's own fields, so editing, deleting, inserting or reordering rows breaks the
chain at the first row touched. A one-row head table holds the last id, the last
hash and the row count, updated in the same transaction as every append, so
deleting the *last* row is caught too.

A chain without a key cannot stop someone who rewrites every row and the head with
fresh hashes; publishing :meth:`AuditLog.head` (for example in a signed round
commitment) anchors the log against that as well. What a row holds and how rows are
chained and checked is :mod:`verification.auditchain`; this module owns the log's file,
its appends and its queries.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verification.auditchain import (
    COLUMNS,
    GENESIS_HASH,
    SCHEMA,
    VERDICTS,
    AuditRow,
    chain_hash,
    check_count,
    check_head,
    clean_rows,
    walk_chain,
)
from verification.database import open_database, transaction

if TYPE_CHECKING:
    from verification.writer import Writer

__all__ = [
    "GENESIS_HASH",
    "VERDICTS",
    "AuditLog",
    "AuditRow",
    "open_database",
    "transaction",
]

logger = logging.getLogger(__name__)

# Verdicts whose contribution ends up in the model, for blame(): this node's own
# contribution is in the aggregate just as an accepted peer's is.
_IN_MODEL = ("accepted", "own")
_REFUSED = ("rejected", "owner_rejected")


class AuditLog:
    """The hash-chained audit log in a node's SQLite file.

    Thread-safe: one connection per instance, serialized by a lock. Several
    instances (or processes) may share the file: an append takes SQLite's write
    lock before it reads the chain head, so the chain stays linear.

    Args:
        path: the database file, usually ``DATA_DIR/atoll.db``; created if missing.
        writer: the node's background writer, for :meth:`append_later`; reads flush
            it first, so they see every row queued before them.
    """

    def __init__(self, path: Path, writer: Writer | None = None) -> None:
        self.path = Path(path)
        self.writer = writer
        self._lock = threading.Lock()
        self._conn = open_database(self.path)
        with self._lock, transaction(self._conn) as conn:
            for statement in SCHEMA:
                conn.execute(statement)
            # Only a brand-new log gets a fresh head: a log with rows and no head was
            # tampered with, and recreating the head would hide that from verify().
            has_head = conn.execute("SELECT 1 FROM audit_head").fetchone() is not None
            has_rows = conn.execute("SELECT 1 FROM audit LIMIT 1").fetchone() is not None
            if not has_head and not has_rows:
                conn.execute(
                    "INSERT INTO audit_head (one, last_id, last_hash, count) VALUES (1, 0, ?, 0)",
                    (GENESIS_HASH,),
                )

    def __enter__(self) -> AuditLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def append(
        self,
        *,
        round: int,
        fragment: int,
        part: int,
        sender: str,
        digest: bytes | str,
        tokens: int,
        verdict: str,
        reason: str = "",
    ) -> AuditRow:
        """Append one record to the chain.

        Args:
            round: training round.
            fragment: fragment index.
            part: part index within the fragment's all-reduce.
            sender: PeerID of the contributor.
            digest: SHA-256 of the signed payload, as bytes or hex.
            tokens: tokens the contribution was weighted by.
            verdict: one of :data:`VERDICTS`.
            reason: why it was rejected; empty for accepted contributions.

        Returns:
            The stored row, with its id and hashes.

        Raises:
            ValueError: a field is malformed or the verdict is unknown.
            RuntimeError: the chain head is missing (the file was tampered with).
        """
        return self.append_many(
            [
                {
                    "round": round,
                    "fragment": fragment,
                    "part": part,
                    "sender": sender,
                    "digest": digest,
                    "tokens": tokens,
                    "verdict": verdict,
                    "reason": reason,
                }
            ]
        )[0]

    def append_many(self, rows: Iterable[dict[str, Any]]) -> list[AuditRow]:
        """Append several records in one transaction: all of them or none.

        Args:
            rows: dicts with the keyword arguments of :meth:`append`.

        Returns:
            The stored rows, in order.

        Raises:
            ValueError: any row is malformed (nothing is written).
            RuntimeError: the chain head is missing (the file was tampered with).
        """
        cleaned = clean_rows(rows)
        if not cleaned:
            return []
        with self._lock, transaction(self._conn) as conn:
            return self._insert(conn, cleaned)

    def append_later(self, rows: Iterable[dict[str, Any]]) -> None:
        """Check records now and append them through the node's background writer (in
        the same order as every other queued write; at once without a writer).

        Raises:
            ValueError: any row is malformed (nothing is queued).
        """
        cleaned = clean_rows(rows)
        if not cleaned:
            return
        if self.writer is None:
            with self._lock, transaction(self._conn) as conn:
                self._insert(conn, cleaned)
            return
        self.writer.submit(lambda conn: self._insert(conn, cleaned))

    def _insert(self, conn: sqlite3.Connection, cleaned: list[tuple[Any, ...]]) -> list[AuditRow]:
        """Extend the chain by ``cleaned`` inside the caller's write transaction."""
        head = conn.execute("SELECT last_id, last_hash, count FROM audit_head").fetchone()
        if head is None:
            raise RuntimeError(f"audit head missing in {self.path}: the log was tampered with")
        last_id, prev_hash, count = head
        records = []
        for fields in cleaned:
            last_id += 1
            values = (last_id, time.time(), *fields)
            row_hash = chain_hash(prev_hash, values)
            records.append((*values, prev_hash, row_hash))
            prev_hash = row_hash
        conn.executemany(
            f"INSERT INTO audit ({COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            records,
        )
        conn.execute(
            "UPDATE audit_head SET last_id = ?, last_hash = ?, count = ?",
            (last_id, prev_hash, count + len(cleaned)),
        )
        return [AuditRow(*record) for record in records]

    def _settle(self) -> None:
        """Reads see every write queued before them."""
        if self.writer is not None:
            self.writer.flush()

    def head(self) -> tuple[int, str]:
        """The chain head: (row count, hash of the last row).

        Publishing this pair (signed) anchors the log: a rewrite of the whole chain
        with fresh hashes would no longer match what was published.

        Raises:
            RuntimeError: the head row is missing.
        """
        self._settle()
        with self._lock:
            head = self._conn.execute("SELECT count, last_hash FROM audit_head").fetchone()
        if head is None:
            raise RuntimeError(f"audit head missing in {self.path}: the log was tampered with")
        return int(head[0]), str(head[1])

    def verify(self) -> tuple[bool, int | None, str]:
        """Walk the whole chain and check every link and the head.

        Returns:
            ``(True, None, "")`` for an intact log; otherwise ``(False, id, reason)``
            where ``id`` is the first row that does not check out (for a truncated
            log, the first missing id; ``None`` when only the head is wrong).
        """
        self._settle()
        with self._lock, transaction(self._conn, immediate=False) as conn:
            # One read transaction: the head and the rows come from the same snapshot.
            head = conn.execute("SELECT last_id, last_hash, count FROM audit_head").fetchall()
            cursor = conn.execute(f"SELECT {COLUMNS} FROM audit ORDER BY id")
            try:
                count, last_hash, failure = walk_chain(cursor)
            finally:
                cursor.close()
        if failure is None:
            failure = check_head(head, count, last_hash)
        if failure is not None:
            logger.warning("audit log %s fails verification at row %s: %s", self.path, *failure)
            return False, *failure
        return True, None, ""

    def rows(
        self, *, round: int | None = None, peer: str | None = None, limit: int | None = None
    ) -> list[AuditRow]:
        """Stored rows in chain order, optionally filtered.

        Args:
            round: only rows of this round.
            peer: only rows whose sender is this PeerID.
            limit: at most this many rows (the earliest ones that match).

        Returns:
            The matching rows, by ascending id.
        """
        clauses, params = [], []
        if round is not None:
            clauses.append("round = ?")
            params.append(round)
        if peer is not None:
            clauses.append("sender = ?")
            params.append(peer)
        query = f"SELECT {COLUMNS} FROM audit"
        if clauses:
            query += " WHERE " + " AND ".join(clauses)
        query += " ORDER BY id"
        if limit is not None:
            query += " LIMIT ?"
            params.append(check_count("limit", limit))
        self._settle()
        with self._lock:
            return [AuditRow(*row) for row in self._conn.execute(query, params)]

    def blame(self, round: int) -> dict[str, dict[str, int]]:
        """Who is in the model at a round: per sender, counts and accepted tokens.

        ``accepted`` counts rows whose contribution is in the aggregate (verdicts
        ``accepted`` and ``own``), ``rejected`` counts refused ones (``rejected`` and
        ``owner_rejected``), and ``tokens`` sums the tokens of the accepted rows.

        Args:
            round: the training round.

        Returns:
            ``{peer: {"accepted": n, "rejected": n, "tokens": n}}`` for every sender
            with at least one row in that round.
        """
        in_model = ", ".join(f"'{verdict}'" for verdict in _IN_MODEL)
        refused = ", ".join(f"'{verdict}'" for verdict in _REFUSED)
        query = (
            "SELECT sender,"
            f" SUM(CASE WHEN verdict IN ({in_model}) THEN 1 ELSE 0 END),"
            f" SUM(CASE WHEN verdict IN ({refused}) THEN 1 ELSE 0 END),"
            f" SUM(CASE WHEN verdict IN ({in_model}) THEN tokens ELSE 0 END)"
            " FROM audit WHERE round = ? GROUP BY sender ORDER BY sender"
        )
        self._settle()
        with self._lock:
            result = self._conn.execute(query, (round,)).fetchall()
        return {
            sender: {"accepted": int(accepted), "rejected": int(rejected), "tokens": int(tokens)}
            for sender, accepted, rejected, tokens in result
        }

    def close(self) -> None:
        """Close the connection; safe to call twice."""
        with self._lock:
            self._conn.close()
