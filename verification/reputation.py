"""Per-peer standing: a reputation score, quarantines and bans, persisted per node.

The standing lives in the node's SQLite file (``DATA_DIR/atoll.db``), in a
``reputation`` table next to the audit log's tables, so it survives restarts and
can be inspected with any SQLite tool. This module only keeps the books: the
operator's :class:`~verification.policy.TrustPolicy` decides whether a violation
means a drop, a quarantine or a ban, and the caller applies that decision here.

A score starts at ``initial`` and moves in ``[0, 1]``: a good contribution adds a
small reward, a violation subtracts a larger penalty and counts toward escalation.
A quarantine lasts a number of rounds and lifts itself; a ban lasts until an
operator pardons the peer.
"""

from __future__ import annotations

import logging
import math
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verification.auditchain import check_count
from verification.database import open_database, transaction

if TYPE_CHECKING:
    from verification.writer import Writer

__all__ = ["STATUSES", "ReputationStore", "Standing"]

INITIAL_SCORE = 0.5
"""The score of a peer seen for the first time (what a node holds for a peer it has not
judged yet)."""

logger = logging.getLogger(__name__)

STATUSES = frozenset({"ok", "quarantined", "banned"})
"""A peer's possible statuses."""

_SCHEMA = """CREATE TABLE IF NOT EXISTS reputation (
    peer        TEXT    PRIMARY KEY,
    score       REAL    NOT NULL,
    status      TEXT    NOT NULL,
    until_round INTEGER NOT NULL,
    violations  INTEGER NOT NULL,
    reason      TEXT    NOT NULL,
    updated     REAL    NOT NULL
)"""

_COLUMNS = "peer, score, status, until_round, violations, reason"


@dataclass(frozen=True)
class Standing:
    """One peer's standing.

    Attributes:
        peer: the PeerID.
        score: reputation in ``[0, 1]``.
        status: ``"ok"``, ``"quarantined"`` or ``"banned"``.
        until_round: first round a quarantine no longer applies; 0 when not quarantined.
        violations: violations recorded so far (they never decay).
        reason: reason given with the last violation, quarantine or ban.
    """

    peer: str
    score: float
    status: str
    until_round: int
    violations: int
    reason: str


def _round(value: Any, name: str = "round") -> int:
    """A non-negative round number (bools refused)."""
    return check_count(name, value)


def _unit(value: float, name: str) -> float:
    """A finite float in ``[0, 1]``."""
    number = float(value)
    if not (math.isfinite(number) and 0.0 <= number <= 1.0):
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    return number


def _clamp(score: float) -> float:
    return min(1.0, max(0.0, score))


def _store(conn: sqlite3.Connection, standing: Standing) -> None:
    conn.execute(
        f"INSERT OR REPLACE INTO reputation ({_COLUMNS}, updated) VALUES (?, ?, ?, ?, ?, ?, ?)",
        (
            standing.peer,
            standing.score,
            standing.status,
            standing.until_round,
            standing.violations,
            standing.reason,
            time.time(),
        ),
    )


def _in_effect(standing: Standing, round: int) -> Standing:
    """The standing as of ``round``: a quarantine whose last round has passed is lifted."""
    if standing.status == "quarantined" and round >= standing.until_round:
        return replace(standing, status="ok", until_round=0)
    return standing


