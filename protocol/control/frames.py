"""The control channel's wire format and the node-to-sidecar pipe framing.

A control message is a small signed broadcast (heartbeat, round commitment,
accusation, verdict) carried by GossipSub::

    wire   = msgpack([version, signed, signature])
    signed = msgpack({"v": 1, "run": str, "topic": str, "sender": PeerID,
                      "ts": float, "seq": int, "body": any msgpack value})
    signature = Ed25519(sender's key, b"atoll/control/v1\\0" + sha256(signed))

It mirrors :mod:`protocol.wire.messages` (the envelope for tensor traffic) with its
own domain tag, so a control signature can never pass as an envelope signature
or the other way round. The signature covers the run and the topic, so a
message cannot be replayed into another run or moved to another topic.

:func:`open_control` is the one gate for control bytes from the network. It
checks the size before parsing, parses with hard msgpack limits, and reports
every refusal as a :class:`~protocol.errors.ProtocolError` whose ``reason`` is
one of ``oversized``, ``malformed``, ``bad_version``, ``bad_signature``,
``wrong_run``, ``wrong_topic`` or ``stale``.

The second half of the module is the pipe framing between a node and its
sidecar process (:mod:`protocol.control.sidecar`): each frame is a big-endian u32
length followed by that many bytes of msgpack.

The outer frame is parsed by :func:`protocol.wire.messages.parse_signed_frame`, the
parser envelopes use. This module imports only the standard library, msgpack,
:mod:`protocol.wire.messages` and :mod:`verification`, because the sidecar process must
not import hivemind or torch (py-libp2p and hivemind cannot share an interpreter).
"""

from __future__ import annotations

import hashlib
import math
import struct
import time
from dataclasses import dataclass
from typing import IO, Any

import msgpack

from protocol.errors import ProtocolError
from protocol.wire._limits import bounded_unpackb, count_items, reject_ext
from protocol.wire.messages import parse_signed_frame
from verification.errors import VerificationError
from verification.identity import Domain, Identity, public_key_from_peer_id

__all__ = [
    "CONTROL",
    "CONTROL_VERSION",
    "DEFAULT_MAX_CONTROL_BYTES",
    "MAX_BODY_ITEMS",
    "MAX_CONTROL_BYTES",
    "MAX_FRAME_BYTES",
    "MAX_NAME_CHARS",
    "ControlMessage",
    "FrameDecoder",
    "encode_frame",
    "open_control",
    "read_frame",
    "sign_control",
    "topic_name",
    "verify_control",
    "write_frame",
]

CONTROL_VERSION = 1
DEFAULT_MAX_CONTROL_BYTES = 256 * 1024
"""Default cap on one control message on the wire."""
MAX_CONTROL_BYTES = 1024 * 1024 - 64 * 1024
"""Largest cap a caller may choose: py-libp2p refuses pubsub RPCs over 1 MiB,
and the message travels inside one with its libp2p signature and headers."""
MAX_BODY_ITEMS = 16 * 1024
"""Cap on array elements plus map entries in one body (see :func:`open_control`)."""
MAX_NAME_CHARS = 128
"""Longest run id or topic accepted."""
MAX_FRAME_BYTES = 4 * 1024 * 1024
"""Largest pipe frame either side accepts; one control message plus headroom."""

CONTROL = Domain(b"atoll/control/v1\0")
_SIGNATURE_LEN = 64
_MAX_SEQ = 2**63 - 1
_FIELDS = ("v", "run", "topic", "sender", "ts", "seq", "body")
_FRAME_HEADER = struct.Struct(">I")


def topic_name(run: str, topic: str) -> str:
    """The GossipSub topic of ``topic`` (``heartbeat``, ``commit``, ``verdict``) in
    ``run``: runs never share a topic."""
    return f"atoll/{run}/{topic}"


@dataclass(frozen=True)
class ControlMessage:
    """A control message whose signature, run and topic have been checked.

    Attributes:
        run: the training run it belongs to.
        topic: the GossipSub topic it was signed for.
        sender: the signer's PeerID in base58.
        ts: the sender's wall-clock time at signing (``time.time()``).
        seq: the sender's sequence number; ``(sender, seq)`` names the message.
        body: the signed body, as msgpack decodes it.
        signature: the 64-byte Ed25519 signature.
        raw_signed: the exact signed bytes, kept as evidence (re-check them with
            :func:`verify_control`).
        digest: SHA-256 of ``raw_signed``.
    """

    run: str
    topic: str
    sender: str
    ts: float
    seq: int
    body: Any
    signature: bytes
    raw_signed: bytes
    digest: bytes


