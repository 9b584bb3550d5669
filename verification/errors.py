"""Errors raised when a peer's contribution or claim does not hold up."""

from __future__ import annotations

__all__ = ["VerificationError"]


class VerificationError(Exception):
    """A signature, key or contribution that fails verification.

    Args:
        reason: short machine-friendly reason, e.g. ``"bad_signature"``.
        detail: human-readable detail for the log line.
        peer: the PeerID concerned, when known.
    """

    def __init__(self, reason: str, detail: str = "", peer: str | None = None) -> None:
        self.reason = reason
        self.detail = detail
        self.peer = peer
        text = reason if not detail else f"{reason}: {detail}"
        if peer:
            text = f"{text} (peer {peer})"
        super().__init__(text)
