"""The node's trace of its own training, kept so that checkers can replay it.

With ``trust.replay_steps = w`` the training loop tells :class:`Tracer` about every
inner step. The tracer cuts the steps into windows of at most ``w``: a window starts
with a snapshot of the trained model's parameters and inner optimizer state
(:class:`node.trainstate.Snapshot`, kept in memory under its digest) and ends after
``w`` steps, or earlier where the loop is about to change the model otherwise
(:meth:`Tracer.seal`: a sync applied, a catch-up), the stream changed, or a sync takes
its claim. A window records each fragment's sketch of its change (end minus start).
Values probed after each step guard the windows: a model changed unannounced since a
window's last step drops that window rather than record a wrong change. When a sync
takes its claim (:meth:`Tracer.claim`), the windows of the claimed batches become a
signed :class:`~verification.replay.Trace` whose digest goes into the claim, and so
into every part and the commitment. The tracer serves traces and start states on
:data:`REPLAY_RPC` for :data:`~protocol.averaging.contributions.ROUNDS_KEPT` rounds.

What it costs the training thread: a sketch a window (one pass over the parameters:
the last window's end is the next one's start), a few probed values after each step,
and one copied state per window, 12 bytes a parameter with AdamW, hashed with BLAKE3 on
a thread of its own beside the next steps; states are kept while a claim may still
name them: in memory up to :data:`MEMORY_BYTES`, beyond that in files of the node's
``trace/`` folder (docs/trust.md, "Replay checks").
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import torch
from torch import nn

from node.trainstate import Snapshot
from protocol.averaging.contributions import ROUNDS_KEPT, WorkClaim
from protocol.averaging.fragments import FragmentPlan
from protocol.errors import ProtocolError
from verification.identity import Identity
from verification.replay import Trace, TraceWindow
from verification.sketch import Sketcher

__all__ = ["REPLAY_RPC", "Tracer"]

logger = logging.getLogger(__name__)

_R = TypeVar("_R")

REPLAY_RPC = "atoll.replay"
"""``msgpack(["trace", round, fragment])`` for a signed trace, ``msgpack(["state",
digest])`` for a window's packed start state; an empty answer when it is not kept."""
_FREE = 2
"""Dropped snapshots kept for their memory."""
_PROBES = 16
"""Values of each parameter tensor probed before and after every step."""
MEMORY_BYTES = 1 << 30
"""Bytes of start states a node keeps in memory; beyond them, in files."""


@dataclass
class _Open:
    """The window being recorded."""

    stream: int
    start: int
    step: int
    accum: int
    snapshot: Snapshot
    begin: torch.Tensor
    """Each fragment's sketch at the window's start."""
    losses: list[float] = field(default_factory=list)
    probed: torch.Tensor | None = None
    """The probe (:meth:`Tracer._probe`) after the last step."""


def _timed(method: Callable[..., _R]) -> Callable[..., _R]:
    """Count a training-thread method's time in :meth:`Tracer.spent`."""

    @functools.wraps(method)
    def timed(self: Tracer, *args: Any, **kwargs: Any) -> _R:
        began = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._seconds += time.perf_counter() - began

    return timed


