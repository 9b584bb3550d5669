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
commitment) anchors the log against that as well.
"""

from __future__ import annotations

import hashlib
import json
import logging
import operator
import sqlite3
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

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

GENESIS_HASH = "0" * 64
"""The ``prev_hash`` of the first row."""

VERDICTS = frozenset(
    {"accepted", "rejected", "owner_rejected", "own", "missing", "operator_ban", "operator_pardon"}
)
"""What a row says of its contribution; ``operator_ban`` and ``operator_pardon`` record an
operator's ``atoll ban`` / ``atoll pardon`` (digest empty, reason as given)."""
"""``accepted``: the contribution is in the aggregate; ``rejected``: it was refused;
``owner_rejected``: a reduced part this node refused from the part's owner;
``own``: this node's own contribution; ``missing``: a member's part never arrived
(reason ``no_delivery`` when the member had signed a commitment to send it)."""

# Verdicts whose contribution ends up in the model, for blame(): this node's own
# contribution is in the aggregate just as an accepted peer's is.
_IN_MODEL = ("accepted", "own")
_REFUSED = ("rejected", "owner_rejected")

# How long (ms) a connection waits for another connection's write lock before failing;
# the audit log and the reputation store share one file and write from one daemon.

_FIELDS = ("round", "fragment", "part", "sender", "digest", "tokens", "verdict", "reason")
_COLUMNS = (
    "id, time, round, fragment, part, sender, digest, tokens, verdict, reason, prev_hash, hash"
)

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS audit (
    id        INTEGER PRIMARY KEY,
    time      REAL    NOT NULL,
    round     INTEGER NOT NULL,
    fragment  INTEGER NOT NULL,
    part      INTEGER NOT NULL,
    sender    TEXT    NOT NULL,
    digest    TEXT    NOT NULL,
    tokens    INTEGER NOT NULL,
    verdict   TEXT    NOT NULL,
    reason    TEXT    NOT NULL,
    prev_hash TEXT    NOT NULL,
    hash      TEXT    NOT NULL
)""",
    "CREATE INDEX IF NOT EXISTS audit_by_round ON audit(round)",
    "CREATE INDEX IF NOT EXISTS audit_by_sender ON audit(sender)",
    """CREATE TABLE IF NOT EXISTS audit_head (
    one       INTEGER PRIMARY KEY CHECK (one = 1),
    last_id   INTEGER NOT NULL,
    last_hash TEXT    NOT NULL,
    count     INTEGER NOT NULL
)""",
)


@dataclass(frozen=True)
class AuditRow:
    """One audit record, exactly as stored.

    Attributes:
        id: position in the chain, 1-based and without gaps.
        time: Unix time of the append.
        round: training round.
        fragment: fragment index.
        part: part index within the fragment's all-reduce.
        sender: PeerID of the contributor (this node's own id for ``own``).
        digest: hex SHA-256 of the signed payload.
        tokens: tokens the contribution was weighted by.
        verdict: one of :data:`VERDICTS`.
        reason: why it was rejected, or ``""``.
        prev_hash: hex hash of the previous row, :data:`GENESIS_HASH` for the first.
        hash: hex SHA-256 over ``prev_hash`` and the fields above.
    """

    id: int
    time: float
    round: int
    fragment: int
    part: int
    sender: str
    digest: str
    tokens: int
    verdict: str
    reason: str
    prev_hash: str
    hash: str


def _row_hash(prev_hash: str, values: tuple[Any, ...]) -> str:
    """SHA-256 of ``prev_hash`` (its ASCII hex) followed by the canonical row encoding.

    The encoding is compact JSON of ``[id, time, round, fragment, part, sender,
    digest, tokens, verdict, reason]``: unambiguous field boundaries, and a float
    ``time`` written with ``repr`` round-trips exactly through SQLite's REAL. Values
    are encoded as read, so a column whose type was changed (``5`` to ``"5"``) no
    longer matches.
    """
    encoded = json.dumps(list(values), separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(prev_hash.encode("ascii") + encoded.encode("ascii")).hexdigest()


def _count(name: str, value: Any) -> int:
    """A non-negative integer field; bools are refused even though they are ints."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if number < 0:
        raise ValueError(f"{name} must be >= 0, got {number}")
    return number


def _clean(
    *,
    round: int,
    fragment: int,
    part: int,
    sender: str,
    digest: bytes | str,
    tokens: int,
    verdict: str,
    reason: str = "",
) -> tuple[int, int, int, str, str, int, str, str]:
    """Validate and normalize one row's fields; raise ValueError on bad input."""
    if verdict not in VERDICTS:
        raise ValueError(f"verdict must be one of {', '.join(sorted(VERDICTS))}, got {verdict!r}")
    if not isinstance(sender, str) or not sender:
        raise ValueError(f"sender must be a non-empty string, got {sender!r}")
    if not isinstance(reason, str):
        raise ValueError(f"reason must be a string, got {reason!r}")
    if isinstance(digest, bytes | bytearray | memoryview):
        digest_hex = bytes(digest).hex()
    elif isinstance(digest, str):
        try:
            digest_hex = bytes.fromhex(digest).hex()
        except ValueError:
            raise ValueError(f"digest must be bytes or a hex string, got {digest!r}") from None
    else:
        raise ValueError(f"digest must be bytes or a hex string, got {digest!r}")
    return (
        _count("round", round),
        _count("fragment", fragment),
        _count("part", part),
        sender,
        digest_hex,
        _count("tokens", tokens),
        verdict,
        reason,
    )


def _clean_rows(rows: Iterable[dict[str, Any]]) -> list[tuple[Any, ...]]:
    cleaned = []
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"row {index}: expected a dict, got {type(row).__name__}")
        unknown = set(row) - set(_FIELDS)
        missing = set(_FIELDS) - {"reason"} - set(row)
        if unknown or missing:
            raise ValueError(
                f"row {index}: unknown fields {sorted(unknown)}, missing fields {sorted(missing)}"
            )
        try:
            cleaned.append(_clean(**row))
        except ValueError as error:
            raise ValueError(f"row {index}: {error}") from None
    return cleaned


