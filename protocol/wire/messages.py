"""The wire format: versioned, signed msgpack envelopes.

Every message on the wire is::

    wire        = msgpack([version, signed_bytes, signature])
    signed_bytes = msgpack([version, kind, run_id, round, fragment, part, sender, body])
    digest      = sha256(signed_bytes)
    signature   = Ed25519(sender's key, b"atoll/envelope/v1\0" + digest)   # 64 bytes

Signing the digest rather than the whole payload costs one SHA-256 pass instead of
Ed25519's two SHA-512 passes (several times faster on multi-megabyte tensor parts),
and the digest is the same value audit logs and commitments name. The domain tag
keeps an envelope signature from ever passing as a signature over anything else.

The signature covers every header field and the body, so nothing a receiver acts on
is unsigned. The sender is a PeerID that embeds its own public key, so the receiver
verifies with nothing but the message. msgpack only: nothing here ever unpickles.

:func:`open_envelope` is the single gate for bytes from peers. It checks the size
before parsing, parses with hard msgpack limits so hostile input cannot blow up
memory, and reports every refusal as a :class:`~protocol.errors.ProtocolError` whose
``reason`` is one of ``oversized``, ``malformed``, ``bad_version``, ``wrong_run``,
``wrong_kind``, ``stale_round``, ``sender_mismatch`` or ``bad_signature``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import msgpack

from protocol.errors import ProtocolError
from protocol.wire._limits import bounded_unpackb, count_items
from verification.errors import VerificationError
from verification.identity import Domain, Identity, public_key_from_peer_id

__all__ = [
    "ENVELOPE",
    "MAX_BODY_ITEMS",
    "MAX_MESSAGE_BYTES",
    "MAX_NAME_CHARS",
    "PROTOCOL_VERSION",
    "Envelope",
    "Header",
    "check_header",
    "envelope_digest",
    "header_problem",
    "open_envelope",
    "parse_signed_frame",
    "seal",
    "verify_signed",
]

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 64 * 2**20
"""Default hard cap on one message on the wire; callers may pass a smaller one."""
MAX_BODY_ITEMS = 2**16
"""Cap on the total number of array elements and map entries in one body.

A one-byte msgpack ``{}`` becomes a ~64-byte Python dict, so without a count a
64 MiB message could expand to gigabytes. Tensors travel as single ``bytes`` values,
so real bodies stay far below this.
"""
MAX_NAME_CHARS = 128
"""Longest ``kind``, ``run_id`` or ``sender`` accepted in a header."""

_SIGNATURE_LEN = 64
ENVELOPE = Domain(b"atoll/envelope/v1\0")
"""What an envelope's signature is made in: over the SHA-256 of its signed bytes."""


def verify_signed(sender: str, raw_signed: bytes, signature: bytes) -> bool:
    """Check a signature over ``raw_signed`` by ``sender`` (for evidence anyone can re-check)."""
    return ENVELOPE.verify(sender, hashlib.sha256(raw_signed).digest(), signature)


_MAX_HEADER_INT = 2**63 - 1
_OUTER_LEN = 3
_SIGNED_LEN = 8


@dataclass(frozen=True)
class Header:
    """What a message is about; every field is covered by the signature.

    Attributes:
        kind: message type, e.g. ``"part"``, ``"reduced"``, ``"state_req"``,
            ``"state_chunk"``, ``"announce"``.
        run_id: the training run this message belongs to.
        round: the outer round it belongs to.
        fragment: the model fragment it carries (0 when not about a fragment).
        part: the part index within the fragment's all-reduce (0 when unused).
        sender: the signer's PeerID in base58.
    """

    kind: str
    run_id: str
    round: int
    fragment: int
    part: int
    sender: str


@dataclass(frozen=True)
class Envelope:
    """A received message whose signature and header have been checked.

    Attributes:
        header: the signed header.
        body: the signed body; a dict with str keys, values as msgpack gives them
            (lists for arrays, ``bytes`` for binary).
        signature: the sender's 64-byte Ed25519 signature over the digest.
        raw_signed: the exact bytes that were signed (a view into the received
            message, not a copy), kept as evidence: anyone can re-check them with
            :func:`verify_signed`.
        digest: SHA-256 of ``raw_signed``: the payload digest for audit logs and
            commitments. It covers the header and body exactly as signed, not the
            signature, so it names *what was said*; Ed25519 signing is deterministic,
            so re-sealing the same content gives the same digest.
    """

    header: Header
    body: dict[str, Any]
    signature: bytes
    raw_signed: bytes | memoryview
    digest: bytes