class Tracer:
    """This node's trace (see the module docstring).

    Args:
        identity: signs traces.
        run_id: the run (the sketches' seed).
        steps: the longest window (``trust.replay_steps``).
        accum: draws per step (``train.grad_accum``).
        spill: a folder for start states beyond ``memory`` bytes (None: all in memory).
        memory: bytes of start states kept in memory before they go to ``spill``.
        plan: the model's fragments (None: one): a fragment's trace records that
            fragment's change in each window (:mod:`verification.binding`).
    """

    def __init__(
        self,
        identity: Identity,
        run_id: str,
        steps: int,
        accum: int,
        spill: Path | None = None,
        memory: int = MEMORY_BYTES,
        plan: FragmentPlan | None = None,
    ) -> None:
        if steps < 1:
            raise ValueError("trust.replay_steps must be at least 1 to trace")
        self.identity = identity
        self.run_id = run_id
        self.steps = steps
        self.accum = accum
        self.sketcher = Sketcher(run_id)
        self.plan = plan
        self.fragments = len(plan) if plan is not None else 1
        self._owners: list[int] | None = None
        """The fragment of each parameter tensor, in the model's order."""
        self.snapshots = 0
        """Start states packed so far."""
        self._seconds = 0.0
        """The training thread's time in the trace so far (:meth:`spent`)."""
        self._open: _Open | None = None
        self._params: list[torch.Tensor] = []
        """The model's parameters (updated in place by every step)."""
        self._end: tuple[torch.Tensor, torch.Tensor] | None = None
        """The last window's end sketch, and its probe."""
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="atoll-trace-hash")
        """Hashes start states beside the training thread."""
        self._places: list[torch.Tensor] | None = None
        self._free: list[Snapshot] = []
        """Dropped snapshots whose memory the next ones are copied into."""
        self._done: list[TraceWindow] = []
        self._moved: dict[tuple[int, int], torch.Tensor] = {}
        """Each fragment's change over a done window, by its ``(stream, start)``."""
        self.spill = spill
        self.memory = memory
        if spill is not None and spill.is_dir():  # left by a node that did not stop cleanly
            for stale in [*spill.glob("*.state"), *spill.glob("*.part")]:
                stale.unlink(missing_ok=True)
        self._states: dict[str, Snapshot | Path] = {}
        self._in_memory = 0
        self._traces: dict[tuple[int, int], tuple[bytes, tuple[str, ...]]] = {}
        self._lock = threading.Lock()

    # ---- the training thread -------------------------------------------------------------

    @_timed
    def before(
        self, model: nn.Module, optimizer: Any, steps: int, at: tuple[int, int] | None
    ) -> None:
        """An inner step is about to start at draw ``at = (stream, position)`` (None: the
        stream is not an assigned one, nothing is traced), the trainer at ``steps``."""
        params = list(model.parameters())
        if self._owners is None:
            module = getattr(model, "module", model)  # a DDP site's names are the module's
            names = [n for n, _ in module.named_parameters()]
            self._owners = self.plan.owners(names) if self.plan else [0] * len(names)
        self._params = params
        probe = self._probe(params)
        w = self._open
        if w is not None and (
            at is None
            or (w.stream, w.start + len(w.losses) * w.accum) != at
            or (w.probed is not None and not torch.equal(probe, w.probed))
        ):
            self._close(probe)  # the stream changed, or the model did unannounced (dropped)
        if at is None or self._open is not None:
            return
        with self._lock:
            reuse = self._free.pop() if self._free else None
        snapshot = Snapshot(params, optimizer, reuse, self._hasher)
        self.snapshots += 1
        # the last window's end is this one's start where nothing else moved the model
        end = self._end
        begin = end[0] if end is not None and torch.equal(probe, end[1]) else self._sketch(params)
        self._open = _Open(at[0], at[1], steps, self.accum, snapshot, begin)

    @_timed
    def after(self, model: nn.Module, loss: float) -> None:
        """The step ended with mean loss ``loss``."""
        w = self._open
        if w is None:
            return
        w.losses.append(float(loss))
        w.probed = self._probe(self._params)
        if len(w.losses) >= self.steps:
            self._close(w.probed)

    @_timed
    def seal(self) -> None:
        """Something other than an inner step is about to change the model (a sync
        applied, a catch-up): the open window ends here."""
        self._close()

    def _probe(self, params: list[torch.Tensor]) -> torch.Tensor:
        """A few values of every parameter, at fixed places: what tells a step's model from
        one a sync or a catch-up changed since (they change every value of a fragment)."""
        if self._places is None or len(self._places) != len(params):
            g = torch.Generator().manual_seed(0)
            self._places = [
                torch.randint(0, max(1, p.numel()), (min(_PROBES, p.numel()),), generator=g).to(
                    p.device
                )
                for p in params
            ]
        with torch.no_grad():
            return torch.cat(
                [p.detach().reshape(-1)[i].float().cpu() for p, i in zip(params, self._places)]
            )

    def _sketch(self, params: list[torch.Tensor]) -> torch.Tensor:
        assert self._owners is not None
        return self.sketcher.by_fragment(params, self._owners, self.fragments)

    def _close(self, probe: torch.Tensor | None = None) -> None:
        """End the open window after its last step: its end sketch, its start state
        kept. A window whose model changed since its last step without :meth:`seal` is
        dropped (its end is not known): no claim can name its batches. ``probe``: the
        model's probe now, where the caller just took it."""
        w, self._open = self._open, None
        if w is None:
            return
        if w.losses and probe is None:
            probe = self._probe(self._params)
        if probe is None or w.probed is None or not torch.equal(probe, w.probed):
            if w.losses:
                logger.warning("a traced window was dropped: the model changed unannounced")
            self._release(w.snapshot)
            return
        end = self._sketch(self._params)
        self._end = (end, probe)
        moved = end - w.begin
        self._store(w.snapshot)
        window = TraceWindow(
            w.stream,
            w.start,
            len(w.losses),
            w.accum,
            w.step,
            w.snapshot.digest,
            tuple(w.losses),
            tuple(moved.sum(0).tolist()),
        )
        with self._lock:
            self._done.append(window)
            self._moved[(w.stream, w.start)] = moved

    def _release(self, snapshot: Snapshot) -> None:
        """A start state no window keeps: its memory goes to the next one (once hashed)."""
        snapshot.digest  # noqa: B018 - waits until the hasher no longer reads it
        with self._lock:
            self._free = [*self._free, snapshot][-_FREE:]

    def _store(self, snapshot: Snapshot) -> None:
        """Keep a start state: in memory while they fit in ``memory`` bytes, else in a
        file of the spill folder (written whole, then renamed)."""
        digest = snapshot.digest
        if self.spill is None or self._in_memory + snapshot.size <= self.memory:
            with self._lock:
                self._states[digest] = snapshot
                self._in_memory += snapshot.size
            return
        self.spill.mkdir(parents=True, exist_ok=True)
        path = self.spill / f"{digest}.state"
        part = path.with_suffix(".part")
        part.write_bytes(snapshot.pack())
        os.replace(part, path)
        with self._lock:
            self._states[digest] = path

    def _read(self, digest: str) -> bytes:
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

    @_timed
    def claim(self, claim: WorkClaim, round_: int, fragment: int) -> WorkClaim:
        """``claim`` with the digest of its signed trace: the windows of its batches."""
        self._close()
        spans = claim.spans
        inside = [self._of(w, fragment) for w in self._done if any(_within(w, s) for s in spans)]
        shape = (claim.ranks, claim.slice[0], claim.slice[1], claim.batch)
        trace = Trace(
            self.identity.peer_id, self.run_id, round_, fragment, tuple(inside), spans, shape
        ).signed(self.identity)
        with self._lock:
            self._traces[(round_, fragment)] = (trace.to_bytes(), tuple(w.state for w in inside))
            for old in [k for k in self._traces if k[0] <= round_ - ROUNDS_KEPT]:
                del self._traces[old]
        return dataclasses.replace(claim, trace=trace.digest)

    def _of(self, w: TraceWindow, fragment: int) -> TraceWindow:
        """``w`` as fragment ``fragment``'s trace holds it: with that fragment's change."""
        moved = self._moved.get((w.stream, w.start))
        if self.plan is None or moved is None or fragment >= len(moved):
            return w
        return dataclasses.replace(w, moved=tuple(moved[fragment].tolist()))

    @_timed
    def keep(self, open_spans: Sequence[tuple[int, int, int]]) -> None:
        """Drop every window (and its state) that no kept trace names and no claim to come
        can name (``open_spans``: the spans not claimed yet, of every fragment)."""
        with self._lock:
            named = {d for _, states in self._traces.values() for d in states}
            self._done = [w for w in self._done if any(_within(w, s) for s in open_spans)]
            named |= {w.state for w in self._done}
            done = {(w.stream, w.start) for w in self._done}
            self._moved = {k: v for k, v in self._moved.items() if k in done}
            dropped = [self._states.pop(d) for d in list(self._states) if d not in named]
            self._in_memory -= sum(v.size for v in dropped if isinstance(v, Snapshot))
            self._free = [v for v in dropped if isinstance(v, Snapshot)][-_FREE:]
        for kept in dropped:
            if isinstance(kept, Path):
                kept.unlink(missing_ok=True)

    # ---- serving (the transport's loop) ---------------------------------------------------

    async def serve(self, peer: str, request: bytes) -> bytes:
        """The :data:`REPLAY_RPC` handler."""
        try:
            fields = msgpack.unpackb(request, raw=False)
            if not isinstance(fields, list) or not fields:
                raise ValueError("expected a list")
            if fields[0] == "trace" and len(fields) == 3:
                with self._lock:
                    kept = self._traces.get((int(fields[1]), int(fields[2])))
                return kept[0] if kept is not None else b""
            if fields[0] == "state" and len(fields) == 2 and isinstance(fields[1], str):
                return self._read(fields[1])
            raise ValueError(f"unknown request {fields[0]!r}")
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError) as exc:
            raise ProtocolError("malformed", f"replay request: {exc}", peer) from None

    def spent(self) -> float:
        """Seconds the trace took the training thread so far."""
        return self._seconds

    def kept_bytes(self) -> int:
        """Bytes of start states kept now, in memory and spilled."""
        with self._lock:
            kept = list(self._states.values())
        return sum(v.size if isinstance(v, Snapshot) else _size(v) for v in kept)

    def summary(self) -> dict[str, float]:
        """Windows snapshotted so far, the bytes of start states kept now and the
        training thread's seconds spent on the trace (the round event's ``trace``)."""
        return {
            "snapshots": self.snapshots,
            "kept_bytes": self.kept_bytes(),
            "seconds": round(self._seconds, 3),
        }

    def close(self) -> None:
        """Remove the spilled states (they are of no use to a later run)."""
        self._hasher.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            kept, self._states, self._in_memory = list(self._states.values()), {}, 0
            self._free = []
        for v in kept:
            if isinstance(v, Path):
                v.unlink(missing_ok=True)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _within(w: TraceWindow, span: tuple[int, int, int]) -> bool:
    stream, start, count = span
    return w.stream == stream and start <= w.start and w.start + w.draws <= start + count