class ReputationStore:
    """Reputations in a node's SQLite file.

    Thread-safe: one connection per instance, serialized by a lock; every write is
    one ``BEGIN IMMEDIATE`` transaction, so a read-modify-write of a peer's row
    cannot interleave with another connection's.

    With a ``writer`` (a running node), every standing is read from an in-memory
    mirror loaded at start, and changes are written through the node's background
    writer: the node must then be the only process that changes the table while it
    runs (an operator's edit made meanwhile is overwritten or ignored).

    Args:
        path: the database file, usually ``DATA_DIR/atoll.db``; created if missing.
        initial: score of a peer seen for the first time.
        writer: the node's background writer; None writes each change at once.
    """

    def __init__(
        self, path: Path, *, initial: float = INITIAL_SCORE, writer: Writer | None = None
    ) -> None:
        self.path = Path(path)
        self.initial = _unit(initial, "initial")
        self.writer = writer
        self._lock = threading.Lock()
        self._conn = open_database(self.path)
        with self._lock, transaction(self._conn) as conn:
            conn.execute(_SCHEMA)
        self._mirror: dict[str, Standing] | None = None
        if writer is not None:
            rows = self._conn.execute(f"SELECT {_COLUMNS} FROM reputation").fetchall()
            self._mirror = {row[0]: Standing(*row) for row in rows}

    def __enter__(self) -> ReputationStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------

    def _fresh(self, peer: str) -> Standing:
        return Standing(peer, self.initial, "ok", 0, 0, "")

    def _load(self, peer: str) -> Standing:
        """The stored standing, or a fresh one; call with the lock held."""
        if not isinstance(peer, str) or not peer:
            raise ValueError(f"peer must be a non-empty string, got {peer!r}")
        if self._mirror is not None:
            return self._mirror.get(peer) or self._fresh(peer)
        row = self._conn.execute(
            f"SELECT {_COLUMNS} FROM reputation WHERE peer = ?", (peer,)
        ).fetchone()
        return self._fresh(peer) if row is None else Standing(*row)

    def _update(self, peer: str, change: Callable[[Standing], Standing]) -> Standing:
        """Read, change and write one peer's row (in one write transaction, or in the
        mirror at once and through the writer)."""
        if self._mirror is not None:
            assert self.writer is not None
            with self._lock:
                standing = change(self._load(peer))
                self._mirror[peer] = standing
                self.writer.submit(lambda conn: _store(conn, standing))
            return standing
        with self._lock, transaction(self._conn):
            standing = change(self._load(peer))
            _store(self._conn, standing)
        return standing

    # -- public API --------------------------------------------------------------

    def record(
        self,
        peer: str,
        round: int,
        ok: bool,
        reason: str = "",
        *,
        penalty: float = 0.2,
        reward: float = 0.02,
    ) -> Standing:
        """Record one judged contribution from ``peer``.

        A good one adds ``reward`` to the score; a violation subtracts ``penalty``,
        counts one more violation and keeps ``reason``. The score stays in ``[0, 1]``.
        The status is not changed here beyond lifting an expired quarantine: what
        a violation leads to is the policy's call (:meth:`quarantine`, :meth:`ban`).

        Args:
            peer: the PeerID.
            round: the round of the contribution.
            ok: whether the contribution passed.
            reason: why it failed (kept only for violations).
            penalty: score lost on a violation, in ``[0, 1]``.
            reward: score gained on a good contribution, in ``[0, 1]``.

        Returns:
            The new standing.
        """
        round = _round(round)
        penalty, reward = _unit(penalty, "penalty"), _unit(reward, "reward")

        def change(old: Standing) -> Standing:
            now = _in_effect(old, round)
            if ok:
                return replace(now, score=_clamp(now.score + reward))
            return replace(
                now, score=_clamp(now.score - penalty), violations=now.violations + 1, reason=reason
            )

        standing = self._update(peer, change)
        if not ok:
            logger.info(
                "peer %s violation %d at round %d (%s): score %.3f",
                peer,
                standing.violations,
                round,
                reason,
                standing.score,
            )
        return standing

    def quarantine(self, peer: str, round: int, rounds: int, reason: str) -> Standing:
        """Exclude ``peer`` from rounds ``round`` to ``round + rounds - 1``.

        A peer already quarantined for longer keeps the later end; a banned peer
        stays banned (a ban is never shortened into a quarantine).

        Args:
            peer: the PeerID.
            round: the current round.
            rounds: how many rounds the quarantine lasts, at least 1.
            reason: why, for the log and for :attr:`Standing.reason`.

        Returns:
            The new standing.
        """
        round, rounds = _round(round), _round(rounds, "rounds")
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {rounds}")

        def change(old: Standing) -> Standing:
            if old.status == "banned":
                return old
            now = _in_effect(old, round)
            until = round + rounds
            if now.status == "quarantined":
                until = max(until, now.until_round)
            return replace(now, status="quarantined", until_round=until, reason=reason)

        standing = self._update(peer, change)
        if standing.status == "quarantined":
            logger.warning(
                "peer %s quarantined until round %d: %s", peer, standing.until_round, reason
            )
        return standing

    def ban(self, peer: str, reason: str) -> Standing:
        """Exclude ``peer`` for good (until :meth:`pardon`).

        Args:
            peer: the PeerID.
            reason: why, for the log and for :attr:`Standing.reason`.

        Returns:
            The new standing.
        """

        def change(old: Standing) -> Standing:
            return replace(old, status="banned", until_round=0, reason=reason)

        standing = self._update(peer, change)
        logger.warning("peer %s banned: %s", peer, reason)
        return standing

    def pardon(self, peer: str, reason: str = "pardoned") -> Standing:
        """Lift a ban or quarantine by operator decision; score and violations stay.

        Args:
            peer: the PeerID.
            reason: why, for the log and for :attr:`Standing.reason`.

        Returns:
            The new standing.
        """

        def change(old: Standing) -> Standing:
            return replace(old, status="ok", until_round=0, reason=reason)

        standing = self._update(peer, change)
        logger.warning("peer %s pardoned: %s", peer, reason)
        return standing

    def standing(self, peer: str, round: int) -> Standing:
        """A peer's standing as of ``round``.

        Args:
            peer: the PeerID.
            round: the current round; a quarantine with ``until_round <= round`` has
                expired and the peer reads as ``"ok"``.

        Returns:
            The standing; an unknown peer gets the initial score and ``"ok"``.
        """
        round = _round(round)
        with self._lock:
            return _in_effect(self._load(peer), round)

    def excluded(self, round: int) -> set[str]:
        """Peers not to group with at ``round``: banned, or quarantined past ``round``."""
        round = _round(round)
        if self._mirror is not None:
            with self._lock:
                return {
                    s.peer
                    for s in self._mirror.values()
                    if s.status == "banned" or (s.status == "quarantined" and s.until_round > round)
                }
        with self._lock:
            rows = self._conn.execute(
                "SELECT peer FROM reputation WHERE status = 'banned'"
                " OR (status = 'quarantined' AND until_round > ?)",
                (round,),
            ).fetchall()
        return {peer for (peer,) in rows}

    def all(self) -> list[Standing]:
        """Every known peer's stored standing, sorted by PeerID.

        With no round to compare against, a quarantine reads as stored, even when it
        has since expired; use :meth:`standing` for the standing at a given round.
        """
        with self._lock:
            if self._mirror is not None:
                return [self._mirror[p] for p in sorted(self._mirror)]
            rows = self._conn.execute(f"SELECT {_COLUMNS} FROM reputation ORDER BY peer").fetchall()
        return [Standing(*row) for row in rows]

    def close(self) -> None:
        """Close the connection; safe to call twice."""
        with self._lock:
            self._conn.close()