def _walk_chain(rows: Iterable[tuple[Any, ...]]) -> tuple[int, str, tuple[int, str] | None]:
    """Check ids, links and hashes in id order.

    Returns:
        ``(rows checked, hash of the last good row, (bad id, reason) or None)``.
    """
    expected_id, prev_hash = 1, GENESIS_HASH
    for row_id, *values, row_prev, row_hash in rows:
        if row_id != expected_id:
            return expected_id - 1, prev_hash, (row_id, f"id gap: expected row {expected_id}")
        if row_prev != prev_hash:
            return expected_id - 1, prev_hash, (row_id, "prev_hash does not match previous row")
        try:
            computed = _row_hash(prev_hash, (row_id, *values))
        except (TypeError, ValueError):  # a column edited to a value JSON cannot encode
            computed = None
        if computed != row_hash:
            return expected_id - 1, prev_hash, (row_id, "hash mismatch: row contents changed")
        expected_id, prev_hash = expected_id + 1, row_hash
    return expected_id - 1, prev_hash, None


def _check_head(
    head: list[tuple[Any, ...]], count: int, last_hash: str
) -> tuple[int | None, str] | None:
    """Compare the head row with an intact chain of ``count`` rows ending in ``last_hash``."""
    if len(head) != 1:
        return None, "audit head missing"
    head_last_id, head_hash, head_count = head[0]
    if (head_last_id, head_count, head_hash) == (count, count, last_hash):
        return None
    if isinstance(head_count, int) and head_count > count:
        # Rows past the end are gone: name the first missing one.
        return count + 1, f"truncated: head records {head_count} rows, log holds {count}"
    return None, (
        f"head mismatch: head says last_id={head_last_id} count={head_count}, log holds {count} rows"
    )


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
            for statement in _SCHEMA:
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
        cleaned = _clean_rows(rows)
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
        cleaned = _clean_rows(rows)
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
            row_hash = _row_hash(prev_hash, values)
            records.append((*values, prev_hash, row_hash))
            prev_hash = row_hash
        conn.executemany(
            f"INSERT INTO audit ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
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
            cursor = conn.execute(f"SELECT {_COLUMNS} FROM audit ORDER BY id")
            try:
                count, last_hash, failure = _walk_chain(cursor)
            finally:
                cursor.close()
        if failure is None:
            failure = _check_head(head, count, last_hash)
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
        query = f"SELECT {_COLUMNS} FROM audit"
        if clauses:
            query += " WHERE " + " AND ".join(clauses)
        query += " ORDER BY id"
        if limit is not None:
            query += " LIMIT ?"
            params.append(_count("limit", limit))
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
