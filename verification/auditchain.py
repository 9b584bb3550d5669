"""The audit log's rows and the chain that links them.

What one row holds (:class:`AuditRow`, :data:`VERDICTS`), the tables it is stored in,
the checks a row's fields pass before it is appended, the hash that chains each row to
the one before, and the walk that finds the first row breaking the chain. The log
itself, its appends and its queries, is :class:`verification.audit.AuditLog`.
"""

from __future__ import annotations

import hashlib
import json
import operator
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "COLUMNS",
    "FIELDS",
    "GENESIS_HASH",
    "SCHEMA",
    "VERDICTS",
    "AuditRow",
    "chain_hash",
    "check_count",
    "check_head",
    "clean_rows",
    "walk_chain",
]

GENESIS_HASH = "0" * 64
"""The ``prev_hash`` of the first row."""

VERDICTS = frozenset(
    {"accepted", "rejected", "owner_rejected", "own", "missing", "operator_ban", "operator_pardon"}
)
"""What a row says of its contribution; ``operator_ban`` and ``operator_pardon`` record an
operator's ``atoll ban`` / ``atoll pardon`` (digest empty, reason as given).

``accepted``: the contribution is in the aggregate; ``rejected``: it was refused;
``owner_rejected``: a reduced part this node refused from the part's owner;
``own``: this node's own contribution; ``missing``: a member's part never arrived
(reason ``no_delivery`` when the member had signed a commitment to send it)."""

FIELDS = ("round", "fragment", "part", "sender", "digest", "tokens", "verdict", "reason")
"""The fields an append names (``reason`` may be left out)."""

COLUMNS = (
    "id, time, round, fragment, part, sender, digest, tokens, verdict, reason, prev_hash, hash"
)
"""The ``audit`` table's columns, in :class:`AuditRow`'s order."""

SCHEMA = (
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
"""The ``audit`` table, its indexes and the one-row ``audit_head``."""


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


def chain_hash(prev_hash: str, values: tuple[Any, ...]) -> str:
    """SHA-256 of ``prev_hash`` (its ASCII hex) followed by the canonical row encoding.

    The encoding is compact JSON of ``[id, time, round, fragment, part, sender,
    digest, tokens, verdict, reason]``: unambiguous field boundaries, and a float
    ``time`` written with ``repr`` round-trips exactly through SQLite's REAL. Values
    are encoded as read, so a column whose type was changed (``5`` to ``"5"``) no
    longer matches.
    """
    encoded = json.dumps(list(values), separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(prev_hash.encode("ascii") + encoded.encode("ascii")).hexdigest()


def check_count(name: str, value: Any) -> int:
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
        check_count("round", round),
        check_count("fragment", fragment),
        check_count("part", part),
        sender,
        digest_hex,
        check_count("tokens", tokens),
        verdict,
        reason,
    )


def clean_rows(rows: Iterable[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """Validate and normalize rows given as dicts of :data:`FIELDS`.

    Raises:
        ValueError: naming the first bad row (by index) and what is wrong with it.
    """
    cleaned = []
    for index, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"row {index}: expected a dict, got {type(row).__name__}")
        unknown = set(row) - set(FIELDS)
        missing = set(FIELDS) - {"reason"} - set(row)
        if unknown or missing:
            raise ValueError(
                f"row {index}: unknown fields {sorted(unknown)}, missing fields {sorted(missing)}"
            )
        try:
            cleaned.append(_clean(**row))
        except ValueError as error:
            raise ValueError(f"row {index}: {error}") from None
    return cleaned


def walk_chain(rows: Iterable[tuple[Any, ...]]) -> tuple[int, str, tuple[int, str] | None]:
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
            computed = chain_hash(prev_hash, (row_id, *values))
        except (TypeError, ValueError):  # a column edited to a value JSON cannot encode
            computed = None
        if computed != row_hash:
            return expected_id - 1, prev_hash, (row_id, "hash mismatch: row contents changed")
        expected_id, prev_hash = expected_id + 1, row_hash
    return expected_id - 1, prev_hash, None


def check_head(
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
