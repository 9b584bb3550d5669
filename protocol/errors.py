"""Errors raised when bytes from a peer (or from disk) break the wire rules.

:class:`ProtocolError` is :class:`~verification.errors.VerificationError` under the name
the protocol raises it by: one class, with ``reason``, ``detail`` and ``peer``, so
``except ProtocolError`` also catches a verification rule's refusal and the other way
round.
"""

from __future__ import annotations

from verification.errors import VerificationError

__all__ = ["ProtocolError"]

ProtocolError = VerificationError
"""A message that is malformed, oversized, replayed, mis-signed or otherwise refused
(``reason``, ``detail``, ``peer``)."""
