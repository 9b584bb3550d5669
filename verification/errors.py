"""The one error for bytes, keys or claims from a peer that do not hold up.

Protocol code raises it under the name :class:`~protocol.errors.ProtocolError` (the same
class), so a refusal by a wire parser and one by a verification rule are caught alike.
"""

from __future__ import annotations

__all__ = ["VerificationError"]


class VerificationError(Exception):
    """A message, signature, key, contribution or claim that fails verification.

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
