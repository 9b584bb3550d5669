"""Inspecting a node's hash-chained audit log from its data directory: ``atoll audit
verify`` (the chain), ``show`` (its rows) and ``blame`` (whose contributions are in the
model at a round).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from verification.audit import AuditLog

__all__ = ["cmd_audit"]


def cmd_audit(args: argparse.Namespace) -> int:
    """``atoll audit verify``, ``show`` and ``blame``."""
    log = _open_audit(args.data_dir)
    try:
        if args.audit_command == "verify":
            return _audit_verify(log)
        if args.audit_command == "show":
            return _audit_show(log, args)
        return _audit_blame(log, args)
    finally:
        log.close()


def _open_audit(data_dir: str) -> AuditLog:
    from verification.audit import AuditLog

    db = Path(data_dir).expanduser() / "atoll.db"
    if not db.exists():
        raise ValueError(f"no audit log at {db} (is --data-dir a node's data directory?)")
    return AuditLog(db)


def _audit_verify(log: AuditLog) -> int:
    ok, bad, reason = log.verify()
    count, head = log.head()
    if ok:
        print(f"audit log OK: {count} rows, head {head[:16]}")
        return 0
    where = f"row {bad}" if bad is not None else "the chain head"
    print(f"audit log BROKEN at {where}: {reason}")
    return 1


def _audit_show(log: AuditLog, args: argparse.Namespace) -> int:
    peer = _resolve_peer(log, args.peer)
    rows = log.rows(round=args.round, peer=peer, limit=args.limit)
    if args.json:
        for row in rows:
            print(json.dumps(row.__dict__))
        return 0
    print(f"{'id':>6} {'round':>5} {'frag':>4} {'part':>4}  {'sender':<16} {'tokens':>8}  verdict")
    for row in rows:
        reason = f" ({row.reason})" if row.reason else ""
        print(
            f"{row.id:>6} {row.round:>5} {row.fragment:>4} {row.part:>4}  "
            f"...{row.sender[-13:]:<13} {row.tokens:>8}  {row.verdict}{reason}"
        )
    return 0


def _audit_blame(log: AuditLog, args: argparse.Namespace) -> int:
    blame = log.blame(args.round)
    if args.json:
        print(json.dumps(blame))
        return 0
    if not blame:
        print(
            f"round {args.round}: no rows in this node's audit log (it owned no part that "
            "round, or the round has not happened here)"
        )
        return 0
    print(f"round {args.round}: contributions in the model")
    for peer, counts in sorted(blame.items()):
        print(
            f"  {peer}  accepted {counts['accepted']:>3}  rejected {counts['rejected']:>3}  "
            f"tokens {counts['tokens']}"
        )
    return 0


def _resolve_peer(log: AuditLog, peer: str | None) -> str | None:
    """A full PeerID from what the operator typed: the PeerID itself, or the shortened
    form ``atoll audit show`` prints (``...`` and its last characters)."""
    if peer is None:
        return None
    suffix = peer.lstrip(".…")
    if suffix == peer and len(peer) >= 46:
        return peer  # a whole PeerID
    senders = sorted({row.sender for row in log.rows() if row.sender.endswith(suffix)})
    if len(senders) == 1:
        return senders[0]
    if not senders:
        raise ValueError(f"no sender in the audit log ends with {suffix!r}")
    raise ValueError(f"{suffix!r} matches {len(senders)} senders: {', '.join(senders)}")
