"""What a node writes down about peers: its audit rows and reputations, under one lock.

One :class:`Ledger` per node holds the SQLite file's writer, its audit log and its
reputation store. Rows and good marks are queued and written off the critical path by
the writer's thread; the stores are used from the transport's loop thread and from the
training thread, so every use takes the ledger's lock.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

from verification.audit import AuditLog
from verification.records import Contribution
from verification.reputation import ReputationStore
from verification.writer import Writer

__all__ = ["Ledger"]


class Ledger:
    """A node's audit log and reputation store, written by one thread.

    Args:
        db_path: the node's SQLite file.
        me: this node's PeerID (its own contributions earn no good mark).
    """

    def __init__(self, db_path: Path, me: str) -> None:
        self.me = me
        self.writer = Writer(db_path)
        self.audit = AuditLog(db_path, writer=self.writer)
        self.reputation = ReputationStore(db_path, writer=self.writer)
        self.lock = threading.RLock()
        """Taken by every use of the stores (the standings share it)."""

    def row(
        self, round_: int, fragment: int, part: int, sender: str, verdict: str, reason: str
    ) -> None:
        """One audit row about a message or a peer rather than a contribution."""
        row = dict(
            round=round_,
            fragment=fragment,
            part=part,
            sender=sender,
            digest="",
            tokens=0,
            verdict=verdict,
            reason=reason,
        )
        with self.lock:
            self.audit.append_later([row])

    def reduction(
        self,
        round_: int,
        fragment: int,
        part: int,
        contributions: Sequence[Contribution],
        used: Sequence[str],
        rejected: dict[str, str],
    ) -> None:
        """One audit row per contribution; a good mark for each peer in the result."""
        rows = []
        for c in contributions:
            if c.peer == self.me:
                verdict, reason = "own", "" if c.peer in used else rejected.get(c.peer, "")
            elif c.peer in used:
                verdict, reason = "accepted", ""
            else:
                verdict, reason = "rejected", rejected[c.peer]
            rows.append(
                dict(
                    round=round_,
                    fragment=fragment,
                    part=part,
                    sender=c.peer,
                    digest=c.digest,
                    tokens=int(c.tokens),
                    verdict=verdict,
                    reason=reason,
                )
            )
        with self.lock:
            self.audit.append_later(rows)
            for peer in used:
                if peer != self.me:
                    self.reputation.record(peer, round_, ok=True)

    def flush(self, timeout: float = 30.0) -> bool:
        """Commit every queued audit row and reputation change."""
        return self.writer.flush(timeout)

    def close(self) -> None:
        """Flush and close the SQLite file (nothing queued is lost)."""
        self.writer.close()
        with self.lock:
            self.audit.close()
            self.reputation.close()
