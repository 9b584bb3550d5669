"""What a node reports about itself: a status snapshot and an event log.

``status.json`` in the data directory is the node's current state (round, step,
loss, peers, ...), rewritten atomically and at a bounded rate so that ``atoll
swarm`` and tests can poll it without ever reading half a file. ``events.jsonl``
is the append-only history: one JSON object per line, each with ``"t"`` (unix
time) and ``"event"``, written whole so a reader following the file sees complete
lines, and read back tolerantly so a crash mid-line loses only that line.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from verification.files import atomic_write

__all__ = ["EventLog", "StatusWriter", "read_events", "read_status"]

logger = logging.getLogger(__name__)


class StatusWriter:
    """Atomically rewrites ``data_dir/status.json`` (tmp + ``os.replace``).

    Every :meth:`update` merges its fields into the current snapshot; the file is
    rewritten at most every ``min_interval`` seconds unless ``force=True``, so a
    training loop can call it every step. Fields merged while throttled reach the
    file with the next write; call ``update(force=True)`` on exit to flush them.
    Safe to call from several threads.

    Args:
        path: The status file; its directory is created if missing.
        min_interval: Least time in seconds between two writes.
    """

    def __init__(self, path: Path, min_interval: float = 0.5) -> None:
        if min_interval < 0:
            raise ValueError(f"min_interval must be >= 0, got {min_interval}")
        self.path = Path(path)
        self.min_interval = min_interval
        self._current: dict[str, Any] = {}
        self._last_write: float | None = None
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)

    @property
    def current(self) -> dict:
        """A copy of the latest snapshot, written or not."""
        with self._lock:
            return dict(self._current)

    def update(self, force: bool = False, **fields: Any) -> None:
        """Merge ``fields`` into the snapshot and rewrite the file if due.

        Adds ``"updated"`` (``time.time()``) to the snapshot.

        Args:
            force: Write now, ignoring ``min_interval``.
            **fields: JSON-serialisable values to set.

        Raises:
            TypeError: a value is not JSON-serialisable; the snapshot is unchanged.
            OSError: writing the file failed.
        """
        with self._lock:
            merged = {**self._current, **fields, "updated": time.time()}
            # Serialise before committing so a bad value fails at the caller that
            # passed it, not later inside some unrelated throttled write.
            text = json.dumps(merged)
            self._current = merged
            now = time.monotonic()
            due = self._last_write is None or now - self._last_write >= self.min_interval
            if force or due:
                self._write(text)
                self._last_write = now

    def _write(self, text: str) -> None:
        # Not durable: this is a live view, rewritten constantly; only the rename must
        # be atomic so a reader never sees a torn file.
        atomic_write(self.path, text, durable=False, perms=0o600, prefix=f".{self.path.name}-")


def read_status(path: Path) -> dict | None:
    """Read a status file written by :class:`StatusWriter`.

    Args:
        path: The status file.

    Returns:
        The snapshot, or ``None`` when the file is missing or does not hold a JSON
        object (for instance a file not written through :class:`StatusWriter`).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
        data = json.loads(text)
    except FileNotFoundError:
        return None
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        return None
    return data if isinstance(data, dict) else None


class EventLog:
    """Append-only JSON-lines event log (``data_dir/events.jsonl``).

    One line per event with ``"t"`` (unix time) and ``"event"``. Each line goes to
    the file in a single unbuffered append, so a reader sees whole lines and
    several writers (threads, or processes sharing the file) never interleave
    within one. Usable as a context manager.

    Args:
        path: The log file; created with its directory if missing, appended to if
            it exists.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # Held open for the log's lifetime and closed by close(), not a with-block.
        self._f = open(self.path, "ab", buffering=0)  # noqa: SIM115
        # A previous run killed mid-line left a torn last line; end it so the next
        # event starts on a line of its own instead of being glued onto garbage.
        if self._f.tell() > 0:
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    self._f.write(b"\n")

    def write(self, event: str, **fields: Any) -> None:
        """Append one event.

        Args:
            event: The event name, e.g. ``"round_done"``.
            **fields: JSON-serialisable values stored beside ``"t"`` and ``"event"``.

        Raises:
            ValueError: a field is named ``t``, or the log is closed.
            TypeError: a value is not JSON-serialisable; nothing is written.
            OSError: the append failed (a full disk); it names the log file.
        """
        if "t" in fields:
            raise ValueError("event field 't' is reserved for the event time")
        line = json.dumps({"t": time.time(), "event": event, **fields}) + "\n"
        data = line.encode("utf-8")
        with self._lock:
            if self._f.closed:
                raise ValueError(f"event log {self.path} is closed")
            view = memoryview(data)
            # A raw write may be partial in principle; finish the line regardless.
            try:
                while view:
                    n = self._f.write(view)
                    view = view[n:]
            except OSError as exc:  # a full disk, say: name the file
                if not exc.errno or exc.filename:
                    raise
                raise OSError(exc.errno, exc.strerror, str(self.path)) from exc

    def close(self) -> None:
        """Close the file; closing twice is harmless."""
        with self._lock:
            self._f.close()

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def read_events(path: Path, event: str | None = None) -> list[dict]:
    """Read an event log written by :class:`EventLog`.

    A torn last line (a writer caught mid-append) is skipped silently; a damaged
    line elsewhere is skipped with a warning.

    Args:
        path: The log file; missing means no events yet.
        event: Only return events with this name.

    Returns:
        The events in the order they were written.
    """
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    lines = data.split(b"\n")
    events = []
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            if i < len(lines) - 1:
                logger.warning("%s line %d: not a JSON object, skipped", path, i + 1)
            continue
        if event is None or record.get("event") == event:
            events.append(record)
    return events


def recent_events(path: Path, max_bytes: int = 256 * 1024) -> list[dict]:
    """The events in the last ``max_bytes`` of an event log (whole lines only), oldest
    first: what a status page shows without reading a long run's whole log."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except FileNotFoundError:
        return []
    if size > max_bytes:
        data = data.split(b"\n", 1)[-1]  # the first line is cut
    events = []
    for raw in data.split(b"\n"):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except ValueError:
            continue  # torn or damaged: read_events reports it
        if isinstance(record, dict):
            events.append(record)
    return events
