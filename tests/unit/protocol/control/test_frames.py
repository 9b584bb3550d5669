"""The control channel's wire format: signed messages refused with distinct reasons, and
the framing of the pipe between a node and its sidecar."""

from __future__ import annotations

import io
import time
from typing import Any

import msgpack
import pytest

from protocol.control.frames import (
    MAX_FRAME_BYTES,
    FrameDecoder,
    encode_frame,
    open_control,
    read_frame,
    sign_control,
    verify_control,
    write_frame,
)
from protocol.errors import ProtocolError
from verification.identity import Identity

ALICE = Identity.from_seed(b"a" * 32)
BOB = Identity.from_seed(b"b" * 32)
RUN = "run-1"
TOPIC = "atoll/run-1/heartbeat"


def _reason(data: Any, run: str = RUN, topic: str = TOPIC, **kwargs: Any) -> str:
    with pytest.raises(ProtocolError) as info:
        open_control(data, run, topic, **kwargs)
    return info.value.reason


def test_sign_open_roundtrip() -> None:
    body = {"round": 7, "digest": b"\x01" * 32, "peers": ["x", "y"]}
    data = sign_control(ALICE, RUN, TOPIC, 42, body, ts=1000.5)
    message = open_control(data, RUN, TOPIC)
    assert (message.sender, message.seq, message.ts, message.body) == (
        ALICE.peer_id,
        42,
        1000.5,
        body,
    )
    assert (message.run, message.topic) == (RUN, TOPIC)
    assert verify_control(ALICE.peer_id, message.raw_signed, message.signature)
    assert not verify_control(BOB.peer_id, message.raw_signed, message.signature)


def test_refusals_have_distinct_reasons() -> None:
    good = sign_control(ALICE, RUN, TOPIC, 1, {"ok": True})
    version, signed, signature = msgpack.unpackb(good)
    forged_sig = msgpack.packb([version, signed, BOB.sign(b"x")], use_bin_type=True)
    reasons = {
        "bad_signature": _reason(forged_sig),
        "wrong_run": _reason(good, run="run-2"),
        "wrong_topic": _reason(good, topic="atoll/run-1/verdicts"),
        "oversized": _reason(good, max_bytes=len(good) - 1),
        "malformed": _reason(b"\xc1garbage"),
        "bad_version": _reason(msgpack.packb([2, signed, signature], use_bin_type=True)),
        "stale": _reason(good, max_age_s=60.0, now=time.time() + 3600),
    }
    assert reasons == {reason: reason for reason in reasons}


@pytest.mark.parametrize(
    "data",
    [
        b"",
        "not bytes",
        msgpack.packb([1, b"\x80", b"s" * 64]),  # signed map missing every field
        msgpack.packb([1, b"not msgpack \xc1", b"s" * 64]),
        msgpack.packb([1, b"x", b"short signature"]),
        msgpack.packb({"v": 1}),
        msgpack.packb([1, msgpack.packb([{}] * 20000), b"s" * 64]),  # item bomb
    ],
)
def test_malformed_bytes_are_refused(data: Any) -> None:
    assert _reason(data) == "malformed"


def test_sign_refuses_what_a_receiver_would_refuse() -> None:
    with pytest.raises(ValueError, match="byte cap"):
        sign_control(ALICE, RUN, TOPIC, 1, b"x" * 5000, max_bytes=4096)
    with pytest.raises(ValueError, match="seq"):
        sign_control(ALICE, RUN, TOPIC, -1, None)
    with pytest.raises(ValueError, match="run"):
        sign_control(ALICE, "", TOPIC, 1, None)


def test_frames_roundtrip_and_refuse_corruption() -> None:
    buf = io.BytesIO()
    write_frame(buf, {"op": "publish", "data": b"\x00" * 10})
    write_frame(buf, {"op": "stop"})
    raw = buf.getvalue()
    buf.seek(0)
    assert read_frame(buf) == {"op": "publish", "data": b"\x00" * 10}
    assert read_frame(buf) == {"op": "stop"}
    assert read_frame(buf) is None
    truncated = io.BytesIO(raw[:-1])
    assert read_frame(truncated) == {"op": "publish", "data": b"\x00" * 10}
    with pytest.raises(ValueError, match="inside a frame"):
        read_frame(truncated)
    with pytest.raises(ValueError, match="over the"):
        read_frame(io.BytesIO((MAX_FRAME_BYTES + 1).to_bytes(4, "big")))
    decoder = FrameDecoder()
    frames = [f for i in range(len(raw)) for f in decoder.feed(raw[i : i + 1])]
    assert frames == [{"op": "publish", "data": b"\x00" * 10}, {"op": "stop"}]
    assert decoder.pending == 0
    assert FrameDecoder().feed(encode_frame([1, 2])) == [[1, 2]]
