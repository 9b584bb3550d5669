"""Traces: what a member signs of the training behind one contribution.

While it trains, a node cuts its inner steps into windows (:class:`TraceWindow`: the
batches drawn, the step count, the start state's digest, each step's loss and a sketch
of the parameters' change); with each sync it signs a :class:`Trace` of the windows
that tile the batches its claim names, whose digest rides in the claim. This module
writes and reads them back (:func:`open_trace`, every field checked) and says whether
windows tile a claim (:func:`covers`); how a checker replays a window is
:mod:`verification.replay`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgpack

from verification.identity import Identity, verify
from verification.sketch import SKETCH_SIZE

__all__ = [
    "MAX_REPLAY_BYTES",
    "MAX_WINDOWS",
    "VERSION",
    "ReplayError",
    "Trace",
    "TraceWindow",
    "covers",
    "is_count",
    "is_number",
    "open_trace",
]

MAX_WINDOWS = 512
"""Windows a trace may hold."""
MAX_REPLAY_BYTES = 192 * 1024
"""The largest replay record on the wire (it holds the trace; the control channel's
messages are at most 256 KiB)."""
VERSION = 1
"""The version of traces and replay records."""
_MAX_STEPS = 1024
_TRACE_DOMAIN = b"atoll/trace/v1\0"


class ReplayError(ValueError):
    """A trace or replay record that cannot be taken; ``reason`` is a short code."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class TraceWindow:
    """Inner steps a node trained one after another, as it records them.

    Attributes:
        stream: the round whose assigned stream the steps drew from.
        start: the first draw (each step draws ``accum`` batches on every rank).
        steps: steps in the window.
        accum: draws per step (``train.grad_accum``).
        step: the trainer's step count at the window's start (the learning rate's).
        state: the BLAKE3 digest of the packed start state (:class:`node.checks.trace.Snapshot`).
        losses: each step's mean loss.
        change: the sketch of the parameters' change over the window.
        moved: in a fragment's trace, the sketch of that fragment's change over the
            window (:mod:`verification.binding`); empty elsewhere.
    """

    stream: int
    start: int
    steps: int
    accum: int
    step: int
    state: str
    losses: tuple[float, ...]
    change: tuple[float, ...]
    moved: tuple[float, ...] = ()

    @property
    def draws(self) -> int:
        return self.steps * self.accum

    def to_wire(self) -> list[Any]:
        return [
            self.stream,
            self.start,
            self.steps,
            self.accum,
            self.step,
            self.state,
            list(self.losses),
            list(self.change),
            list(self.moved),
        ]

    @classmethod
    def from_wire(cls, value: Any) -> TraceWindow:
        if not isinstance(value, list) or len(value) != 9:
            raise ReplayError("malformed", "a window holds 9 fields")
        stream, start, steps, accum, step, state, losses, change, moved = value
        if not all(is_count(v) for v in (stream, start, step)) or not is_count(
            steps, 1, _MAX_STEPS
        ):
            raise ReplayError("malformed", "a window's stream, draws and steps are counts")
        if not is_count(accum, 1, 4096):
            raise ReplayError("malformed", "a window's draws per step are out of range")
        if not isinstance(state, str) or len(state) != 64:
            raise ReplayError("malformed", "a window's state digest is 64 hex digits")
        losses_ = _floats(losses, "losses")
        change_, moved_ = _floats(change, "change"), _floats(moved, "moved")
        if len(losses_) != steps or len(change_) != SKETCH_SIZE:
            raise ReplayError("malformed", "a window holds a loss per step and a full sketch")
        if len(moved_) not in (0, SKETCH_SIZE):
            raise ReplayError("malformed", "a window's fragment sketch is full or empty")
        return cls(stream, start, steps, accum, step, state, losses_, change_, moved_)


@dataclass(frozen=True)
class Trace:
    """What a member signs of the training behind one contribution, for exchange
    ``(round, fragment)`` of ``run``: the spans its claim names (``(round, start,
    count)``, as :class:`~protocol.averaging.contributions.WorkClaim` holds them) and the
    windows that trained them."""

    peer: str
    run: str
    round: int
    fragment: int
    windows: tuple[TraceWindow, ...]
    spans: tuple[tuple[int, int, int], ...] = ()
    shape: tuple[int, int, int, int] = (1, 0, 1, 1)
    """The claim's ``(ranks, slice index, slice count, batch)``: whose batches these are."""
    signature: bytes = b""

    def body(self) -> bytes:
        return msgpack.packb(
            {
                "v": VERSION,
                "peer": self.peer,
                "run": self.run,
                "round": self.round,
                "fragment": self.fragment,
                "spans": [list(s) for s in self.spans],
                "shape": list(self.shape),
                "windows": [w.to_wire() for w in self.windows],
            },
            use_bin_type=True,
        )

    @property
    def digest(self) -> str:
        """What the claim carries (and so every part, and the commitment)."""
        return hashlib.sha256(_TRACE_DOMAIN + self.body()).hexdigest()

    def signed(self, identity: Identity) -> Trace:
        if identity.peer_id != self.peer:
            raise ValueError("a trace is signed by its member")
        return replace(self, signature=identity.sign(bytes.fromhex(self.digest)))

    def to_bytes(self) -> bytes:
        return msgpack.packb([self.body(), self.signature], use_bin_type=True)


