"""Replay checks: evidence of the work itself, so that partial work fails.

A member that trains a tenth of the steps it claims can send a pseudo-gradient that
looks like an honest one, and a measure of its effect on the loss tells the two apart
only slowly (:mod:`verification.workscores`). A replay check asks for the work instead:

- while it trains, a node cuts its inner steps into *windows* of at most
  ``trust.replay_steps`` steps. For each it keeps the *start state* (its parameters and
  inner optimizer state, whose SHA-256 it records) and records the batches the window
  drew, the trainer's step count (which sets the learning rate), each step's loss and a
  :class:`Sketch` of how far the window moved its parameters;
- with each sync it signs a :class:`Trace`: the windows that tile the batches its claim
  names. The trace's digest rides in the claim, signed into every part and committed
  before the exchange's seed exists, so a member cannot pick which windows it trained
  once it knows which one a checker draws;
- a drawn checker takes one window (:func:`drawn_window`), fetches its start state
  (which must hash to the recorded digest), trains the window's steps again on the
  claimed batches and compares: the sketch of its own change must lie within
  ``trust.replay_tolerance`` of the recorded one, relative to the recorded one's size,
  and so must each step's loss (:func:`agreement`).

A window the member never trained does not replay: where it skipped the steps its
recorded change is zero or stale, and a sketch it made up misses the one the replay
gives (64 signed sums over every parameter). To pass, a member must have trained, from
the very state it committed to, every window a checker may draw: all of them.

A failed replay is proof anyone can check, inside the group or not: the member's signed
trace, the window and the state the trace commits to. The checker signs a
:class:`ReplayRecord` holding the trace and gossips it; a node that receives one
fetches the state and replays the window itself. A record that does not reproduce
costs its checker.

This module knows neither the model nor the network: the node snapshots and replays
(``node.checks.trace``, ``node.checks.replay``) and hands the numbers here.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import msgpack
import torch

from verification.identity import Domain, Identity, verify
from verification.sketch import SKETCH_SIZE, Sketcher

__all__ = [
    "MAX_REPLAY_BYTES",
    "MAX_WINDOWS",
    "SKETCH_SIZE",
    "ReplayError",
    "ReplayRecord",
    "Sketcher",
    "Trace",
    "TraceWindow",
    "agreement",
    "covers",
    "drawn_window",
    "is_replay_record",
    "open_replay_record",
    "open_trace",
]

MAX_WINDOWS = 512
"""Windows a trace may hold."""
MAX_REPLAY_BYTES = 192 * 1024
"""The largest replay record on the wire (it holds the trace; the control channel's
messages are at most 256 KiB)."""
_MAX_STEPS = 1024
_TRACE_DOMAIN = b"atoll/trace/v1\0"
_REPLAY = Domain(b"atoll/replay/v1\0")
_VERSION = 1
_REPLAY_TAG = msgpack.packb(["replay", b"", b""])[:8]
"""How a replay record starts on the wire (``msgpack([\"replay\", ...])``)."""


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
        if not all(_count(v) for v in (stream, start, step)) or not _count(steps, 1, _MAX_STEPS):
            raise ReplayError("malformed", "a window's stream, draws and steps are counts")
        if not _count(accum, 1, 4096):
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
                "v": _VERSION,
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
        or fields.get("v") != _VERSION
        or not isinstance(signature, bytes)
    ):
        raise ReplayError("malformed", f"not a version-{_VERSION} trace")
    if set(fields) != {"v", "peer", "run", "round", "fragment", "spans", "shape", "windows"}:
        raise ReplayError("malformed", "a trace's fields are missing or unknown")
    if not all(isinstance(fields[k], str) and len(fields[k]) <= 128 for k in ("peer", "run")):
        raise ReplayError("malformed", "peer and run are short strings")
    if not _count(fields["round"]) or not _count(fields["fragment"], 0, 4096):
        raise ReplayError("malformed", "round and fragment are counts")
    windows, spans = fields["windows"], fields["spans"]
    if not isinstance(windows, list) or len(windows) > MAX_WINDOWS:
        raise ReplayError("malformed", f"a trace holds at most {MAX_WINDOWS} windows")
    if not isinstance(spans, list) or len(spans) > 64:
        raise ReplayError("malformed", "a trace names at most 64 spans")
    if not all(
        isinstance(s, list) and len(s) == 3 and all(_count(v) for v in s) and s[2] > 0
        for s in spans
    ):
        raise ReplayError("malformed", "spans are (round, start, count > 0)")
    shape = fields["shape"]
    if not (
        isinstance(shape, list)
        and len(shape) == 4
        and _count(shape[0], 1, 4096)
        and _count(shape[2], 1, 2**20)
        and _count(shape[1], 0, shape[2] - 1)
        and _count(shape[3], 1, 2**20)
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


def drawn_window(seed: bytes, checker: str, windows: int) -> int:
    """The window of a trace ``checker`` replays, from the exchange's seed (known only
    after the commit phase closed)."""
    h = hashlib.sha256(b"atoll/replay-window\0" + seed + checker.encode()).digest()
    return int.from_bytes(h[:8], "big") % windows


def agreement(
    window: TraceWindow, change: Sequence[float], losses: Sequence[float]
) -> tuple[float, float]:
    """How far a replay is from the recorded window: the distance between the two
    changes' sketches over the recorded one's size (inf where the recorded window did
    not move and the replay did), and the largest loss difference relative to the
    recorded loss (at least 1)."""
    recorded = torch.tensor(window.change, dtype=torch.float64)
    replayed = torch.tensor(list(change), dtype=torch.float64)
    size = float(recorded.norm())
    apart = float((recorded - replayed).norm())
    distance = apart / size if size > 0 else (0.0 if apart == 0 else math.inf)
    loss = max(
        (abs(a - b) / max(1.0, abs(a)) for a, b in zip(window.losses, losses, strict=True)),
        default=0.0,
    )
    return distance, loss


@dataclass(frozen=True)
class ReplayRecord:
    """A checker's signed account of one replay check of ``peer``'s contribution to
    exchange ``(round, fragment)``.

    Attributes:
        checker: who replayed.
        trace: the member's signed trace, as served (the evidence; empty where none was
            served or it did not match the claim: then the record is the checker's word).
        window: the index of the window replayed.
        passed: whether the replay agreed within the tolerance.
        distance: :func:`agreement`'s sketch distance (inf where it did not move).
        loss: :func:`agreement`'s loss difference.
        why: what failed, in words ("" when it passed).
        state: whether the member served the window's start state (a failure without
            it is the checker's word).
        sent: the record is of the sent check (:mod:`verification.binding`): the
            contribution the member sent against the sum of its trace's windows, no
            window replayed (``window`` is 0).
    """

    checker: str
    peer: str
    round: int
    fragment: int
    trace: bytes
    window: int
    passed: bool
    distance: float = 0.0
    loss: float = 0.0
    why: str = ""
    state: bool = True
    sent: bool = False
    signature: bytes = b""
    opened: Trace | None = field(default=None, compare=False, repr=False)

    def body(self) -> bytes:
        distance = self.distance if math.isfinite(self.distance) else -1.0
        return msgpack.packb(
            {
                "v": _VERSION,
                "checker": self.checker,
                "peer": self.peer,
                "round": self.round,
                "fragment": self.fragment,
                "trace": self.trace,
                "window": self.window,
                "passed": self.passed,
                "distance": distance,
                "loss": self.loss,
                "why": self.why,
                "state": self.state,
                "sent": self.sent,
            },
            use_bin_type=True,
        )

    def signed(self, identity: Identity) -> ReplayRecord:
        if identity.peer_id != self.checker:
            raise ValueError("a replay record is signed by its checker")
        digest = hashlib.sha256(self.body()).digest()
        return replace(self, signature=_REPLAY.sign(identity, digest))

    def to_bytes(self) -> bytes:
        return msgpack.packb(["replay", self.body(), self.signature], use_bin_type=True)

    @property
    def proof(self) -> bool:
        """Whether others can check it: the trace was served, and for a replay the
        window's start state."""
        return self.opened is not None and self.state


def is_replay_record(data: bytes) -> bool:
    """Whether ``data`` on the ``check`` topic is a replay record (a check record is a
    two-element list; a replay record a three-element one tagged ``"replay"``)."""
    return data.startswith(_REPLAY_TAG)


def open_replay_record(data: bytes, run: str) -> ReplayRecord:
    """Parse and authenticate a replay record, and the trace it holds.

    Raises:
        ReplayError: ``oversized``, ``malformed``, ``bad_signature``, or any refusal of
            :func:`open_trace`.
    """
    if len(data) > MAX_REPLAY_BYTES + 4096:
        raise ReplayError("oversized", f"{len(data)} bytes")
    try:
        tag, body, signature = msgpack.unpackb(data, raw=False)
        fields = msgpack.unpackb(body, raw=False)
    except Exception as exc:
        raise ReplayError("malformed", f"not a replay record: {type(exc).__name__}") from None
    keys = {"v", "checker", "peer", "round", "fragment", "trace", "window", "passed"}
    keys |= {"distance", "loss", "why", "state", "sent"}
    if tag != "replay" or not isinstance(fields, dict) or set(fields) != keys:
        raise ReplayError("malformed", "a replay record's fields are missing or unknown")
    if fields["v"] != _VERSION or not isinstance(signature, bytes):
        raise ReplayError("malformed", f"not a version-{_VERSION} replay record")
    checker, peer, trace = fields["checker"], fields["peer"], fields["trace"]
    if not all(isinstance(v, str) and len(v) <= 128 for v in (checker, peer)):
        raise ReplayError("malformed", "checker and peer are short strings")
    if not isinstance(trace, bytes) or not _count(fields["round"]):
        raise ReplayError("malformed", "the trace is bytes, the round a count")
    if not _count(fields["fragment"], 0, 4096) or not _count(fields["window"], 0, MAX_WINDOWS):
        raise ReplayError("malformed", "fragment and window are indices")
    if not all(isinstance(fields[k], bool) for k in ("passed", "state", "sent")):
        raise ReplayError("malformed", "passed, state and sent are bools")
    if not isinstance(fields["why"], str) or not all(
        _number(fields[k]) for k in ("distance", "loss")
    ):
        raise ReplayError("malformed", "why is a string, distance and loss numbers")
    opened = None
    if trace:
        opened = open_trace(trace, run, peer)
        if (opened.round, opened.fragment) != (fields["round"], fields["fragment"]):
            raise ReplayError("malformed", "the trace is of another exchange")
        if fields["window"] >= len(opened.windows):
            raise ReplayError("malformed", f"window {fields['window']} of {len(opened.windows)}")
    if not _REPLAY.verify(checker, hashlib.sha256(body).digest(), signature):
        raise ReplayError("bad_signature", f"not signed by its checker {checker[:16]}")
    distance = float(fields["distance"])
    return ReplayRecord(
        checker,
        peer,
        fields["round"],
        fields["fragment"],
        trace,
        fields["window"],
        fields["passed"],
        math.inf if distance < 0 else distance,
        float(fields["loss"]),
        fields["why"][:200],
        fields["state"],
        fields["sent"],
        signature,
        opened,
    )


def _count(value: Any, low: int = 0, high: int = 2**53) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _floats(value: Any, name: str) -> tuple[float, ...]:
    if not isinstance(value, list) or len(value) > max(SKETCH_SIZE, _MAX_STEPS):
        raise ReplayError("malformed", f"{name} is a short list of numbers")
    if not all(_number(v) for v in value):
        raise ReplayError("malformed", f"{name} must be finite numbers")
    return tuple(float(v) for v in value)
