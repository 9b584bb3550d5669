"""Replay checks: evidence of the work itself, so that partial work fails.

A member that trains a tenth of the steps it claims can send a pseudo-gradient that
looks like an honest one, and a measure of its effect on the loss tells the two apart
only slowly (:mod:`verification.workscores`). A replay check asks for the work instead:

- while it trains, a node cuts its inner steps into *windows* of at most
  ``trust.replay_steps`` steps. For each it keeps the *start state* (its parameters and
  inner optimizer state, whose SHA-256 it records) and records the batches the window
  drew, the trainer's step count (which sets the learning rate), each step's loss and a
  :class:`Sketch` of how far the window moved its parameters;
- with each sync it signs a :class:`~verification.traces.Trace`: the windows that tile
  the batches its claim names. The trace's digest rides in the claim, signed into every
  part and committed before the exchange's seed exists, so a member cannot pick which
  windows it trained once it knows which one a checker draws;
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
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import msgpack
import torch

from verification.identity import Domain, Identity
from verification.traces import (
    MAX_REPLAY_BYTES,
    MAX_WINDOWS,
    VERSION,
    ReplayError,
    Trace,
    TraceWindow,
    is_count,
    is_number,
    open_trace,
)

__all__ = [
    "ReplayRecord",
    "agreement",
    "drawn_window",
    "is_replay_record",
    "open_replay_record",
]

_REPLAY = Domain(b"atoll/replay/v1\0")
_REPLAY_TAG = msgpack.packb(["replay", b"", b""])[:8]
"""How a replay record starts on the wire (``msgpack([\"replay\", ...])``)."""


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
                "v": VERSION,
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
    if fields["v"] != VERSION or not isinstance(signature, bytes):
        raise ReplayError("malformed", f"not a version-{VERSION} replay record")
    checker, peer, trace = fields["checker"], fields["peer"], fields["trace"]
    if not all(isinstance(v, str) and len(v) <= 128 for v in (checker, peer)):
        raise ReplayError("malformed", "checker and peer are short strings")
    if not isinstance(trace, bytes) or not is_count(fields["round"]):
        raise ReplayError("malformed", "the trace is bytes, the round a count")
    if not is_count(fields["fragment"], 0, 4096) or not is_count(fields["window"], 0, MAX_WINDOWS):
        raise ReplayError("malformed", "fragment and window are indices")
    if not all(isinstance(fields[k], bool) for k in ("passed", "state", "sent")):
        raise ReplayError("malformed", "passed, state and sent are bools")
    if not isinstance(fields["why"], str) or not all(
        is_number(fields[k]) for k in ("distance", "loss")
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
