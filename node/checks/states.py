"""The start states of the node's traced windows (:mod:`node.checks.trace`), by digest.

:class:`StateStore` keeps each state in memory while the kept states fit in ``memory``
bytes, and writes the others to files of the node's ``trace/`` folder on the trace's
thread (whole, then renamed: a file is never served half written). It serves a state's
packed bytes by its digest, drops the states the trace no longer names, and hands the
memory of dropped states to the next copies (:class:`node.train.trainstate.Snapshot`
copies into a dropped one's tensors).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Collection, Sequence
from pathlib import Path

from node.train.trainstate import Snapshot, TimedExecutor

__all__ = ["StateStore", "unlink"]

logger = logging.getLogger(__name__)

_FREE = 2
"""Dropped snapshots kept for their memory."""


class StateStore:
    """Start states kept for replay (see the module docstring).

    Args:
        spill: a folder for states beyond ``memory`` bytes (None: all in memory); files
            a node that did not stop cleanly left there are removed.
        memory: bytes of states kept in memory before they go to ``spill``.
        background: the trace's thread, which writes states to files.
    """

    def __init__(self, spill: Path | None, memory: int, background: TimedExecutor) -> None:
        self.spill = spill
        self.memory = memory
        self._background = background
        if spill is not None and spill.is_dir():  # left by a node that did not stop cleanly
            for stale in [*spill.glob("*.state"), *spill.glob("*.part")]:
                stale.unlink(missing_ok=True)
        self._states: dict[str, Snapshot | Path] = {}
        self._in_memory = 0
        self._spilling: set[str] = set()
        """Digests of states being written to files (their memory is not reused yet)."""
        self._free: list[Snapshot] = []
        """Dropped snapshots whose memory the next ones are copied into."""
        self._lock = threading.Lock()

    def reuse(self) -> Snapshot | None:
        """A dropped snapshot whose memory the next copy may take (None: none)."""
        with self._lock:
            return self._free.pop() if self._free else None

    def release(self, snapshot: Snapshot) -> None:
        """A start state no window keeps: its memory goes to the next one (once hashed)."""
        snapshot.digest  # noqa: B018 - waits until the hasher no longer reads it
        with self._lock:
            self._free = [*self._free, snapshot][-_FREE:]

    def store(self, snapshot: Snapshot) -> None:
        """Keep a start state: in memory while they fit in ``memory`` bytes, else in a
        file of the spill folder, written on the trace's thread."""
        digest = snapshot.digest
        with self._lock:
            self._states[digest] = snapshot
            self._in_memory += snapshot.size
            spill = self.spill is not None and self._in_memory > self.memory
            if spill:
                self._spilling.add(digest)
        if spill:
            self._background.submit(lambda: self._spill(snapshot))

    def _spill(self, snapshot: Snapshot) -> None:
        """Write a kept state to its file (whole, then renamed) and serve it from there;
        its memory goes to the next window's copy (the trace's thread)."""
        assert self.spill is not None
        digest = snapshot.digest
        path = self.spill / f"{digest}.state"
        try:
            self.spill.mkdir(parents=True, exist_ok=True)
            part = path.with_suffix(".part")
            with part.open("wb") as f:
                snapshot.write(f)
            os.replace(part, path)
        except OSError as exc:  # a full disk: it stays in memory
            logger.warning("a start state could not be written to %s: %s", self.spill, exc)
            with self._lock:
                self._spilling.discard(digest)
            return
        with self._lock:
            self._spilling.discard(digest)
            kept = self._states.get(digest) is snapshot
            if kept:
                self._states[digest] = path
                self._in_memory -= snapshot.size
            self._free = [*self._free, snapshot][-_FREE:]
        if not kept:  # dropped while it was written
            path.unlink(missing_ok=True)

    def read(self, digest: str) -> bytes:
        """The packed state of digest ``digest`` (empty: not kept)."""
        with self._lock:
            kept = self._states.get(digest)
        if kept is None:
            return b""
        if isinstance(kept, Snapshot):
            with self._lock:  # a dropped snapshot's memory is written into again
                return kept.pack() if self._states.get(digest) is kept else b""
        try:
            return kept.read_bytes()
        except OSError:
            return b""

    def keep_only(self, named: Collection[str]) -> list[Snapshot | Path]:
        """Drop the states not ``named``; their memory goes to the next copies. The
        dropped ones, whose files the caller removes (:func:`unlink`) once it holds no
        lock."""
        with self._lock:
            dropped = [self._states.pop(d) for d in list(self._states) if d not in named]
            memory = [v for v in dropped if isinstance(v, Snapshot)]
            self._in_memory -= sum(v.size for v in memory)
            # a state being written keeps its memory until the write ends (:meth:`_spill`)
            free = [v for v in memory if v.digest not in self._spilling]
            self._free = [*self._free, *free][-_FREE:]
        return dropped

    def kept_bytes(self) -> int:
        """Bytes of start states kept now, in memory and spilled."""
        with self._lock:
            kept = list(self._states.values())
        return sum(v.size if isinstance(v, Snapshot) else _size(v) for v in kept)

    def close(self) -> None:
        """Drop every state and remove the spilled ones (of no use to a later run)."""
        with self._lock:
            kept, self._states, self._in_memory = list(self._states.values()), {}, 0
            self._free = []
        unlink(kept)


def unlink(states: Sequence[Snapshot | Path]) -> None:
    """Remove the files of dropped states (a state in memory has none)."""
    for kept in states:
        if isinstance(kept, Path):
            kept.unlink(missing_ok=True)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