def seal(identity: Identity, header: Header, body: dict[str, Any]) -> bytes:
    """Sign and encode one message.

    Args:
        identity: the key to sign with; must be the one named in ``header.sender``.
        header: the message header.
        body: a msgpack-able dict with str keys (``bytes`` values travel as binary).

    Returns:
        The wire bytes.

    Raises:
        ValueError: if the sender is not ``identity``, a header field is out of range,
            the body has non-str keys or too many items, or the result exceeds
            ``MAX_MESSAGE_BYTES`` (a receiver would refuse all of these).
        TypeError: if the body holds a value msgpack cannot encode.
    """
    if header.sender != identity.peer_id:
        raise ValueError(
            f"header.sender {header.sender!r} is not this identity ({identity.peer_id})"
        )
    problem = header_problem(header) or _body_problem(body)
    if problem:
        raise ValueError(problem)
    if count_items(body) > MAX_BODY_ITEMS:
        raise ValueError(f"body has more than {MAX_BODY_ITEMS} items")
    signed = msgpack.packb(
        [
            PROTOCOL_VERSION,
            header.kind,
            header.run_id,
            header.round,
            header.fragment,
            header.part,
            header.sender,
            body,
        ],
        use_bin_type=True,
    )
    signature = ENVELOPE.sign(identity, hashlib.sha256(signed).digest())
    # The same bytes msgpack.packb([version, signed, signature]) writes, assembled with
    # one copy of the (possibly many-megabyte) signed payload instead of two.
    wire = b"".join((_OUTER_HEAD, _bin_header(len(signed)), signed, _SIGNATURE_HEAD, signature))
    if len(wire) > MAX_MESSAGE_BYTES:
        raise ValueError(f"message is {len(wire)} bytes, over the {MAX_MESSAGE_BYTES} byte cap")
    return wire


def envelope_digest(data: bytes) -> bytes:
    """The digest a sealed message's signature covers, without checking the signature.

    This is the value a sender commits to before an exchange and the value the
    receiver's :class:`Envelope` carries after :func:`open_envelope`.

    Raises:
        ProtocolError: ``malformed`` bytes.
    """
    signed, _ = parse_signed_frame(bytes(data), PROTOCOL_VERSION)
    return hashlib.sha256(signed).digest()


def open_envelope(
    data: bytes,
    *,
    max_bytes: int = MAX_MESSAGE_BYTES,
    expected_sender: str | None = None,
    run_id: str | None = None,
    kinds: Collection[str] | None = None,
    round_window: tuple[int, int] | None = None,
) -> Envelope:
    """Parse, authenticate and check one message from a peer.

    Checks run cheapest-first up to the signature, then the signature, then the
    header against what the caller expects, so a ``wrong_run``/``wrong_kind``/
    ``stale_round`` refusal is always attributable to the key that signed it.

    Args:
        data: the wire bytes.
        max_bytes: refuse anything longer, before parsing.
        expected_sender: the stream's authenticated PeerID (``ctx.remote_id``); the
            signed sender must equal it, so a peer cannot relay another's message as
            its own contribution.
        run_id: the only run accepted.
        kinds: the message kinds accepted.
        round_window: inclusive ``(lo, hi)`` range of accepted rounds; anything
            outside is a replay or from a peer too far behind or ahead.

    Returns:
        The checked envelope.

    Raises:
        ProtocolError: for any refused input (and nothing else for bad bytes).
        ValueError: if ``round_window`` itself is inverted (a caller bug).
    """
    if round_window is not None and round_window[0] > round_window[1]:
        raise ValueError(f"round_window {round_window} has lo > hi")
    peer = expected_sender
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError("malformed", f"expected bytes, got {type(data).__name__}", peer)
    if len(data) > max_bytes:
        raise ProtocolError("oversized", f"{len(data)} bytes > {max_bytes}", peer)

    view = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
    fast = _split_outer(view)
    signed, signature = (
        fast if fast is not None else parse_signed_frame(bytes(data), PROTOCOL_VERSION, peer)
    )
    header, body = _parse_signed(signed, peer)
    if expected_sender is not None and header.sender != expected_sender:
        raise ProtocolError(
            "sender_mismatch", f"signed sender {header.sender} is not the stream peer", peer
        )
    peer = header.sender
    digest = hashlib.sha256(signed).digest()
    if not ENVELOPE.verify(header.sender, digest, signature):
        raise ProtocolError("bad_signature", f"{header.kind} r{header.round}", peer)
    check_header(header, run_id=run_id, kinds=kinds, round_window=round_window)
    return Envelope(header=header, body=body, signature=signature, raw_signed=signed, digest=digest)


_OUTER_HEAD = bytes((0x93, PROTOCOL_VERSION))  # fixarray of 3, then the version
_SIGNATURE_HEAD = bytes((0xC4, _SIGNATURE_LEN))  # bin8 of 64 bytes


def _bin_header(n: int) -> bytes:
    if n < 2**8:
        return bytes((0xC4, n))
    if n < 2**16:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


