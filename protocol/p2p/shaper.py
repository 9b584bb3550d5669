"""Long links on loopback: a one-way delay and a bandwidth cap on this process's egress.

Tests and benchmarks switch it on with an environment variable, for example
``ATOLL_LINK_SHAPE="delay_ms=70,mbit=100"``; unset (the default) there is no shaper at
all and the transport writes as it always does. The kernel's netem would do this
better, but it needs a network namespace and the ``sch_netem`` module, which shared
machines often lack; this one needs nothing.

The model, and where it is approximate:

- **One uplink per process.** All streams of the process share one :class:`Shaper`,
  as all peers of a node share its uplink. The cap is on what this process sends;
  what it receives is capped by the senders' shapers only (no downlink limit).
- **Bandwidth** is a token bucket refilled at the line rate and only
  ``burst_seconds`` (2 ms) of line rate deep: an idle link can send that much at once,
  so a message may arrive up to 2 ms early, and a sleep that oversleeps by up to 2 ms
  (a busy event loop) costs no capacity. Reservations are first come, first served.
- **Delay** is applied once per message, by the sender, before the message's first
  byte is written. On a real link the bytes are serialised first and then propagate;
  here they wait first and are then serialised. With one constant delay for all
  messages the two give the same arrival time for every byte of every message (the
  whole queue is shifted by the delay); what differs is that the sending task is
  busy for the delay too.
- Only what goes through ``protocol.p2p._framing`` is shaped (Atoll's RPCs: matchmaking,
  all-reduce, repair, catch-up). hivemind's DHT traffic and p2pd's own control
  traffic are not, and real links also lose, reorder and jitter, which this does not.
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

__all__ = ["ENV_VAR", "LinkShape", "Shaper"]

ENV_VAR = "ATOLL_LINK_SHAPE"
"""Environment variable that switches shaping on, e.g. ``"delay_ms=70,mbit=100"``."""

_KEYS = {"delay_ms": 1e-3, "mbit": 1e6}  # key -> factor to seconds or bits per second
_FORMAT = (
    'expected comma-separated key=value with keys delay_ms and mbit, e.g. "delay_ms=70,mbit=100"'
)


@dataclass(frozen=True)
class LinkShape:
    """One emulated link.

    Attributes:
        delay_s: one-way delay added to every message, in seconds (>= 0).
        bandwidth_bps: line rate in bits per second, or None for no cap.
    """

    delay_s: float = 0.0
    bandwidth_bps: float | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.delay_s, (int, float)) and math.isfinite(self.delay_s)):
            raise ValueError(f"link delay_s = {self.delay_s!r}: expected a finite number >= 0")
        if self.delay_s < 0:
            raise ValueError(f"link delay_s = {self.delay_s!r}: expected a finite number >= 0")
        bw = self.bandwidth_bps
        if bw is not None and not (isinstance(bw, (int, float)) and math.isfinite(bw) and bw > 0):
            raise ValueError(f"link bandwidth_bps = {bw!r}: expected a finite number > 0 or None")

    @classmethod
    def parse(cls, text: str) -> LinkShape:
        """Parse ``"delay_ms=70,mbit=100"``; either key may be left out.

        Raises:
            ValueError: unknown or repeated keys, values that are not numbers, or
                values out of range; the message quotes the text and the format.
        """
        values: dict[str, float] = {}
        for item in text.split(","):
            key, sep, raw = (part.strip() for part in item.partition("="))
            if not sep or key not in _KEYS:
                raise ValueError(f"{ENV_VAR} = {text!r}: bad item {item.strip()!r}; {_FORMAT}")
            if key in values:
                raise ValueError(f"{ENV_VAR} = {text!r}: {key} given twice")
            try:
                values[key] = float(raw)
            except ValueError:
                raise ValueError(f"{ENV_VAR} = {text!r}: {key} = {raw!r} is not a number") from None
        try:
            return cls(
                delay_s=values.get("delay_ms", 0.0) * _KEYS["delay_ms"],
                bandwidth_bps=values["mbit"] * _KEYS["mbit"] if "mbit" in values else None,
            )
        except ValueError as e:
            raise ValueError(f"{ENV_VAR} = {text!r}: {e}") from None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> LinkShape | None:
        """The shape in :data:`ENV_VAR`, or None when it is unset or empty."""
        text = (os.environ if environ is None else environ).get(ENV_VAR, "").strip()
        return cls.parse(text) if text else None

    def to_env(self) -> str:
        """The value of :data:`ENV_VAR` that :meth:`parse` turns back into this shape."""
        items = [f"delay_ms={self.delay_s / _KEYS['delay_ms']:g}"]
        if self.bandwidth_bps is not None:
            items.append(f"mbit={self.bandwidth_bps / _KEYS['mbit']:g}")
        return ",".join(items)

    @property
    def label(self) -> str:
        """Short human-readable form, e.g. ``"70 ms, 100 Mbit/s"``."""
        rate = "no cap" if self.bandwidth_bps is None else _rate(self.bandwidth_bps)
        return f"{self.delay_s * 1e3:g} ms, {rate}"

    def transfer_seconds(self, nbytes: int) -> float:
        """Time to serialise ``nbytes`` at the line rate (0 without a cap)."""
        return 0.0 if self.bandwidth_bps is None else nbytes * 8 / self.bandwidth_bps


def _rate(bps: float) -> str:
    return f"{bps / 1e9:g} Gbit/s" if bps >= 1e9 else f"{bps / 1e6:g} Mbit/s"


class Shaper:
    """Paces this process's outgoing bytes through one emulated link.

    Thread-safe: reservations are plain arithmetic under a lock, so transports running
    their event loops in different threads of one process share the link.

    Args:
        shape: the link.
        burst_seconds: depth of the token bucket, in seconds of line rate.
        clock: monotonic clock in seconds (tests pass a fake one).
        sleep: async sleep (tests pass one that advances the fake clock).
    """

    def __init__(
        self,
        shape: LinkShape,
        *,
        burst_seconds: float = 0.002,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if not burst_seconds >= 0:
            raise ValueError(f"burst_seconds = {burst_seconds!r}: expected >= 0")
        self.shape = shape
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        rate = shape.bandwidth_bps / 8 if shape.bandwidth_bps is not None else None
        self._rate = rate  # bytes per second, None: no cap
        self._depth = rate * burst_seconds if rate is not None else 0.0
        self._tokens = self._depth
        self._updated = clock()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Shaper | None:
        """A shaper for the shape in :data:`ENV_VAR`; None when unset or a no-op shape."""
        shape = LinkShape.from_env(environ)
        if shape is None or (shape.delay_s == 0 and shape.bandwidth_bps is None):
            return None
        return cls(shape)

    @property
    def slice_bytes(self) -> int:
        """How many bytes to pace at a time: one bucket's depth (at least 16 KiB)."""
        return max(16 * 1024, int(self._depth))

    def reserve(self, nbytes: int, now: float | None = None) -> float:
        """Take ``nbytes`` from the bucket; return the seconds to wait before sending them.

        The bucket may go into debt: later reservations wait for earlier ones, so the
        link sends at most its line rate over any stretch longer than its burst.
        """
        if self._rate is None:
            return 0.0
        with self._lock:
            now = self._clock() if now is None else now
            elapsed = max(0.0, now - self._updated)
            self._tokens = min(self._depth, self._tokens + elapsed * self._rate) - nbytes
            self._updated = max(self._updated, now)
            return max(0.0, -self._tokens / self._rate)

    async def send(self, nbytes: int) -> None:
        """Wait until the link has room for ``nbytes``; call before writing them."""
        wait = self.reserve(nbytes)
        if wait > 0:
            await self._sleep(wait)

    async def delay(self) -> None:
        """Wait the one-way delay; call once per message, before its first byte."""
        if self.shape.delay_s > 0:
            await self._sleep(self.shape.delay_s)