def sign_control(
    identity: Identity,
    run: str,
    topic: str,
    seq: int,
    body: Any,
    *,
    ts: float | None = None,
    max_bytes: int = DEFAULT_MAX_CONTROL_BYTES,
) -> bytes:
    """Sign and encode one control message.

    Args:
        identity: the node's key; its PeerID becomes the sender.
        run: the run id.
        topic: the topic the message will be published on.
        seq: the sender's sequence number, in ``[0, 2**63)``.
        body: any msgpack-encodable value (``bytes`` travel as binary).
        ts: the timestamp to sign; ``time.time()`` when omitted.
        max_bytes: refuse to produce a message longer than this.

    Returns:
        The wire bytes.

    Raises:
        ValueError: if a field is out of range or the message exceeds ``max_bytes``
            (a receiver would refuse it).
        TypeError: if ``body`` holds a value msgpack cannot encode.
    """
    ts = time.time() if ts is None else float(ts)
    signed_map = {
        "v": CONTROL_VERSION,
        "run": run,
        "topic": topic,
        "sender": identity.peer_id,
        "ts": ts,
        "seq": seq,
        "body": body,
    }
    problem = _field_problem(signed_map)
    if problem:
        raise ValueError(problem)
    if count_items(body) > MAX_BODY_ITEMS:
        raise ValueError(f"body has more than {MAX_BODY_ITEMS} items")
    signed = msgpack.packb(signed_map, use_bin_type=True)
    signature = CONTROL.sign(identity, hashlib.sha256(signed).digest())
    wire = msgpack.packb([CONTROL_VERSION, signed, signature], use_bin_type=True)
    if len(wire) > max_bytes:
        raise ValueError(f"control message is {len(wire)} bytes, over the {max_bytes} byte cap")
    return wire


