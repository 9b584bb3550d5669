"""The one error for what a peer sent that does not hold up, under both its names."""

from __future__ import annotations

import pytest

from protocol.errors import ProtocolError
from verification.errors import VerificationError


def test_the_message_carries_reason_detail_and_peer() -> None:
    error = VerificationError("bad_signature", "signature does not verify", peer="12D3KooWx")
    assert (error.reason, error.detail, error.peer) == (
        "bad_signature",
        "signature does not verify",
        "12D3KooWx",
    )
    assert str(error) == "bad_signature: signature does not verify (peer 12D3KooWx)"


def test_without_detail_or_peer_the_message_is_the_reason() -> None:
    error = VerificationError("malformed")
    assert str(error) == "malformed" and error.detail == "" and error.peer is None


def test_a_protocol_error_and_a_verification_error_are_caught_alike() -> None:
    with pytest.raises(VerificationError):
        raise ProtocolError("oversized", "too big")
    with pytest.raises(ProtocolError, match="bad_evidence"):
        raise VerificationError("bad_evidence")
