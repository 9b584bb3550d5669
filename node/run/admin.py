"""Operator commands to a node (``atoll ban``, ``atoll pardon``), running or not.

A running node holds its reputations in memory and writes them through its own writer,
so an edit of its SQLite file made behind its back would be overwritten. Commands for
a running node therefore go through its data directory: the CLI drops one small JSON
file into ``DATA_DIR/admin/`` and the node, which looks there every
``network.registry_seconds``, takes it (renaming it first, so a command is applied
once), applies it through its verifier (reputation, audit row, event) and leaves the
outcome beside it for the CLI to read. A node that is not running is changed
directly, by the same code.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verification.files import atomic_write
from verification.identity import public_key_from_peer_id

__all__ = ["ADMIN_DIR", "OPS", "AdminInbox", "Command", "submit"]

logger = logging.getLogger(__name__)

ADMIN_DIR = "admin"
OPS = ("ban", "pardon")
_MAX_COMMAND_BYTES = 4096
_MAX_REASON = 200
_POLL_SECONDS = 0.1


@dataclass(frozen=True)
class Command:
    """One operator command: ``op`` (``ban`` or ``pardon``) on ``peer``, with a reason."""

    op: str
    peer: str
    reason: str

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown command {self.op!r}: expected one of {', '.join(OPS)}")
        try:
            public_key_from_peer_id(self.peer)
        except Exception:  # any decoding failure: not an Ed25519 PeerID
            raise ValueError(f"{self.peer!r} is not a PeerID (12D3KooW...)") from None
        if not isinstance(self.reason, str) or not self.reason.strip():
            raise ValueError("give a reason (--reason): it goes into the audit log")
        if len(self.reason) > _MAX_REASON:
            raise ValueError(f"the reason is longer than {_MAX_REASON} characters")

    def to_json(self) -> bytes:
        return json.dumps({"op": self.op, "peer": self.peer, "reason": self.reason}).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Command:
        """Raises ValueError for anything but a well-formed command."""
        if len(data) > _MAX_COMMAND_BYTES:
            raise ValueError(f"command of {len(data)} bytes")
        try:
            fields = json.loads(data)
        except ValueError:
            raise ValueError("not JSON") from None
        if not isinstance(fields, dict) or set(fields) != {"op", "peer", "reason"}:
            raise ValueError("a command is {op, peer, reason}")
        return cls(fields["op"], fields["peer"], fields["reason"])


def submit(data_dir: Path, command: Command, timeout: float = 20.0) -> dict[str, Any]:
    """Hand ``command`` to the node running in ``data_dir`` and wait for its outcome.

    Returns:
        The node's answer: ``{"ok": True, "standing": {...}}`` or ``{"ok": False,
        "error": ...}``.

    Raises:
        TimeoutError: the node did not take the command within ``timeout``; the command
            stays queued and is applied when the node next looks.
    """
    folder = Path(data_dir) / ADMIN_DIR
    folder.mkdir(parents=True, exist_ok=True)
    name = f"{time.time_ns()}-{os.getpid()}"
    atomic_write(folder / f"{name}.json", command.to_json(), durable=False)
    done = folder / f"{name}.done"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if done.exists():
            answer = json.loads(done.read_text())
            done.unlink()
            return answer  # type: ignore[no-any-return]
        time.sleep(_POLL_SECONDS)
    raise TimeoutError(
        f"the node did not take the command within {timeout:.0f} s; it stays queued in "
        f"{folder} and is applied when the node next looks"
    )


class AdminInbox:
    """The node's side: takes queued commands and applies them.

    Args:
        data_dir: the node's data directory.
        apply: applies one command; returns the peer's new standing as a dict.
    """

    def __init__(self, data_dir: Path, apply: Callable[[Command], dict[str, Any]]) -> None:
        self.folder = Path(data_dir) / ADMIN_DIR
        self.apply = apply

    def poll(self) -> int:
        """Apply every queued command, oldest first; returns how many were taken."""
        if not self.folder.is_dir():
            return 0
        taken = 0
        for request in sorted(self.folder.glob("*.json")):
            taking = request.with_suffix(".taking")
            try:
                os.replace(request, taking)  # once: a second poll finds it gone
            except FileNotFoundError:
                continue
            taken += 1
            try:
                command = Command.from_json(taking.read_bytes())
                answer: dict[str, Any] = {"ok": True, "standing": self.apply(command)}
            except ValueError as exc:
                answer = {"ok": False, "error": str(exc)}
                logger.warning("operator command %s refused: %s", request.name, exc)
            atomic_write(request.with_suffix(".done"), json.dumps(answer).encode(), durable=False)
            taking.unlink(missing_ok=True)
        return taken