def _split_outer(view: memoryview) -> tuple[memoryview, bytes] | None:
    """Zero-copy split of a well-formed outer frame; None sends it to the strict parser."""
    if len(view) < 5 or bytes(view[:2]) != _OUTER_HEAD:
        return None
    kind = view[2]
    size = {0xC4: 1, 0xC5: 2, 0xC6: 4}.get(kind)
    if size is None or len(view) < 3 + size:
        return None
    n = int.from_bytes(view[3 : 3 + size], "big")
    start = 3 + size
    end = start + n
    if len(view) != end + 2 + _SIGNATURE_LEN or bytes(view[end : end + 2]) != _SIGNATURE_HEAD:
        return None
    return view[start:end], bytes(view[end + 2 :])


def parse_signed_frame(data: bytes, version: int, peer: str | None = None) -> tuple[bytes, bytes]:
    """Split a signed frame ``msgpack([version, signed, signature])`` (an envelope, or a
    control message of :mod:`protocol.control.frames`) into its signed bytes and its
    signature, with hard msgpack limits; the signature is not checked here.

    Args:
        data: the wire bytes.
        version: the only version accepted.
        peer: named in the error, when known.

    Raises:
        ProtocolError: ``malformed``, or ``bad_version`` for a frame of another version.
    """
    try:
        outer = bounded_unpackb(data, max_container=16, max_str_len=MAX_NAME_CHARS)
    except ValueError as e:
        raise ProtocolError("malformed", f"outer frame: {e}", peer) from None
    if not isinstance(outer, list) or not outer:
        raise ProtocolError("malformed", "outer frame is not a non-empty array", peer)
    # The version comes first so that a future layout is reported as a version
    # mismatch rather than as garbage.
    if type(outer[0]) is not int:
        raise ProtocolError("malformed", "version is not an int", peer)
    if outer[0] != version:
        raise ProtocolError("bad_version", f"version {outer[0]}, expected {version}", peer)
    if len(outer) != _OUTER_LEN:
        raise ProtocolError("malformed", f"outer frame has {len(outer)} items, expected 3", peer)
    _, signed, signature = outer
    if not isinstance(signed, bytes) or not isinstance(signature, bytes):
        raise ProtocolError("malformed", "signed payload and signature must be binary", peer)
    return signed, signature


def _parse_signed(signed: bytes, peer: str | None) -> tuple[Header, dict[str, Any]]:
    try:
        fields = bounded_unpackb(
            signed,
            max_container=MAX_BODY_ITEMS,
            max_str_len=len(signed),
            max_items=MAX_BODY_ITEMS + _SIGNED_LEN,
        )
    except ValueError as e:
        raise ProtocolError("malformed", f"signed payload: {e}", peer) from None
    if not isinstance(fields, list) or len(fields) != _SIGNED_LEN:
        raise ProtocolError("malformed", "signed payload is not an 8-item array", peer)
    version, *header_fields, body = fields
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError("malformed", "signed version differs from the frame's", peer)
    header = Header(*header_fields)
    problem = header_problem(header) or _body_problem(body)
    if problem:
        raise ProtocolError("malformed", problem, peer)
    return header, body


def check_header(
    header: Header,
    *,
    run_id: str | None = None,
    kinds: Collection[str] | None = None,
    round_window: tuple[int, int] | None = None,
) -> None:
    """Check an authenticated header against what the caller accepts (shared with
    :mod:`protocol.wire.partwire`).

    Raises:
        ProtocolError: ``wrong_run``, ``wrong_kind`` or ``stale_round``, naming the signer.
    """
    peer = header.sender
    if run_id is not None and header.run_id != run_id:
        raise ProtocolError("wrong_run", f"run {header.run_id!r}, expected {run_id!r}", peer)
    if kinds is not None and header.kind not in kinds:
        raise ProtocolError("wrong_kind", f"kind {header.kind!r} not accepted here", peer)
    if round_window is not None and not round_window[0] <= header.round <= round_window[1]:
        raise ProtocolError(
            "stale_round",
            f"round {header.round} outside [{round_window[0]}, {round_window[1]}]",
            peer,
        )


def header_problem(header: Header) -> str | None:
    """Why a header is unacceptable, or None (shared with :mod:`protocol.wire.partwire`)."""
    for name in ("kind", "run_id", "sender"):
        value = getattr(header, name)
        if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME_CHARS:
            return f"header.{name} must be a str of 1..{MAX_NAME_CHARS} chars"
    for name in ("round", "fragment", "part"):
        value = getattr(header, name)
        # type() rather than isinstance(): msgpack decodes true/false as bools.
        if type(value) is not int or not 0 <= value <= _MAX_HEADER_INT:
            return f"header.{name} must be an int in [0, 2**63)"
    try:
        public_key_from_peer_id(header.sender)
    except VerificationError as e:
        return f"header.sender is not an Ed25519 PeerID: {e.detail}"
    return None


def _body_problem(body: object) -> str | None:
    if not isinstance(body, dict):
        return f"body must be a dict, got {type(body).__name__}"
    if not all(isinstance(key, str) for key in body):
        return "body keys must be str"
    return None
