"""A signed commitment on the wire: the fields of its body, and opening one from its bytes.

A commitment is a control message on the ``commit`` topic whose body names
``(round, fragment, content)`` and the digest of each part (see
:mod:`protocol.control.commitments`); its signed bytes are the evidence a verdict shows.
"""

from __future__ import annotations

from typing import Any

import msgpack

from protocol.averaging.parts import CONTENTS
from protocol.control.frames import (
    CONTROL_VERSION,
    DEFAULT_MAX_CONTROL_BYTES,
    ControlMessage,
    open_control,
    topic_name,
)
from protocol.errors import ProtocolError
from verification.evidence import SignedCommit

__all__ = ["commit_fields", "commit_wire", "open_commit"]


def commit_fields(body: Any) -> tuple[int, int, str, dict[int, bytes]]:
    """``(round, fragment, content, {part: digest})`` of a commitment's body.

    Raises:
        ProtocolError: ``malformed``: not a commitment.
    """
    if not isinstance(body, dict):
        raise ProtocolError("malformed", "commitment body is not a map")
    r, f, pairs = body.get("round"), body.get("fragment"), body.get("digests")
    content = body.get("content")
    if not (isinstance(r, int) and isinstance(f, int) and r >= 0 and f >= 0):
        raise ProtocolError("malformed", "commitment round and fragment must be integers")
    if content not in CONTENTS:
        raise ProtocolError("malformed", f"commitment content {content!r}")
    if not isinstance(pairs, list):
        raise ProtocolError("malformed", "commitment digests must be a list")
    digests: dict[int, bytes] = {}
    for pair in pairs:
        if not (
            isinstance(pair, list)
            and len(pair) == 2
            and isinstance(pair[0], int)
            and isinstance(pair[1], bytes)
            and len(pair[1]) == 32
        ):
            raise ProtocolError("malformed", "a commitment digest is not [part, 32 bytes]")
        digests[pair[0]] = pair[1]
    return r, f, str(content), digests


def open_commit(data: bytes, run: str, max_bytes: int = DEFAULT_MAX_CONTROL_BYTES) -> SignedCommit:
    """Check a signed commitment (its signature, run, topic and body) from its bytes.

    Raises:
        ProtocolError: as :func:`~protocol.control.frames.open_control`, or ``malformed``.
    """
    msg = open_control(data, run, topic_name(run, "commit"), max_bytes)
    r, f, content, digests = commit_fields(msg.body)
    return SignedCommit(msg.sender, r, f, content, digests, bytes(data))


def commit_wire(msg: ControlMessage) -> bytes:
    """The signed message of an opened commitment, as bytes again (evidence)."""
    return msgpack.packb([CONTROL_VERSION, msg.raw_signed, msg.signature], use_bin_type=True)