def verify_control(sender: str, raw_signed: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is ``sender``'s control signature over ``raw_signed``."""
    if not isinstance(raw_signed, (bytes, bytearray)):
        return False
    return CONTROL.verify(sender, hashlib.sha256(raw_signed).digest(), signature)


def open_control(
    data: bytes,
    run: str,
    topic: str,
    max_bytes: int = DEFAULT_MAX_CONTROL_BYTES,
    *,
    max_age_s: float | None = None,
    now: float | None = None,
) -> ControlMessage:
    """Parse, authenticate and check one control message from the network.

    Args:
        data: the wire bytes.
        run: the only run accepted.
        topic: the topic the message arrived on; it must be the signed topic.
        max_bytes: refuse anything longer, before parsing.
        max_age_s: when set, refuse a message whose timestamp is further than this
            from ``now`` in either direction (``stale``).
        now: the receiver's clock for ``max_age_s``; ``time.time()`` when omitted.

    Returns:
        The checked message.

    Raises:
        ProtocolError: for any refused input, and nothing else for bad bytes.
    """
    if not isinstance(data, (bytes, bytearray)):
        raise ProtocolError("malformed", f"expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise ProtocolError("oversized", f"{len(data)} bytes > {max_bytes}")
    data = bytes(data)
    signed, signature = _parse_outer(data)
    fields = _parse_signed(signed)
    sender = fields["sender"]
    if not verify_control(sender, signed, signature):
        raise ProtocolError("bad_signature", f"topic {fields['topic']!r}", sender)
    if fields["run"] != run:
        raise ProtocolError("wrong_run", f"run {fields['run']!r}, expected {run!r}", sender)
    if fields["topic"] != topic:
        raise ProtocolError(
            "wrong_topic", f"signed for {fields['topic']!r}, arrived on {topic!r}", sender
        )
    ts = float(fields["ts"])
    if max_age_s is not None:
        now = time.time() if now is None else now
        if abs(now - ts) > max_age_s:
            raise ProtocolError("stale", f"timestamp {now - ts:+.1f} s from now", sender)
    return ControlMessage(
        run=fields["run"],
        topic=fields["topic"],
        sender=sender,
        ts=ts,
        seq=fields["seq"],
        body=fields["body"],
        signature=signature,
        raw_signed=signed,
        digest=hashlib.sha256(signed).digest(),
    )


def encode_frame(obj: Any) -> bytes:
    """Encode ``obj`` as one pipe frame (u32 big-endian length + msgpack).

    Raises:
        ValueError: if the frame would exceed :data:`MAX_FRAME_BYTES`.
        TypeError: if ``obj`` holds a value msgpack cannot encode.
    """
    payload = msgpack.packb(obj, use_bin_type=True)
    if len(payload) > MAX_FRAME_BYTES:
        raise ValueError(f"frame is {len(payload)} bytes, over the {MAX_FRAME_BYTES} byte cap")
    return _FRAME_HEADER.pack(len(payload)) + payload


def write_frame(fileobj: IO[bytes], obj: Any) -> None:
    """Write one frame to a binary file object and flush it.

    Raises:
        ValueError: if the frame is too large.
        OSError: if the write fails (``BrokenPipeError`` when the reader is gone).
    """
    fileobj.write(encode_frame(obj))
    fileobj.flush()


def read_frame(fileobj: IO[bytes]) -> Any | None:
    """Read one frame from a binary file object.

    Returns:
        The decoded object, or None at a clean end of file (between frames).

    Raises:
        ValueError: if the stream ends inside a frame, announces a frame over
            :data:`MAX_FRAME_BYTES`, or holds bytes that are not msgpack.
    """
    header = _read_exact(fileobj, _FRAME_HEADER.size)
    if header is None:
        return None
    (length,) = _FRAME_HEADER.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {length} bytes announced, over the {MAX_FRAME_BYTES} cap")
    payload = _read_exact(fileobj, length)
    if payload is None:
        raise ValueError("end of file inside a frame")
    return _decode_frame(payload)


class FrameDecoder:
    """Incremental frame decoder for byte streams that arrive in arbitrary chunks."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        """Add received bytes; return every frame they complete, in order.

        Raises:
            ValueError: if a frame is oversized or not msgpack.
        """
        self._buffer += data
        frames = []
        while len(self._buffer) >= _FRAME_HEADER.size:
            (length,) = _FRAME_HEADER.unpack_from(self._buffer)
            if length > MAX_FRAME_BYTES:
                raise ValueError(f"frame of {length} bytes announced, over the cap")
            end = _FRAME_HEADER.size + length
            if len(self._buffer) < end:
                break
            frames.append(_decode_frame(bytes(self._buffer[_FRAME_HEADER.size : end])))
            del self._buffer[:end]
        return frames

    @property
    def pending(self) -> int:
        """Bytes received that do not yet form a whole frame."""
        return len(self._buffer)


def _read_exact(fileobj: IO[bytes], n: int) -> bytes | None:
    chunks = []
    got = 0
    while got < n:
        chunk = fileobj.read(n - got)
        if not chunk:
            if got:
                raise ValueError("end of file inside a frame")
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _decode_frame(payload: bytes) -> Any:
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=True, ext_hook=reject_ext)
    except Exception as e:  # every msgpack failure is one kind of error
        raise ValueError(f"frame is not msgpack: {type(e).__name__}: {e}") from None


def _parse_outer(data: bytes) -> tuple[bytes, bytes]:
    signed, signature = parse_signed_frame(data, CONTROL_VERSION)
    if len(signature) != _SIGNATURE_LEN:
        raise ProtocolError("malformed", f"signature is {len(signature)} bytes, expected 64")
    return signed, signature


def _parse_signed(signed: bytes) -> dict[str, Any]:
    try:
        fields = bounded_unpackb(
            signed,
            max_container=MAX_BODY_ITEMS,
            max_str_len=len(signed),
            max_items=MAX_BODY_ITEMS + len(_FIELDS),
        )
    except ValueError as e:
        raise ProtocolError("malformed", f"signed payload: {e}") from None
    if not isinstance(fields, dict) or set(fields) != set(_FIELDS):
        raise ProtocolError("malformed", f"signed payload must be a map of {', '.join(_FIELDS)}")
    if type(fields["v"]) is not int or fields["v"] != CONTROL_VERSION:
        raise ProtocolError("malformed", "signed version differs from the frame's")
    problem = _field_problem(fields)
    if problem:
        raise ProtocolError("malformed", problem)
    return fields


def _field_problem(fields: dict[str, Any]) -> str | None:
    """Why the signed fields are unacceptable, or None."""
    for name in ("run", "topic"):
        value = fields[name]
        if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME_CHARS:
            return f"{name} must be a str of 1..{MAX_NAME_CHARS} chars"
    seq = fields["seq"]
    # type() rather than isinstance(): msgpack decodes true/false as bools.
    if type(seq) is not int or not 0 <= seq <= _MAX_SEQ:
        return "seq must be an int in [0, 2**63)"
    ts = fields["ts"]
    if type(ts) not in (int, float) or not math.isfinite(ts) or ts < 0:
        return "ts must be a finite, non-negative number"
    sender = fields["sender"]
    if not isinstance(sender, str):
        return "sender must be a str"
    try:
        public_key_from_peer_id(sender)
    except VerificationError as e:
        return f"sender is not an Ed25519 PeerID: {e.detail}"
    return None
