"""The sidecar's end of the node's pipe: the start frame's checked settings, frames
from the node, and events to it through one bounded queue.

Only :mod:`protocol.control.sidecar` uses this module; like it, it imports neither
hivemind nor torch.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from collections import deque
from dataclasses import dataclass
from typing import Any

import multiaddr
import trio

from protocol.control.frames import MAX_CONTROL_BYTES, MAX_NAME_CHARS, FrameDecoder, encode_frame

__all__ = ["FrameReader", "PipeOut", "StartConfig"]

logger = logging.getLogger(__name__)

_READ_CHUNK = 1 << 16
_MAX_TOPICS = 64


@dataclass(frozen=True)
class StartConfig:
    """What the node's ``start`` frame asks of the sidecar, checked."""

    key_file: str
    listen_host: str
    port: int
    run: str
    topics: tuple[str, ...]
    max_bytes: int

    @classmethod
    def from_frame(cls, frame: Any) -> StartConfig:
        if not isinstance(frame, dict) or frame.get("op") != "start":
            raise ValueError("the first frame must be {'op': 'start', ...}")
        key_file, host, port = frame.get("key_file"), frame.get("listen_host"), frame.get("port")
        run, topics, max_bytes = frame.get("run"), frame.get("topics"), frame.get("max_bytes")
        if not isinstance(key_file, str) or not key_file:
            raise ValueError("start.key_file must be a path")
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(f"start.listen_host must be an IP address, got {host!r}") from None
        if type(port) is not int or not 0 <= port <= 65535:
            raise ValueError("start.port must be an int in [0, 65535]")
        if not isinstance(run, str) or not 0 < len(run) <= MAX_NAME_CHARS:
            raise ValueError(f"start.run must be a str of 1..{MAX_NAME_CHARS} chars")
        if (
            not isinstance(topics, list)
            or not 0 < len(topics) <= _MAX_TOPICS
            or not all(isinstance(t, str) and 0 < len(t) <= MAX_NAME_CHARS for t in topics)
        ):
            raise ValueError(f"start.topics must be 1..{_MAX_TOPICS} non-empty strs")
        if type(max_bytes) is not int or not 1024 <= max_bytes <= MAX_CONTROL_BYTES:
            raise ValueError(f"start.max_bytes must be an int in [1024, {MAX_CONTROL_BYTES}]")
        return cls(key_file, host, port, run, tuple(dict.fromkeys(topics)), max_bytes)

    @property
    def listen_addr(self) -> multiaddr.Multiaddr:
        family = "ip6" if ":" in self.listen_host else "ip4"
        return multiaddr.Multiaddr(f"/{family}/{self.listen_host}/tcp/{self.port}")


class PipeOut:
    """Frames to the node: one writer task, a bounded queue, drops counted."""

    def __init__(self, stream: trio.abc.SendStream, capacity: int) -> None:
        self._stream = stream
        self._lock = trio.Lock()
        self._send, self._receive = trio.open_memory_channel[dict[str, Any]](capacity)
        self.dropped = 0

    def emit(self, event: dict[str, Any]) -> None:
        """Queue an event; if the node is not reading, drop it and count it."""
        try:
            self._send.send_nowait(event)
        except trio.WouldBlock:
            self.dropped += 1

    async def send(self, event: dict[str, Any]) -> None:
        """Write an event now, bypassing the queue."""
        frame = encode_frame(event)
        async with self._lock:
            await self._stream.send_all(frame)

    async def drain(self) -> None:
        async for event in self._receive:
            try:
                await self.send(event)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                logger.error("the node's pipe is closed; exiting")
                os._exit(0)
            except (ValueError, TypeError):
                logger.exception("could not encode %s event", event.get("ev"))


class FrameReader:
    """Frames from the node's pipe."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream = stream
        self._decoder = FrameDecoder()
        self._frames: deque[Any] = deque()

    async def receive(self) -> Any | None:
        """The next frame, or None at end of file.

        Raises:
            ValueError: if the pipe carries something that is not a frame.
        """
        while not self._frames:
            data = await self._stream.receive_some(_READ_CHUNK)
            if not data:
                return None
            self._frames.extend(self._decoder.feed(data))
        return self._frames.popleft()