def open_trace(data: bytes, run: str, peer: str | None = None) -> Trace:
    """Parse and authenticate a trace.

    Raises:
        ReplayError: ``oversized``, ``malformed``, ``wrong_run``, ``wrong_peer`` or
            ``bad_signature``.
    """
    if not isinstance(data, bytes) or len(data) > MAX_REPLAY_BYTES:
        raise ReplayError("oversized", f"a trace is at most {MAX_REPLAY_BYTES} bytes")
    try:
        body, signature = msgpack.unpackb(data, raw=False)
        fields = msgpack.unpackb(body, raw=False)
    except Exception as exc:
        raise ReplayError("malformed", f"not a trace: {type(exc).__name__}") from None
    if (
        not isinstance(fields, dict)
        or fields.get("v") != VERSION
        or not isinstance(signature, bytes)
    ):
        raise ReplayError("malformed", f"not a version-{VERSION} trace")
    if set(fields) != {"v", "peer", "run", "round", "fragment", "spans", "shape", "windows"}:
        raise ReplayError("malformed", "a trace's fields are missing or unknown")
    if not all(isinstance(fields[k], str) and len(fields[k]) <= 128 for k in ("peer", "run")):
        raise ReplayError("malformed", "peer and run are short strings")
    if not is_count(fields["round"]) or not is_count(fields["fragment"], 0, 4096):
        raise ReplayError("malformed", "round and fragment are counts")
    windows, spans = fields["windows"], fields["spans"]
    if not isinstance(windows, list) or len(windows) > MAX_WINDOWS:
        raise ReplayError("malformed", f"a trace holds at most {MAX_WINDOWS} windows")
    if not isinstance(spans, list) or len(spans) > 64:
        raise ReplayError("malformed", "a trace names at most 64 spans")
    if not all(
        isinstance(s, list) and len(s) == 3 and all(is_count(v) for v in s) and s[2] > 0
        for s in spans
    ):
        raise ReplayError("malformed", "spans are (round, start, count > 0)")
    shape = fields["shape"]
    if not (
        isinstance(shape, list)
        and len(shape) == 4
        and is_count(shape[0], 1, 4096)
        and is_count(shape[2], 1, 2**20)
        and is_count(shape[1], 0, shape[2] - 1)
        and is_count(shape[3], 1, 2**20)
    ):
        raise ReplayError("malformed", "a trace's shape is (ranks, slice, slices, batch)")
    trace = Trace(
        fields["peer"],
        fields["run"],
        fields["round"],
        fields["fragment"],
        tuple(TraceWindow.from_wire(w) for w in windows),
        tuple((s[0], s[1], s[2]) for s in spans),
        (shape[0], shape[1], shape[2], shape[3]),
        signature,
    )
    if trace.run != run:
        raise ReplayError("wrong_run", f"a trace of run {trace.run!r}")
    if peer is not None and trace.peer != peer:
        raise ReplayError("wrong_peer", f"a trace of {trace.peer[:16]}, not {peer[:16]}")
    if not verify(trace.peer, bytes.fromhex(trace.digest), signature):
        raise ReplayError("bad_signature", f"not signed by its member {trace.peer[:16]}")
    return trace


def covers(windows: Sequence[TraceWindow], spans: Sequence[tuple[int, int, int]]) -> bool:
    """Whether ``windows`` tile exactly the draws of a claim's ``spans`` (``(round, start,
    count)``): every claimed batch was trained in a recorded window, and no window holds
    a batch the claim does not name."""
    return _merged((w.stream, w.start, w.draws) for w in windows) == _merged(spans)


def _merged(ranges: Iterable[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    out: list[list[int]] = []
    for stream, start, count in sorted(ranges):
        last = out[-1] if out else None
        if last is not None and last[0] == stream and start < last[1] + last[2]:
            return [(-1, -1, -1)]  # overlapping ranges tile nothing
        if last is not None and last[0] == stream and start == last[1] + last[2]:
            last[2] += count
        else:
            out.append([stream, start, count])
    return [(a, b, c) for a, b, c in out]


def is_count(value: Any, low: int = 0, high: int = 2**53) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _floats(value: Any, name: str) -> tuple[float, ...]:
    if not isinstance(value, list) or len(value) > max(SKETCH_SIZE, _MAX_STEPS):
        raise ReplayError("malformed", f"{name} is a short list of numbers")
    if not all(is_number(v) for v in value):
        raise ReplayError("malformed", f"{name} must be finite numbers")
    return tuple(float(v) for v in value)
