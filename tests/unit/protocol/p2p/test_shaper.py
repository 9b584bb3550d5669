"""Tests for protocol.p2p.shaper: parsing, errors, and the pacing schedule on a fake clock."""

from __future__ import annotations

import asyncio
import math

import pytest

from protocol.p2p import _frames, _framing
from protocol.p2p.shaper import ENV_VAR, LinkShape, Shaper


class FakeTime:
    """A clock that only moves when something sleeps on it; records every sleep."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def _shaper(shape: LinkShape, fake: FakeTime, burst_seconds: float = 0.0) -> Shaper:
    return Shaper(shape, burst_seconds=burst_seconds, clock=fake.clock, sleep=fake.sleep)


# ---- parsing ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "delay_s", "bps"),
    [
        ("delay_ms=70,mbit=100", 0.070, 100e6),
        (" mbit = 1000 , delay_ms = 10 ", 0.010, 1e9),
        ("delay_ms=0", 0.0, None),
        ("mbit=0.5", 0.0, 0.5e6),
    ],
)
def test_parse(text: str, delay_s: float, bps: float | None) -> None:
    shape = LinkShape.parse(text)
    assert shape.delay_s == pytest.approx(delay_s)
    assert shape.bandwidth_bps == (pytest.approx(bps) if bps is not None else None)
    assert LinkShape.parse(shape.to_env()) == shape


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("delay=70", "bad item 'delay=70'"),
        ("delay_ms", "bad item 'delay_ms'"),
        ("delay_ms=70,,mbit=1", "bad item ''"),
        ("delay_ms=seventy", "is not a number"),
        ("delay_ms=1,delay_ms=2", "given twice"),
        ("delay_ms=-1", "expected a finite number >= 0"),
        ("delay_ms=nan", "expected a finite number >= 0"),
        ("mbit=0", "expected a finite number > 0"),
        ("mbit=inf", "expected a finite number > 0"),
    ],
)
def test_parse_errors_name_the_variable_and_the_problem(text: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=ENV_VAR) as info:
        LinkShape.parse(text)
    assert fragment in str(info.value)


def test_shape_validation() -> None:
    with pytest.raises(ValueError, match="delay_s"):
        LinkShape(delay_s=-0.1)
    with pytest.raises(ValueError, match="bandwidth_bps"):
        LinkShape(bandwidth_bps=-5.0)
    with pytest.raises(ValueError, match="delay_s"):
        LinkShape(delay_s=math.inf)
    assert LinkShape(0.07, 1e8).label == "70 ms, 100 Mbit/s"
    assert LinkShape(0.01, 1e9).label == "10 ms, 1 Gbit/s"


def test_from_env() -> None:
    assert LinkShape.from_env({}) is None
    assert LinkShape.from_env({ENV_VAR: "  "}) is None
    assert Shaper.from_env({}) is None
    assert Shaper.from_env({ENV_VAR: "delay_ms=0"}) is None  # a no-op shape costs nothing
    shaper = Shaper.from_env({ENV_VAR: "delay_ms=10,mbit=100"})
    assert shaper is not None and shaper.shape == LinkShape(0.010, 100e6)
    with pytest.raises(ValueError, match=ENV_VAR):
        Shaper.from_env({ENV_VAR: "mbit=fast"})


def test_framing_has_no_shaper_by_default() -> None:
    # the test run does not set the variable: the transport takes the unshaped path
    assert _frames._SHAPER is None


# ---- pacing schedule -------------------------------------------------------------------


def test_reservations_queue_at_line_rate() -> None:
    fake = FakeTime()
    shaper = _shaper(LinkShape(bandwidth_bps=8e6), fake)  # 1 MB/s, no burst
    assert shaper.reserve(500_000, now=0.0) == pytest.approx(0.5)
    # a second stream asking at the same moment waits for the first one's bytes too
    assert shaper.reserve(250_000, now=0.0) == pytest.approx(0.75)
    # later on, the debt has partly drained
    assert shaper.reserve(100_000, now=0.5) == pytest.approx(0.35)
    # an idle link earns no credit beyond its (zero) burst
    assert shaper.reserve(100_000, now=10.0) == pytest.approx(0.1)


def test_burst_allowance() -> None:
    fake = FakeTime()
    shaper = _shaper(LinkShape(bandwidth_bps=8e6), fake, burst_seconds=0.01)  # 10 kB deep
    assert shaper.slice_bytes == 16 * 1024
    assert shaper.reserve(10_000, now=0.0) == 0.0
    assert shaper.reserve(10_000, now=0.0) == pytest.approx(0.01)
    # after a long idle stretch the bucket is full again, but no fuller
    assert shaper.reserve(30_000, now=100.0) == pytest.approx(0.02)


def test_no_cap_never_waits() -> None:
    shaper = _shaper(LinkShape(delay_s=0.07), FakeTime())
    assert shaper.reserve(10**9, now=0.0) == 0.0


def test_send_paces_a_message_to_its_transfer_time() -> None:
    fake = FakeTime()
    shape = LinkShape(delay_s=0.07, bandwidth_bps=100e6)
    shaper = _shaper(shape, fake)

    async def message(nbytes: int, piece: int) -> None:
        await shaper.delay()
        for offset in range(0, nbytes, piece):
            await shaper.send(min(piece, nbytes - offset))

    asyncio.run(message(1_000_000, 65_536))
    # the last byte goes out one delay plus the serialisation time after the start
    assert fake.now == pytest.approx(0.07 + shape.transfer_seconds(1_000_000))
    assert fake.sleeps[0] == pytest.approx(0.07)
    assert len(fake.sleeps) == 1 + math.ceil(1_000_000 / 65_536)


def test_concurrent_messages_share_the_link() -> None:
    """Two streams of one process sending 500 kB each at once: 1 MB through one uplink."""
    shaper = _shaper(LinkShape(bandwidth_bps=8e6), FakeTime())  # 1 MB/s, no burst
    waits = {"a": [], "b": []}
    for _ in range(5):  # the two streams' slices arrive interleaved
        for name in waits:
            waits[name].append(shaper.reserve(100_000, now=0.0))
    assert waits["a"] == pytest.approx([0.1, 0.3, 0.5, 0.7, 0.9])
    assert waits["b"] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])


def test_real_sleep_paces_loosely() -> None:
    """With the real clock, 200 kB at 8 Mbit/s takes at least its 0.2 s serialisation."""
    shaper = Shaper(LinkShape(bandwidth_bps=8e6), burst_seconds=0.0)

    async def message() -> float:
        loop = asyncio.get_running_loop()
        started = loop.time()
        for _ in range(10):
            await shaper.send(20_000)
        return loop.time() - started

    # a lower bound only: a busy machine can make this slower, never faster
    assert asyncio.run(message()) >= 0.19


class _Writer:
    """Collects what a framing function writes, as an ``asyncio.StreamWriter`` would send it."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, chunk: bytes | memoryview) -> None:
        self.data += chunk

    async def drain(self) -> None:
        pass


def test_shaped_frames_are_byte_identical(monkeypatch: pytest.MonkeyPatch) -> None:
    payload = bytes(range(256)) * 2000  # 512 kB, several slices
    plain = _Writer()
    asyncio.run(_framing.write_response(plain, _framing.STATUS_OK, payload))

    fake = FakeTime()
    shape = LinkShape(delay_s=0.01, bandwidth_bps=80e6)  # 10 MB/s
    monkeypatch.setattr(_frames, "_SHAPER", _shaper(shape, fake))
    shaped = _Writer()
    asyncio.run(_framing.write_response(shaped, _framing.STATUS_OK, payload))

    assert shaped.data == plain.data  # the wire format does not change
    assert fake.sleeps[0] == pytest.approx(0.01)  # the delay comes once, first
    assert fake.now == pytest.approx(0.01 + shape.transfer_seconds(len(plain.data)))
