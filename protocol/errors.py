"""Errors raised when bytes from a peer (or from disk) break the wire rules."""

from __future__ import annotations

__all__ = ["ProtocolError"]


class ProtocolError(Exception):
    """A message that is malformed, oversized, replayed, mis-signed or otherwise refused.

    Args:
        reason: short machine-friendly reason, e.g. ``"bad_signature"``.
        detail: human-readable detail for the log line.
        peer: the PeerID the bytes came from, when known.
    """

    def __init__(self, reason: str, detail: str = "", peer: str | None = None) -> None:
        self.reason = reason
        self.detail = detail
        self.peer = peer
        text = reason if not detail else f"{reason}: {detail}"
        if peer:
            text = f"{text} (peer {peer})"
        super().__init__(text)
